"""C(k): the cost of one target forward of k new tokens on top of a KV cache,
with the number of unique experts per layer, like Fig. 1 of the EVICT paper.

Measured on real text (held-out continuation tokens after a ~200-token prefix,
causal mask), median over repetitions and offsets. ``moe_s`` is the time spent
inside the MoE blocks (forward pre/post hooks on ``layer.mlp``, separate runs), so
``(moe_s(k) - moe_s(1)) / (C(k) - C(1))`` says how much of the extra cost of
verifying k tokens comes from the expert union.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache

from trtllm_moespec.training.routing import RouterTrace


@dataclass(frozen=True)
class CostPoint:
    """One point of the C(k) curve."""

    k: int  # new tokens in the forward
    seconds: float  # median wall time of the forward
    moe_seconds: float  # median time inside the MoE blocks
    unique_experts: float  # mean over layers and offsets of |union of the k tokens' experts|


class _MoeTimer:
    """Accumulates wall time spent inside every ``layer.mlp`` forward."""

    def __init__(self, model: torch.nn.Module):
        self.total = 0.0
        self._t0 = 0.0
        self._handles = []
        for layer in model.model.layers:
            self._handles.append(layer.mlp.register_forward_pre_hook(self._pre))
            self._handles.append(layer.mlp.register_forward_hook(self._post))

    def _pre(self, *args: object) -> None:
        self._t0 = time.perf_counter()

    def _post(self, *args: object) -> None:
        self.total += time.perf_counter() - self._t0

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


@torch.no_grad()
def _forward_time(model: torch.nn.Module, cache: DynamicCache, new_ids: torch.Tensor) -> float:
    start = time.perf_counter()
    model(input_ids=new_ids, cache=cache, use_cache=True)
    elapsed = time.perf_counter() - start
    cache.crop(-new_ids.shape[1])  # negative = number of tokens to drop
    return elapsed


@torch.no_grad()
def measure_cost_curve(
    model: torch.nn.Module,
    stream: np.ndarray,
    ks: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
    prefix_len: int = 200,
    num_offsets: int = 3,
    reps: int = 7,
) -> list[CostPoint]:
    """C(k) of ``model`` on text of ``stream`` (a uint16 token stream)."""
    model.eval()
    span = prefix_len + max(ks)
    offsets = np.linspace(0, len(stream) - span - 1, num_offsets).astype(int)
    times = {k: [] for k in ks}
    moe_times = {k: [] for k in ks}
    unique = {k: [] for k in ks}
    for offset in offsets:
        ids = torch.from_numpy(stream[offset : offset + span].astype(np.int64))[None]
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :prefix_len], cache=cache, use_cache=True)
        for k in ks:  # warm-up
            _forward_time(model, cache, ids[:, prefix_len : prefix_len + k])
        for _ in range(reps):
            for k in ks:  # interleaved so that load changes hit every k alike
                times[k].append(_forward_time(model, cache, ids[:, prefix_len : prefix_len + k]))
        timer = _MoeTimer(model)
        for _ in range(reps):
            for k in ks:
                timer.total = 0.0
                _forward_time(model, cache, ids[:, prefix_len : prefix_len + k])
                moe_times[k].append(timer.total)
        timer.remove()
        for k in ks:
            with RouterTrace(model) as trace:
                _forward_time(model, cache, ids[:, prefix_len : prefix_len + k])
                topk = trace.topk_ids(1)[0]  # [k, L, K]
            unique[k].append(statistics.mean(len(set(topk[:, l].flatten().tolist())) for l in range(topk.shape[1])))
    return [CostPoint(k, statistics.median(times[k]), statistics.median(moe_times[k]), statistics.mean(unique[k])) for k in ks]


def format_curve(points: list[CostPoint]) -> str:
    """A readable table: k, C(k) ms, C(k)/C(1), MoE share of the extra cost, unique experts/layer."""
    base = points[0]
    lines = ["   k   C(k) ms  C(k)/C(1)  MoE ms  extra-from-MoE  unique experts/layer"]
    for p in points:
        extra = p.seconds - base.seconds
        share = (p.moe_seconds - base.moe_seconds) / extra if extra > 0 else float("nan")
        lines.append(f"{p.k:4d} {p.seconds * 1e3:9.2f} {p.seconds / base.seconds:10.2f} {p.moe_seconds * 1e3:7.2f} {share:15.0%} {p.unique_experts:21.1f}")
    return "\n".join(lines)
