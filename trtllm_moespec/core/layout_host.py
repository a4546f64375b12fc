"""One CPU request's verify layout as one compiled call.

`layout._build_layout_host` lays out a step's selection on Python lists: four tree fields read as lists
(a few hundred nodes each), a loop over the selection and seven tensors made from nested lists. After the
target's forward has swept the caches each of those costs several times its hot-loop time (~0.15 ms of a
speculative step on moespec-base's CPU, issue 25). `layout_row` does the checks and the layout of one
request in one numba-compiled pass over numpy views, and the tensors are numpy arrays handed to torch
without a copy.

The reference is the list path; tests/core/test_layout_host.py checks the same layout and the same
errors on random selections. numba is optional: without it (or with MOESPEC_FUSED_VALUES=0, the switch of
the compiled step host work, values_host.py) the list path runs.
"""

from __future__ import annotations

import numpy as np

from .host_jit import compiled_kernels

# layout_row's outcomes: 0 laid out, else the error the list path raises
EMPTY_TREE, OUT_OF_RANGE, PADDED_NODE, NOT_PARENT_CLOSED = 1, 2, 3, 4


def compiled_layout():
    """The compiled `layout_row`, or None when numba is missing or MOESPEC_FUSED_VALUES=0."""
    kernels = compiled_kernels("MOESPEC_FUSED_VALUES", globals(), ("layout_row",))
    return None if kernels is None else kernels[0]


def layout_row(parents, tokens, depth, valid, sel, root):
    """Lay out the root and the selected nodes sel [K] (-1 pad) of one tree (parents, tokens, depth [N]
    int64, valid [N] bool). Returns (outcome, node_idx [K], token_ids [K+1], depth [K+1], parent_pos [K+1],
    valid [K+1], paths [K+1, D+1], num_nodes) as `layout.TreeLayout` holds them for one request; on an
    outcome other than 0 the arrays are empty (the caller raises, with the list path's precedence)."""
    N, K = parents.shape[0], sel.shape[0]
    e = np.empty(0, dtype=np.int64)
    nothing = (e, e, e, e, np.empty(0, dtype=np.bool_), np.empty((0, 0), dtype=np.int64), 0)
    for j in range(K):  # the list path's checks, in its order
        if N == 0 and sel[j] >= 0:
            return (EMPTY_TREE,) + nothing
    for j in range(K):
        if sel[j] >= N:
            return (OUT_OF_RANGE,) + nothing
    for j in range(K):
        if sel[j] >= 0 and not valid[sel[j]]:
            return (PADDED_NODE,) + nothing
    pos_of = np.zeros(N, dtype=np.int64)  # tree node -> layout position (0: not selected)
    for j in range(K):
        if sel[j] >= 0:
            pos_of[sel[j]] = j + 1
    node_idx = np.full(K, -1, dtype=np.int64)
    token_ids = np.full(K + 1, root, dtype=np.int64)
    out_depth = np.zeros(K + 1, dtype=np.int64)
    parent_pos = np.full(K + 1, -1, dtype=np.int64)
    out_valid = np.zeros(K + 1, dtype=np.bool_)
    out_valid[0] = True
    count, max_depth = 0, 0
    for j in range(1, K + 1):
        n = sel[j - 1]
        if n < 0:
            continue
        tp = parents[n]
        pp = pos_of[tp] if tp >= 0 else 0
        if pp >= j or (tp >= 0 and pp == 0):
            return (NOT_PARENT_CLOSED,) + nothing
        node_idx[j - 1], token_ids[j], out_depth[j], parent_pos[j], out_valid[j] = n, tokens[n], depth[n], pp, True
        count += 1
        max_depth = max(max_depth, depth[n])
    # a node's path is its parent's (laid out earlier) plus itself at its depth
    paths = np.full((K + 1, max_depth + 1), -1, dtype=np.int64)
    paths[0, 0] = 0
    for j in range(1, K + 1):
        if out_valid[j]:
            paths[j] = paths[parent_pos[j]]
            paths[j, out_depth[j]] = j
    return 0, node_idx, token_ids, out_depth, parent_pos, out_valid, paths, count
