"""Cheap per-node features of a draft tree that predict acceptance beyond the draft probability:
the node's rank among its siblings and whether its token continues an n-gram seen in the context.

Both are pure numpy over the tree and the committed tokens (no model), so the value
calibrator (values.py) and the learned acceptance head (models/acceptance_head.py) share them.
"""

from __future__ import annotations

import numpy as np

from .tree import DraftTree

NGRAM_ORDERS = (1, 2, 4)


def sibling_rank(tree: DraftTree) -> np.ndarray:
    """[N] rank of each node's q among its siblings (0 = the drafter's best child); batch of one."""
    parents, q, valid = tree.parents[0].cpu().numpy(), tree.draft_probs[0].cpu().numpy(), tree.valid[0].cpu().numpy()
    N = len(parents)
    order = np.lexsort((np.arange(N), -q, parents))  # by parent, then q descending, then index
    p_sorted = parents[order]
    pos = np.arange(N)
    starts = np.r_[True, p_sorted[1:] != p_sorted[:-1]] if N else np.zeros(0, dtype=bool)
    first = np.maximum.accumulate(np.where(starts, pos, 0)) if N else pos
    rank = np.empty(N, dtype=np.int64)
    rank[order] = pos - first
    return np.where(valid, rank, 0)


def copy_features(tree: DraftTree, context: list[int]) -> np.ndarray:
    """[N, 2 * len(NGRAM_ORDERS)] float32: for n in NGRAM_ORDERS, (v's token follows the last n tokens of
    context + path somewhere in the context, v's token is the most recent such follower). Batch of one.

    Repetitive text (and a small target's loops) continues the way it went last time."""
    followers: list[tuple[dict[tuple, set], dict[tuple, int]]] = []
    for n in NGRAM_ORDERS:
        keys = list(zip(*(context[j:len(context) - n + j] for j in range(n))))  # key i = context[i:i+n]
        seen: dict[tuple, set] = {}
        for key, nxt in zip(keys, context[n:]):
            seen.setdefault(key, set()).add(nxt)
        followers.append((seen, dict(zip(keys, context[n:]))))  # later entries win: the most recent follower
    tokens, parents, valid = tree.token_ids[0].tolist(), tree.parents[0].tolist(), tree.valid[0].tolist()
    tail_len = max(NGRAM_ORDERS)
    root_tail = tuple(context[-tail_len:])
    tails: list[tuple] = []
    out = np.zeros((len(tokens), 2 * len(NGRAM_ORDERS)), dtype=np.float32)
    for v, (tok, p) in enumerate(zip(tokens, parents)):  # topological: parents come first
        prev = root_tail if p < 0 else tails[p]
        tails.append((prev + (tok,))[-tail_len:])
        if not valid[v]:
            continue
        for j, n in enumerate(NGRAM_ORDERS):
            if len(prev) >= n:
                key = prev[-n:]
                out[v, 2 * j] = float(tok in followers[j][0].get(key, ()))
                out[v, 2 * j + 1] = float(followers[j][1].get(key, -1) == tok)
    return out


class RecentFollowers:
    """Incremental index of the most recent follower of every n-gram of a growing context
    (one per request: each step adds only the newly committed tokens)."""

    def __init__(self, n: int = 2):
        self.n, self.recent, self.context = n, {}, []

    def update(self, context: list[int]) -> None:
        n, start = self.n, max(len(self.context) - self.n, 0)
        if context[:len(self.context)] != self.context:  # not an extension: start again
            self.recent, start = {}, 0
        for i in range(start, len(context) - n):
            self.recent[tuple(context[i:i + n])] = context[i + n]
        self.context = list(context)


def copies_recent(tree: DraftTree, context: list[int], n: int = 2, index: RecentFollowers | None = None) -> np.ndarray:
    """[N] int64 1 where the node's token is the most recent follower, in the context, of the last n
    tokens of (context + its path). Batch of one. `index` (kept per request) avoids re-reading the context."""
    if index is None:
        index = RecentFollowers(n)
    index.update(context)
    recent = index.recent
    tokens_np, parents_np = tree.token_ids[0].cpu().numpy(), tree.parents[0].cpu().numpy()
    N = len(parents_np)
    tokens, parents = tokens_np.tolist(), parents_np.tolist()
    # Siblings share their parent's tail: one look-up per node that has children (about N / topk of them),
    # walked in index order (a parent's index is below its children's), not one per node. follower[N] is the
    # root's, so parents -1 read it.
    root_tail = tuple(context[-n:])
    tails = {-1: root_tail}
    follower = np.full(N + 1, -1, dtype=np.int64)
    follower[N] = recent.get(root_tail, -1) if len(root_tail) >= n else -1
    for p in np.unique(parents_np[parents_np >= 0]).tolist():
        tails[p] = tail = (tails[parents[p]] + (tokens[p],))[-n:]
        follower[p] = recent.get(tail, -1) if len(tail) >= n else -1
    next_of_parent = follower[np.where(parents_np >= 0, parents_np, N)]
    return ((tokens_np == next_of_parent) & tree.valid[0].cpu().numpy()).astype(np.int64)
