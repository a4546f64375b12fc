"""Serving backends for MoE-aware tree speculative decoding.

`trtllm/` adapts TensorRT-LLM's PyTorch backend (EAGLE-3 dynamic-tree worker,
engine-directory configuration). Nothing here imports TensorRT or TensorRT-LLM at
import time; the parts that need them import them lazily.
"""
