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


class ContextFollowers:
    """Incremental index of a growing context's n-gram followers, for every n in `orders`: the tokens that
    followed each n-gram, and the most recent one. One per request (the value model's request state keeps
    it): each step reads only the newly committed tokens (a context that is not an extension of the last one
    starts the index again). `table`: the same index as the compiled paths' hash tables
    (followers_host.NgramFollowers), made and kept up to date by them."""

    def __init__(self, orders: tuple[int, ...] = NGRAM_ORDERS) -> None:
        self.orders = orders
        self.context: list[int] = []
        self.seen: dict[int, dict[tuple, set]] = {n: {} for n in orders}
        self.recent: dict[int, dict[tuple, int]] = {n: {} for n in orders}
        self.table = None  # a followers_host.NgramFollowers, made by followers_host.copy_flags_of

    def update(self, context: list[int]) -> None:
        old = len(self.context)
        if context[:old] != self.context:  # not an extension: start again
            self.seen, self.recent = {n: {} for n in self.orders}, {n: {} for n in self.orders}
            old = 0
        for n in self.orders:
            seen, recent = self.seen[n], self.recent[n]
            for i in range(max(old - n, 0), len(context) - n):  # key i = context[i:i+n], new since the last update
                key, nxt = tuple(context[i:i + n]), context[i + n]
                seen.setdefault(key, set()).add(nxt)
                recent[key] = nxt  # later entries win: the most recent follower
        self.context = list(context)


def copy_features(tree: DraftTree, context: list[int], followers: ContextFollowers | None = None) -> np.ndarray:
    """[N, 2 * len(NGRAM_ORDERS)] float32: for n in NGRAM_ORDERS, (v's token follows the last n tokens of
    context + path somewhere in the context, v's token is the most recent such follower). Batch of one.
    `followers` (kept per request) avoids re-reading the context.

    Repetitive text (and a small target's loops) continues the way it went last time."""
    if followers is None:
        followers = ContextFollowers()
    followers.update(context)
    tokens, parents, valid = tree.token_ids[0].tolist(), tree.parents[0].tolist(), tree.valid[0].tolist()
    tail_len = max(NGRAM_ORDERS)
    # Siblings share their parent's tail, so the look-ups run once per parent, not once per node;
    # a parent's index is below its children's, so one pass in index order builds every tail.
    tails: dict[int, tuple] = {-1: tuple(context[-tail_len:])}
    for p in sorted(set(parents) - {-1}):
        tails[p] = (tails[parents[p]] + (tokens[p],))[-tail_len:]
    rows = [v for v in range(len(tokens)) if valid[v]]
    toks, pars = [tokens[v] for v in rows], [parents[v] for v in rows]
    columns = []
    for n in NGRAM_ORDERS:
        keys = {p: tails[p][-n:] for p in set(pars) if len(tails[p]) >= n}  # parent -> its n-gram tail
        seen = {p: followers.seen[n].get(k, ()) for p, k in keys.items()}
        recent = {p: followers.recent[n].get(k, -1) for p, k in keys.items()}
        columns.append([t in seen.get(p, ()) for t, p in zip(toks, pars)])
        columns.append([t == recent.get(p, -1) for t, p in zip(toks, pars)])
    out = np.zeros((len(tokens), 2 * len(NGRAM_ORDERS)), dtype=np.float32)
    if rows:
        out[rows] = np.asarray(columns, dtype=np.float32).T
    return out


def copies_recent(tree: DraftTree, context: list[int], n: int = 2, index: ContextFollowers | None = None) -> np.ndarray:
    """[N] int64 1 where the node's token is the most recent follower, in the context, of the last n
    tokens of (context + its path). Batch of one. `index` (kept per request, indexing order n) avoids
    re-reading the context."""
    if index is None:
        index = ContextFollowers((n,))
    index.update(context)
    recent = index.recent[n]
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
