"""Model adapters: the MoE targets (Hugging Face Qwen3-MoE, GPT-OSS), the EAGLE-3
drafter, the weightless n-gram drafter, and the architecture table they share."""
