"""The acceptance head's local probabilities of one CPU tree as one compiled call.

`AcceptanceHead.local` scores a drafted tree with ~10 small torch operations over features made in
numpy and Python (sibling ranks, the copy features' dict look-ups): ~1.2 ms a speculative step on
moespec-base's CPU, against ~0.1 ms for the calibrated values' compiled path, enough to cancel what its
better values gain (issue 25, benchmarks/results/base/values_head_ab_t0.md). `head_local` does the same
arithmetic in one numba-compiled loop over the valid nodes: the sibling rank (core/values_host.py), the
hidden projection once per parent (its children share the hidden of the forward that proposed them), then per
node the token, scalar, depth and rank terms, SiLU, the output dot product and the sigmoid. The copy
features come from the request's compiled n-gram tables (core/followers_host.py).

The reference is `AcceptanceHead.local`'s torch path; tests/models/test_acceptance_head.py checks they
agree to float rounding. Values only choose which nodes are verified, never how: output is unchanged
either way. numba is optional: without it (or with MOESPEC_FUSED_VALUES=0) the torch path runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core.host_jit import compiled_kernels
from ..core.values_host import sibling_ranks  # noqa: F401  (a helper head_local calls, compiled with it)


def compiled_head():
    """(head_local,) compiled, or None when numba is missing or MOESPEC_FUSED_VALUES=0."""
    return compiled_kernels("MOESPEC_FUSED_VALUES", globals(), ("head_local",), helpers=("sibling_ranks",),
                            boundscheck=False)  # head_local checks its own indices


@dataclass(frozen=True)
class HostHeadWeights:
    """The head's weights as contiguous float32 arrays laid out for `head_local` (I: its width)."""

    norm: np.ndarray  # [H] hidden RMSNorm weight
    hidden_in: np.ndarray  # [H, I] (transposed: the inner loop runs over I)
    token_part: np.ndarray  # [V, I] every token's embedding contribution
    scalar_in: np.ndarray  # [S, I] (transposed)
    scalar_bias: np.ndarray  # [I]
    depth_bias: np.ndarray  # [max_depth + 1, I]
    rank_bias: np.ndarray  # [max_rank, I]
    out: np.ndarray  # [I]
    out_bias: float
    eps: float

    @staticmethod
    def of(model, token_part: torch.Tensor) -> "HostHeadWeights":
        """From an `AcceptanceHeadModel` and its bound token table [V, I]."""
        def host(t: torch.Tensor) -> np.ndarray:
            return np.ascontiguousarray(t.detach().float().cpu().numpy())

        return HostHeadWeights(host(model.hidden_norm.weight), host(model.hidden_in.weight.T), host(token_part),
                               host(model.scalar_in.weight.T), host(model.scalar_in.bias),
                               host(model.depth_bias.weight), host(model.rank_bias.weight), host(model.out.weight[0]),
                               float(model.out.bias.detach()[0]), float(model.cfg.rms_norm_eps))


def head_local(tokens, parents, depth, q, log_score, valid, copies, hidden, row_div, norm, eps, hidden_in,
               token_part, scalar_in, scalar_bias, depth_bias, rank_bias, w_out, out_bias, out):
    """out [N] float32: the head's sigmoid for each valid node, 0 for the others; False when a parent does
    not come before its child, or an index or shape is out of range (the torch path then runs, and names it).

    tokens, parents, depth [N] int64; q, log_score [N] float32 (draft probability, raw log path score);
    valid [N] bool; copies [N, 2 * orders] float32 (followers_host.copy_flags); hidden [R, H] float32 the
    drafter's pre-norm hidden of each forward row, node v proposed by row v // row_div (siblings share it, so
    a parent's first valid child's is read). Scalars and clamps as `node_scalars` and
    `AcceptanceHeadModel.logits`.

    Compiled without numba's bounds checks, which halve its speed (its loops over the head's width run
    ~1.5M times a step on moespec-base's trees): every index is checked here instead, the shapes once and
    each node's parent, token and row as it is read."""
    N = tokens.shape[0]
    H, I = hidden_in.shape
    S = scalar_in.shape[0]
    if (min(parents.shape[0], depth.shape[0], q.shape[0], log_score.shape[0], valid.shape[0], copies.shape[0],
            out.shape[0]) < N or copies.shape[1] != S - 2 or row_div < 1 or hidden.shape[1] != H
            or norm.shape[0] != H or token_part.shape[1] != I or scalar_in.shape[1] != I or scalar_bias.shape[0] != I
            or depth_bias.shape[1] != I or rank_bias.shape[1] != I or w_out.shape[0] != I
            or depth_bias.shape[0] < 1 or rank_bias.shape[0] < 1):
        return False
    ranks = np.empty(N, dtype=np.int64)
    if not sibling_ranks(parents, q, valid, ranks):  # also checks every parent comes before its child
        return False
    # hidden_in(hidden_norm(row)), once per parent: siblings come from one forward (slot N: the root's children)
    part = np.zeros((N + 1, I), dtype=np.float32)
    done = np.zeros(N + 1, dtype=np.bool_)
    scalars = np.empty(S, dtype=np.float32)
    pre = np.empty(I, dtype=np.float32)
    for v in range(N):
        out[v] = 0.0
        if not valid[v]:
            continue
        p = N if parents[v] < 0 else parents[v]
        t = tokens[v]
        if t < 0 or t >= token_part.shape[0]:
            return False
        if not done[p]:
            r = v // row_div
            if r >= hidden.shape[0]:
                return False
            square = 0.0
            for h in range(H):
                square += hidden[r, h] * hidden[r, h]
            scale = 1.0 / np.sqrt(square / H + eps)
            for h in range(H):
                x = np.float32(hidden[r, h] * scale) * norm[h]
                for i in range(I):
                    part[p, i] += x * hidden_in[h, i]
            done[p] = True
        scalars[0] = np.log(min(max(q[v], np.float32(1e-8)), np.float32(1.0)))
        scalars[1] = min(max(log_score[v], np.float32(-30.0)), np.float32(0.0))
        scalars[2:] = copies[v]
        d = min(max(depth[v], 0), depth_bias.shape[0] - 1)
        k = min(ranks[v], rank_bias.shape[0] - 1)
        for i in range(I):  # the loops over I are contiguous: vectorised
            pre[i] = part[p, i] + token_part[t, i] + scalar_bias[i] + depth_bias[d, i] + rank_bias[k, i]
        for m in range(S):
            s = scalars[m]
            if s != 0:  # the copy flags are mostly 0
                for i in range(I):
                    pre[i] += s * scalar_in[m, i]
        logit = np.float32(out_bias)
        for i in range(I):  # SiLU in float32 (expf)
            x = pre[i]
            logit += w_out[i] * x / (np.float32(1.0) + np.exp(-x))
        out[v] = np.float32(1.0) / (np.float32(1.0) + np.exp(-logit))
    return True
