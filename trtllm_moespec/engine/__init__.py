"""The decode loop: prefill -> draft -> select -> verify -> commit, with per-step stats."""

from .config import TreeConfig
from .engine import SpecEngine
from .stats import GenerationStats, StepStats

__all__ = ["GenerationStats", "SpecEngine", "StepStats", "TreeConfig"]
