"""EAGLE-3 tree drafting with (steps, topk), on tensors (EAGLE-2/3 dynamic tree).

Step 1 takes the drafter's top-`topk` tokens at the root (the output of the last
committed drafter position). Each later step runs ONE drafter forward over the
current frontier: a frontier node v feeds (embed(token v), pre-norm hidden of the
forward that proposed v) at position `S - 1 + depth(v)`, attending to the whole
drafter prefix, to its already-drafted ancestors and to itself (a tree mask). Its
top-`topk` children are added via `core.TreeBuffer.grow` (`core.grow_tree` in place), which
keeps every child in the tree and makes the top-`topk` by score the next frontier. DDD's dynamic-depth rule
(`core.ddd_should_stop`) may end drafting early. Tree keys are kept outside the
drafter cache, so drafting never changes the cache: it always holds exactly the
committed tokens.

With a `frontier_runner` each step's forward runs through the static-shape drafter forward
(`models/cuda_graphs.py` `StaticDrafterFrontier`; on CUDA one captured graph, `DrafterFrontierGraphs`):
the frontier padded to the runner's width, attending over the whole drafter buffer. Without one
(the default, and the CPU engine's path) it is `Eagle3Drafter.forward` over exactly F rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from ..core.policies import ddd_should_stop
from ..core.tree import DraftTree, TreeBuffer

if TYPE_CHECKING:
    from .cuda_graphs import StaticDrafterFrontier
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
    frontier_runner: "StaticDrafterFrontier | None" = None,
) -> Eagle3Draft:
    """Draft a tree of up to topk + (steps-1)*topk^2 nodes after the committed positions of `cache`.

    Before each later step, drafting stops when DDD's rule fires (`ddd_threshold`) or when
    `should_expand(tree, frontier)` returns False: the per-step "expand further?" decision a
    stop rule plugs in here. `frontier_runner` (`models.cuda_graphs.StaticDrafterFrontier`, or its
    CUDA graph `DrafterFrontierGraphs`) runs each step's forward with static shapes instead of
    `Eagle3Drafter.forward`; the tree and everything around the forward stay the same.
    """
    if steps < 1 or topk < 1:
        raise ValueError(f"steps and topk must be >= 1, got steps={steps}, topk={topk}")
    if cache.last_logits is None:
        raise ValueError("the drafter cache is empty: call prefill()/extend() before draft_tree()")
    topk = min(topk, drafter.config.draft_vocab_size)
    S = cache.num_tokens
    attn = drafter.midlayer.self_attn
    max_slots = (steps - 1) * topk  # tree keys: one per expanded node, written after the committed ones
    # a static runner pads the last frontier to its width: room for the padded rows' keys too
    pad = 0 if frontier_runner is None else max(frontier_runner.width - topk, 0)
    kv = cache.reserve(S + max_slots + pad, attn.num_kv_heads, attn.head_dim, cache.last_hidden.dtype, cache.last_hidden.device)
    device, capacity = kv.device, topk + max_slots * topk

    ids, probs = _top_children(drafter, cache.last_logits[:, None], topk)  # [1, 1, topk]
    nodes = TreeBuffer(1, capacity, device)
    frontier = nodes.add_root(ids[:, 0], probs[:, 0])
    node_hidden = cache.last_hidden.new_empty(1, capacity, cache.last_hidden.shape[-1])
    node_hidden[0, :topk] = cache.last_hidden[0]
    masks = _TreeMasks(S, max_slots, capacity, topk, kv.dtype, device)
    num_slots = num_forwards = 0
    # [steps - 1, topk] view: row `step` holds position S + step (one op for the whole draft)
    positions = torch.arange(S, S + max(steps - 1, 0), device=device)[:, None].expand(max(steps - 1, 0), topk)
    for step in range(steps - 1):
        f = _valid(frontier[0])
        F_ = f.numel()
        if F_ == 0:
            break
        if ddd_threshold is not None and bool(ddd_should_stop(nodes.tree().scores[:, f], ddd_threshold)[0]):
            break
        if should_expand is not None and not should_expand(nodes.tree(), f):
            break
        n = nodes.num_nodes
        if frontier_runner is None:
            out = drafter(
                node_hidden.index_select(1, f),  # the hidden of the forward that proposed each frontier node
                input_ids=nodes.token_ids.index_select(1, f),
                position_ids=positions[step:step + 1, :F_],  # S - 1 + depth
                attention_mask=masks.frontier(f, num_slots),
                cache_kv=kv,
                cache_start=S + num_slots,
            )
        else:  # the same forward, padded to the runner's width (CUDA: a graph replay)
            out = frontier_runner.run(kv, node_hidden.index_select(1, f), nodes.token_ids.index_select(1, f),
                                      S + step, S + num_slots, masks.frontier(f, num_slots))
        num_forwards += 1
        ids, probs = _top_children(drafter, out.logits, topk)  # [1, F, topk]
        frontier = nodes.grow(f[None], ids, probs, topk, dense=True)
        masks.add_children(n, F_, topk, num_slots)
        node_hidden[0, n:n + F_ * topk].view(F_, topk, -1).copy_(out.hidden[0, :, None])
        num_slots += F_
    return Eagle3Draft(tree=nodes.tree(), node_hidden=node_hidden[:, :nodes.num_nodes], num_forwards=num_forwards)


def _valid(frontier: torch.Tensor) -> torch.Tensor:
    """The frontier's node idx without its -1 padding (on CPU through numpy: one op instead of three)."""
    if frontier.device.type == "cpu":
        f = frontier.numpy()
        return torch.from_numpy(f[f >= 0])
    return frontier[frontier >= 0]


class _TreeMasks:
    """Attention masks of tree drafting, kept up to date in place.

    `rows[v]` is node v's additive visibility of the tree key slots (0 = an ancestor's key, written
    when v is created from its parent's row); `mask` holds the committed prefix (always visible) and
    the tree part of the current frontier's rows.
    """

    def __init__(self, prefix_len: int, max_slots: int, capacity: int, topk: int, dtype: torch.dtype, device):
        hidden = torch.finfo(dtype).min
        self.prefix_len = prefix_len
        self.rows = torch.full((capacity, max(max_slots, 1)), hidden, dtype=dtype, device=device)
        self.mask = torch.zeros(topk, prefix_len + max_slots, dtype=dtype, device=device)
        # CPU: the row copies go through numpy views of the same storage (~1 us per op instead of ~10);
        # dtypes numpy lacks (bfloat16) keep the torch ops.
        host = self.mask.device.type == "cpu" and dtype in (torch.float32, torch.float64, torch.float16)
        self._rows_np, self._mask_np = (self.rows.numpy(), self.mask.numpy()) if host else (None, None)

    def frontier(self, f: torch.Tensor, num_slots: int) -> torch.Tensor:
        """[1, 1, F, S + num_slots + F] for frontier nodes f [F], whose own keys go to the next F slots:
        each sees the prefix, its ancestors' slots and its own slot."""
        F_, S = f.numel(), self.prefix_len
        if self._mask_np is not None:
            m, own = self._mask_np, np.arange(F_)
            m[:F_, S:S + num_slots + F_] = self._rows_np[f.numpy(), :num_slots + F_]  # new slots still hidden
            m[own, S + num_slots + own] = 0
            return self.mask[None, None, :F_, :S + num_slots + F_]
        mask = self.mask[:F_, :S + num_slots + F_]
        mask[:, S:].copy_(self.rows[f, :num_slots + F_])  # the new slots are still hidden in these rows
        mask[:, S + num_slots:].diagonal().zero_()
        return mask[None, None]

    def add_children(self, first: int, num_parents: int, topk: int, num_slots: int) -> None:
        """Children first.. of the last frontier (topk per parent, in order) see what their parent saw."""
        width = num_slots + num_parents
        if self._mask_np is not None:
            parents = self._mask_np[:num_parents, self.prefix_len:self.prefix_len + width]
            self._rows_np[first:first + num_parents * topk, :width] = np.repeat(parents, topk, axis=0)
            return
        parents = self.mask[:num_parents, self.prefix_len:self.prefix_len + width]
        self.rows[first:first + num_parents * topk, :width].view(num_parents, topk, width).copy_(parents[:, None])


def _top_children(drafter: "Eagle3Drafter", logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k draft-vocab tokens of logits [1, F, V_draft] -> (target ids, probs), each [1, F, topk]."""
    probs = torch.softmax(logits.float(), dim=-1)
    top_p, top_d = probs.topk(topk, dim=-1)
    return drafter.to_target_ids(top_d), top_p
