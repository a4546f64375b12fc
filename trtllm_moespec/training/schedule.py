"""Learning-rate schedule shared by the training loops: linear warmup over steps,
then cosine decay over the elapsed fraction of the planned training time."""

from __future__ import annotations

import math


def cosine_lr(step: int, frac: float, peak_lr: float, warmup_steps: int, min_lr_ratio: float) -> float:
    """lr at optimizer step ``step`` when ``frac`` of the planned time has elapsed."""
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    frac = min(1.0, max(0.0, frac))
    return peak_lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))
