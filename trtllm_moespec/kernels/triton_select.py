"""Triton kernels for tree selection, one program per request.

`_evict_kernel`: takes the nodes ranked by (valid first, score desc, depth asc, index
asc) from `reference.score_rank_order` (torch stable sorts, on the device: an N x N
comparison inside one program spilled at N = 256 and could not be built past N = 1024),
accumulates S_k in that order (float64, one add per k, the same order as the reference's
cumsum) and keeps the first k in 0..K_eff maximising (1 + S_k) / C(k).

`_greedy_kernel`: EcoSpec / joint greedy growth of a parent-closed set. Per-node
expert sets arrive as int64 words ([N, W], bit = layer * num_experts + expert),
processed in tiles of NODE_CHUNK nodes x WB words so 94 x 256 experts (376 words) and
trees of thousands of nodes fit (the per-node counts of a pass go through a [B, N]
workspace row: a whole-tree tile spilled from registers at 256 nodes). In the
marginal modes new(v) = |node(v) \\ B| (v's parent is selected, so its path is
already inside the buffer B: the same number as |E_path(v) \\ B|), B = root | OR of
the selected nodes' sets, kept in a [B, W] workspace row (stored after each pick,
then a block barrier). In the static mode
(`ecospec_global`) |E_path(v) \\ root| is computed once by walking ancestors.
Keys are float64 score / (token_cost + expert_cost * new) with no fused
multiply-add (launch with enable_fp_fusion=False), argmax ties to the lowest index.

Popcount is SWAR on int64 words (shifts and masks only), which runs the same in
the interpreter (TRITON_INTERPRET=1) and on the GPU.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from .reference import score_rank_order
from .spec import Mode, greedy_costs

WORD_CHUNK = 32  # int64 words per tile column block
NODE_CHUNK = 32  # nodes per tile row block: a [NODE_CHUNK, WORD_CHUNK] int64 tile is 8 KB over a program's threads


@triton.jit
def _popcount64(x):
    """Set bits per int64 element (SWAR; arithmetic shifts are harmless under these masks)."""
    x = x - ((x >> 1) & 0x5555555555555555)
    x = (x & 0x3333333333333333) + ((x >> 2) & 0x3333333333333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0F
    x = x + (x >> 8)
    x = x + (x >> 16)
    x = x + (x >> 32)
    return x & 0x7F


@triton.jit
def _root_words(root_ptr, b, W, w, USE_ROOT: tl.constexpr):
    """Words w of request b's root expert set (zeros when the mode has no root)."""
    if USE_ROOT:
        return tl.load(root_ptr + b * W + w, mask=w < W, other=0)
    else:
        return tl.zeros_like(w).to(tl.int64)


@triton.jit
def _evict_kernel(
    scores_ptr, order_ptr, valid_ptr, cost_ptr,  # [B, N] f32/f64, [B, N] i64 node idx by rank, [B, N] u8, [K+1] f64
    out_idx_ptr, out_count_ptr, out_expected_ptr, out_cost_ptr,  # [B, budget] i64, [B] i64, [B] f64, [B] f64
    N, K_eff, budget,
    NB: tl.constexpr, MB: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs_i = tl.arange(0, NB)
    in_i = offs_i < N
    v_i = tl.load(valid_ptr + b * N + offs_i, mask=in_i, other=0) != 0
    num_valid = tl.sum((v_i & in_i).to(tl.int32), axis=0)
    k_max = tl.minimum(num_valid, K_eff)

    cu = tl.zeros([], tl.float64)
    best_k = tl.zeros([], tl.int64)
    best_exp = tl.full([], 1.0, tl.float64)
    best_cost = tl.load(cost_ptr).to(tl.float64)
    best_util = best_exp / best_cost
    for k in range(1, K_eff + 1):  # K_eff <= N: rank k - 1 is a node
        node = tl.load(order_ptr + b * N + k - 1)
        cu = cu + tl.load(scores_ptr + b * N + node).to(tl.float64)
        expected = 1.0 + cu
        cost_k = tl.load(cost_ptr + k).to(tl.float64)
        util = expected / cost_k
        better = (k <= k_max) & (util > best_util)
        best_util = tl.where(better, util, best_util)
        best_k = tl.where(better, k, best_k)
        best_exp = tl.where(better, expected, best_exp)
        best_cost = tl.where(better, cost_k, best_cost)

    offs_r = tl.arange(0, MB)
    node_of_rank = tl.load(order_ptr + b * N + offs_r, mask=offs_r < N, other=-1)
    out = tl.where(offs_r < best_k, node_of_rank.to(tl.int64), -1)
    tl.store(out_idx_ptr + b * budget + offs_r, out, mask=offs_r < budget)
    tl.store(out_count_ptr + b, best_k)
    tl.store(out_expected_ptr + b, best_exp)
    tl.store(out_cost_ptr + b, best_cost)


@triton.jit(do_not_specialize=["token_cost_bits", "expert_cost_bits", "c0_bits", "c_tok_bits", "c_exp_bits"])
def _greedy_kernel(
    scores_ptr, parents_ptr, valid_ptr, depth_ptr,  # [B, N]
    bits_ptr, root_ptr, buffer_ptr, count_ptr,  # [B, N, W] i64 node sets, [B, W] i64 root set; workspaces [B, W], [B, N] i64
    out_idx_ptr, out_count_ptr, out_expected_ptr, out_cost_ptr,
    N, W, M, budget,
    token_cost_bits, expert_cost_bits, c0_bits, c_tok_bits, c_exp_bits,  # float64 scalars as int64 bit patterns
    NB: tl.constexpr, WB: tl.constexpr, MB: tl.constexpr, NC: tl.constexpr,
    MARGINAL: tl.constexpr, USE_ROOT: tl.constexpr, JOINT: tl.constexpr,
):
    # Python floats would arrive as fp32: the float64 scalars travel as their bits.
    token_cost = token_cost_bits.to(tl.int64).to(tl.float64, bitcast=True)
    expert_cost = expert_cost_bits.to(tl.int64).to(tl.float64, bitcast=True)
    c0 = c0_bits.to(tl.int64).to(tl.float64, bitcast=True)
    c_tok = c_tok_bits.to(tl.int64).to(tl.float64, bitcast=True)
    c_exp = c_exp_bits.to(tl.int64).to(tl.float64, bitcast=True)
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, NB)
    in_n = offs < N
    s = tl.load(scores_ptr + b * N + offs, mask=in_n, other=0.0).to(tl.float64)
    par = tl.load(parents_ptr + b * N + offs, mask=in_n, other=-1).to(tl.int64)
    val = (tl.load(valid_ptr + b * N + offs, mask=in_n, other=0) != 0) & in_n
    offs_w = tl.arange(0, WB)
    offs_c = tl.arange(0, NC)

    # U_0 = |root|; B starts at the root's set.
    u = tl.zeros([], tl.int64)
    for c in range(0, W, WB):
        w = c + offs_w
        in_w = w < W
        root_c = _root_words(root_ptr, b, W, w, USE_ROOT)
        u += tl.sum(_popcount64(root_c), axis=0)
        if MARGINAL:
            tl.store(buffer_ptr + b * W + w, root_c, mask=in_w)
    static_new = tl.zeros([NB], tl.int64)
    if not MARGINAL:  # the static mode: |E_path(v) \ root| per node, once, a block of nodes at a time
        max_depth = tl.max(tl.load(depth_ptr + b * N + offs, mask=in_n, other=0).to(tl.int64), axis=0)
        for n0 in range(0, N, NC):
            nodes = n0 + offs_c
            in_c = nodes < N
            par_c = tl.load(parents_ptr + b * N + nodes, mask=in_c, other=-1).to(tl.int64)
            total = tl.zeros([NC], tl.int64)
            for c in range(0, W, WB):
                w = c + offs_w
                in_w = w < W
                root_c = _root_words(root_ptr, b, W, w, USE_ROOT)
                acc = tl.load(bits_ptr + (b * N + nodes[:, None]) * W + w[None, :],
                              mask=in_c[:, None] & in_w[None, :], other=0)
                p = par_c
                for _ in range(1, max_depth):
                    has_p = (p >= 0) & (p < N) & in_c  # a parent past the tree is not read
                    p_safe = tl.where(has_p, p, 0)
                    acc = acc | tl.load(bits_ptr + (b * N + p_safe[:, None]) * W + w[None, :],
                                        mask=has_p[:, None] & in_w[None, :], other=0)
                    p = tl.where(has_p, tl.load(parents_ptr + b * N + p_safe, mask=has_p, other=-1).to(tl.int64), -1)
                total += tl.sum(_popcount64(acc & ~root_c[None, :]), axis=1)
            tl.store(count_ptr + b * N + nodes, total, mask=in_c)
        tl.debug_barrier()
        static_new = tl.load(count_ptr + b * N + offs, mask=in_n, other=0)
    tl.debug_barrier()

    selected = offs < 0  # all False
    parent_ok = par < 0
    order = tl.full([MB], -1, tl.int64)
    offs_m = tl.arange(0, MB)
    cu = tl.zeros([], tl.float64)
    n_sel = tl.zeros([], tl.int64)
    best_util = tl.full([], float("-inf"), tl.float64)
    best_j = tl.zeros([], tl.int64)
    best_exp = tl.full([], 1.0, tl.float64)
    best_cost = tl.full([], float("nan"), tl.float64)
    if JOINT:
        best_cost = (c0 + c_tok * 0.0) + c_exp * u.to(tl.float64)
        best_util = 1.0 / best_cost
    for n in range(0, M):
        cand = val & ~selected & parent_ok
        new = static_new
        if MARGINAL:  # new(v) = |node(v) \ B|, a block of nodes at a time, gathered through the workspace row
            for n0 in range(0, N, NC):
                nodes = n0 + offs_c
                in_c = nodes < N
                total = tl.zeros([NC], tl.int64)
                for c in range(0, W, WB):
                    w = c + offs_w
                    in_w = w < W
                    tile = tl.load(bits_ptr + (b * N + nodes[:, None]) * W + w[None, :],
                                   mask=in_c[:, None] & in_w[None, :], other=0)
                    buf = tl.load(buffer_ptr + b * W + w, mask=in_w, other=0)
                    total += tl.sum(_popcount64(tile & ~buf[None, :]), axis=1)
                tl.store(count_ptr + b * N + nodes, total, mask=in_c)
            tl.debug_barrier()
            new = tl.load(count_ptr + b * N + offs, mask=in_n, other=0)
        key = s / (token_cost + expert_cost * new.to(tl.float64))
        key = tl.where(cand, key, float("-inf"))
        top = tl.max(key, axis=0)
        v = tl.min(tl.where(cand & (key == top), offs, NB), axis=0)
        has = tl.sum(cand.to(tl.int32), axis=0) > 0
        pick = has & (offs == v)
        selected = selected | pick
        parent_ok = parent_ok | (has & (par == v))
        order = tl.where(has & (offs_m == n), v.to(tl.int64), order)
        cu = cu + tl.sum(tl.where(pick, s, 0.0), axis=0)
        u = u + tl.sum(tl.where(pick, new, 0), axis=0)
        n_sel = n_sel + has.to(tl.int64)
        if MARGINAL:  # B |= node(v): the buffer lives in the workspace row of this request
            v_safe = tl.where(has, v, 0).to(tl.int64)
            w_lim = tl.where(has, W, 0)  # no pick: nothing to add
            for c in range(0, W, WB):
                w = c + offs_w
                in_w = w < w_lim
                buf = tl.load(buffer_ptr + b * W + w, mask=in_w, other=0)
                buf = buf | tl.load(bits_ptr + (b * N + v_safe) * W + w, mask=in_w, other=0)
                tl.store(buffer_ptr + b * W + w, buf, mask=in_w)
            tl.debug_barrier()
        if JOINT:
            cost_j = (c0 + c_tok * n_sel.to(tl.float64)) + c_exp * u.to(tl.float64)
            util = (1.0 + cu) / cost_j
            better = has & (util > best_util)
            best_util = tl.where(better, util, best_util)
            best_j = tl.where(better, n_sel, best_j)
            best_exp = tl.where(better, 1.0 + cu, best_exp)
            best_cost = tl.where(better, cost_j, best_cost)
    if not JOINT:
        best_j = n_sel
        best_exp = 1.0 + cu
    out = tl.where(offs_m < best_j, order, -1)
    tl.store(out_idx_ptr + b * budget + offs_m, out, mask=offs_m < budget)
    tl.store(out_count_ptr + b, best_j)
    tl.store(out_expected_ptr + b, best_exp)
    tl.store(out_cost_ptr + b, best_cost)


def float_bits(x: float) -> int:
    """The IEEE-754 float64 bit pattern of x as a signed 64-bit int."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def select_tree_triton(
    scores: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, depth: torch.Tensor,
    node_bits: torch.Tensor, root_bits: torch.Tensor, cost_table: torch.Tensor,
    mode: Mode, budget: int, c0: float, c_tok: float, c_exp: float, eps: float, word_chunk: int = WORD_CHUNK,
    node_chunk: int = NODE_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the kernels (inputs already checked by spec.check_inputs); returns the op's 4 outputs.

    word_chunk / node_chunk: int64 words / nodes per tile step (powers of two; tests vary them to cover
    the chunk loops).
    Allocates only outputs and never syncs, so it can run under CUDA graph capture.
    """
    for name, chunk in (("word_chunk", word_chunk), ("node_chunk", node_chunk)):
        if chunk < 1 or chunk & (chunk - 1):
            raise ValueError(f"{name} must be a power of two, got {chunk}")
    B, N = scores.shape
    W = node_bits.shape[2]
    dev = scores.device
    node_idx = torch.empty(B, budget, dtype=torch.int64, device=dev)
    count = torch.empty(B, dtype=torch.int64, device=dev)
    expected = torch.empty(B, dtype=torch.float64, device=dev)
    cost = torch.empty(B, dtype=torch.float64, device=dev)
    if B == 0:
        return node_idx, count, expected, cost
    scores, parents, depth = scores.contiguous(), parents.contiguous(), depth.contiguous()
    valid = valid.contiguous().view(torch.uint8)
    NB, MB = _pow2(N), _pow2(budget)
    if mode == Mode.EVICT:
        table = cost_table.contiguous().double()
        k_eff = min(budget, table.shape[0] - 1, N)
        order = score_rank_order(scores, valid.bool(), depth).contiguous()  # [B, N] torch sorts, no host read
        _evict_kernel[(B,)](scores, order, valid, table, node_idx, count, expected, cost,
                            N, k_eff, budget, NB=NB, MB=MB, num_warps=4, enable_fp_fusion=False)
        return node_idx, count, expected, cost
    g = greedy_costs(mode, c_tok, c_exp, eps)
    bits = node_bits.contiguous()
    root = root_bits.contiguous()
    buffer = torch.empty(B, max(W, 1), dtype=torch.int64, device=dev)  # expert buffer B per request
    counts = torch.empty(B, max(N, 1), dtype=torch.int64, device=dev)  # new experts per node, per pass
    _greedy_kernel[(B,)](
        scores, parents, valid, depth, bits, root, buffer, counts, node_idx, count, expected, cost,
        N, W, min(budget, N), budget,
        float_bits(g.token_cost), float_bits(g.expert_cost), float_bits(c0), float_bits(c_tok), float_bits(c_exp),
        NB=NB, WB=min(word_chunk, _pow2(W)), MB=MB, NC=min(node_chunk, NB), MARGINAL=g.marginal,
        USE_ROOT=g.use_root, JOINT=mode == Mode.JOINT, num_warps=4, enable_fp_fusion=False,
    )
    return node_idx, count, expected, cost
