"""The expert-aware selection's host work on one CPU tree as compiled calls: EcoSpec's and joint's greedy
(`select.greedy_expert_select`), the path expert sets it reads (`select.path_bits`) and the predicted
sets it is given (top-K experts per layer of each node's routing logits, as bitset words).

In numpy the greedy takes one pick at a time over the candidate frontier: ~10 array calls a pick, up to
32 picks; with the path sets, ~0.8 ms of a moespec-base step with joint's expert term on, and the top-K and
packing of the draft-head predictor's logits ~0.9 ms more in torch (issue 25; measured as the drop of the
selection's and the predictor's times, 1.7 -> 0.9 and 2.75 -> 1.8 ms). Each is one loop here.

The references are the numpy/torch paths (`select._greedy_one`, `select._path_bits_reference`, and
`DraftHeadPredictor._topk` + `experts.pack_expert_ids`); tests/core/test_greedy_host.py checks the same
picks, prefix sums and unions on random trees with tied scores, and the same words on random logits. The
greedy divides and compares the same float64 numbers in the same order as numpy, so it picks the same
nodes; the top-K breaks exact ties in a logit toward the lower expert id (torch's top-k leaves them
unspecified), which only changes a prediction. Selection never changes what is emitted.

Under expert parallelism (a placement) the greedy keeps the numpy path. numba is optional: without it (or
with MOESPEC_FUSED_VALUES=0, the switch of the other compiled step-host work) the reference paths run.
"""

from __future__ import annotations

import numpy as np

from .host_jit import compiled_kernels
from .select_host import top_indices  # a helper of topk_words

_M1 = np.uint64(0x5555555555555555)
_M2 = np.uint64(0x3333333333333333)
_M4 = np.uint64(0x0F0F0F0F0F0F0F0F)
_H01 = np.uint64(0x0101010101010101)


def compiled_greedy():
    """(greedy_order, path_words, topk_words) compiled, or None when numba is missing or
    MOESPEC_FUSED_VALUES=0."""
    return compiled_kernels("MOESPEC_FUSED_VALUES", globals(), ("greedy_order", "path_words", "topk_words"),
                            helpers=("_popcount", "top_indices"))


def _popcount(x):
    """Set bits of a uint64 word (SWAR: numba has no popcount intrinsic for numpy integers)."""
    x = x - ((x >> np.uint64(1)) & _M1)
    x = (x & _M2) + ((x >> np.uint64(2)) & _M2)
    x = (x + (x >> np.uint64(4))) & _M4
    return np.int64((x * _H01) >> np.uint64(56))


def greedy_order(scores, parents, valid, bits, buf, max_picks, token_cost, expert_cost, marginal, order, cu, uniq):
    """`select._greedy_one` without a placement: picks parent-closed nodes one at a time by
    score / (token_cost + expert_cost * new experts), the first maximum among candidates in index order.

    scores [N] f64, parents [N] i64, valid [N] bool, bits [N, W] u64 path sets, buf [W] u64 the initial
    union (the root's experts, or zeros); marginal: new experts counted against the growing union, else
    against buf. Writes order [>= max_picks], cu [max_picks + 1] (score prefix sums) and uniq
    [max_picks + 1] (union sizes); returns the number of picks."""
    N, W = bits.shape
    union = buf.copy()
    ref = union if marginal else buf  # what new experts are counted against (union grows in place)
    is_cand = np.zeros(N, dtype=np.bool_)
    for i in range(N):
        is_cand[i] = valid[i] and parents[i] < 0
    count = 0
    for w in range(W):
        count += _popcount(union[w])
    uniq[0] = count
    n = 0
    while n < max_picks:
        best, best_u = -1, 0.0
        for c in range(N):
            if not is_cand[c]:
                continue
            new = 0
            for w in range(W):
                new += _popcount(bits[c, w] & ~ref[w])
            u = scores[c] / (token_cost + expert_cost * new)  # > 0 denominators: the caller's condition
            if best < 0 or u > best_u or (u != u and best_u == best_u):  # numpy's argmax: a NaN is the maximum
                best, best_u = c, u
        if best < 0:
            break
        is_cand[best] = False
        for i in range(N):
            if valid[i] and parents[i] == best:
                is_cand[i] = True
        count = 0
        for w in range(W):
            union[w] |= bits[best, w]
            count += _popcount(union[w])
        order[n] = best
        cu[n + 1] = cu[n] + scores[best]
        n += 1
        uniq[n] = count
    for j in range(n + 1, max_picks + 1):
        cu[j] = cu[n]
        uniq[j] = uniq[n]
    return n


def path_words(bits, parents, depth, out):
    """`select._path_bits_reference` for one tree: out [N, W] = the union of node sets on each root -> v path.
    Parents come before their children in depth order, so one pass by depth finishes each parent first."""
    N, W = bits.shape
    max_depth = 0
    for v in range(N):
        out[v, :] = bits[v, :]
        max_depth = max(max_depth, depth[v])
    for d in range(2, max_depth + 1):
        for v in range(N):
            if depth[v] == d:
                for w in range(W):
                    out[v, w] |= out[parents[v], w]


def topk_words(logits, k, out):
    """The top-`k` experts of each row's routing logits per layer as bitset words: logits [M, L, E] f32
    -> out [M, W] i64 zeroed here, bit l * E + e of word (l * E + e) // 64 set for each chosen e.
    Exact ties go to the lower expert id."""
    M, L, E = logits.shape
    k = min(k, E)
    chosen = np.empty(k, dtype=np.int64)
    out[:] = 0
    for m in range(M):
        for l in range(L):
            top_indices(logits[m, l], k, chosen)
            for j in range(k):
                b = l * E + chosen[j]
                out[m, b // 64] |= np.int64(1) << np.int64(b % 64)
