"""Target distributions for verification: temperature, top-k, min-p and top-p.

Greedy decoding (temperature 0) is expressed as a one-hot distribution on the
argmax, so greedy and sampling verification run the same acceptance rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingConfig:
    """Per-request target-distribution settings."""

    temperature: float = 0.0  # 0 = greedy (argmax); > 0 divides the logits
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set with mass >= top_p; 1 = off
    min_p: float = 0.0  # keep tokens with probability >= min_p * the most likely one's; 0 = off

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must lie in [0, 1], got {self.min_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# the refusal of every verify path
CORRUPT_LOGITS = "target logits contain NaN or inf; refusing to verify against a corrupt distribution"


def all_finite(x: torch.Tensor) -> bool:
    """No NaN or inf in x. CPU float32/64 through numpy: one ~2 us call where torch's check and
    reduction cost ~35 us, paid at every verified position of every step."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return bool(np.isfinite(x.numpy()).all())
    return bool(torch.isfinite(x).all())


def target_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """[M, V] logits -> [M, V] float32 target distribution under `cfg`."""
    if not all_finite(logits):
        raise ValueError(CORRUPT_LOGITS)
    logits = logits.float()
    if cfg.greedy:
        probs = torch.zeros_like(logits)
        probs.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        return probs
    logits = logits / cfg.temperature
    if 0 < cfg.top_k < logits.shape[-1]:
        kth = logits.topk(cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if cfg.min_p > 0.0:  # vLLM's and transformers' rule: relative to the most likely token, after top-k
        probs = probs.masked_fill(probs < cfg.min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if cfg.top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        # Drop a token when the mass strictly before it already reaches top_p.
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from_probs(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample from unnormalised non-negative weights [M, V] with uniforms u [M].

    Never returns a zero-weight token, also when rounding leaves u * total past the
    last cumulative value.
    """
    cdf = weights.cumsum(-1)
    idx = torch.searchsorted(cdf, u[:, None].to(cdf.dtype) * cdf[..., -1:], right=True)[:, 0]
    overflow = idx >= weights.shape[-1]
    if bool(overflow.any()):  # rounding: fall back to the last token with weight
        last_nonzero = (weights > 0).long().cumsum(-1).argmax(-1)
        idx = torch.where(overflow, last_nonzero, idx)
    return idx
