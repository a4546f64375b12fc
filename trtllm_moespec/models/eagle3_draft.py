"""EAGLE-3 tree drafting with (steps, topk), on tensors (EAGLE-2/3 dynamic tree).

Step 1 takes the drafter's top-`topk` tokens at the root (the output of the last
committed drafter position). Each later step runs ONE drafter forward over the
current frontier: a frontier node v feeds (embed(token v), pre-norm hidden of the
forward that proposed v) at position `S - 1 + depth(v)`, attending to the whole
drafter prefix, to its already-drafted ancestors and to itself (a tree mask). Its
top-`topk` children are added via `core.grow_tree`, which keeps every child in the
tree and makes the top-`topk` by score the next frontier. DDD's dynamic-depth rule
(`core.ddd_should_stop`) may end drafting early. Tree keys are kept outside the
drafter cache, so drafting never changes the cache: it always holds exactly the
committed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from ..core.policies import ddd_should_stop
from ..core.tree import DraftTree, draft_root, grow_tree

if TYPE_CHECKING:
    from .eagle3 import Eagle3Cache, Eagle3Drafter


@dataclass(frozen=True)
class Eagle3Draft:
    """A drafted tree plus per-node drafter features."""

    tree: DraftTree
    node_hidden: torch.Tensor  # [1, N, H] pre-norm drafter hidden of the forward that proposed each node
    num_forwards: int  # drafter forwards run (steps - 1 unless DDD stopped early)


ExpandRule = Callable[[DraftTree, torch.Tensor], bool]  # (tree so far, frontier node idx [F]) -> expand it?


@torch.no_grad()
def draft_eagle3_tree(
    drafter: "Eagle3Drafter",
    cache: "Eagle3Cache",
    steps: int,
    topk: int,
    ddd_threshold: float | None = None,
    should_expand: ExpandRule | None = None,
) -> Eagle3Draft:
    """Draft a tree of up to topk + (steps-1)*topk^2 nodes after the committed positions of `cache`.

    Before each later step, drafting stops when DDD's rule fires (`ddd_threshold`) or when
    `should_expand(tree, frontier)` returns False: the per-step "expand further?" decision a
    stop rule plugs in here.
    """
    if steps < 1 or topk < 1:
        raise ValueError(f"steps and topk must be >= 1, got steps={steps}, topk={topk}")
    if cache.last_logits is None:
        raise ValueError("the drafter cache is empty: call prefill()/extend() before draft_tree()")
    topk = min(topk, drafter.config.draft_vocab_size)
    S = cache.num_tokens
    attn = drafter.midlayer.self_attn
    max_slots = (steps - 1) * topk  # tree keys: one per expanded node, written after the committed ones
    kv = cache.reserve(S + max_slots, attn.num_kv_heads, attn.head_dim, cache.last_hidden.dtype, cache.last_hidden.device)
    device = kv.device

    ids, probs = _top_children(drafter, cache.last_logits[:, None], topk)  # [1, 1, topk]
    tree, frontier = draft_root(ids[:, 0], probs[:, 0])
    hiddens = [cache.last_hidden[:, None].expand(1, topk, -1)]
    # ancestors[v, s]: the key in tree slot s belongs to an ancestor of node v (what v's query may see).
    ancestors = torch.zeros(topk + max_slots * topk, max(max_slots, 1), dtype=torch.bool, device=device)
    num_slots = num_forwards = block_start = 0
    for _ in range(steps - 1):
        f = frontier[0][frontier[0] >= 0]
        F_ = f.numel()
        if F_ == 0:
            break
        if ddd_threshold is not None and bool(ddd_should_stop(tree.scores[:, f], ddd_threshold)[0]):
            break
        if should_expand is not None and not should_expand(tree, f):
            break
        own = torch.arange(num_slots, num_slots + F_, device=device)  # the frontier's new key slots
        visible = ancestors[f, :num_slots + F_].clone()  # [F, slots]
        visible[torch.arange(F_, device=device), own] = True
        out = drafter(
            hiddens[-1][:, f - block_start],  # the frontier always comes from the newest block of children
            input_ids=tree.token_ids[:, f],
            position_ids=(S - 1 + tree.depth[:, f]),
            attention_mask=_frontier_mask(visible, S, kv.dtype),
            cache_kv=kv,
            cache_start=S + num_slots,
        )
        num_forwards += 1
        ids, probs = _top_children(drafter, out.logits, topk)  # [1, F, topk]
        n = block_start = tree.num_nodes
        tree, frontier = grow_tree(tree, f[None], ids, probs, topk)
        ancestors[n:n + F_ * topk, :num_slots + F_] = visible.repeat_interleave(topk, dim=0)
        num_slots += F_
        hiddens.append(out.hidden[:, :, None].expand(-1, -1, topk, -1).reshape(1, F_ * topk, -1))
    return Eagle3Draft(tree=tree, node_hidden=torch.cat(hiddens, 1), num_forwards=num_forwards)


def _top_children(drafter: "Eagle3Drafter", logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k draft-vocab tokens of logits [1, F, V_draft] -> (target ids, probs), each [1, F, topk]."""
    probs = torch.softmax(logits.float(), dim=-1)
    top_p, top_d = probs.topk(topk, dim=-1)
    return drafter.to_target_ids(top_d), top_p


def _frontier_mask(visible: torch.Tensor, prefix_len: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, F, S + slots] additive mask: the committed prefix visible to every frontier node,
    tree slots as `visible` [F, slots] says (ancestors' keys and the node's own)."""
    F_, slots = visible.shape
    mask = torch.zeros(F_, prefix_len + slots, dtype=dtype, device=visible.device)
    mask[:, prefix_len:].masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]
