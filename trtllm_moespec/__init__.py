"""trtllm-moespec: MoE-aware tree speculative decoding.

The public API (`LLM`, `SamplingParams`, `MoESpecConfig`, `TreeConfig`, `StructuredOutput`, the outputs) is imported lazily so that
`import trtllm_moespec.core` stays free of transformers.
"""

__version__ = "0.1.0"

_LAZY = {"LLM": ".api", "SamplingParams": ".api", "TreeConfig": ".api", "RequestOutput": ".api",
         "StructuredOutput": ".api", "MoESpecConfig": ".api", "CompletionOutput": ".api", "StreamEvent": ".api"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
