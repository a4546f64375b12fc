"""Calibrated node values of one tree as one compiled call (CPU).

`values._CalibratedRequest.values` turns a drafted tree into node values in four numpy passes:
each node's rank among its siblings, its calibrator group, its conditional acceptance read off
the group's isotonic map, and the product of those along its path. On a tree of ~50 nodes that
is ~40 small numpy calls, about half a millisecond per speculative step on moespec-base (issue 25:
the overhead of a step). `calibrated_values` does all four in one numba-compiled loop over the nodes,
`isotonic` is the pool-adjacent-violators fit the online maps refit each step, and `add_trials` adds
the step's outcome to the online counts.

The references are the numpy path (`node_features.sibling_rank`, `Calibrator.group_ids`,
`OnlineCalibration.conditional`, `values.path_values`), `values.isotonic_fit` and `values.observed_trials`
with `OnlineCalibration.update`;
tests/core/test_values_host.py checks they agree (groups exactly, values to float rounding:
numba's log/exp may differ from numpy's in the last bit). Values only choose which nodes are
verified, never how: output is unchanged either way.

numba is optional: without it (or with MOESPEC_FUSED_VALUES=0) the numpy path runs.
"""

from __future__ import annotations

import numpy as np

from .host_jit import compiled_kernels

MIN_COND = 1e-6  # values.MIN_COND: keeps log(value) finite


def compiled_values():
    """(calibrated_values, isotonic, add_trials, refit_maps) compiled, or None when numba is missing or
    MOESPEC_FUSED_VALUES=0."""
    return compiled_kernels("MOESPEC_FUSED_VALUES", globals(),
                            ("calibrated_values", "isotonic", "add_trials", "refit_maps"),
                            helpers=("isotonic", "sibling_ranks"))  # what refit_maps and calibrated_values call


def calibrated_values(parents, depth, q, score, valid, copies, maps, centers, num_depths, num_ranks, split_copy,
                      groups, values):
    """Fill groups [N] (int64) and values [N] (float32) of one tree; False when a parent does not come
    before its child (the caller then takes the numpy path, which needs no such order).

    parents [N] int64 (-1: the root); depth [N] int64 (>= 1); q [N] float32 the draft probability (what
    sibling ranks compare); score [N] the local score (what the maps read, as float64: float32 converts exactly);
    valid [N] bool; copies [N] int64 0/1; maps [G, M] float64 each group's rate at the bin centres
    centers [M]. A node's sibling rank counts the siblings (valid or not) with a higher q, or an equal
    one and a lower index; its group is (depth, rank, copy) as `Calibrator.group_ids` numbers it; its
    conditional interpolates its group's map linearly between centres; its value is the product of the
    conditionals on its path (0 for padding and below it).
    """
    N = parents.shape[0]
    M = centers.shape[0]
    ranks = np.empty(N, dtype=np.int64)
    if not sibling_ranks(parents, q, valid, ranks):
        return False
    log_value = np.empty(N, dtype=np.float64)
    for v in range(N):
        p = parents[v]
        d = min(max(depth[v], 1), num_depths)
        g = (d - 1) * num_ranks + min(ranks[v], num_ranks - 1)
        if split_copy:
            g = g * 2 + copies[v]
        groups[v] = g
        if not valid[v]:
            log_value[v] = -np.inf
            continue
        x = min(max(np.float64(score[v]), centers[0]), centers[M - 1])
        hi = 1
        while hi < M - 1 and centers[hi] <= x:  # searchsorted(centers, x, "right"), clipped to 1 .. M-1
            hi += 1
        w = (x - centers[hi - 1]) / (centers[hi] - centers[hi - 1])
        cond = maps[g, hi - 1] * (1 - w) + maps[g, hi] * w
        cond = min(max(cond, MIN_COND), 1.0)
        log_value[v] = np.log(cond) + (log_value[p] if p >= 0 else 0.0)
    for v in range(N):
        values[v] = np.float32(np.exp(log_value[v]))
    return True


def sibling_ranks(parents, q, valid, out):
    """out [N] int64: each valid node's rank among its siblings by q, as `node_features.sibling_rank`
    (the siblings, valid or not, with a higher q, or an equal one and a lower index), 0 for the others.
    False when a parent does not come before its child."""
    N = parents.shape[0]
    # siblings as linked lists per parent (slot N: the root's children), in index order
    first = np.full(N + 1, -1, dtype=np.int64)
    nxt = np.full(N, -1, dtype=np.int64)
    for v in range(N - 1, -1, -1):
        p = parents[v]
        if p >= v:
            return False
        slot = N if p < 0 else p
        nxt[v] = first[slot]
        first[slot] = v
    for v in range(N):
        rank = 0
        u = first[N if parents[v] < 0 else parents[v]]
        while u >= 0:
            if q[u] > q[v] or (q[u] == q[v] and u < v):
                rank += 1
            u = nxt[u]
        out[v] = rank if valid[v] else 0
    return True


def isotonic(y, w, out):
    """out [M] = the weighted non-decreasing fit of y [M] with weights w [M] > 0 (pool adjacent violators)."""
    M = y.shape[0]
    level = np.empty(M, dtype=np.float64)
    weight = np.empty(M, dtype=np.float64)
    size = np.empty(M, dtype=np.int64)
    n = 0
    for i in range(M):
        level[n], weight[n], size[n] = y[i], w[i], 1
        n += 1
        while n > 1 and level[n - 2] > level[n - 1]:
            wt = weight[n - 2] + weight[n - 1]
            level[n - 2] = (level[n - 2] * weight[n - 2] + level[n - 1] * weight[n - 1]) / wt
            weight[n - 2] = wt
            size[n - 2] += size[n - 1]
            n -= 1
    i = 0
    for b in range(n):
        for _ in range(size[b]):
            out[i] = level[b]
            i += 1


def refit_maps(hits, trials, groups, maps):
    """maps[g] = the isotonic fit of hits[g] / max(trials[g], 1e-12) weighted by trials[g], for each g of
    groups [n] (the groups whose counts changed): `OnlineCalibration.maps`' refit in one call."""
    rate = np.empty(hits.shape[1], dtype=np.float64)
    for g in groups:
        for m in range(hits.shape[1]):
            rate[m] = hits[g, m] / max(trials[g, m], 1e-12)
        isotonic(rate, trials[g], maps[g])


def add_trials(parents, selected, accepted, groups, local, edges, trials, hits, touched):
    """Add one step's trials to the counts trials / hits [G, M] (float64, in place): each verified node
    (selected [K], -1 pads) whose parent is the root or an accepted node (accepted [D], -1 pads) is a trial
    of its group (groups [N]) in the bin of its local score (local [N] float32; bins by edges [M+1], as
    searchsorted on the right, clipped), accepted or not. touched [G] is set where a group got a trial."""
    N = parents.shape[0]
    M = edges.shape[0] - 1
    is_accepted = np.zeros(N, dtype=np.bool_)
    for a in accepted:
        if a >= 0:
            is_accepted[a] = True
    for v in selected:
        if v < 0:
            continue
        p = parents[v]
        if p >= 0 and not is_accepted[p]:
            continue
        x = np.float64(local[v])
        m = 0
        while m < M - 1 and edges[m + 1] <= x:
            m += 1
        g = groups[v]
        trials[g, m] += 1.0
        if is_accepted[v]:
            hits[g, m] += 1.0
        touched[g] = True
