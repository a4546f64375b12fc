"""The copy features of a CPU tree (`node_features.copy_features`, `copies_recent`) from compiled n-gram tables.

The node values read whether a drafted token continues an n-gram of the context (n = 1, 2, 4): the
calibrated values the most recent follower of the last two tokens, the acceptance head all six flags.
`ContextFollowers` keeps that index in Python dicts and sets, and walking a tree's parents against them
costs ~0.1-0.4 ms of a speculative step on moespec-base's CPU (issue 25). `NgramFollowers` keeps the same
index as open-addressing hash tables in numpy arrays, grown by the committed tokens of each step, and
`copy_flags` reads every node's six flags from it in one numba-compiled pass.

How an n-gram becomes one int64 key: a token is its own key (n = 1); a bigram (a, b) is a << 32 | b
(token ids below 2^31); a 4-gram (a, b, c, d) is id(a, b) << 32 | id(c, d), from the dense ids the bigram
table gives each bigram it holds (a 4-gram of the context is made of two bigrams of the context, each
followed by a token, so both have ids; a 4-gram with another bigram never occurred). Each order's table
maps its keys to dense ids; `recent[j, id]` is that n-gram's most recent follower, and one set holds
every (order, id, follower) seen.

The references are `copy_features` and `copies_recent`; tests/core/test_followers_host.py checks the same
flags on random trees and contexts, grown step by step and restarted. numba is optional: without it (or
with MOESPEC_FUSED_VALUES=0, the switch of the compiled step host work, values_host.py) the values take
the reference path.
"""

from __future__ import annotations

import numpy as np

from .host_jit import compiled_kernels
from .node_features import NGRAM_ORDERS, ContextFollowers
from .tree import DraftTree

assert NGRAM_ORDERS == (1, 2, 4), "the compiled keys below are written for orders 1, 2 and 4"
ORDERS = np.array(NGRAM_ORDERS, dtype=np.int64)
_GOLDEN = 0x9E3779B97F4A7C15  # Fibonacci hashing: the top bits of key * 2^64 / phi


def compiled_followers():
    """(insert_ngrams, copy_flags) compiled, or None when numba is missing or MOESPEC_FUSED_VALUES=0."""
    return compiled_kernels("MOESPEC_FUSED_VALUES", globals(), ("insert_ngrams", "copy_flags"),
                            helpers=("_slot", "_dense_id", "_key"))


class NgramFollowers:
    """Per request: the followers of every 1-, 2- and 4-gram of its growing context, as hash tables for
    `copy_flags`. keys [3, cap] int64 (-1 empty) and ids [3, cap] per order; recent [3, cap] each dense id's
    most recent follower; counts [3] the ids given; seen [cap] the (order, id, follower) set. Token ids must
    be below 2^31."""

    def __init__(self):
        self._allocate(64)
        self.context: list[int] = []

    def _allocate(self, capacity: int) -> None:
        self.keys = np.full((3, capacity), -1, dtype=np.int64)
        self.ids = np.zeros((3, capacity), dtype=np.int64)
        self.recent = np.full((3, capacity), -1, dtype=np.int64)
        self.counts = np.zeros(3, dtype=np.int64)
        self.seen = np.full(capacity, -1, dtype=np.int64)

    def update(self, context: list[int], insert) -> np.ndarray:
        """Add the n-grams whose follower was committed since the last call (start again when `context`
        does not extend the last one, or when the set would pass ~3/8 full: it holds up to 3 entries per
        token); returns the context's last four tokens ([4] int64, -1 for a missing one)."""
        old = len(self.context)
        if context[:old] != self.context or 8 * len(context) > self.seen.shape[0]:
            old = 0
            self._allocate(1 << max((16 * len(context)).bit_length(), 6))
        start = max(old - int(ORDERS[-1]), 0)  # a new 4-gram starts up to 4 tokens before the first new one
        if len(context) > old:
            insert(np.asarray(context[start:], dtype=np.int64), old - start, ORDERS, self.keys, self.ids,
                   self.recent, self.counts, self.seen)
        self.context = list(context)
        tail = np.full(4, -1, dtype=np.int64)
        tail[4 - len(context[-4:]):] = context[-4:]
        return tail


def copy_flags_of(tree: DraftTree, context: list[int], index: ContextFollowers, out: np.ndarray,
                  with_seen: bool = True) -> bool:
    """`copy_flags` of a host tree (batch of one) into out [N, 6] float32, the context added to the request's
    compiled index (kept on its `ContextFollowers`, made on first use). Call only when `compiled_followers()`
    is not None. False when the tree is not in parent-first order (out is then undefined)."""
    insert, flags = compiled_followers()
    if index.table is None:
        index.table = NgramFollowers()
    table = index.table
    tail = table.update(context, insert)
    return flags(tree.token_ids[0].numpy(), tree.parents[0].numpy(), tree.valid[0].numpy(), tail, ORDERS,
                 table.keys, table.ids, table.recent, table.seen, with_seen, out)


def insert_ngrams(tokens, first, orders, keys, ids, recent, counts, seen):
    """Record, for each order, tokens[i + n] as a follower of the n-gram tokens[i:i + n] for every i whose
    follower is new (i + n >= first), later ones winning `recent`. Orders go up: a 4-gram's key reads the
    ids its bigrams got."""
    L = tokens.shape[0]
    for j in range(orders.shape[0]):
        n = orders[j]
        for i in range(max(first - n, 0), L - n):
            key = _key(keys, ids, j, tokens[i:i + n])
            s = _slot(keys[j], key)
            if keys[j, s] != key:
                keys[j, s] = key
                ids[j, s] = counts[j]
                counts[j] += 1
            d = ids[j, s]
            recent[j, d] = tokens[i + n]
            pair = (j << 60) | (d << 31) | tokens[i + n]
            seen[_slot(seen, pair)] = pair


def copy_flags(tokens, parents, valid, tail, orders, keys, ids, recent, seen, with_seen, out):
    """out [N, 6] float32, as `copy_features`: for each order n, (a valid node's token followed the last n
    tokens of context + its parent's path somewhere in the context, it is the most recent such follower);
    with_seen False leaves the first of each pair 0 (the calibrated values read only n = 2's second).
    tokens, parents [N] int64 (-1: the root); valid [N] bool; tail [4] the context's last four tokens (-1
    where missing). False when a parent does not come before its child (the caller takes the reference)."""
    N = tokens.shape[0]
    J = orders.shape[0]
    tails = np.empty((N + 1, 4), dtype=np.int64)  # the last four tokens of context + each node's path; N: the root
    tails[N] = tail
    for v in range(N):
        p = parents[v]
        if p >= v:
            return False
        src = N if p < 0 else p
        tails[v, :3] = tails[src, 1:]
        tails[v, 3] = tokens[v]
    # each parent's n-grams' dense ids (-1: not in the context), looked up once for all its children
    dense = np.full((N + 1, J), -2, dtype=np.int64)
    for v in range(N):
        out[v] = 0
        if not valid[v]:
            continue
        p = N if parents[v] < 0 else parents[v]
        if dense[p, 0] == -2:
            for j in range(J):
                key = _key(keys, ids, j, tails[p, 4 - orders[j]:])
                dense[p, j] = -1 if key < 0 else _dense_id(keys, ids, j, key)
        for j in range(J):
            d = dense[p, j]
            if d < 0:
                continue
            if recent[j, d] == tokens[v]:
                out[v, 2 * j + 1] = 1
            if with_seen:
                pair = (j << 60) | (d << 31) | tokens[v]
                if seen[_slot(seen, pair)] == pair:
                    out[v, 2 * j] = 1
    return True


def _key(keys, ids, j, gram):
    """The int64 key of an n-gram (n = len(gram): 1, 2 or 4) in table j, or -1 when it has a missing token
    (-1) or, for n = 4, a bigram the context never had."""
    for t in gram:
        if t < 0:
            return -1
    n = gram.shape[0]
    if n == 1:
        return gram[0]
    if n == 2:
        return (gram[0] << 32) | gram[1]
    first, second = _dense_id(keys, ids, 1, (gram[0] << 32) | gram[1]), _dense_id(keys, ids, 1, (gram[2] << 32) | gram[3])
    if first < 0 or second < 0:
        return -1
    return (first << 32) | second


def _dense_id(keys, ids, j, key):
    """The dense id of `key` in table j, -1 when absent."""
    s = _slot(keys[j], key)
    return ids[j, s] if keys[j, s] == key else -1


def _slot(keys, key):
    """The slot holding `key`, or the empty one where it would go (linear probing; the table is at most
    half full)."""
    mask = keys.shape[0] - 1
    s = np.int64((np.uint64(key) * np.uint64(_GOLDEN)) >> np.uint64(40)) & mask  # 24 high bits, then the table's
    while keys[s] != -1 and keys[s] != key:
        s = (s + 1) & mask
    return s
