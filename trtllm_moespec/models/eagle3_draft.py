"""EAGLE-3 tree drafting with (steps, topk), on tensors (EAGLE-2/3 dynamic tree).

Step 1 takes the drafter's top-`topk` tokens at the root (the output of the last
committed drafter position). Each later step runs ONE drafter forward over the
current frontier: a frontier node v feeds (embed(token v), pre-norm hidden of the
forward that proposed v) at position `S - 1 + depth(v)`, attending to the whole
drafter prefix, to its already-drafted ancestors and to itself (a tree mask). Its
top-`topk` children are added via `core.grow_tree`, which keeps every child in the
tree and makes the top-`topk` by score the next frontier. DDD's dynamic-depth rule
(`core.ddd_should_stop`) or a cost-aware `stop_rule` (`core.drafting.DraftStopRule`)
may end drafting early. Tree keys are kept outside the
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


@torch.no_grad()
def draft_eagle3_tree(
    drafter: "Eagle3Drafter",
    cache: "Eagle3Cache",
    steps: int,
    topk: int,
    ddd_threshold: float | None = None,
    stop_rule: Callable[[DraftTree, torch.Tensor, int], torch.Tensor] | None = None,
) -> Eagle3Draft:
    """Draft a tree of up to topk + (steps-1)*topk^2 nodes after the committed positions of `cache`."""
    if steps < 1 or topk < 1:
        raise ValueError(f"steps and topk must be >= 1, got steps={steps}, topk={topk}")
    if cache.last_logits is None:
        raise ValueError("the drafter cache is empty: call prefill()/extend() before draft_tree()")
    topk = min(topk, drafter.config.draft_vocab_size)
    S = cache.num_tokens
    device = cache.keys.device

    ids, probs = _top_children(drafter, cache.last_logits[:, None], topk)  # [1, 1, topk]
    tree, frontier = draft_root(ids[:, 0], probs[:, 0])
    node_hidden = cache.last_hidden[:, None].expand(1, topk, -1)
    tree_keys = cache.keys.new_zeros(*cache.keys.shape[:2], 0, cache.keys.shape[3])
    tree_values = tree_keys.clone()
    drafted = torch.zeros(0, dtype=torch.int64, device=device)  # tree node idx of each tree key slot
    num_forwards = 0
    for _ in range(steps - 1):
        f = frontier[0][frontier[0] >= 0]
        if f.numel() == 0:
            break
        if ddd_threshold is not None and bool(ddd_should_stop(tree.scores[:, f], ddd_threshold)[0]):
            break
        if stop_rule is not None and bool(stop_rule(tree, f[None], num_forwards)[0]):
            break  # core.drafting: another forward would not pay for itself
        mask = _frontier_mask(tree, f, drafted, S, cache.keys.dtype)
        out = drafter(
            node_hidden[:, f],
            input_ids=tree.token_ids[:, f],
            position_ids=(S - 1 + tree.depth[:, f]),
            attention_mask=mask,
            past_kv=(torch.cat([cache.keys, tree_keys], 2), torch.cat([cache.values, tree_values], 2)),
        )
        num_forwards += 1
        tree_keys = torch.cat([tree_keys, out.keys], 2)
        tree_values = torch.cat([tree_values, out.values], 2)
        drafted = torch.cat([drafted, f])
        ids, probs = _top_children(drafter, out.logits, topk)  # [1, F, topk]
        tree, frontier = grow_tree(tree, f[None], ids, probs, topk)
        child_hidden = out.hidden[:, :, None].expand(-1, -1, topk, -1).reshape(1, f.numel() * topk, -1)
        node_hidden = torch.cat([node_hidden, child_hidden], 1)
    return Eagle3Draft(tree=tree, node_hidden=node_hidden, num_forwards=num_forwards)


def _top_children(drafter: "Eagle3Drafter", logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k draft-vocab tokens of logits [1, F, V_draft] -> (target ids, probs), each [1, F, topk]."""
    probs = torch.softmax(logits.float(), dim=-1)
    top_p, top_d = probs.topk(topk, dim=-1)
    return drafter.to_target_ids(top_d), top_p


def _frontier_mask(tree: DraftTree, frontier: torch.Tensor, drafted: torch.Tensor, prefix_len: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, F, S + n_drafted + F] additive mask: prefix visible, drafted keys visible iff an
    ancestor of the query node, the frontier's own new keys visible only on the diagonal."""
    F_ = frontier.numel()
    ancestors = torch.zeros(F_, tree.num_nodes, dtype=torch.bool, device=frontier.device)
    cur = frontier.clone()
    rows = torch.arange(F_, device=frontier.device)
    for _ in range(int(tree.depth[0, frontier].max())):
        alive = cur >= 0
        ancestors[rows[alive], cur[alive]] = True
        cur = torch.where(alive, tree.parents[0, cur.clamp(min=0)], -1)
    allowed = torch.cat([
        torch.ones(F_, prefix_len, dtype=torch.bool, device=frontier.device),
        ancestors[:, drafted],
        torch.eye(F_, dtype=torch.bool, device=frontier.device),
    ], 1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=frontier.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
