"""Greedy acceptance of one CPU request's tree as one compiled call.

`verify._chain_host` walks the layout on Python lists: three layout fields read as lists, a loop over
the positions, a numpy argmax and a finiteness check per visited row and the result arrays filled from
lists. After the target's forward has swept the caches each of those small calls costs several times
its hot-loop time: ~0.2 ms of a speculative step on moespec-base's CPU (issue 25). `greedy_walk` does
the walk, the argmaxes and the checks in one numba-compiled pass over numpy views.

The reference is the list walk; tests/core/test_accept_host.py checks the same result on random layouts
with tied logits, and the same refusal of a visited row that is not finite. numba is optional: without it
(or with MOESPEC_FUSED_VALUES=0, the switch of the compiled step host work, values_host.py) the list walk
runs.
"""

from __future__ import annotations

import numpy as np

from .host_jit import compiled_kernels


def compiled_greedy_walk():
    """The compiled `greedy_walk`, or None when numba is missing or MOESPEC_FUSED_VALUES=0."""
    kernels = compiled_kernels("MOESPEC_FUSED_VALUES", globals(), ("greedy_walk",), helpers=("_finite_argmax",))
    return None if kernels is None else kernels[0]


def greedy_walk(logits, parent_pos, tokens, valid, accepted, emitted):
    """The greedy rule's walk over one request's layout: from the root, move to the first child (in layout
    order) whose token is the argmax of its parent's row (the first maximum, as numpy's and torch's argmax);
    the last argmax is the bonus token.

    logits [T, V] float (the layout positions' rows); parent_pos, tokens [T] int64; valid [T] bool.
    Fills accepted [D] (layout positions, -1 pads) and emitted [D + 1] (accepted tokens then the bonus, -1
    pads) and returns how many nodes were accepted, or -1 when a visited row holds a NaN or an infinity.
    """
    best = _finite_argmax(logits[0])
    if best < 0:
        return -1
    cur, n = 0, 0
    for j in range(1, tokens.shape[0]):  # layout order puts every child after its parent: one scan
        if valid[j] and parent_pos[j] == cur and tokens[j] == best:
            accepted[n] = j
            emitted[n] = tokens[j]
            n += 1
            cur = j
            best = _finite_argmax(logits[j])
            if best < 0:
                return -1
    emitted[n] = best
    for i in range(n, accepted.shape[0]):
        accepted[i] = -1
    for i in range(n + 1, emitted.shape[0]):
        emitted[i] = -1
    return n


def _finite_argmax(row):
    """The index of row's first maximum, or -1 when it holds a NaN or an infinity."""
    best, top = 0, row[0]
    if not np.isfinite(top):
        return -1
    for i in range(1, row.shape[0]):
        x = row[i]
        if not np.isfinite(x):
            return -1
        if x > top:
            best, top = i, x
    return best
