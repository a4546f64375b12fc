"""A static-shape EAGLE-3 drafter forward: what a CUDA graph of a drafter forward captures.

`Eagle3Drafter.forward` reads the drafter cache up to `cache_start + T` and takes a mask of that
width, so its shapes change every step. Here every forward attends over the drafter's whole
preallocated K/V buffer (`Eagle3Cache.kv`, `[2, 1, KVH, capacity, D]`) under a boolean
visibility mask `[1, T, capacity]`, and writes its keys at cache indices given as a tensor, so
the only shapes are T (a bucket) and the capacity: a tree-drafting step runs with T = topk (the
frontier padded to its full width) and an extension (commit / catch-up) with T = the length
bucket. Padded rows write keys past the real ones, into slots that no real row sees and that the
next forward overwrites, exactly as the padded rows of the target's verify buckets.

NOT YET RUN ON A GPU. On CPU the same function runs eagerly and is tested against
`Eagle3Drafter.forward` (tests/models/test_eagle3_static.py); its CUDA captures are
`graphs.py` `DrafterGraphs` (extensions, wired in `engine/drafters.py`) and
`DrafterFrontierGraphs` (tree-drafting steps, wired through `drafting.draft_eagle3_tree`'s
`frontier_runner`), both on with `LLM(cuda_graphs=...)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .layers import _rms
from .modeling import Eagle3Drafter
from .types import Eagle3Output


@torch.no_grad()
def static_drafter_forward(drafter: Eagle3Drafter, kv: torch.Tensor, hidden: torch.Tensor, input_ids: torch.Tensor,
                           positions: torch.Tensor, write_idx: torch.Tensor, visible: torch.Tensor) -> Eagle3Output:
    """One drafter forward over T rows with static shapes and no host reads.

    kv [2, 1, KVH, capacity, D]: the drafter cache buffer, written in place at `write_idx` [T]
    (cache indices); hidden [1, T, 3*H_target] target features or [1, T, H] drafter hiddens;
    input_ids / positions [1, T]; visible [1, T, capacity] bool: which cache entries each row
    attends to (after this forward's keys are written). Same math as the fused inference path of
    `Eagle3Drafter.forward`; returned keys/values are this forward's [1, KVH, T, D].
    """
    fused, eps = drafter._fused_weights(), drafter.config.rms_norm_eps
    a = drafter.midlayer.self_attn
    embeds = F.embedding(input_ids, drafter.embed_tokens.weight).to(drafter.fc.weight.dtype)
    h = hidden.to(drafter.fc.weight.dtype)
    if h.shape[-1] == drafter.fc.in_features:
        h = F.linear(h, drafter.fc.weight)
    B, T, H = h.shape
    x = _rms(torch.stack([embeds, h], dim=2), fused.input_norms, eps).view(B, T, 2 * H)
    heads = a.num_heads + 2 * a.num_kv_heads
    qkv = F.linear(x, fused.qkv).view(B, T, heads, a.head_dim)
    # Positions never pass the buffer (a row is written at an index >= its position): a host-known bound,
    # so no position is read back inside a graph capture, past max_position_embeddings too.
    cos, sin_signed = drafter._rope_signed(qkv, positions, bound=kv.shape[3])
    qk = qkv[:, :, :a.num_heads + a.num_kv_heads]
    qk = qk * cos + qk.roll(a.head_dim // 2, dims=-1) * sin_signed
    q = qk[:, :, :a.num_heads].transpose(1, 2)
    k = qk[:, :, a.num_heads:].transpose(1, 2)  # [1, KVH, T, D]
    v = qkv[:, :, a.num_heads + a.num_kv_heads:].transpose(1, 2)
    kv[0, 0].index_copy_(1, write_idx, k[0])
    kv[1, 0].index_copy_(1, write_idx, v[0])
    mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, torch.finfo(q.dtype).min)
    out = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask[:, None],
                                         enable_gqa=a.num_heads != a.num_kv_heads)
    h = h + F.linear(out.transpose(1, 2).reshape(B, T, a.num_heads * a.head_dim), a.o_proj.weight)
    gate, up = F.linear(_rms(h, fused.post_attention_norm, eps), fused.gate_up).chunk(2, dim=-1)
    h = h + F.linear(drafter.midlayer.mlp.act_fn(gate) * up, fused.down)
    logits = F.linear(_rms(h, fused.final_norm, eps), drafter.lm_head.weight).float()
    return Eagle3Output(logits=logits, hidden=h, keys=k, values=v)


def extension_inputs(start: torch.Tensor, num_rows: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions [1, T], write_idx [T], visible [1, T, capacity]) of an extension by T = num_rows
    positions after `start` [1] committed ones (a device tensor: no host read): row j sits at
    position and cache index start + j and sees every committed key and rows 0..j. Rows past the
    real ones (a padded bucket) see the real rows too, which is harmless: no real row sees them."""
    device = start.device
    rows = torch.arange(num_rows, device=device)
    write_idx = start.reshape(1) + rows  # [T]
    idx = torch.arange(capacity, device=device)
    visible = (idx[None, :] <= write_idx[:, None])[None]  # committed keys and the causal new block
    return write_idx[None], write_idx, visible


def frontier_visibility(tree_mask: torch.Tensor, capacity: int, write_idx: torch.Tensor) -> torch.Tensor:
    """The static [1, T, capacity] bool visibility of a tree-drafting forward from the additive mask
    `Eagle3Drafter.forward` takes there ([1, 1, F, S + slots + F], 0 = visible; F <= T): the same
    entries for the F real frontier rows, every cache index past them hidden; rows F..T-1 (the
    frontier padded to its full width) see only their own key at `write_idx` [T]."""
    F_, width, T = tree_mask.shape[2], tree_mask.shape[-1], write_idx.shape[0]
    if width > capacity:
        raise ValueError(f"a drafting mask over {width} cache entries exceeds the buffer's {capacity}")
    if F_ > T:
        raise ValueError(f"{F_} frontier rows do not fit a forward of {T} rows")
    visible = torch.arange(capacity, device=write_idx.device)[None, :] == write_idx[:, None]  # [T, capacity]
    visible[:F_] = False
    visible[:F_, :width] = tree_mask[0, 0] == 0
    return visible[None]
