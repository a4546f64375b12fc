"""Attention of the lean forward over the static KV cache: masks, rotary embedding, sinks.

Key indices are cache indices of a request's slot. Request b's committed tokens sit at
`[0, P_b)` (cache index = position), and this forward writes its T new keys at
`[P_b, P_b + T)`. A query sees every committed key, the new keys its `tree_mask` row allows
(causal when there is no tree), and nothing past `P_b + T` (stale entries of rejected trees
or of a longer neighbour in the batch).

Sliding-window layers (GPT-OSS `sliding_attention`, Qwen3 `use_sliding_window`): a query at
position p sees keys at positions > p - window. The smallest query position of a forward is
P_b (the first new token or the tree root), so only cache indices >= P_b - window + 1 can be
visible: such a layer reads the cache from `min_b(P_b) - window + 1` on, so its cost stays flat
however long the context grows, and the mask applies the exact per-query window (tree keys
have position P_b + depth, not their cache index).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core.device import host_tensor


@dataclass(frozen=True)
class AttentionMasks:
    """The additive masks of one forward, one per attention kind, over a cache index range."""

    full: torch.Tensor | None  # [B, 1, T, end - full_start] additive float (None: nothing is masked)
    full_start: int  # first cache index the full-attention layers read
    sliding: torch.Tensor | None  # [B, 1, T, end - sliding_start] (None: no sliding layers)
    sliding_start: int
    end: int  # one past the last cache index any request of the batch reads


def build_masks(prefix_lens: tuple[int, ...], positions: torch.Tensor, tree_mask: torch.Tensor | None,
                dtype: torch.dtype, window: int | None, has_full: bool = True) -> AttentionMasks:
    """Masks for a forward whose request b has `prefix_lens[b]` committed keys and T new tokens
    at `positions` [B, T]; tree_mask [B, T, T] bool (None = causal among the new tokens)."""
    B, T = positions.shape
    end = max(prefix_lens) + T
    P = None if B == 1 and T == 1 and window is None else host_tensor(prefix_lens, positions.device)
    full = None
    if has_full and B == 1 and T > 1:
        full = _single_full_mask(prefix_lens[0], T, tree_mask, dtype, positions.device)
    elif has_full and not (T == 1 and len(set(prefix_lens)) == 1):  # one new token each: every key is visible
        full = _additive(_allowed(P, positions, tree_mask, 0, end, None), dtype)
    sliding, sliding_start = None, 0
    if window is not None:
        sliding_start = max(0, min(prefix_lens) - window + 1)
        sliding = _additive(_allowed(P, positions, tree_mask, sliding_start, end, window), dtype)
    return AttentionMasks(full, 0, sliding, sliding_start, end)


def _single_full_mask(P: int, T: int, tree_mask: torch.Tensor | None, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """The full-attention mask of one request [1, 1, T, P + T]: the committed keys are all visible,
    so only the new-key block needs the tree (or causal) pattern; the same values as `_allowed`
    in three ops instead of a dozen over the whole key range."""
    mask = torch.zeros(1, 1, T, P + T, dtype=dtype, device=device)
    new = tree_mask[0] if tree_mask is not None else torch.ones(T, T, dtype=torch.bool, device=device).tril()
    mask[0, 0, :, P:].masked_fill_(~new, torch.finfo(dtype).min)
    return mask


def build_static_masks(prefix_lens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor | None,
                       dtype: torch.dtype, window: int | None, max_len: int) -> AttentionMasks:
    """The same masks over the whole cache range [0, max_len), from tensors only: shapes never
    depend on the prefix lengths and nothing reads back to the host (CUDA-graph capturable)."""
    full = _additive(_allowed(prefix_lens, positions, tree_mask, 0, max_len, None), dtype)
    sliding = None if window is None else _additive(_allowed(prefix_lens, positions, tree_mask, 0, max_len, window), dtype)
    return AttentionMasks(full, 0, sliding, 0, max_len)


def _allowed(P: torch.Tensor, positions, tree_mask, start: int, end: int, window: int | None) -> torch.Tensor:
    """[B, T, end - start] bool visibility of cache indices start..end-1; P [B] prefix lengths."""
    B, T = positions.shape
    device = positions.device
    idx = torch.arange(start, end, device=device)[None, None, :]  # [1, 1, K]
    rel = idx - P.reshape(B, 1, 1)  # [B, 1, K] index among this forward's new keys (< 0: committed)
    if tree_mask is None:
        new_visible = rel <= torch.arange(T, device=device)[None, :, None]
    else:
        padded = F.pad(tree_mask, (0, 1))  # column T reads False: every rel outside [0, T) lands there
        col = torch.where((rel >= 0) & (rel < T), rel, T)
        new_visible = padded.gather(2, col.expand(B, T, -1))
    allowed = (rel < 0) | ((rel < T) & new_visible)
    if window is not None:
        key_pos = torch.where(rel < 0, idx, positions.gather(1, rel.clamp(0, T - 1)[:, 0])[:, None, :])
        allowed &= (positions[:, :, None] - key_pos) < window
    return allowed


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] with cos/signed_sin [B, 1, T, D] (the half-split "rotate_half" convention,
    `signed_sin` = [-sin[:D/2], sin[D/2:]]: x * cos + rotate_half(x) * sin in fewer ops)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           sinks: torch.Tensor | None) -> torch.Tensor:
    """q [B, Hq, T, D], k/v [B, Hkv, K, D] -> [B, T, Hq * D]. `sinks` [Hq]: GPT-OSS's per-head
    sink logit, an extra softmax column whose value is zero (transformers' eager formula)."""
    B, Hq, T, D = q.shape
    if sinks is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=Hq != k.shape[1])
        return out.transpose(1, 2).reshape(B, T, Hq * D)
    Hkv = k.shape[1]
    rep = Hq // Hkv
    qg = q.reshape(B, Hkv, rep * T, D)  # query heads grouped by their kv head: no repeat of K/V
    scores = (qg @ k.transpose(2, 3)).view(B, Hq, T, -1) * scale
    if mask is not None:
        scores = scores + mask
    logits = torch.cat([scores, sinks.reshape(1, Hq, 1, 1).expand(B, Hq, T, 1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(v.dtype)
    out = probs.reshape(B, Hkv, rep * T, -1) @ v  # [B, Hkv, rep*T, D]
    return out.view(B, Hq, T, D).transpose(1, 2).reshape(B, T, Hq * D)
