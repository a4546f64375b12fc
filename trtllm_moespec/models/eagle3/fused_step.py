"""One EAGLE-3 drafting step's host bookkeeping as one compiled call (CPU).

Between two drafter forwards, drafting a tree on the CPU does small work on a few hundred numbers:
the top-`topk` children of each frontier row, their scores, the node arrays, the children's attention
rows and features, the next frontier and the next forward's inputs. As torch ops that is ~30
dispatches of 5-40 us each per step, a third of a millisecond: on moespec-base, 5 steps make most of
the speculative step's overhead (issue 25). `grow_step` does all of it in one numba-compiled call
on numpy views of the drafting buffers (`drafting._TreeDraft`), in tens of microseconds.

The reference is the torch/numpy path it replaces (`drafting._top_children`, `TreeBuffer.grow`,
`_TreeMasks.add_children` / `.frontier`, `_TreeDraft._write_hidden` / `.inputs`); tests/models/
test_fused_step.py checks they draft the same trees. Children are ranked on the probabilities the
caller's softmax computed, so node tokens, parents, depths, features and masks are the reference's
exactly; a score may differ from it in its last bit (the log is numba's), which can only reorder
children whose scores tie to that bit. Acceptance never reads either: output is unchanged.

numba is optional: without it (or with MOESPEC_FUSED_DRAFT=0) drafting takes the reference path.
"""

from __future__ import annotations

import numpy as np

from ...core.host_jit import compiled_kernels
from ...core.select_host import top_indices as _top_indices  # a helper of grow_step


def fused_grow_step():
    """The compiled `grow_step`, or None when numba is missing or MOESPEC_FUSED_DRAFT=0 turns it off."""
    kernels = compiled_kernels("MOESPEC_FUSED_DRAFT", globals(), ("grow_step",),
                               helpers=("_top_indices", "_next_frontier"))  # grow_step calls both
    return None if kernels is None else kernels[0]


def grow_step(probs, hidden, frontier, target_ids, topk, first, num_slots, prefix_len, is_root, hidden_value,
              token_ids, parents, depth, draft_probs, log_scores, valid, row_hidden, rows, mask,
              next_frontier, in_hidden, in_ids):
    """Add the top-`topk` children of each frontier node, then prepare the next step. Returns F', the
    number of real nodes in the next frontier.

    probs [F, V] f32 draft-vocab probabilities of the frontier's rows; hidden [F, H] their features;
    frontier [F] node idx (is_root: the tree is empty and the one row is the root's); target_ids [V]
    the target id of each draft token; first: the first new node's idx; num_slots: tree key slots
    before this step's F; hidden_value: the mask's value of a slot not visible. The node arrays
    ([N]: token_ids, parents, depth, draft_probs, log_scores, valid) get nodes first .. first + F * topk - 1,
    topk per row in order; row_hidden [N / topk, H] gets the rows' features, row first / topk + i for row i
    (every forward row proposes topk children, so node v's features are row v // topk's).
    rows [N, slots] f32 each node's visibility of the tree slots; mask [topk, prefix_len + slots] f32
    the frontier's attention rows (0 visible, else hidden), as the forward just used them.
    Outputs: next_frontier [topk] (the top-`topk` new nodes by score, ties to the earlier node, -1 for
    those scoring 0; every child of the root), and for its F' real nodes the next forward's inputs:
    in_hidden [topk, H], in_ids [topk] and mask rows 0..F'-1 over the slots num_slots + F + F'.
    """
    F, V = probs.shape
    width = num_slots + F  # the slots this step's children inherit: their ancestors' and their parents' own
    chosen = np.empty(topk, dtype=np.int64)
    for i in range(F):
        row_hidden[first // topk + i, :] = hidden[i, :]
        parent = frontier[i]
        base_log = np.float32(0.0) if is_root else log_scores[parent]
        base_depth = 0 if is_root else depth[parent]
        _top_indices(probs[i], topk, chosen)
        for j in range(topk):
            v = first + i * topk + j
            p = probs[i, chosen[j]]
            token_ids[v] = target_ids[chosen[j]]
            parents[v] = -1 if is_root else parent
            depth[v] = base_depth + 1
            draft_probs[v] = p
            log_scores[v] = base_log + np.float32(np.log(min(max(p, np.float32(0.0)), np.float32(1.0))))
            valid[v] = True
            if not is_root:  # a child sees what its parent saw (the root's children: no tree slot yet)
                rows[v, :width] = mask[i, prefix_len:prefix_len + width]
    count = F * topk
    if is_root:
        for k in range(topk):
            next_frontier[k] = first + k
    else:
        _next_frontier(log_scores[first:first + count], first, next_frontier)
    slots = num_slots if is_root else width  # slots after this step (the root's forward wrote none)
    n_next = 0
    while n_next < topk and next_frontier[n_next] >= 0:  # the real nodes come first
        n_next += 1
    if prefix_len + slots + n_next > mask.shape[1]:
        return n_next  # the last step: no slots left for another forward
    for k in range(n_next):
        v = next_frontier[k]
        in_hidden[k, :] = row_hidden[v // topk, :]
        in_ids[k] = token_ids[v]
        mask[k, prefix_len:prefix_len + slots + n_next] = hidden_value
        mask[k, prefix_len:prefix_len + slots] = rows[v, :slots]
        mask[k, prefix_len + slots + k] = 0.0  # its own key
    return n_next


def _next_frontier(child_log, offset, out):
    """out [k] = offset + the k best children by score (stable: ties to the earlier child), -1 where
    a child scores 0 (-inf) or none is left."""
    k, m = out.shape[0], child_log.shape[0]
    taken = np.zeros(m, dtype=np.bool_)
    for r in range(k):
        best = -1
        for c in range(m):
            if not taken[c] and child_log[c] > -np.inf and (best < 0 or child_log[c] > child_log[best]):
                best = c
        if best < 0:
            out[r] = -1
        else:
            taken[best] = True
            out[r] = offset + best
