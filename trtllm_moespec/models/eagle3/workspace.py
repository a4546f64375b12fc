"""The compiled CPU drafting path's buffers, kept between a request's drafting steps (`DraftWorkspace`).

A drafting step on the CPU (`drafting._TreeDraft` with the compiled step of fused_step.py) works in a dozen
arrays: the tree's node arrays, each node's drafter features, the attention rows of the tree slots, the
frontier's mask, the next forward's inputs and positions. Made afresh each step they cost ~0.1 ms of a
moespec-base step, whose host work runs on caches the target's forward just flushed (issue 25). The request's
drafter cache keeps them instead (`Eagle3Cache.workspace`), and the next step drafts into them again.

Reuse must never change a tree handed out earlier: a draft's `DraftTree` and features are views of these
buffers. So a step reuses them only when nothing else holds a view of the node arrays or of the features
(their storages' use counts are back to what the workspace alone holds; a replay recorder or a test keeping
an earlier tree makes the step allocate a new workspace instead, leaving the old one to its holder).
"""

from __future__ import annotations

import numpy as np
import torch

from ...core.tree import TreeBuffer


def _use_count(t: torch.Tensor) -> int:
    """How many tensors and numpy arrays share t's storage (torch's own count; -1 where torch lacks it)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return -1 if count is None else count(t.untyped_storage()._cdata)


class DraftWorkspace:
    """One request's drafting buffers on the CPU, float32: for trees of up to `capacity` nodes drafted by
    `topk` children per node with up to `max_slots` tree keys, H drafter features per node, steps - 1 forwards."""

    def __init__(self, capacity: int, max_slots: int, topk: int, hidden_size: int, forwards: int):
        self.shape = (capacity, max_slots, topk, hidden_size, forwards)
        self.nodes = TreeBuffer(1, capacity, "cpu")
        # the features of each forward row (the root's, then every expanded node's): its topk children's
        self.row_hidden = torch.from_numpy(np.empty((1, capacity // topk, hidden_size), dtype=np.float32))
        self.hidden_np = self.row_hidden.numpy()[0]  # [capacity / topk, H]
        self.mask_value = float(torch.finfo(torch.float32).min)  # a slot a row does not see
        # each node's visibility of the tree slots: a row is written (up to the slots it may read) when its node is
        self.rows = np.full((capacity, max(max_slots, 1)), self.mask_value, dtype=np.float32)
        self._mask_flat = np.empty(0, dtype=np.float32)  # the frontier's mask rows, grown with the prefix
        self.in_hidden = np.empty((1, topk, hidden_size), dtype=np.float32)  # the next forward's inputs
        self.in_ids = np.zeros((1, topk), dtype=np.int64)
        self.next = np.empty(topk, dtype=np.int64)  # the next frontier's node idx
        self.frontier = torch.from_numpy(self.next[None])  # [1, topk] a view: each grow rewrites it
        self._positions = np.empty((max(forwards, 0), topk), dtype=np.int64)
        n = self.nodes
        self._handed_out = (n.token_ids, n.parents, n.depth, n.draft_probs, n.log_scores, n.valid, self.row_hidden)
        self._own_counts = [_use_count(t) for t in self._handed_out]

    @classmethod
    def of(cls, holder, capacity: int, max_slots: int, topk: int, hidden_size: int, forwards: int) -> "DraftWorkspace":
        """The workspace `holder` (a drafter cache) keeps, cleared for a new tree, when it has this shape and no
        earlier tree drafted in it is still held; else a new one, which `holder` keeps from now on."""
        ws = getattr(holder, "workspace", None)
        if ws is None or ws.shape != (capacity, max_slots, topk, hidden_size, forwards) or not ws.unshared():
            ws = holder.workspace = cls(capacity, max_slots, topk, hidden_size, forwards)
        else:
            ws.nodes.clear()
        return ws

    def unshared(self) -> bool:
        """True when only this workspace holds its node arrays and features (no tree or features handed out
        by an earlier draft are alive); False where torch cannot say."""
        counts = [_use_count(t) for t in self._handed_out]
        return counts[0] >= 0 and counts == self._own_counts

    def mask(self, prefix_len: int) -> np.ndarray:
        """[topk, prefix_len + max_slots] the frontier's mask rows: the committed prefix visible (0); the tree
        part is written by each drafting step before a forward reads it."""
        _, max_slots, topk, _, _ = self.shape
        size = topk * (prefix_len + max_slots)
        if self._mask_flat.size < size:  # room for the prefix to grow a while before the next allocation
            self._mask_flat = np.empty(size + topk * 256, dtype=np.float32)
        m = self._mask_flat[:size].reshape(topk, prefix_len + max_slots)
        m[:, :prefix_len] = 0.0
        return m

    def positions(self, start: int) -> np.ndarray:
        """[steps - 1, topk]: row `step` holds position start + step, for every frontier row."""
        p = self._positions
        p[:] = np.arange(start, start + p.shape[0])[:, None]
        return p
