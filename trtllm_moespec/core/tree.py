"""Draft trees: batched node tensors, EAGLE-style tree growth, score ordering and
the verification layout of a selected node list.

Definitions follow DESIGN.md: the root is the last committed token (its target
logits are known and it is not a node of the tree); node v has a token, a parent
(-1 = child of the root), a depth (root children have depth 1), a local draft
probability q(v) and score(v) = prod of q along the root->v path. Nodes are
stored in topological order: a parent's index is always smaller than its child's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .select_host import compiled_top

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class DraftTree:
    """A batch of draft trees, padded to a common node count."""

    token_ids: torch.Tensor  # [B, N] int64 target-vocabulary token ids
    parents: torch.Tensor  # [B, N] int64, -1 = child of the root; parent idx < own idx
    depth: torch.Tensor  # [B, N] int64, root children = 1, 0 for padding
    draft_probs: torch.Tensor  # [B, N] float32 local draft probability q(v)
    log_scores: torch.Tensor  # [B, N] float32 sum of log q on the root->v path (-inf if padded)
    valid: torch.Tensor  # [B, N] bool, False for padding

    @property
    def batch_size(self) -> int:
        return self.token_ids.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.token_ids.shape[1]

    @property
    def scores(self) -> torch.Tensor:
        """[B, N] float32 path probabilities, 0 for padded nodes."""
        return torch.where(self.valid, self.log_scores.exp(), torch.zeros_like(self.log_scores))

    def on_host(self) -> "DraftTree":
        """The tree on the CPU, read back in two transfers instead of one per field (itself on the CPU):
        for host code that reads several fields of a device tree."""
        if self.token_ids.device.type == "cpu":
            return self
        ints = torch.stack([self.token_ids, self.parents, self.depth, self.valid.long()]).cpu()
        floats = torch.stack([self.draft_probs.float(), self.log_scores.float()]).cpu()
        return DraftTree(ints[0], ints[1], ints[2], floats[0], floats[1], ints[3].bool())

    @property
    def num_valid(self) -> torch.Tensor:
        """[B] int64 number of real nodes per request."""
        return self.valid.sum(-1)

    @staticmethod
    def empty(batch_size: int, device: torch.device | str = "cpu") -> "DraftTree":
        """A tree with no nodes (plain decoding step)."""
        z = torch.zeros(batch_size, 0, dtype=torch.int64, device=device)
        f = torch.zeros(batch_size, 0, dtype=torch.float32, device=device)
        return DraftTree(z, z.clone(), z.clone(), f, f.clone(), z.bool())

    @staticmethod
    def from_parents(
        token_ids: torch.Tensor,
        parents: torch.Tensor,
        draft_probs: torch.Tensor,
        valid: torch.Tensor | None = None,
    ) -> "DraftTree":
        """Build a tree of any shape from parent pointers; computes depth and scores.

        Raises ValueError for parents that point forward (which also rules out
        cycles), to padded nodes or out of range, and for probabilities outside (0, 1].
        """
        token_ids, parents = token_ids.long(), parents.long()
        draft_probs = draft_probs.float()
        if valid is None:
            valid = torch.ones_like(token_ids, dtype=torch.bool)
        _check_parents(parents, valid)
        _check_probs(draft_probs, valid)
        B, N = token_ids.shape
        depth = torch.zeros(B, N, dtype=torch.int64, device=token_ids.device)
        log_scores = torch.full((B, N), _NEG_INF, device=token_ids.device)
        log_q = draft_probs.clamp(max=1.0).log()
        for i in range(N):  # topological order: parents are already filled in
            p = parents[:, i]
            has_parent = p >= 0
            p_safe = p.clamp(min=0)
            parent_depth = torch.where(has_parent, depth.gather(1, p_safe[:, None])[:, 0], 0)
            parent_log = torch.where(has_parent, log_scores.gather(1, p_safe[:, None])[:, 0], 0.0)
            depth[:, i] = torch.where(valid[:, i], parent_depth + 1, 0)
            log_scores[:, i] = torch.where(valid[:, i], parent_log + log_q[:, i], _NEG_INF)
        parents = torch.where(valid, parents, torch.full_like(parents, -1))
        return DraftTree(token_ids, parents, depth, draft_probs, log_scores, valid)

    def validate(self) -> None:
        """Check the invariants; raise ValueError naming the first problem found."""
        shape = self.token_ids.shape
        for name in ("parents", "depth", "draft_probs", "log_scores", "valid"):
            if getattr(self, name).shape != shape:
                raise ValueError(f"DraftTree.{name} has shape {tuple(getattr(self, name).shape)}, expected {tuple(shape)}")
        _check_parents(self.parents, self.valid)
        _check_probs(self.draft_probs, self.valid)
        if torch.isnan(self.log_scores).any() or (self.log_scores[self.valid] == float("inf")).any():
            raise ValueError("DraftTree.log_scores has NaN or +inf entries")
        p_safe = self.parents.clamp(min=0)
        parent_log = torch.where(self.parents >= 0, self.log_scores.gather(1, p_safe), torch.zeros_like(self.log_scores))
        if (self.valid & (self.log_scores > parent_log)).any():
            raise ValueError("DraftTree scores are not monotone: a child scores above its parent")
        parent_depth = torch.where(self.parents >= 0, self.depth.gather(1, p_safe), torch.zeros_like(self.depth))
        if (self.valid & (self.depth != parent_depth + 1)).any():
            raise ValueError("DraftTree.depth is inconsistent with parents")


def _check_parents(parents: torch.Tensor, valid: torch.Tensor) -> None:
    N = parents.shape[-1]
    idx = torch.arange(N, device=parents.device)
    bad_range = valid & ((parents < -1) | (parents >= idx))
    if bad_range.any():
        b, i = bad_range.nonzero()[0].tolist()
        raise ValueError(
            f"invalid parent {parents[b, i].item()} for node {i} of request {b}: parents must be -1 (root) "
            "or the index of an earlier node (this also rules out cycles)"
        )
    p_safe = parents.clamp(min=0)
    parent_valid = torch.where(parents >= 0, valid.gather(1, p_safe), torch.ones_like(valid))
    if (valid & ~parent_valid).any():
        raise ValueError("a valid node has a padded (invalid) parent")


def _check_probs(draft_probs: torch.Tensor, valid: torch.Tensor) -> None:
    q = draft_probs[valid]
    if not torch.isfinite(q).all():
        raise ValueError("draft probabilities must be finite (got NaN or inf)")
    if (q < 0).any() or (q > 1.0 + 1e-5).any():
        raise ValueError("draft probabilities must lie in [0, 1]")


def gather_nodes(values: torch.Tensor, idx: torch.Tensor, fill) -> torch.Tensor:
    """values [B, N] read at idx [B, K] where idx >= 0, else `fill` (also for trees with no nodes)."""
    if values.shape[1] == 0:
        return torch.full(idx.shape, fill, dtype=values.dtype, device=idx.device)
    # a Python fill keeps values' dtype and, unlike a CPU 0-dim tensor, needs no copy to the device
    return torch.where(idx >= 0, values.gather(1, idx.clamp(min=0)), fill)


def draft_root(token_ids: torch.Tensor, probs: torch.Tensor) -> tuple[DraftTree, torch.Tensor]:
    """EAGLE step 1: the top-`topk` tokens at the root become depth-1 nodes.

    token_ids, probs: [B, topk]. Returns the tree and its frontier [B, topk] (node idx).
    """
    B, topk = token_ids.shape
    device = token_ids.device
    probs = probs.float()
    _check_probs(probs, torch.ones_like(probs, dtype=torch.bool))
    tree = DraftTree(
        token_ids=token_ids.long(),
        parents=torch.full((B, topk), -1, dtype=torch.int64, device=device),
        depth=torch.ones(B, topk, dtype=torch.int64, device=device),
        draft_probs=probs,
        log_scores=probs.clamp(max=1.0).log(),
        valid=torch.ones(B, topk, dtype=torch.bool, device=device),
    )
    frontier = torch.arange(topk, device=device).expand(B, topk).clone()
    return tree, frontier


def grow_tree(
    tree: DraftTree,
    frontier: torch.Tensor,
    child_ids: torch.Tensor,
    child_probs: torch.Tensor,
    topk: int,
) -> tuple[DraftTree, torch.Tensor]:
    """One later EAGLE step: expand every frontier node by its drafter top-k.

    frontier: [B, F] node idx (-1 = padded slot); child_ids/child_probs: [B, F, C].
    All F*C children are kept in the tree; the new frontier is the top-`topk` of
    them by score (ties by position). Returns (grown tree, new frontier [B, topk]).
    """
    B, F, C = child_ids.shape
    device = tree.token_ids.device
    frontier_valid = frontier >= 0
    f_safe = frontier.clamp(min=0)
    parent_log = tree.log_scores.gather(1, f_safe)  # [B, F]
    child_log = parent_log[:, :, None] + child_probs.float().clamp(min=0.0, max=1.0).log()  # [B, F, C]
    child_valid = frontier_valid[:, :, None].expand(B, F, C)
    child_log = torch.where(child_valid, child_log, torch.full_like(child_log, _NEG_INF))
    parent_depth = tree.depth.gather(1, f_safe)[:, :, None].expand(B, F, C)

    N = tree.num_nodes
    new_parents = torch.where(child_valid, f_safe[:, :, None].expand(B, F, C), -1).reshape(B, F * C)
    grown = DraftTree(
        token_ids=torch.cat([tree.token_ids, child_ids.reshape(B, F * C).long()], 1),
        parents=torch.cat([tree.parents, new_parents], 1),
        depth=torch.cat([tree.depth, torch.where(child_valid, parent_depth + 1, 0).reshape(B, F * C)], 1),
        draft_probs=torch.cat([tree.draft_probs, child_probs.float().reshape(B, F * C)], 1),
        log_scores=torch.cat([tree.log_scores, child_log.reshape(B, F * C)], 1),
        valid=torch.cat([tree.valid, child_valid.reshape(B, F * C)], 1),
    )
    return grown, _next_frontier(child_log.reshape(B, F * C), N, topk).to(device)


class TreeBuffer:
    """A draft tree grown in place: `draft_root` then `grow_tree` steps without concatenation.

    The node tensors are preallocated for `capacity` nodes; `tree()` is a DraftTree of views of the
    first `num_nodes` columns (cheap enough to hand to a stop rule before every step). `add_root` and
    `grow` produce exactly the nodes and frontiers of `draft_root` and `grow_tree`. A view handed out
    stays valid: later steps only write columns past it.
    """

    def __init__(self, batch_size: int, capacity: int, device: torch.device | str = "cpu"):
        if batch_size < 1 or capacity < 0:
            raise ValueError(f"TreeBuffer needs batch_size >= 1 and capacity >= 0, got {batch_size}, {capacity}")
        B, N = batch_size, capacity
        self.num_nodes = 0
        if torch.device(device).type == "cpu":
            # On CPU the integer bookkeeping (parents, depth, frontier order) runs on numpy views of the same
            # storage: each torch op costs ~5-40 us at these sizes, a numpy one ~1 us. The float math (log of
            # the probabilities, the score sums) is the same IEEE float32 arithmetic either way. The arrays
            # are made by numpy too (a new buffer every drafting step; torch's allocations cost more).
            self._host = _HostViews(np.zeros((B, N), np.int64), np.full((B, N), -1, np.int64),
                                    np.zeros((B, N), np.int64), np.zeros((B, N), np.float32),
                                    np.full((B, N), _NEG_INF, np.float32), np.zeros((B, N), np.bool_),
                                    np.arange(B)[:, None])
            h = self._host
            self.token_ids, self.parents, self.depth, self.draft_probs, self.log_scores, self.valid = (
                torch.from_numpy(a) for a in (h.token_ids, h.parents, h.depth, h.draft_probs, h.log_scores, h.valid))
            return
        self._host = None
        self.token_ids = torch.zeros(B, N, dtype=torch.int64, device=device)
        self.parents = torch.full((B, N), -1, dtype=torch.int64, device=device)
        self.depth = torch.zeros(B, N, dtype=torch.int64, device=device)
        self.draft_probs = torch.zeros(B, N, dtype=torch.float32, device=device)
        self.log_scores = torch.full((B, N), _NEG_INF, dtype=torch.float32, device=device)
        self.valid = torch.zeros(B, N, dtype=torch.bool, device=device)

    def tree(self) -> DraftTree:
        n = self.num_nodes
        return DraftTree(self.token_ids[:, :n], self.parents[:, :n], self.depth[:, :n], self.draft_probs[:, :n],
                         self.log_scores[:, :n], self.valid[:, :n])

    def clear(self) -> None:
        """Empty the buffer for a new tree. Its columns are rewritten as nodes are added, so a view handed out
        before stops being valid: only an owner that knows none is held clears (`eagle3.workspace`)."""
        self.num_nodes = 0

    def _take(self, count: int) -> tuple[int, int]:
        """Columns [n, n + count) for new nodes."""
        n, m = self.num_nodes, self.num_nodes + count
        if m > self.token_ids.shape[1]:
            raise ValueError(f"TreeBuffer holds {self.token_ids.shape[1]} nodes; {m} needed")
        return n, m

    def add_root(self, token_ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """`draft_root` into an empty buffer: token_ids, probs [B, topk] -> frontier [B, topk]."""
        if self.num_nodes:
            raise ValueError("add_root needs an empty TreeBuffer")
        B, topk = token_ids.shape
        n, m = self._take(topk)
        probs = probs.float()
        log = probs.clamp(max=1.0).log()
        if self._host is not None:  # numpy views: ~1 us per write instead of ~10
            h = self._host
            h.token_ids[:, n:m], h.depth[:, n:m], h.valid[:, n:m] = token_ids.numpy(), 1, True
            h.draft_probs[:, n:m], h.log_scores[:, n:m] = probs.numpy(), log.numpy()
            self.num_nodes = m
            return torch.from_numpy(np.tile(np.arange(topk), (B, 1)))
        self.token_ids[:, n:m] = token_ids
        self.depth[:, n:m] = 1
        self.draft_probs[:, n:m] = probs
        self.log_scores[:, n:m] = log
        self.valid[:, n:m] = True
        self.num_nodes = m
        return torch.arange(topk, device=token_ids.device).expand(B, topk).clone()

    def grow(self, frontier: torch.Tensor, child_ids: torch.Tensor, child_probs: torch.Tensor, topk: int,
             dense: bool = False) -> torch.Tensor:
        """`grow_tree` in place: frontier [B, F] (-1 = padded), children [B, F, C] -> new frontier
        [B, topk]. dense=True: the caller guarantees no padded frontier entry (skips the masking)."""
        B, F, C = child_ids.shape
        n, m = self._take(F * C)
        if self._host is not None:
            return self._grow_host(frontier, child_ids, child_probs, topk, dense, n, m)
        f_safe = frontier if dense else frontier.clamp(min=0)
        child_log = self.log_scores.gather(1, f_safe)[:, :, None] + child_probs.float().clamp(min=0.0, max=1.0).log()
        parent_depth = self.depth.gather(1, f_safe)
        if dense:
            parents, depth = f_safe, parent_depth + 1
        else:
            frontier_valid = frontier >= 0
            child_log = torch.where(frontier_valid[:, :, None], child_log, _NEG_INF)
            parents = torch.where(frontier_valid, f_safe, -1)
            depth = torch.where(frontier_valid, parent_depth + 1, 0)
        # [B, m - n] column slices split into [B, F, C]: parent values broadcast over C children
        self.token_ids[:, n:m].view(B, F, C).copy_(child_ids)
        self.parents[:, n:m].view(B, F, C).copy_(parents[:, :, None])
        self.depth[:, n:m].view(B, F, C).copy_(depth[:, :, None])
        self.draft_probs[:, n:m].view(B, F, C).copy_(child_probs)
        self.log_scores[:, n:m].view(B, F, C).copy_(child_log)
        if dense:
            self.valid[:, n:m] = True
        else:
            self.valid[:, n:m].view(B, F, C).copy_(frontier_valid[:, :, None])
        self.num_nodes = m
        return _next_frontier(child_log.reshape(B, F * C), n, topk)


    def _grow_host(self, frontier: torch.Tensor, child_ids: torch.Tensor, child_probs: torch.Tensor, topk: int,
                   dense: bool, n: int, m: int) -> torch.Tensor:
        """`grow` on numpy views (CPU): the same values, written to the same storage."""
        h, (B, F, C) = self._host, child_ids.shape
        fr = frontier.numpy()
        f_safe = fr if dense else np.maximum(fr, 0)
        child_log = h.log_scores[h.rows, f_safe][:, :, None] + child_probs.float().clamp(min=0.0, max=1.0).log().numpy()
        parents, depth = f_safe, h.depth[h.rows, f_safe] + 1
        if not dense:
            frontier_valid = fr >= 0
            child_log = np.where(frontier_valid[:, :, None], child_log, np.float32(_NEG_INF))
            parents, depth = np.where(frontier_valid, f_safe, -1), np.where(frontier_valid, depth, 0)
        h.token_ids[:, n:m] = child_ids.numpy().reshape(B, F * C)
        h.parents[:, n:m] = np.repeat(parents, C, axis=1)
        h.depth[:, n:m] = np.repeat(depth, C, axis=1)
        h.draft_probs[:, n:m] = child_probs.float().numpy().reshape(B, F * C)
        flat_log = child_log.reshape(B, F * C)
        h.log_scores[:, n:m] = flat_log
        h.valid[:, n:m] = True if dense else np.repeat(frontier_valid, C, axis=1)
        self.num_nodes = m
        return torch.from_numpy(_next_frontier_host(flat_log, n, topk))


@dataclass(frozen=True)
class _HostViews:
    """numpy views of a CPU TreeBuffer's tensors (shared storage)."""

    token_ids: np.ndarray
    parents: np.ndarray
    depth: np.ndarray
    draft_probs: np.ndarray
    log_scores: np.ndarray
    valid: np.ndarray
    rows: np.ndarray  # [B, 1] batch row index, for fancy indexing


def _next_frontier_host(flat_log: np.ndarray, offset: int, topk: int) -> np.ndarray:
    """`_next_frontier` in numpy: the same stable order of the same float32 scores, so the same nodes."""
    B, M = flat_log.shape
    k = min(topk, M)
    top_pos = np.argsort(-flat_log, axis=1, kind="stable")[:, :k]
    top_log = flat_log[np.arange(B)[:, None], top_pos]
    frontier = np.where(top_log > _NEG_INF, top_pos + offset, -1).astype(np.int64)
    if k < topk:
        frontier = np.concatenate([frontier, np.full((B, topk - k), -1, dtype=np.int64)], axis=1)
    return frontier


def _next_frontier(flat_log: torch.Tensor, offset: int, topk: int) -> torch.Tensor:
    """[B, topk] node idx of the top-`topk` children by score (ties go to the earlier child), -1 for
    children scoring 0 and past the last child; flat_log [B, M] holds the children of nodes offset..."""
    B, M = flat_log.shape
    k = min(topk, M)
    top_pos = (-flat_log).argsort(dim=1, stable=True)[:, :k]
    top_log = flat_log.gather(1, top_pos)
    frontier = torch.where(top_log > _NEG_INF, top_pos + offset, -1)
    if k < topk:
        frontier = torch.cat([frontier, frontier.new_full((B, topk - k), -1)], 1)
    return frontier


def score_order(tree: DraftTree) -> torch.Tensor:
    """[B, N] node idx sorted by (score desc, depth asc, index asc); padded nodes last.

    A child never scores above its parent and is deeper, so every prefix of this
    order is parent-closed.
    """
    B, N = tree.token_ids.shape
    if N == 0:
        return torch.zeros(B, 0, dtype=torch.int64, device=tree.token_ids.device)
    return torch.from_numpy(_score_order_host(tree)[0]).to(tree.token_ids.device)


def _score_order_host(tree: DraftTree) -> tuple[np.ndarray, np.ndarray]:
    """score_order as numpy [B, N] int64, with each ordered entry's validity [B, N] bool."""
    B, N = tree.token_ids.shape
    valid = tree.valid.cpu().numpy()
    neg_score = np.where(valid, -tree.log_scores.cpu().numpy().astype(np.float64), np.inf)
    depth = tree.depth.cpu().numpy()
    index = np.broadcast_to(np.arange(N), (B, N))
    # lexsort: the last key is the primary one.
    order = np.lexsort((index, depth, neg_score, ~valid), axis=-1).astype(np.int64)
    return order, np.take_along_axis(valid, order, 1)


def top_k_nodes(tree: DraftTree, k: int) -> torch.Tensor:
    """[B, k] the top-k nodes by score (EAGLE-3's pruning), -1 where fewer exist."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    B, N = tree.token_ids.shape
    top = np.full((B, k), -1, dtype=np.int64)
    kernel = compiled_top() if B == 1 and N and k and tree.token_ids.device.type == "cpu" else None
    if kernel is not None:  # one CPU tree: the best k in one compiled pass (select_host.py), no sort of all N
        kernel(tree.log_scores[0].numpy(), tree.depth[0].numpy(), tree.valid[0].numpy(), top[0, :min(k, N)])
    elif N and k:  # one numpy pass (the ordering is host work anyway): no tensor ops around it
        order, valid = _score_order_host(tree)
        n = min(k, N)
        top[:, :n] = np.where(valid[:, :n], order[:, :n], -1)
    return torch.from_numpy(top).to(tree.token_ids.device)


def deepest_selected(tree: DraftTree, node_idx: torch.Tensor) -> torch.Tensor:
    """0-dim: the largest depth among the selected nodes node_idx [B, K] (-1 pad), 0 when none is,
    on the tree's device (callers stack it with other values into one read back)."""
    return gather_nodes(tree.depth, node_idx, 0).max() if node_idx.numel() else node_idx.new_zeros(())


def keep_top_nodes(tree: DraftTree, m: int) -> DraftTree:
    """Only the top-`m` nodes by score stay valid (the others are marked padded, as `limit_depth` does).

    A path's score never rises from parent to child, so the kept set is parent-closed (EAGLE-3's
    pruning keeps the same prefix of the score order). A tree of at most m nodes is returned as is."""
    return keep_top_valued(tree, tree, m)[0]


def keep_top_valued(tree: DraftTree, valued: DraftTree, m: int) -> tuple[DraftTree, DraftTree]:
    """(tree, valued) with only the top-`m` nodes of `valued` (the same tree with its scores replaced
    by node values, `core.values.with_values`) valid in both. Values, like scores, never rise from
    parent to child, so the kept set is parent-closed. Trees of at most m nodes are returned as they are."""
    if tree.num_nodes <= m:
        return tree, valued
    N = tree.num_nodes
    top = top_k_nodes(valued, m)  # [B, m] (-1 where fewer valid nodes exist: sent to a spare column)
    keep = torch.zeros(tree.batch_size, N + 1, dtype=torch.bool, device=top.device)
    keep.scatter_(1, torch.where(top >= 0, top, N), True)
    keep = keep[:, :N] & tree.valid
    return _only(tree, keep), _only(valued, keep)


def limit_depth(tree: DraftTree, max_depth: int) -> DraftTree:
    """Drop nodes deeper than max_depth (marks them padded); the rest stays parent-closed.

    A node's depth is at most the node count, so a tree of no more nodes than max_depth is returned
    as it is, without reading its depths back (a device sync for a tree on an accelerator)."""
    if tree.num_nodes <= max_depth:
        return tree
    if tree.depth.device.type == "cpu" and tree.num_nodes and int(tree.depth.numpy().max()) <= max_depth:
        return tree  # no node is deeper (one host read instead of four tensor ops)
    keep = tree.valid & (tree.depth <= max_depth)
    if bool(keep.equal(tree.valid)):
        return tree
    return _only(tree, keep)


def _only(tree: DraftTree, keep: torch.Tensor) -> DraftTree:
    """The tree with only the nodes where keep [B, N] (a parent-closed subset of the valid ones) valid."""
    return DraftTree(tree.token_ids, torch.where(keep, tree.parents, -1), torch.where(keep, tree.depth, 0),
                     tree.draft_probs, torch.where(keep, tree.log_scores, _NEG_INF), keep)
