"""EVICT's selection on one CPU tree as one compiled call.

`policies._evict` orders a tree's nodes by score (`tree.score_order`: a four-key lexsort over every
node), reads the top `cap` scores and takes the prefix k* = argmax (1 + S_k) / C(k) (`select.evict_select`):
about twenty numpy calls, ~0.2 ms of a speculative step on moespec-base's CPU (issue 25). A step needs
the top few dozen of a few hundred nodes, so `evict_prefix` keeps the best `cap` in one pass (insertion
into a sorted list, as EAGLE's top-k) and scans their prefixes, in one numba-compiled loop.

`top_nodes` alone is the top-k every fixed-budget selection takes (`tree.top_k_nodes`: EAGLE-3's pruning).

The reference is the numpy path; tests/core/test_select_host.py checks the same order and k* on random
trees, ties in score included. numba is optional: without it (or with MOESPEC_FUSED_VALUES=0, the switch
of the other compiled step-host work, values_host.py) the numpy path runs.
"""

from __future__ import annotations

import numpy as np

from .host_jit import compiled_kernels


def compiled_evict():
    """The compiled `evict_prefix`, or None when numba is missing or MOESPEC_FUSED_VALUES=0."""
    kernels = _kernels()
    return None if kernels is None else kernels[1]


def compiled_top():
    """The compiled `top_nodes`, or None when numba is missing or MOESPEC_FUSED_VALUES=0."""
    kernels = _kernels()
    return None if kernels is None else kernels[0]


def _kernels():
    # evict_prefix calls top_nodes: a helper too
    return compiled_kernels("MOESPEC_FUSED_VALUES", globals(), ("top_nodes", "evict_prefix"), helpers=("top_nodes",))


def top_nodes(log_scores, depth, valid, order):
    """Fill order [M] with the M best valid nodes in score order (score desc, depth asc, index asc; -1 pads
    past the valid ones) and return how many are valid.

    log_scores [N] float32 (what the order compares, as float64); depth [N] int64; valid [N] bool.
    """
    M = order.shape[0]
    if M == 0:  # nothing to keep (a cap of 0: a cost table of C(0) alone); order[M - 1] below would write before the array
        return 0
    n = 0  # entries of order filled
    for v in range(valid.shape[0]):
        if not valid[v]:
            continue
        key = -np.float64(log_scores[v])
        if n == M:  # full: v enters only when it beats the last kept
            last = order[M - 1]
            lk = -np.float64(log_scores[last])
            if not (key < lk or (key == lk and depth[v] < depth[last])):
                continue  # an equal key and depth: the lower index, kept already, stays ahead
            pos = M - 1
        else:
            pos = n
            n += 1
        while pos > 0:
            u = order[pos - 1]
            uk = -np.float64(log_scores[u])
            if key < uk or (key == uk and depth[v] < depth[u]):
                order[pos] = u
                pos -= 1
            else:
                break
        order[pos] = v
    for i in range(n, M):
        order[i] = -1
    return n


def evict_prefix(log_scores, scores, depth, valid, costs, order):
    """Fill order [M] as `top_nodes` does and return k*, the prefix of it with the most expected tokens
    per cost: scores [N] float32 (what S_k sums, in float64); costs [K+1] float64 C(k). k ranges over
    0 .. min(valid nodes, M, K); ties in the ratio go to the smallest k.
    """
    n = top_nodes(log_scores, depth, valid, order)
    K = min(n, costs.shape[0] - 1)
    best_k, expected = 0, 1.0
    best = expected / costs[0]
    for k in range(1, K + 1):
        expected += np.float64(scores[order[k - 1]])
        u = expected / costs[k]
        if u > best:
            best, best_k = u, k
    return best_k


def top_indices(p, k, out):
    """out[:k] = indices of the k largest of p, largest first, ties to the lower index (insertion into a sorted
    list: a row's top-k in one pass; the drafting step's children and the predictor's experts per layer)."""
    n = 0  # entries of out filled so far
    floor = p[0] if p.shape[0] else 0.0  # once k are kept: the smallest of them, what a later entry must beat
    for d in range(p.shape[0]):
        x = p[d]
        if n < k:
            pos = n
            n += 1
        elif x > floor:
            pos = k - 1  # replaces the smallest kept
        else:
            continue
        while pos > 0 and x > p[out[pos - 1]]:  # strictly greater: an equal earlier index stays first
            out[pos] = out[pos - 1]
            pos -= 1
        out[pos] = d
        if n == k:
            floor = p[out[k - 1]]
