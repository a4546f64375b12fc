"""Routing and routed-expert computation of one MoE layer, over the parameters transformers loaded.

Everything expert-parallel execution needs to change lives here: `routed_experts` computes
the experts for (token, expert) pairs; an expert-parallel engine keeps the experts of its rank
(`ExpertWeights` of a slice of the expert axis, ids outside it dropped) and all-reduces the
output across ranks.

Routers (transformers 5.24 `Qwen3MoeTopKRouter`, `GptOssTopKRouter`):
- Qwen3-MoE: probs = softmax(x W^T) in float32, top-k of probs, renormalised if `norm_topk_prob`.
- GPT-OSS: logits = x W^T + b, top-k of logits, softmax over the k values.
Experts (transformers' `grouped_mm` experts implementation, the default):
- Qwen3-MoE: gate_up_proj [E, 2I, H] (gate then up), silu(gate) * up, down_proj [E, H, I].
- GPT-OSS: gate_up_proj [E, H, 2I] with gate/up interleaved and a bias; gate clamped above at
  `limit`, up clamped to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate); down_proj
  [E, I, H] plus bias.
Quantized experts (GPT-OSS MXFP4 modules hold blocks and scales, not `gate_up_proj`) run through
the transformers module itself: dequantization stays transformers' job.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .experts_host import CLAMPED_SWIGLU, HOST_MAX_PAIRS, SILU_GATED, HostExperts, routed_slots

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
# Without the compiled kernel (experts_host.py: no numba, or switched off), up to this many (token, expert)
# pairs CPU runs one matmul per routed expert instead of a grouped GEMM. Measured on moespec-tiny (top-4 of 32, 1 thread): one token (4 pairs) 162 vs
# 319 us per layer; 8 pairs about even; 12+ pairs the grouped GEMM wins (see `_looped_experts`).
LOOPED_MAX_PAIRS = 4


@dataclass(frozen=True)
class RouterWeights:
    weight: torch.Tensor  # [E, H]
    bias: torch.Tensor | None  # [E] (GPT-OSS)
    top_k: int
    softmax_first: bool  # Qwen3-MoE: softmax over all experts, then top-k; GPT-OSS: top-k, then softmax
    renormalize: bool  # Qwen3-MoE norm_topk_prob


@dataclass(frozen=True)
class ExpertWeights:
    """Stacked expert weights laid out for `x @ W` per expert (grouped GEMM operands)."""

    gate_up: torch.Tensor | None  # [E, H, 2I] (a transposed view for Qwen3-MoE)
    gate_up_bias: torch.Tensor | None  # [E, 2I]
    down: torch.Tensor | None  # [E, I, H]
    down_bias: torch.Tensor | None  # [E, H]
    gate: Callable[[torch.Tensor], torch.Tensor] | None  # [S, 2I] -> [S, I]
    module: nn.Module | None  # fallback: the transformers experts module (quantized weights)
    num_experts: int
    host: HostExperts | None = None  # the same weights for the compiled CPU kernel (experts_host.py)


def route(x: torch.Tensor, r: RouterWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] -> (top-k expert ids [N, k] int64, routing weights [N, k] in x's dtype)."""
    logits = F.linear(x, r.weight, r.bias)  # [N, E]
    if r.softmax_first:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_w, top_ids = probs.topk(r.top_k, dim=-1)
        if r.renormalize:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_ids, top_w.to(logits.dtype)
    top_logits, top_ids = logits.topk(r.top_k, dim=-1)
    return top_ids, torch.softmax(top_logits, dim=1, dtype=top_logits.dtype)


def routed_experts(x: torch.Tensor, top_ids: torch.Tensor, top_w: torch.Tensor, w: ExpertWeights,
                   looped: bool | None = None) -> torch.Tensor:
    """sum_j top_w[n, j] * expert_{top_ids[n, j]}(x[n]) for x [N, H] -> [N, H].

    One grouped GEMM per projection over the (token, expert) pairs sorted by expert, so only
    experts that received tokens cost anything (as transformers' `grouped_mm` path). On CPU, up to
    `HOST_MAX_PAIRS` pairs run through the compiled kernel (`experts_host.py`) when it applies;
    without it, up to `LOOPED_MAX_PAIRS` pairs run as one matmul per expert that received tokens
    (`looped`: force one torch path or the other, the kernel off; None = by size).
    """
    if w.module is not None:
        return w.module(x, top_ids, top_w)
    N, k = top_ids.shape
    if w.host is not None and looped is None and N * k <= HOST_MAX_PAIRS and not torch.is_grad_enabled():
        slots = routed_slots(x, top_ids, top_w, w.host)  # [N * k, H]
        if slots is not None:
            return slots.view(N, k, -1).sum(dim=1).to(x.dtype)
    cpu = x.device.type == "cpu"
    if cpu and N == 1 and looped is not False:  # a plain decode step: k distinct experts, one row each
        return _one_token_experts(x, top_ids[0], top_w[0], w)
    flat_ids = top_ids.reshape(-1)  # [S] S = N * k
    sorted_ids, perm = torch.sort(flat_ids)
    xs = x[perm // k]  # [S, H] token rows grouped by expert
    if cpu and (looped if looped is not None else flat_ids.numel() <= LOOPED_MAX_PAIRS):
        h = _looped_experts(xs, sorted_ids, w)
    else:
        # offsets[e] = pairs routed to experts <= e, one search over the sorted ids. Its size never
        # depends on the data and it reads nothing on the host (CUDA-graph safe; bincount reads the
        # largest id back, and CUDA histc asks the driver for free memory at every launch).
        experts = torch.arange(w.num_experts, device=sorted_ids.device)
        offsets = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)  # [E]
        h = _grouped_linear(xs, w.gate_up, offsets, w.gate_up_bias, sorted_ids)  # [S, 2I]
        h = _grouped_linear(w.gate(h), w.down, offsets, w.down_bias, sorted_ids)  # [S, H]
    h = h * top_w.reshape(-1)[perm, None]
    out = torch.empty_like(h)
    out[perm] = h  # back to (token, slot) order
    return out.view(N, k, -1).sum(dim=1).to(x.dtype)


def _looped_experts(xs: torch.Tensor, sorted_ids: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    """Both projections for token rows xs [S, H] sorted by expert (`sorted_ids` [S]), one
    matmul per expert that received rows: [S, H] out, rows in the same order.

    CPU only (it reads the expert ids on the host). CPU `grouped_mm` walks all E experts
    with a few tensor ops each, received rows or not; for a plain decode step's few pairs
    that walk costs more than the matmuls themselves.
    """
    bounds = _expert_runs(sorted_ids.tolist())
    xs = xs.to(w.gate_up.dtype)
    # torch.cat, not mm(out=): the same op count and autograd still works (EP shards, training).
    h = torch.cat([xs[s:t] @ w.gate_up[e] for e, s, t in bounds])  # [S, 2I]
    if w.gate_up_bias is not None:
        h = h + w.gate_up_bias[sorted_ids]
    a = w.gate(h).to(w.down.dtype)
    out = torch.cat([a[s:t] @ w.down[e] for e, s, t in bounds])  # [S, H]
    if w.down_bias is not None:
        out = out + w.down_bias[sorted_ids]
    return out


def _one_token_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    """routed_experts for one token x [1, H] and its k expert ids / weights [k]: no sort and
    no gather, one matmul per expert."""
    experts = ids.tolist()
    xs = x.to(w.gate_up.dtype)
    h = torch.cat([xs @ w.gate_up[e] for e in experts])  # [k, 2I]
    if w.gate_up_bias is not None:
        h = h + w.gate_up_bias[ids]
    a = w.gate(h).to(w.down.dtype)
    out = torch.cat([a[j:j + 1] @ w.down[e] for j, e in enumerate(experts)])  # [k, H]
    if w.down_bias is not None:
        out = out + w.down_bias[ids]
    return (out * weights[:, None]).sum(dim=0, keepdim=True).to(x.dtype)


def _expert_runs(sorted_ids: list[int]) -> list[tuple[int, int, int]]:
    """(expert, start, end) of each run of equal ids in a sorted list."""
    runs, start = [], 0
    for i in range(1, len(sorted_ids) + 1):
        if i == len(sorted_ids) or sorted_ids[i] != sorted_ids[start]:
            runs.append((sorted_ids[start], start, i))
            start = i
    return runs


# Up to this many (token, expert) pairs, CUDA computes a grouped GEMM that torch cannot run on the device
# alone as one batched matmul over each pair's gathered expert weight (pairs x H x N elements of scratch:
# 64 MB for moespec-tiny in float32 at this bound; a verify of 33 tokens is 132 pairs).
GATHERED_MAX_PAIRS = 256


@functools.lru_cache(maxsize=None)
def _grouped_mm_reads_host(device: torch.device, dtype: torch.dtype) -> bool:
    """Does torch's CUDA grouped GEMM read the group offsets on the host here? Its device-only kernel
    is bf16 on sm90 / sm100 (torch's native grouped GEMM, torch 2.9-2.11); other dtypes and GPUs take
    a fallback that loops over `offs.cpu()`, a host read a CUDA graph capture cannot hold."""
    return dtype != torch.bfloat16 or torch.cuda.get_device_capability(device)[0] not in (9, 10)


def gathered_matmul(x: torch.Tensor, weight: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """x [S, H] @ weight[expert_ids[s]] [H, N] for every row s: one batched matmul, no host read."""
    return torch.bmm(x.to(weight.dtype)[:, None], weight.index_select(0, expert_ids))[:, 0]


def _gathers(weight: torch.Tensor, pairs: int) -> bool:
    """Run a grouped GEMM as `gathered_matmul`: on CUDA, for few pairs, where torch's would read the host."""
    return (weight.is_cuda and pairs <= GATHERED_MAX_PAIRS
            and (_grouped_mm is None or _grouped_mm_reads_host(weight.device, weight.dtype)))


def _grouped_linear(x, weight, offsets, bias, sorted_ids):
    if _gathers(weight, x.shape[0]):
        out = gathered_matmul(x, weight, sorted_ids)  # no host read: the verify forwards CUDA graphs capture
    elif _grouped_mm is not None:
        out = _grouped_mm(x.to(weight.dtype), weight, offs=offsets)
    else:  # torch without grouped GEMM: one matmul per expert that got tokens
        out = x.new_empty(x.shape[0], weight.shape[-1])
        start = 0
        for e, end in enumerate(offsets.tolist()):
            if end > start:
                out[start:end] = x[start:end] @ weight[e]
            start = end
    if bias is not None:
        out = out + bias[sorted_ids]
    return out


def qwen3_moe_weights(block: nn.Module) -> tuple[RouterWeights, ExpertWeights]:
    """Router and experts of a transformers `Qwen3MoeSparseMoeBlock` (5.x layout)."""
    gate, experts = block.gate, block.experts
    router = RouterWeights(gate.weight, None, gate.top_k, softmax_first=True, renormalize=bool(gate.norm_topk_prob))
    if not isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
        return router, _module_fallback(experts)
    act = experts.act_fn

    def silu_gate(h: torch.Tensor) -> torch.Tensor:
        g, u = h.chunk(2, dim=-1)
        return act(g) * u
    silu = isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"  # transformers' ACT2FN["silu"]
    host = HostExperts.of(experts.gate_up_proj, None, experts.down_proj, None, True, SILU_GATED) if silu else None
    return router, ExpertWeights(experts.gate_up_proj.transpose(-2, -1), None, experts.down_proj.transpose(-2, -1),
                                 None, silu_gate, None, experts.num_experts, host)


def gpt_oss_weights(mlp: nn.Module) -> tuple[RouterWeights, ExpertWeights]:
    """Router and experts of a transformers `GptOssMLP` (5.x layout)."""
    r, experts = mlp.router, mlp.experts
    router = RouterWeights(r.weight, r.bias, r.top_k, softmax_first=False, renormalize=False)
    if not isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
        return router, _module_fallback(experts)
    alpha, limit = experts.alpha, experts.limit

    def clamped_swiglu(h: torch.Tensor) -> torch.Tensor:
        g, u = h[..., ::2].clamp(max=limit), h[..., 1::2].clamp(min=-limit, max=limit)
        return (u + 1) * (g * torch.sigmoid(g * alpha))
    host = HostExperts.of(experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj, experts.down_proj_bias,
                          False, CLAMPED_SWIGLU, alpha, limit)
    return router, ExpertWeights(experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj,
                                 experts.down_proj_bias, clamped_swiglu, None, experts.num_experts, host)


def _module_fallback(experts: nn.Module) -> ExpertWeights:
    return ExpertWeights(None, None, None, None, None, experts, experts.num_experts)
