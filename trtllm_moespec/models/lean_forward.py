"""Our own Qwen3-MoE / GPT-OSS forward over the parameters transformers loaded.

transformers keeps loading, dtypes and quantization; this module reads the loaded tensors
(no copy: the q/k/v projections are fused once into one weight and transformers' modules are
re-pointed at views of it, so both implementations share memory) and runs the decoder for a
batch of B requests over a `StaticKVCache`: per-request positions, slots and prefix lengths,
a tree mask, and outputs returned as values (logits, the EAGLE-3 capture hiddens, the router
top-k ids), with no hooks, no cache classes and no mask factories on the hot path.

Matched against transformers 5.24 `modeling_qwen3_moe.py` / `modeling_gpt_oss.py`:
- RMSNorm in float32; Qwen3 multiplies the weight after casting back to the input dtype,
  GPT-OSS before (its norms stay float32 under `_keep_in_fp32_modules`).
- Qwen3: per-head q_norm / k_norm before the rotary embedding; SDPA attention.
- GPT-OSS: q/k/v/o biases, attention sinks (eager softmax with an extra column), alternating
  sliding / full layers, router with bias, clamped SwiGLU experts with biases (`moe.py`).
- Rotary cos/sin are computed by the model's own rotary module once for positions
  `[0, max_len)` and gathered per forward (the same float ops as computing them per call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..core.device import host_tensor
from .kv_cache import StaticKVCache
from .lean_attention import AttentionMasks, apply_rotary, attend, build_masks, build_static_masks
from .moe import ExpertWeights, RouterWeights, gpt_oss_weights, qwen3_moe_weights, route, routed_experts


@dataclass(frozen=True)
class ForwardBatch:
    """Inputs of one lean forward over B requests, each with T new tokens."""

    input_ids: torch.Tensor  # [B, T] int64
    positions: torch.Tensor  # [B, T] int64 rotary positions (prefix_len + depth for tree nodes)
    slots: tuple[int, ...]  # [B] cache slot of each request
    prefix_lens: tuple[int, ...]  # [B] committed keys per request; new K/V go to cache index prefix_len + t
    tree_mask: torch.Tensor | None = None  # [B, T, T] bool, query i sees new key j; None = causal
    logits_to_keep: int = 0  # 0: logits at all T positions; n: at the last n
    logits_at: tuple[int, ...] | None = None  # [B] instead: the one position per row whose logits are kept


@dataclass(frozen=True)
class LeanOutput:
    logits: torch.Tensor  # [B, T_keep, V] float32
    hidden: torch.Tensor  # [B, T, C*H] inputs of the capture layers, concatenated
    expert_ids: torch.Tensor  # [B, T, L_moe, topk] int64


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, H] fused projection (transformers' q/k/v weights are views of it)
    qkv_bias: torch.Tensor | None  # [(Hq + 2 Hkv) D]
    qk_norm: torch.Tensor | None  # [Hq + Hkv, D] Qwen3's per-head q_norm / k_norm weights, one row per head
    o_proj: torch.Tensor  # [H, Hq D]
    o_bias: torch.Tensor | None
    sinks: torch.Tensor | None  # [Hq] GPT-OSS
    sliding: bool  # a sliding-window layer
    router: RouterWeights | None  # None: a dense layer (Qwen3 mlp_only_layers)
    experts: ExpertWeights | None
    dense_mlp: nn.Module | None


class LeanForward:
    """The decoder of a loaded transformers Qwen3-MoE / GPT-OSS model, run over a static cache."""

    def __init__(self, model: nn.Module, arch: str, capture_layers: tuple[int, ...], layer_types: tuple[str, ...],
                 sliding_window: int | None):
        cfg = model.config
        self.arch = arch
        self.gpt_oss = arch == "GptOssForCausalLM"
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim ** -0.5
        self.eps = cfg.rms_norm_eps
        self.window = sliding_window if "sliding_attention" in layer_types else None
        self.capture_layers = capture_layers
        self.embed = model.get_input_embeddings().weight  # [V, H]
        self.lm_head = model.get_output_embeddings()
        self.final_norm = model.model.norm.weight
        self.rotary = model.model.rotary_emb
        self.layers = [self._layer(layer, kind == "sliding_attention") for layer, kind in zip(model.model.layers, layer_types)]
        self.has_full = any(not layer.sliding for layer in self.layers)
        self._cos = self._sin = None  # [max_len, D] rotary tables, built for the cache length

    # ------------------------------------------------------------------ weights
    def _layer(self, layer: nn.Module, sliding: bool) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, qkv_bias = _fuse_qkv(attn)
        router = experts = dense = None
        if hasattr(mlp, "router"):
            router, experts = gpt_oss_weights(mlp)
        elif hasattr(mlp, "gate") and hasattr(mlp, "experts"):
            router, experts = qwen3_moe_weights(mlp)
        else:
            dense = mlp
        return _Layer(
            input_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
            qkv=qkv, qkv_bias=qkv_bias,
            qk_norm=self._qk_norm(attn),
            o_proj=attn.o_proj.weight, o_bias=attn.o_proj.bias, sinks=getattr(attn, "sinks", None),
            sliding=sliding, router=router, experts=experts, dense_mlp=dense,
        )

    def _qk_norm(self, attn: nn.Module) -> torch.Tensor | None:
        """q_norm and k_norm as one weight over the q and k heads (expanded views, no copy), so one
        norm and one rotary call cover both."""
        if not hasattr(attn, "q_norm"):
            return None
        D = self.head_dim
        return torch.cat([attn.q_norm.weight[None].expand(self.num_heads, D),
                          attn.k_norm.weight[None].expand(self.num_kv_heads, D)])

    def new_cache(self, max_len: int, num_slots: int = 1, max_len_cap: int | None = None) -> StaticKVCache:
        """A static cache for this model: one K/V entry per layer, slot and position."""
        return StaticKVCache(len(self.layers), self.num_kv_heads, self.head_dim, max_len, num_slots,
                             dtype=self.embed.dtype, device=self.embed.device, max_len_cap=max_len_cap)

    def _rope(self, positions: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos is None or self._cos.shape[0] < max_len:
            pos = torch.arange(max_len, device=self.embed.device)[None]
            cos, sin = self.rotary(self.embed[:1, None], pos)  # [1, max_len, D or D/2]
            if cos.shape[-1] != self.head_dim:  # GPT-OSS returns half-width tables for its half-split rotary
                cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
            half = self.head_dim // 2
            # rotate_half(x) * sin == roll(x, D/2) * [-sin_lo, sin_hi]: the sign lives in the table
            # (negation is exact), so the rotary is 4 elementwise ops, bit-identical to transformers'.
            self._cos, self._sin = cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], -1)
        return self._cos[positions][:, None], self._sin[positions][:, None]  # [B, 1, T, D]

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, cache: StaticKVCache, batch: ForwardBatch) -> LeanOutput:
        """Run B requests' new tokens; reads only the cache ranges they need (host-side lengths)."""
        cache.ensure_len(max(batch.prefix_lens) + batch.input_ids.shape[1])
        masks = build_masks(batch.prefix_lens, batch.positions, batch.tree_mask, self.embed.dtype, self.window,
                            self.has_full)
        io = _HostIndexedIO(batch.slots, batch.prefix_lens)
        return self._decode(cache, batch.input_ids, batch.positions, masks, io, batch.logits_to_keep, batch.logits_at)

    @torch.no_grad()
    def forward_static(self, cache: StaticKVCache, input_ids: torch.Tensor, positions: torch.Tensor,
                       slots: tuple[int, ...], prefix_lens: torch.Tensor, tree_mask: torch.Tensor | None,
                       logits_to_keep: int = 0) -> LeanOutput:
        """The same forward with static shapes and no host reads: prefix_lens [B] is a tensor,
        every request attends over the whole cache [0, max_len) under a mask (CUDA-graph capturable;
        the cache must already be long enough)."""
        masks = build_static_masks(prefix_lens, positions, tree_mask, self.embed.dtype, self.window, cache.max_len)
        io = _TensorIndexedIO(slots, prefix_lens, input_ids.shape[1])
        return self._decode(cache, input_ids, positions, masks, io, logits_to_keep)

    def _decode(self, cache, input_ids, positions, masks: AttentionMasks, io, logits_to_keep: int,
                logits_at: tuple[int, ...] | None = None) -> LeanOutput:
        B, T = input_ids.shape
        cos, sin = self._rope(positions, cache.max_len)
        h = F.embedding(input_ids, self.embed)  # [B, T, H]
        hidden, expert_ids = [], []
        for i, layer in enumerate(self.layers):
            if i in self.capture_layers:
                hidden.extend([h] * self.capture_layers.count(i))
            h = h + self._attention(layer, self._norm(h, layer.input_norm), cache, i, io, masks, cos, sin)
            mlp_out, ids = self._mlp(layer, self._norm(h, layer.post_norm))
            h = h + mlp_out
            if ids is not None:
                expert_ids.append(ids.view(B, T, -1))
        if logits_at is not None:  # rows of different lengths (a batch of right-padded prompts): [B, 1, H]
            keep = h[torch.arange(B, device=h.device), torch.tensor(logits_at, device=h.device)][:, None]
        else:
            keep = h if logits_to_keep == 0 else h[:, -logits_to_keep:]
        logits = self.lm_head(self._norm(keep, self.final_norm)).float()
        return LeanOutput(logits=logits, hidden=torch.cat(hidden, dim=-1), expert_ids=torch.stack(expert_ids, dim=2))

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and weight.dtype == torch.float32:  # one fused op; same float ops as below
            return F.rms_norm(x, weight.shape, weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gpt_oss:
            return (weight * xf).to(x.dtype)
        return weight * xf.to(x.dtype)

    def _attention(self, layer: _Layer, x, cache: StaticKVCache, i: int, io, masks: AttentionMasks,
                   cos, sin) -> torch.Tensor:
        B, T, _ = x.shape
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = F.linear(x, layer.qkv, layer.qkv_bias)
        qk, v = qkv.split([(Hq + Hkv) * D, Hkv * D], dim=-1)
        qk = qk.view(B, T, Hq + Hkv, D)
        if layer.qk_norm is not None:  # per-head RMSNorm over q and k heads at once (Qwen3)
            qk = self._head_norm(qk, layer.qk_norm)
        qk = apply_rotary(qk.transpose(1, 2), cos, sin)  # [B, Hq + Hkv, T, D]: elementwise, so q and k together
        q, k = qk[:, :Hq], qk[:, Hq:]
        v = v.view(B, T, Hkv, D)
        start = masks.sliding_start if layer.sliding else masks.full_start
        keys, values = io.write_and_read(cache, i, k, v.transpose(1, 2), start, masks.end)
        mask = masks.sliding if layer.sliding else masks.full
        out = attend(q, keys, values, mask, self.scale, layer.sinks)  # [B, T, Hq D]
        return F.linear(out, layer.o_proj, layer.o_bias)

    def _head_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # the per-head weights differ, so only the normalisation is fused
            return weight * F.rms_norm(x, (x.shape[-1],), None, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * xf.to(x.dtype)

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if layer.router is None:
            return layer.dense_mlp(x), None
        flat = x.reshape(-1, x.shape[-1])
        ids, weights = route(flat, layer.router)
        return routed_experts(flat, ids, weights, layer.experts).view_as(x), ids


class _HostIndexedIO:
    """Cache writes/reads addressed by host-side slots and prefix lengths (eager forwards)."""

    def __init__(self, slots: tuple[int, ...], prefix_lens: tuple[int, ...]):
        self.slots, self.prefix_lens = slots, prefix_lens
        self._index: tuple[torch.Tensor, torch.Tensor] | None = None  # (slot [B, T], position [B, T]), per forward

    def _indices(self, T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer writes the same cache positions: their index tensors are made once per forward."""
        if self._index is None:
            slots, prefix = host_tensor(self.slots, device), host_tensor(self.prefix_lens, device)
            self._index = (slots[:, None].expand(len(self.slots), T), prefix[:, None] + torch.arange(T, device=device))
        return self._index

    def write_and_read(self, cache: StaticKVCache, layer: int, k, v, start: int, end: int):
        """Write k/v [B, Hkv, T, D] at `prefix_len + t` of each request's slot; read back the slot
        ranges [start, end) as [B, Hkv, end - start, D]."""
        kc, vc = cache.layer(layer)  # [slots, Hkv, max_len, D]
        B, _, T, _ = k.shape
        if B == 1:  # views, no gather
            s, P = self.slots[0], self.prefix_lens[0]
            kc[s, :, P:P + T] = k[0]
            vc[s, :, P:P + T] = v[0]
            return kc[s:s + 1, :, start:end], vc[s:s + 1, :, start:end]
        sl, idx = self._indices(T, k.device)  # [B, T] each
        kc[sl, :, idx] = k.transpose(1, 2)  # advanced indices on dims 0 and 2: value is [B, T, Hkv, D]
        vc[sl, :, idx] = v.transpose(1, 2)
        views = _block_views(kc, vc, self.slots, start, end)  # the usual batch: consecutive slots
        return views if views is not None else (kc[sl[:, 0], :, start:end], vc[sl[:, 0], :, start:end])


class _TensorIndexedIO:
    """Cache writes addressed by a prefix-length tensor; reads the whole slot (static shapes)."""

    def __init__(self, slots: tuple[int, ...], prefix_lens: torch.Tensor, num_new: int):
        self.slots = slots
        self.write_idx = prefix_lens.reshape(-1, 1) + torch.arange(num_new, device=prefix_lens.device)  # [B, T]

    def write_and_read(self, cache: StaticKVCache, layer: int, k, v, start: int, end: int):
        kc, vc = cache.layer(layer)
        for b, s in enumerate(self.slots):
            kc[s].index_copy_(1, self.write_idx[b], k[b])
            vc[s].index_copy_(1, self.write_idx[b], v[b])
        views = _block_views(kc, vc, self.slots, start, end)  # one request, or the usual batch
        if views is not None:
            return views
        return (torch.stack([kc[s, :, start:end] for s in self.slots]),
                torch.stack([vc[s, :, start:end] for s in self.slots]))


def _block_views(kc: torch.Tensor, vc: torch.Tensor, slots: tuple[int, ...], start: int, end: int):
    """The slots' K/V at cache positions [start, end) as views, no copy, when the slots are one block
    of the cache [slots, Hkv, max_len, D]; None otherwise (the caller gathers them)."""
    first, B = slots[0], len(slots)
    if slots != tuple(range(first, first + B)):
        return None
    return kc[first:first + B, :, start:end], vc[first:first + B, :, start:end]


def _fuse_qkv(attn: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One [q; k; v] weight (and bias); transformers' projections are re-pointed at views of it,
    so the two implementations keep sharing one copy of the weights."""
    projs = (attn.q_proj, attn.k_proj, attn.v_proj)
    weight = torch.cat([p.weight.detach() for p in projs], 0)
    bias = torch.cat([p.bias.detach() for p in projs], 0) if projs[0].bias is not None else None
    start = 0
    for p in projs:
        n = p.weight.shape[0]
        p.weight = nn.Parameter(weight[start:start + n], requires_grad=False)
        if bias is not None:
            p.bias = nn.Parameter(bias[start:start + n], requires_grad=False)
        start += n
    return weight, bias
