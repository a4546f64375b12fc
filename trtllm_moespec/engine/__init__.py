"""The decode loop: prefill -> draft -> select -> verify -> commit, with per-step stats.

Names are imported lazily so that `engine.config` (TreeConfig) stays free of torch: the CLI checks
a `--tree` argument before torch is imported.
"""

_LAZY = {"TreeConfig": ".config", "SpecEngine": ".engine", "GenerationStats": ".stats", "StepStats": ".stats"}

__all__ = ["GenerationStats", "SpecEngine", "StepStats", "TreeConfig"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
