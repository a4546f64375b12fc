"""Model adapters: the MoE targets (Hugging Face Qwen3-MoE, GPT-OSS), the EAGLE-3
drafter, the weightless n-gram drafter, and the architecture table they share.
(transformers is imported lazily, inside the functions that need it.)"""

from .arch import ARCHITECTURES, ArchSpec, arch_spec, default_capture_layers
from .eagle3 import Eagle3Cache, Eagle3Config, Eagle3Draft, Eagle3Drafter, Eagle3Output, load_eagle3, write_random_drafter
from .ngram import NgramConfig, NgramDrafter
from .target import TargetCache, TargetModel, TargetOutput

__all__ = [
    "ARCHITECTURES", "ArchSpec", "Eagle3Cache", "Eagle3Config", "Eagle3Draft", "Eagle3Drafter", "Eagle3Output",
    "NgramConfig", "NgramDrafter", "TargetCache", "TargetModel", "TargetOutput", "arch_spec",
    "default_capture_layers", "load_eagle3", "write_random_drafter",
]
