"""The copy feature of a CPU tree (`node_features.copies_recent`, n = 2) from a compiled bigram table.

`copies_recent` walks the tree's parents in Python against a dict of the context's bigrams: ~0.14 ms of a
speculative step on moespec-base's CPU, over half of the node values' time (issue 25). `BigramFollowers`
keeps the same index, each bigram's most recent follower in the context, as an open-addressing hash table
in numpy arrays, grown by the committed tokens of each step; `copies_of` reads every node's flag from it
in one numba-compiled pass.

The reference is `copies_recent`; tests/core/test_followers_host.py checks the same flags on random trees
and contexts, grown step by step and restarted. numba is optional: without it (or with
MOESPEC_FUSED_VALUES=0, the switch of the compiled step host work, values_host.py) the values take the
reference path.
"""

from __future__ import annotations

import numpy as np

from .host_jit import compiled_kernels

_GOLDEN = 0x9E3779B97F4A7C15  # Fibonacci hashing: the top bits of key * 2^64 / phi


def compiled_followers():
    """(insert_followers, copies_of) compiled, or None when numba is missing or MOESPEC_FUSED_VALUES=0."""
    return compiled_kernels("MOESPEC_FUSED_VALUES", globals(), ("insert_followers", "copies_of"),
                            helpers=("_slot", "_lookup"))


class BigramFollowers:
    """Per request: the most recent follower of every bigram of its growing context, as a hash table
    (keys [cap] int64, -1 empty; values [cap] int64), for `copies_of`. Token ids must be below 2^31."""

    def __init__(self):
        self.keys = np.full(0, -1, dtype=np.int64)
        self.values = np.zeros(0, dtype=np.int64)
        self.context: list[int] = []

    def update(self, context: list[int], insert) -> np.ndarray:
        """Add the bigrams of the tokens committed since the last call (start again when `context` does
        not extend the last one, or when the table would pass half full); returns the context's last two
        tokens ([2] int64, -1 for a missing one)."""
        start = max(len(self.context) - 2, 0)
        if context[:len(self.context)] != self.context or 2 * len(context) > len(self.keys):
            start = 0
            capacity = 1 << max(int(4 * len(context)).bit_length(), 6)
            self.keys, self.values = np.full(capacity, -1, dtype=np.int64), np.zeros(capacity, dtype=np.int64)
        if len(context) - 2 > start:
            insert(self.keys, self.values, np.asarray(context[start:], dtype=np.int64))
        self.context = list(context)
        tail = np.full(2, -1, dtype=np.int64)
        tail[2 - len(context[-2:]):] = context[-2:]
        return tail


def insert_followers(keys, values, tokens):
    """Record tokens[i + 2] as the follower of the bigram (tokens[i], tokens[i + 1]), later ones winning."""
    for i in range(tokens.shape[0] - 2):
        key = (tokens[i] << 32) | tokens[i + 1]
        s = _slot(keys, key)
        keys[s] = key
        values[s] = tokens[i + 2]


def copies_of(tokens, parents, valid, tail, keys, values, out):
    """out [N] int64: 1 where a valid node's token is the most recent follower, in the context, of the
    last two tokens of (context + its parent's path), as `copies_recent` (n = 2). tokens, parents [N]
    int64 (-1: the root); valid [N] bool; tail [2] the context's last two tokens (-1 where missing)."""
    N = tokens.shape[0]
    root = _lookup(keys, values, tail[0], tail[1]) if tail[0] >= 0 else -1
    follower = np.empty(N, dtype=np.int64)  # of each node's own path: its bigram is (parent's token, its token)
    for p in range(N):
        prev = tokens[parents[p]] if parents[p] >= 0 else tail[1]
        follower[p] = _lookup(keys, values, prev, tokens[p])
    for v in range(N):
        f = follower[parents[v]] if parents[v] >= 0 else root
        out[v] = 1 if valid[v] and tokens[v] == f else 0


def _lookup(keys, values, a, b):
    """The follower of the bigram (a, b), -1 when the context never had one."""
    if a < 0 or b < 0:
        return -1
    key = (a << 32) | b
    s = _slot(keys, key)
    return values[s] if keys[s] == key else -1


def _slot(keys, key):
    """The slot holding `key`, or the empty one where it would go (linear probing; the table is at most
    half full)."""
    mask = keys.shape[0] - 1
    s = np.int64((np.uint64(key) * np.uint64(_GOLDEN)) >> np.uint64(40)) & mask  # 24 high bits, then the table's
    while keys[s] != -1 and keys[s] != key:
        s = (s + 1) & mask
    return s
