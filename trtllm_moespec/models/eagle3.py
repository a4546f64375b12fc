"""EAGLE-3 drafter in the SpecForge / SGLang checkpoint format (`LlamaForCausalLMEagle3`).

Architecture (SGLang `llama_eagle3.py`, SpecForge `llama3_eagle.py`): one decoder
layer whose attention takes 2H inputs, the concatenation of
`input_layernorm(embed(token))` and `hidden_norm(h)`; the residual stream starts
at h. On the first draft step h = fc(concat of the target's three captured hidden
states) [3*H_target -> H]; on later steps h is the drafter's own pre-norm output
(the residual stream after the MLP) at the parent node. Logits come from
`lm_head(norm(h_out))` over the draft vocabulary; a draft id d maps to the target
id `d + d2t[d]`.

Pairing (EAGLE-3): drafter position t holds (embedding of token t+1, target hidden
at position t) and predicts token t+2. So after the target has processed tokens
x_0..x_{n-1} and x_n is the next (root) token, the drafter cache holds positions
0..n-1 with tokens x_1..x_n and the last position's output proposes the root's
children. `prefill` and `commit` take care of this pairing.

This module holds the network, its KV cache and checkpoint I/O; tree drafting
lives in `eagle3_draft.py`.
"""

from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import check_safetensors_dir, parse_dtype, safetensors_files

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3",)


@dataclass(frozen=True)
class Eagle3Config:
    """The config.json fields an EAGLE-3 head uses (names as in the checkpoints)."""

    hidden_size: int  # drafter width H
    intermediate_size: int  # MLP width
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # target vocabulary (embedding rows, t2d length)
    draft_vocab_size: int  # lm_head rows
    target_hidden_size: int  # H_target; fc maps 3*H_target -> H
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None

    @staticmethod
    def from_dict(d: dict) -> "Eagle3Config":
        archs = d.get("architectures") or []
        if not any(a in EAGLE3_ARCHITECTURES for a in archs):
            raise ValueError(f"not an EAGLE-3 drafter config: architectures={archs}, expected {list(EAGLE3_ARCHITECTURES)}")
        if d.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"only single-layer EAGLE-3 heads are supported, got num_hidden_layers={d['num_hidden_layers']}")
        hidden, heads = d["hidden_size"], d["num_attention_heads"]
        rope = d.get("rope_parameters") or {}
        return Eagle3Config(
            hidden_size=hidden,
            intermediate_size=d["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads", heads),
            head_dim=d.get("head_dim") or hidden // heads,
            vocab_size=d["vocab_size"],
            draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
            target_hidden_size=d.get("target_hidden_size") or hidden,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            hidden_act=d.get("hidden_act", "silu"),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rope_theta=d.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=d.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"} or None),
        )

    def to_dict(self) -> dict:
        return {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size, "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": self.hidden_act, "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling, "tie_word_embeddings": False,
        }


@dataclass(frozen=True)
class Eagle3Output:
    """One drafter forward over T positions."""

    logits: torch.Tensor  # [B, T, V_draft] float32
    hidden: torch.Tensor  # [B, T, H] pre-norm output (fed back as h on the next draft step)
    keys: torch.Tensor  # [B, KVH, T, D] this forward's keys (rotary applied), for the caller to cache
    values: torch.Tensor  # [B, KVH, T, D]


@dataclass(frozen=True)
class PackedSegment:
    """One request's rows in a packed drafter forward (`Eagle3Drafter.forward_packed`)."""

    cache_kv: torch.Tensor  # [2, 1, KVH, capacity, D] the request's buffer; its rows' keys go to start..start+length
    start: int  # positions before these rows that they attend to (committed ones, then tree slots)
    length: int  # rows T_b
    attention_mask: torch.Tensor | None = None  # [1, 1, T_b, start + T_b] additive; None: causal after `start`


class DrafterKVPool:
    """Drafter K/V buffers [2, 1, KVH, capacity, D] reused across requests.

    A request's buffer comes back here when its `Eagle3Cache` is garbage-collected (as the target's
    cache slots do) or when the cache outgrows it, and the next request takes it instead of
    allocating its own. Why: a CUDA graph of a drafter forward is bound to the buffer it was
    captured over (`cuda_graphs.DrafterGraphStore` keeps graphs per buffer, as long as the buffer
    lives), so requests that reuse buffers replay graphs instead of capturing new ones; with one
    request at a time every request runs on the same buffer. The pool keeps as many free buffers
    as were ever in use at once (the engine's concurrency so far), so memory stays what the busiest
    moment needed.
    """

    def __init__(self):
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()  # a finalizer may return a buffer from another thread (a server's)
        self.allocated = 0  # buffers allocated so far (a reused buffer does not count)
        self.in_use = 0  # buffers taken and not given back
        self.peak = 0  # the most buffers in use at once

    def take(self, length: int, like: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        """A buffer of at least `length` positions with K/V shape `like` = (KVH, D): the smallest free
        one that fits, zeroed (a reused buffer's stale keys are masked out, but zeros keep even a
        masked product finite), else a new one of max(length, 256) positions."""
        device = torch.device(device)
        with self._lock:
            fits = [kv for kv in self._free if kv.shape[3] >= length and (kv.shape[2], kv.shape[4]) == like
                    and kv.dtype == dtype and kv.device == device]
            kv = min(fits, key=lambda t: t.shape[3]) if fits else None
            if kv is not None:
                self._free = [t for t in self._free if t is not kv]
            else:
                self.allocated += 1
            self.in_use += 1
            self.peak = max(self.peak, self.in_use)
        return kv.zero_() if kv is not None else _new_buffer(length, like, dtype, device)

    def give(self, kv: torch.Tensor) -> None:
        """Return a buffer no cache uses any more."""
        with self._lock:
            self.in_use -= 1
            self._free.append(kv)
            self._free.sort(key=lambda t: t.shape[3], reverse=True)
            del self._free[self.peak:]  # beyond the busiest moment's count, the smallest go


def _new_buffer(length: int, like: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed K/V buffer [2, 1, KVH, capacity, D] of max(length, 256) positions, like = (KVH, D)."""
    return torch.zeros(2, 1, like[0], max(length, 256), like[1], dtype=dtype, device=device)


class _Lease:
    """The buffer a cache holds, shared with the finalizer that returns it to the pool."""

    def __init__(self):
        self.kv: torch.Tensor | None = None

    def give_back(self, pool: DrafterKVPool) -> None:
        if self.kv is not None:
            pool.give(self.kv)
            self.kv = None


@dataclass
class Eagle3Cache:
    """Per-request drafter state (mutable; owned by the engine): KV of committed positions
    plus the last position's outputs, which propose the root's children.

    K/V live in one preallocated buffer written in place (no concatenation per step);
    positions past `num_tokens` are scratch space that tree drafting writes its keys to.
    With a `pool` the buffer is taken from it and returned to it (see `DrafterKVPool`).
    """

    kv: torch.Tensor | None = None  # [2, 1, KVH, capacity, D] keys (0) and values (1)
    num_tokens: int = 0  # committed drafter positions S
    last_logits: torch.Tensor | None = None  # [1, V_draft] float32 at position S-1
    last_hidden: torch.Tensor | None = None  # [1, H] pre-norm output at position S-1
    pool: DrafterKVPool | None = None
    _lease: _Lease | None = None

    @property
    def keys(self) -> torch.Tensor | None:
        """[1, KVH, S, D] view of the committed keys."""
        return None if self.kv is None else self.kv[0, :, :, :self.num_tokens]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.kv is None else self.kv[1, :, :, :self.num_tokens]

    def reserve(self, length: int, num_kv_heads: int, head_dim: int, dtype, device) -> torch.Tensor:
        """The buffer, grown (doubling, contents kept) to hold `length` positions."""
        if self.kv is None or self.kv.shape[3] < length:
            capacity = length if self.kv is None else max(length, 2 * self.kv.shape[3])
            take = _new_buffer if self.pool is None else self.pool.take
            kv = take(capacity, (num_kv_heads, head_dim), dtype, device)
            if self.kv is not None:
                kv[:, :, :, :self.num_tokens] = self.kv[:, :, :, :self.num_tokens]
            self._hold(kv)
        return self.kv

    def _hold(self, kv: torch.Tensor) -> None:
        if self.pool is not None:
            if self._lease is None:
                self._lease = _Lease()
                weakref.finalize(self, self._lease.give_back, self.pool)
            self._lease.give_back(self.pool)  # the outgrown buffer, if any
            self._lease.kv = kv
        self.kv = kv


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Llama form: normalise in float32, cast back, scale); weight [H] or one row per
    stacked input [N, H]."""
    if x.dtype == torch.float32:  # torch's fused kernel: the same result, ~3 us less per call on CPU
        if weight.dim() == 1:
            return F.rms_norm(x, weight.shape, weight, eps)
        return weight * F.rms_norm(x, (x.shape[-1],), None, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms(x, self.weight, self.eps)


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.act_fn = ACT2FN[c.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.input_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)


def _rotary(c: Eagle3Config) -> nn.Module:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    lc = LlamaConfig(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads, head_dim=c.head_dim,
                     max_position_embeddings=c.max_position_embeddings, rope_theta=c.rope_theta,
                     rope_scaling=c.rope_scaling)
    return LlamaRotaryEmbedding(lc)


@dataclass(frozen=True)
class _FusedWeights:
    """Inference-only concatenations of the checkpoint's weights (the checkpoint's tensor names and the
    state dict are unchanged): one matmul for q/k/v, one for gate/up, one norm for both attention inputs."""

    key: tuple  # (data_ptr, version) of every source weight, to notice replacements and in-place updates
    qkv: torch.Tensor  # [(Hq + 2 * KVH) * D, 2H]
    gate_up: torch.Tensor  # [2I, H]
    down: torch.Tensor  # [H, I]
    input_norms: torch.Tensor  # [2, H] input_layernorm (embedding half), hidden_norm (hidden half)
    post_attention_norm: torch.Tensor  # [H]
    final_norm: torch.Tensor  # [H]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Eagle3Drafter(nn.Module):
    """The EAGLE-3 head. Parameter names match the checkpoint's tensor names."""

    def __init__(self, config: Eagle3Config, embed_tokens: nn.Embedding | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = embed_tokens if embed_tokens is not None else nn.Embedding(config.vocab_size, config.hidden_size)
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = _MidLayer(config)
        self.norm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        self.rotary_emb = _rotary(config)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [positions, D]
        self._fused: _FusedWeights | None = None  # inference weights, built on first use (_fused_weights)
        self._rope_signed_table: tuple[torch.Tensor, torch.Tensor] | None = None  # (source cos table, [P, 2, 1, D])
        self.kv_pool = DrafterKVPool()  # per-request K/V buffers, reused across requests

    # ------------------------------------------------------------------ network
    def forward(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache_kv: torch.Tensor | None = None,
        cache_start: int = 0,
    ) -> Eagle3Output:
        """One pass of the head over T positions (training or inference).

        hidden_states: [B, T, 3*H_target] target features (projected by fc) or [B, T, H] the
        drafter's own pre-norm outputs. input_ids [B, T] or inputs_embeds [B, T, H]: the tokens
        paired with them. position_ids [B, T] (default: S..S+T-1 after the S past positions).
        attention_mask: additive float [B, 1, T, S+T] (default: causal; None reaches `_attend` only when
        S == 0, where SDPA's own top-left causal mask is the same). past_kv: keys/values
        [B, KVH, S, D] to attend to before this forward's own positions (not modified).
        cache_kv [2, B, KVH, capacity, D] with cache_start=S instead: the S past positions are
        read from it and this forward's keys/values are written in place at S..S+T-1; position_ids
        must then be < S + T (no query sits past its own key slot; tree drafting's do not).
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        embeds, h = self._inputs(hidden_states, input_ids, inputs_embeds)
        B, T, _ = h.shape
        S = cache_start if cache_kv is not None else (0 if past_kv is None else past_kv[0].shape[2])
        # 1 + the largest position when known on the host (see _rope_cos_sin): a position never passes
        # its own key slot, so with cache_kv every position is < S + T.
        rope_bound = S + T if position_ids is None or cache_kv is not None else None
        if position_ids is None:
            position_ids = torch.arange(S, S + T, device=h.device).expand(B, T)
        if attention_mask is None and (S > 0 or T == 1):
            attention_mask = causal_mask(S, T, h.dtype, h.device)
        # else (no past, several positions, e.g. a prefill): attention_mask stays None = plain causal, which
        # SDPA applies itself, skipping the blocks above the diagonal and no [T, T] mask is built
        if not torch.is_grad_enabled():  # inference: fused weights (no autograd through them needed)
            return self._forward_fused(embeds, h, position_ids, attention_mask, past_kv, cache_kv, S, rope_bound)
        # Functional calls on the modules' parameters: the same math, without nn.Module call overhead.
        layer, eps = self.midlayer, self.config.rms_norm_eps
        x = torch.cat([_rms(embeds, layer.input_layernorm.weight, eps), _rms(h, layer.hidden_norm.weight, eps)], dim=-1)
        attn, keys, values = self._attention(x, position_ids, attention_mask, past_kv, cache_kv, S, rope_bound)
        h = h + attn
        mlp, y = layer.mlp, _rms(h, layer.post_attention_layernorm.weight, eps)
        h = h + F.linear(mlp.act_fn(F.linear(y, mlp.gate_proj.weight)) * F.linear(y, mlp.up_proj.weight),
                         mlp.down_proj.weight)
        logits = F.linear(_rms(h, self.norm.weight, eps), self.lm_head.weight).float()
        return Eagle3Output(logits=logits, hidden=h, keys=keys, values=values)

    def _inputs(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None,
                inputs_embeds: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(token embeddings, h [B, T, H]) in the drafter's dtype; target features are projected by fc."""
        embeds = F.embedding(input_ids, self.embed_tokens.weight) if inputs_embeds is None else inputs_embeds
        embeds = embeds.to(self.fc.weight.dtype)
        h = hidden_states.to(self.fc.weight.dtype)
        if h.shape[-1] == self.fc.in_features:
            h = F.linear(h, self.fc.weight)
        elif h.shape[-1] != self.config.hidden_size:
            raise ValueError(f"hidden_states width {h.shape[-1]} is neither 3*target_hidden_size "
                             f"({self.fc.in_features}) nor hidden_size ({self.config.hidden_size})")
        return embeds, h

    @torch.no_grad()
    def forward_packed(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                       segments: "list[PackedSegment]") -> Eagle3Output:
        """Several requests' positions in one inference forward: hidden_states [1, R, 3*H_target or H],
        input_ids and position_ids [1, R], where segment b owns the next `segments[b].length` rows.
        Every row-wise op (norms, matmuls, the lm_head) runs once over all R rows: on this machine a
        forward over 64 rows costs about 4 over 8 (bound by reading the weights). Attention runs per
        segment, over that request's own buffer, written in place as `forward` does with cache_kv.
        A row's outputs are what `forward` gives it alone, up to matmul rounding (a GEMM may round a
        row differently with the number of rows it is given)."""
        if sum(seg.length for seg in segments) != input_ids.shape[1]:
            raise ValueError(f"the segments cover {sum(seg.length for seg in segments)} rows, the inputs "
                             f"{input_ids.shape[1]}")
        if len(segments) == 1:
            seg = segments[0]
            return self(hidden_states, input_ids=input_ids, position_ids=position_ids,
                        attention_mask=seg.attention_mask, cache_kv=seg.cache_kv, cache_start=seg.start)
        embeds, h = self._inputs(hidden_states, input_ids, None)
        bound = max(seg.start + seg.length for seg in segments)  # no position passes its own key slot
        return self._forward_fused(embeds, h, position_ids, None, None, None, 0, bound, segments)

    def _attention(self, x, position_ids, attention_mask, past_kv, cache_kv=None, start: int = 0,
                   rope_bound: int | None = None):
        a = self.midlayer.self_attn
        B, T, _ = x.shape
        q = F.linear(x, a.q_proj.weight).view(B, T, a.num_heads, a.head_dim).transpose(1, 2)
        k = F.linear(x, a.k_proj.weight).view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)
        v = F.linear(x, a.v_proj.weight).view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)
        cos, sin = self._rope(x, position_ids, rope_bound)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return self._attend(q, k, v, attention_mask, past_kv, cache_kv, start)

    def _attend(self, q, k, v, attention_mask, past_kv, cache_kv, start: int):
        """Attention of q [B, Hq, T, D] over the past keys/values and k, v [B, KVH, T, D] (written into
        cache_kv at start.. when given), then o_proj -> ([B, T, H], k, v). attention_mask None: causal,
        only used with no past positions (SDPA's causal mask is aligned top-left)."""
        out = self._sdpa(q, k, v, attention_mask, past_kv, cache_kv, start)
        return F.linear(out, self.midlayer.self_attn.o_proj.weight), k, v

    def _attend_packed(self, q, k, v, segments: "list[PackedSegment]"):
        """`_attend` of packed rows [1, heads, R, D]: each segment's rows over its own buffer and
        mask (None: causal after its `start` positions, as `forward` defaults), one o_proj for all."""
        outs, row = [], 0
        for seg in segments:
            rows = slice(row, row + seg.length)
            mask = seg.attention_mask
            if mask is None and (seg.start > 0 or seg.length == 1):
                mask = causal_mask(seg.start, seg.length, q.dtype, q.device)
            outs.append(self._sdpa(q[:, :, rows], k[:, :, rows], v[:, :, rows], mask, None, seg.cache_kv, seg.start))
            row += seg.length
        return F.linear(torch.cat(outs, dim=1), self.midlayer.self_attn.o_proj.weight), k, v

    def _sdpa(self, q, k, v, attention_mask, past_kv, cache_kv, start: int) -> torch.Tensor:
        """`_attend` before o_proj: [B, T, Hq * D]."""
        a = self.midlayer.self_attn
        B, _, T, _ = q.shape
        if cache_kv is not None:  # write in place, read the prefix and this forward's keys as views
            cache_kv[0, :, :, start:start + T] = k
            cache_kv[1, :, :, start:start + T] = v
            all_k, all_v = cache_kv[0, :, :, :start + T], cache_kv[1, :, :, :start + T]
        else:
            all_k = k if past_kv is None else torch.cat([past_kv[0], k], dim=2)
            all_v = v if past_kv is None else torch.cat([past_kv[1], v], dim=2)
        mask = None if attention_mask is None else attention_mask.to(q.dtype)
        out = F.scaled_dot_product_attention(q, all_k, all_v, attn_mask=mask, is_causal=attention_mask is None,
                                             enable_gqa=a.num_heads != a.num_kv_heads)
        return out.transpose(1, 2).reshape(B, T, a.num_heads * a.head_dim)

    def _forward_fused(self, embeds, h, position_ids, attention_mask, past_kv, cache_kv, start: int,
                       rope_bound: int | None = None, segments: "list[PackedSegment] | None" = None) -> Eagle3Output:
        """The layer with q/k/v in one matmul, gate/up in one matmul, both input norms in one and rotary
        on q and k together (same math as the unfused path; per-op overhead dominates at these sizes).
        With `segments` the rows are packed requests (`forward_packed`)."""
        fused, eps = self._fused_weights(), self.config.rms_norm_eps
        a = self.midlayer.self_attn
        B, T, H = h.shape
        x = _rms(torch.stack([embeds, h], dim=2), fused.input_norms, eps).view(B, T, 2 * H)
        heads = a.num_heads + 2 * a.num_kv_heads
        qkv = F.linear(x, fused.qkv).view(B, T, heads, a.head_dim)
        cos, sin_signed = self._rope_signed(qkv, position_ids, rope_bound)
        qk = qkv[:, :, :a.num_heads + a.num_kv_heads]
        # rotate_half(x) * sin == roll(x, D/2) * (sin with its first half negated), bit for bit
        qk = qk * cos + qk.roll(a.head_dim // 2, dims=-1) * sin_signed
        q = qk[:, :, :a.num_heads].transpose(1, 2)
        k = qk[:, :, a.num_heads:].transpose(1, 2)
        v = qkv[:, :, a.num_heads + a.num_kv_heads:].transpose(1, 2)
        if segments is None:
            attn, keys, values = self._attend(q, k, v, attention_mask, past_kv, cache_kv, start)
        else:
            attn, keys, values = self._attend_packed(q, k, v, segments)
        h = h + attn
        gate, up = F.linear(_rms(h, fused.post_attention_norm, eps), fused.gate_up).chunk(2, dim=-1)
        h = h + F.linear(self.midlayer.mlp.act_fn(gate) * up, fused.down)
        logits = F.linear(_rms(h, fused.final_norm, eps), self.lm_head.weight).float()
        return Eagle3Output(logits=logits, hidden=h, keys=keys, values=values)

    def _fused_weights(self) -> "_FusedWeights":
        """The concatenated weights, rebuilt whenever a source weight was replaced or modified in place
        (load, .to(), training steps, a new module): keyed by each tensor's storage and version counter."""
        sources = self._fused_sources()
        key = tuple((t.data_ptr(), t._version) for t in sources)
        if self._fused is None or self._fused.key != key:
            with torch.no_grad():
                self._fused = _FusedWeights(
                    key=key, qkv=torch.cat(sources[:3]), gate_up=torch.cat(sources[4:6]), down=sources[6].detach(),
                    input_norms=torch.stack(sources[7:9]), post_attention_norm=sources[9].detach(),
                    final_norm=sources[10].detach())
        return self._fused

    def _fused_sources(self) -> tuple[torch.Tensor, ...]:
        """q, k, v, o, gate, up, down, input_layernorm, hidden_norm, post_attention_layernorm, norm weights.
        Read through the module dicts: nn.Module attribute lookups cost more than the check itself."""
        layer = self._modules["midlayer"]._modules
        attn, mlp = layer["self_attn"]._modules, layer["mlp"]._modules

        def weight(module: nn.Module) -> torch.Tensor:
            return module._parameters["weight"]

        return (weight(attn["q_proj"]), weight(attn["k_proj"]), weight(attn["v_proj"]), weight(attn["o_proj"]),
                weight(mlp["gate_proj"]), weight(mlp["up_proj"]), weight(mlp["down_proj"]),
                weight(layer["input_layernorm"]), weight(layer["hidden_norm"]), weight(layer["post_attention_layernorm"]),
                weight(self._modules["norm"]))

    def _rope_signed(self, x: torch.Tensor, position_ids: torch.Tensor,
                     bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin with its first half negated), each [B, T, 1, D], at position_ids [B, T]: one gather
        from a [positions, 2, 1, D] table made from `_rope`'s (rebuilt when that one grows or changes)."""
        source = self._rope_cos_sin(x, position_ids, bound)
        table = self._rope_signed_table
        if table is None or table[0] is not source[0]:
            cos, sin = source
            half = sin.shape[-1] // 2
            signed = torch.stack([cos, torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)], dim=1)[:, :, None]
            table = self._rope_signed_table = (source[0], signed)
        cs = table[1][position_ids]  # [B, T, 2, 1, D]
        return cs[:, :, 0], cs[:, :, 1]

    def _rope(self, x: torch.Tensor, position_ids: torch.Tensor, bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, 1, T, D] gathered from a table the rotary module filled once (same float ops
        as calling it per forward; the table grows when a position past it appears)."""
        cos, sin = self._rope_cos_sin(x, position_ids, bound)
        return cos[position_ids][:, None], sin[position_ids][:, None]

    def _rope_cos_sin(self, x: torch.Tensor, position_ids: torch.Tensor,
                      bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) tables [positions, D] in x's dtype/device, covering position_ids (all < bound
        when bound is given)."""
        table = self._rope_table
        covered = table is not None and table[0].dtype == x.dtype and table[0].device == x.device
        # Positions may pass max_position_embeddings (a long request); the table then grows, doubling.
        # `bound` (1 + the largest position, when the caller knows it on the host) avoids reading the
        # positions. Without it they are read, except on an accelerator once the table covers
        # max_position_embeddings: there a read is a device sync (and is illegal in a CUDA graph
        # capture), so such callers must pass `bound` when positions can go further.
        if bound is not None:
            need = bound
        elif x.device.type != "cpu" and covered and table[0].shape[0] >= self.config.max_position_embeddings:
            need = 0
        else:
            need = int(position_ids.max()) + 1
        if not covered or table[0].shape[0] < need:
            length = max(need, self.config.max_position_embeddings, 2 * table[0].shape[0] if covered else 0)
            cos, sin = self.rotary_emb(x, torch.arange(length, device=x.device)[None])
            table = self._rope_table = (cos[0], sin[0])
        return table

    def draft_vocab_target_ids(self) -> torch.Tensor:
        """[V_draft] the target id of every draft-vocabulary token (cached per d2t table)."""
        d2t = self._buffers["d2t"]
        key = (d2t.data_ptr(), d2t._version)  # a load writes the buffer in place: its version changes
        cached = getattr(self, "_draft_vocab_ids", None)
        if cached is None or cached[0] != key:
            cached = self._draft_vocab_ids = (key, self.to_target_ids(torch.arange(d2t.numel(), device=d2t.device)))
        return cached[1]

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target ids: d + d2t[d]."""
        d2t = self._buffers["d2t"]  # a module attribute lookup costs more than the lookup itself
        if draft_ids.device.type == "cpu" and d2t.device.type == "cpu" and draft_ids.dtype == torch.int64:
            ids = draft_ids.numpy()  # small index arithmetic: numpy is ~10x cheaper per op than torch here
            return torch.from_numpy(ids + d2t.numpy()[ids])
        return draft_ids + d2t[draft_ids]

    @torch.no_grad()
    def prune_vocab(self, keep_target_ids: torch.Tensor) -> "Eagle3Drafter":
        """Restrict the draft vocabulary to the target ids `keep_target_ids` [N] (in place, no
        retraining): lm_head keeps the rows of those tokens and d2t / t2d describe the new set
        (the SpecForge format). The softmax then runs over N rows instead of draft_vocab_size:
        the top-k among kept tokens is unchanged, their probabilities are renormalised over the
        kept set, and tokens outside it can no longer be proposed (drafting stays lossless)."""
        current = self.to_target_ids(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))
        wanted = torch.zeros(self.config.vocab_size, dtype=torch.bool, device=self.d2t.device)
        wanted[keep_target_ids.to(self.d2t.device).long()] = True
        rows = wanted[current].nonzero()[:, 0]  # draft ids to keep, ascending target ids stay ascending
        if rows.numel() == 0:
            raise ValueError("prune_vocab would leave an empty draft vocabulary")
        head = nn.Linear(self.config.hidden_size, rows.numel(), bias=False).to(self.lm_head.weight)
        head.weight.copy_(self.lm_head.weight[rows])
        self.lm_head = head
        kept = current[rows]
        self.d2t = kept - torch.arange(kept.numel(), device=kept.device)
        self.t2d = torch.zeros_like(self.t2d)
        self.t2d[kept] = True
        from dataclasses import replace

        self.config = replace(self.config, draft_vocab_size=int(kept.numel()))
        return self

    # -------------------------------------------------------- per-request cache
    def new_cache(self) -> Eagle3Cache:
        """A request's drafter cache, its K/V buffer taken from (and returned to) the drafter's pool."""
        return Eagle3Cache(pool=self.kv_pool)

    @torch.no_grad()
    def extend(self, cache: Eagle3Cache, token_ids: torch.Tensor, target_hidden: torch.Tensor) -> None:
        """Append n drafter positions: token_ids [1, n] paired with target_hidden [1, n, 3*H_target]
        (hidden of the target position *before* each token). Updates the last-position outputs."""
        if token_ids.dim() != 2 or token_ids.shape[0] != 1 or target_hidden.shape[:2] != token_ids.shape:
            raise ValueError(f"extend expects token_ids [1, n] and target_hidden [1, n, 3H], got "
                             f"{tuple(token_ids.shape)} and {tuple(target_hidden.shape)}")
        if token_ids.shape[1] == 0:
            return
        S, n = cache.num_tokens, token_ids.shape[1]
        a = self.midlayer.self_attn
        kv = cache.reserve(S + n, a.num_kv_heads, a.head_dim, self.lm_head.weight.dtype, self.lm_head.weight.device)
        out = self(target_hidden, input_ids=token_ids.to(self.lm_head.weight.device), cache_kv=kv, cache_start=S)
        cache.num_tokens = S + n
        cache.last_logits, cache.last_hidden = out.logits[:, -1], out.hidden[:, -1]

    @torch.no_grad()
    def extend_packed(self, caches: list[Eagle3Cache], token_ids: list[torch.Tensor],
                      target_hidden: list[torch.Tensor]) -> None:
        """`extend` of several requests' caches (token_ids[b] [1, n_b], target_hidden[b] [1, n_b, 3H]) in
        one packed forward (`forward_packed`)."""
        for ids, hidden in zip(token_ids, target_hidden):
            if ids.dim() != 2 or ids.shape[0] != 1 or hidden.shape[:2] != ids.shape:
                raise ValueError(f"extend expects token_ids [1, n] and target_hidden [1, n, 3H], got "
                                 f"{tuple(ids.shape)} and {tuple(hidden.shape)}")
        items = [(c, ids, hidden) for c, ids, hidden in zip(caches, token_ids, target_hidden) if ids.shape[1]]
        if len(items) <= 1:
            for c, ids, hidden in items:
                self.extend(c, ids, hidden)
            return
        a, w = self.midlayer.self_attn, self.lm_head.weight
        segments = [PackedSegment(c.reserve(c.num_tokens + ids.shape[1], a.num_kv_heads, a.head_dim, w.dtype, w.device),
                                  c.num_tokens, ids.shape[1]) for c, ids, _ in items]
        positions = torch.cat([torch.arange(seg.start, seg.start + seg.length, device=w.device) for seg in segments])
        out = self.forward_packed(torch.cat([hidden.to(w.device) for _, _, hidden in items], dim=1),
                                  torch.cat([ids.to(w.device) for _, ids, _ in items], dim=1), positions[None], segments)
        end = 0
        for (c, _, _), seg in zip(items, segments):
            end += seg.length
            c.num_tokens = seg.start + seg.length
            c.last_logits, c.last_hidden = out.logits[:, end - 1], out.hidden[:, end - 1]

    def copy_prefix(self, dst: Eagle3Cache, src: Eagle3Cache, length: int) -> None:
        """Give the empty cache `dst` the first `length` committed positions of `src` (K/V copied; the
        last-position outputs come with the next `extend`)."""
        if dst.num_tokens:
            raise ValueError("copy_prefix fills an empty drafter cache")
        if not 0 < length <= src.num_tokens:
            raise ValueError(f"copy_prefix of {length} positions from a drafter cache holding {src.num_tokens}")
        a = self.midlayer.self_attn
        kv = dst.reserve(length, a.num_kv_heads, a.head_dim, src.kv.dtype, src.kv.device)
        kv[:, :, :, :length] = src.kv[:, :, :, :length]
        dst.num_tokens = length

    def prefill(self, cache: Eagle3Cache, input_ids: torch.Tensor, target_hidden: torch.Tensor, next_token: int) -> None:
        """After the target prefilled input_ids [1, T] (hidden [1, T, 3H]) and `next_token` (the
        root) was chosen: drafter positions 0..T-1 get tokens x_1..x_{T-1}, next_token."""
        shifted = torch.cat([input_ids[:, 1:], input_ids.new_tensor([[int(next_token)]])], dim=1)
        self.extend(cache, shifted, target_hidden)

    def commit(self, cache: Eagle3Cache, accepted_pos: torch.Tensor, emitted_ids: torch.Tensor,
               target_hidden: torch.Tensor) -> None:
        """After a verify step: accepted layout positions accepted_pos [D] (-1 pad), the emitted
        tokens emitted_ids [D+1] (accepted tokens then the bonus, -1 pad) and the verify forward's
        capture hidden [1, 1+K, 3H]. Appends (emitted token i, hidden at root/accepted node i)."""
        self.extend(cache, *self.commit_pairs(accepted_pos, emitted_ids, target_hidden))

    def commit_pairs(self, accepted_pos: torch.Tensor, emitted_ids: torch.Tensor,
                     target_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What `commit` appends: (token ids [1, n], target hidden [1, n, 3H]), n = accepted + 1."""
        if accepted_pos.device.type == "cpu" and emitted_ids.device.type == "cpu":
            # a handful of indices: filtering them in numpy is a few us instead of ~10 torch ops
            accepted, emitted = accepted_pos.reshape(-1).numpy(), emitted_ids.reshape(-1).numpy()
            accepted, emitted = accepted[accepted >= 0], emitted[emitted >= 0]
            pos = torch.from_numpy(np.concatenate([np.zeros(1, dtype=np.int64), accepted.astype(np.int64)]))
            emitted = torch.from_numpy(emitted.astype(np.int64))
        else:
            accepted = accepted_pos.reshape(-1)
            accepted = accepted[accepted >= 0]
            emitted = emitted_ids.reshape(-1)
            emitted = emitted[emitted >= 0]
            pos = torch.cat([accepted.new_zeros(1), accepted]).long()
        if emitted.shape[0] != accepted.shape[0] + 1:
            raise ValueError(f"{emitted.shape[0]} emitted tokens for {accepted.shape[0]} accepted nodes; "
                             "expected accepted + 1 (the bonus token)")
        return emitted[None].to(self.lm_head.weight.device), target_hidden.index_select(1, pos.to(target_hidden.device))

    def draft_tree(self, cache: Eagle3Cache, steps: int, topk: int, ddd_threshold: float | None = None,
                   should_expand=None, constraint=None, sync_free: bool | None = None):
        """Draft a tree after the committed positions (see eagle3_draft.py); returns Eagle3Draft.
        `should_expand(tree, frontier)` -> False stops drafting before the next expansion; `constraint`
        restricts each node's children to the tokens a grammar allows; `sync_free` (None: off the CPU)
        feeds padded frontiers instead of reading their length back."""
        from .eagle3_draft import draft_eagle3_tree

        return draft_eagle3_tree(self, cache, steps, topk, ddd_threshold, should_expand, constraint=constraint,
                                 sync_free=sync_free)


def causal_mask(past_len: int, num_new: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[1, 1, T, S+T] additive causal mask for T new positions after S past ones."""
    q = torch.arange(past_len, past_len + num_new, device=device)[:, None]
    k = torch.arange(past_len + num_new, device=device)[None, :]
    mask = torch.zeros(num_new, past_len + num_new, dtype=dtype, device=device)
    mask.masked_fill_(k > q, torch.finfo(dtype).min)
    return mask[None, None]


# ---------------------------------------------------------------------- checkpoint I/O
def load_eagle3(path: str | Path, target=None, device: str | torch.device | None = None,
                dtype: str | torch.dtype | None = None) -> Eagle3Drafter:
    """Load a SpecForge/SGLang EAGLE-3 checkpoint directory; `target` (a TargetModel) is
    checked for matching sizes and lends its embedding when the checkpoint has none.
    device/dtype default to the target's (else cpu / float32)."""
    from safetensors.torch import load_file

    path = Path(path)
    device = device if device is not None else (target.device if target is not None else "cpu")
    dtype = parse_dtype(dtype if dtype is not None else (target.dtype if target is not None else "float32"))
    config = Eagle3Config.from_dict(check_safetensors_dir(path, what="EAGLE-3 drafter"))
    weights: dict[str, torch.Tensor] = {}
    for shard in safetensors_files(path, "EAGLE-3 drafter"):
        weights.update({k.removeprefix("model."): v for k, v in load_file(str(shard)).items()})
    if target is not None:
        _check_matches_target(config, target, has_embeddings="embed_tokens.weight" in weights)
    embed = None
    if "embed_tokens.weight" not in weights:
        if target is None:
            raise ValueError(f"EAGLE-3 drafter at {path} has no embed_tokens.weight; pass the target to share its embedding")
        embed = target.input_embeddings()
        if embed.weight.dtype != dtype or not _same_device(embed.weight.device, torch.device(device)):
            raise ValueError(f"a drafter sharing the target embedding must use the target's device/dtype "
                             f"({embed.weight.device}, {embed.weight.dtype}), got ({device}, {dtype})")
    drafter = Eagle3Drafter(config, embed_tokens=embed)
    _load_weights(drafter, weights, path, shared_embedding=embed is not None)
    return drafter.to(device=device, dtype=dtype).eval()


def _same_device(actual: torch.device, wanted: torch.device) -> bool:
    return actual.type == wanted.type and (wanted.index is None or actual.index == wanted.index)


def _check_matches_target(c: Eagle3Config, target, has_embeddings: bool) -> None:
    if c.target_hidden_size != target.hidden_size:
        raise ValueError(f"drafter target_hidden_size {c.target_hidden_size} != target hidden size {target.hidden_size}")
    if c.vocab_size != target.vocab_size:
        raise ValueError(f"drafter vocab_size {c.vocab_size} != target vocab_size {target.vocab_size}")
    if not has_embeddings and c.hidden_size != target.hidden_size:
        raise ValueError(f"drafter without embeddings has hidden_size {c.hidden_size}, which must equal the target "
                         f"hidden size {target.hidden_size} to share its embedding")


def _load_weights(drafter: Eagle3Drafter, weights: dict, path: Path, shared_embedding: bool) -> None:
    expected = {k: v for k, v in drafter.state_dict().items() if not (shared_embedding and k.startswith("embed_tokens."))}
    missing = sorted(set(expected) - set(weights) - {"t2d", "d2t"})
    if missing:
        raise ValueError(f"EAGLE-3 drafter at {path} is missing tensors {missing}")
    for name, ref in expected.items():
        if name in weights and tuple(weights[name].shape) != tuple(ref.shape):
            raise ValueError(f"EAGLE-3 tensor {name} has shape {tuple(weights[name].shape)}, config implies {tuple(ref.shape)}")
    d2t = weights.get("d2t", torch.zeros(drafter.config.draft_vocab_size, dtype=torch.int64)).long()
    target_ids = torch.arange(d2t.numel()) + d2t
    if target_ids.numel() and (target_ids.min() < 0 or target_ids.max() >= drafter.config.vocab_size):
        raise ValueError(f"EAGLE-3 d2t maps draft ids outside the target vocabulary [0, {drafter.config.vocab_size})")
    weights = dict(weights, d2t=d2t, t2d=weights.get("t2d", drafter.t2d).bool())
    drafter.load_state_dict({k: weights[k] for k in expected}, strict=False)


def write_random_drafter(target_config, out_dir: str | Path, seed: int = 0, hidden_size: int | None = None,
                         draft_vocab_size: int | None = None, with_embeddings: bool = True,
                         init_std: float = 0.05) -> Path:
    """Write a randomly initialised EAGLE-3 head for a target with `target_config` (a transformers
    config) in the SpecForge/SGLang format: config.json + model.safetensors. For smoke tests."""
    from safetensors.torch import save_file

    tc = target_config
    hidden = hidden_size or tc.hidden_size
    heads = max(1, min(tc.num_attention_heads, hidden // 16))
    vocab = tc.vocab_size
    config = Eagle3Config(
        hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=heads,
        num_key_value_heads=heads, head_dim=hidden // heads, vocab_size=vocab,
        draft_vocab_size=draft_vocab_size or vocab, target_hidden_size=tc.hidden_size,
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6), max_position_embeddings=tc.max_position_embeddings,
    )
    gen = torch.Generator().manual_seed(seed)
    drafter = Eagle3Drafter(config)
    tensors = {}
    for name, t in drafter.state_dict().items():
        if name in ("d2t", "t2d") or (name.startswith("embed_tokens.") and not with_embeddings):
            continue
        is_norm = name.endswith("norm.weight")
        tensors[name] = torch.ones_like(t) if is_norm else torch.randn(t.shape, generator=gen) * init_std
    hot = torch.randperm(vocab, generator=gen)[: config.draft_vocab_size].sort().values
    tensors["d2t"] = hot - torch.arange(config.draft_vocab_size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[hot] = True
    tensors["t2d"] = t2d
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out
