"""Selection algorithms on plain tensors: the reference that every kernel
(Triton, CUDA C++, TensorRT plugin) is tested against.

- `evict_select`: EVICT (utility-guided truncation). Given node scores already in
  score order, S_k = prefix sums, pick k* = argmax_{0<=k<=K} (1 + S_k) / C(k).
- `greedy_expert_select`: EcoSpec-style greedy growth of a parent-closed node set.
  Each round picks, among unselected nodes whose parent is selected (or is the
  root), the one maximising score(v) / (token_cost + expert_cost * new(v)), where
  new(v) = |E_path(v) \\ B| counts (layer, expert) pairs of v's root->v path not
  yet in the expert buffer B; then B |= E_path(v). With marginal=False, B stays
  at its initial value (the paper's "global cost" ablation).
  EcoSpec: token_cost = eps, expert_cost = 1. Joint: token and expert cost from
  the fitted cost model. Ties go to the lowest node index. On the CPU without a placement, the greedy
  and the path sets run as compiled loops (greedy_host.py; this numpy path is their reference).
  Under expert parallelism (a `placement`, see placement.py) new(v) and U_j count
  U_max, each MoE layer's busiest rank summed over layers, instead of the global union.
- `joint_prefix`: stop a greedy order where (1 + S_j) / (c0 + c_tok*j + c_exp*U_j)
  peaks, U_j = unique (layer, expert) pairs after j nodes (root included).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .greedy_host import compiled_greedy
from .placement import ExpertPlacement


@dataclass(frozen=True)
class GreedyOrder:
    node_idx: torch.Tensor  # [B, M] int64 nodes in the order chosen, -1 pad
    num_selected: torch.Tensor  # [B] int64 nodes chosen (<= M)
    cu_scores: torch.Tensor  # [B, M+1] float64 S_j = sum of the first j scores
    unique_experts: torch.Tensor  # [B, M+1] int64 U_j = |buffer| after j nodes (root's experts included)


def evict_select(
    sorted_scores: torch.Tensor, num_valid: torch.Tensor, cost_table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EVICT's k* per request.

    sorted_scores: [B, N] node scores in score order (entries past num_valid ignored);
    num_valid: [B] int64; cost_table: [K+1] C(k) in seconds, k = 0..K.
    Returns (k* [B] int64, expected tokens 1 + S_k* [B] float64, C(k*) [B] float64).
    Only k <= min(num_valid, K, N) is considered; ties go to the smallest k.
    """
    device = sorted_scores.device
    k_star, expected, cost = evict_select_host(sorted_scores.detach().cpu().double().numpy(),
                                               num_valid.detach().cpu().numpy(), cost_table.detach().cpu().double().numpy())
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    return to(k_star), to(expected), to(cost)


def evict_select_host(scores: np.ndarray, n_valid: np.ndarray, cost: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`evict_select` on numpy arrays: scores [B, N] float64 in score order, n_valid [B], cost [K+1] float64."""
    B, N = scores.shape
    K = min(N, cost.shape[0] - 1)
    ks = np.arange(K + 1)
    live = ks[None, :] <= n_valid[:, None]  # [B, K+1]
    expected = 1.0 + np.concatenate([np.zeros((B, 1)), np.cumsum(np.where(live[:, 1:], scores[:, :K], 0.0), 1)], 1)
    utility = np.where(live, expected / cost[None, : K + 1], -np.inf)
    k_star = utility.argmax(1)  # first maximum
    rows = np.arange(B)
    return k_star.astype(np.int64), expected[rows, k_star], cost[k_star]


def path_bits(node_bits: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """[B, N, W] E_path(v): union of the node sets on each root->v path."""
    return torch.from_numpy(_path_bits_np(node_bits.cpu().numpy(), parents.cpu().numpy(), depth.cpu().numpy())).to(
        node_bits.device)


def _path_bits_np(bits: np.ndarray, parents: np.ndarray, depth: np.ndarray) -> np.ndarray:
    kernels = compiled_greedy()
    if kernels is not None:
        out = np.empty_like(bits)
        for b in range(bits.shape[0]):
            kernels[1](bits[b], parents[b], depth[b], out[b])
        return out
    return _path_bits_reference(bits, parents, depth)


def _path_bits_reference(bits: np.ndarray, parents: np.ndarray, depth: np.ndarray) -> np.ndarray:
    out = bits.copy()
    max_depth = int(depth.max()) if depth.size else 0
    for d in range(2, max_depth + 1):  # depth-1 nodes hang from the root: their path is themselves
        b, i = np.nonzero(depth == d)
        out[b, i] |= out[b, parents[b, i]]  # parents at depth d-1 are final already
    return out


def greedy_expert_select(
    scores: torch.Tensor,
    parents: torch.Tensor,
    valid: torch.Tensor,
    traj_bits: torch.Tensor,
    root_bits: torch.Tensor | None,
    max_nodes: int,
    token_cost: float,
    expert_cost: float,
    marginal: bool = True,
    placement: ExpertPlacement | None = None,
) -> GreedyOrder:
    """Greedy parent-closed selection by score / (token_cost + expert_cost * new experts).

    scores/parents/valid: [B, N]; traj_bits: [B, N, W] path expert sets (see path_bits);
    root_bits: [B, W] the root token's experts (initial buffer) or None.
    placement: which EP rank holds each (layer, expert), or None (one device): with one,
    "new experts" and U_j count U_max (each layer's busiest rank, summed over layers).
    Stops after max_nodes picks or when no candidate is left.
    """
    if max_nodes < 0:
        raise ValueError(f"max_nodes must be >= 0, got {max_nodes}")
    if token_cost < 0 or expert_cost < 0 or token_cost + expert_cost <= 0:
        raise ValueError(f"token_cost and expert_cost must be >= 0 and not both 0, got {token_cost}, {expert_cost}")
    B, N = scores.shape
    M = min(max_nodes, N)
    order = np.full((B, M), -1, dtype=np.int64)
    counts = np.zeros(B, dtype=np.int64)
    cu = np.zeros((B, M + 1), dtype=np.float64)
    uniq = np.zeros((B, M + 1), dtype=np.int64)
    s_np = scores.detach().double().cpu().numpy()
    p_np = parents.detach().cpu().numpy()
    v_np = valid.detach().cpu().numpy()
    bits = traj_bits.detach().cpu().contiguous().numpy().view(np.uint64)
    root = root_bits.detach().cpu().contiguous().numpy().view(np.uint64) if root_bits is not None else None
    # compiled: one loop per request; its division needs positive denominators (no placement: U itself)
    kernels = compiled_greedy() if placement is None and token_cost > 0 else None
    for b in range(B):
        buf = root[b].copy() if root is not None else np.zeros(bits.shape[2], dtype=np.uint64)
        if kernels is not None:
            counts[b] = kernels[0](s_np[b], p_np[b], v_np[b], bits[b], buf, M, float(token_cost),
                                   float(expert_cost), bool(marginal), order[b], cu[b], uniq[b])
        else:
            counts[b], _ = _greedy_one(s_np[b], p_np[b], v_np[b], bits[b], buf, M, token_cost, expert_cost, marginal,
                                       order[b], cu[b], uniq[b], placement)
    return GreedyOrder(
        node_idx=torch.from_numpy(order).to(scores.device),
        num_selected=torch.from_numpy(counts).to(scores.device),
        cu_scores=torch.from_numpy(cu).to(scores.device),
        unique_experts=torch.from_numpy(uniq).to(scores.device),
    )


def _greedy_one(scores, parents, valid, bits, buf, M, token_cost, expert_cost, marginal, order, cu, uniq, placement=None):
    """One request of greedy_expert_select (numpy, writes into order/cu/uniq)."""
    N = len(scores)
    children = [[] for _ in range(N + 1)]  # children[N] = the root's children
    for i in np.flatnonzero(valid):
        children[parents[i] if parents[i] >= 0 else N].append(i)
    is_cand = np.zeros(N, dtype=bool)
    is_cand[children[N]] = True
    union = buf.copy()
    ref = buf  # what new experts are counted against: the growing union (marginal) or the initial buffer
    uniq[0] = _expert_count(union, placement)
    n = 0
    while n < M:
        cand = np.flatnonzero(is_cand)  # ascending, so argmax's first maximum is the lowest index
        if cand.size == 0:
            break
        new = _new_experts(bits[cand], ref, placement)
        v = cand[int(np.argmax(scores[cand] / (token_cost + expert_cost * new)))]
        is_cand[v] = False
        is_cand[children[v]] = True
        union |= bits[v]
        if marginal:
            ref = union
        order[n] = v
        cu[n + 1] = cu[n] + scores[v]
        n += 1
        uniq[n] = _expert_count(union, placement)
    cu[n + 1 :] = cu[n]
    uniq[n + 1 :] = uniq[n]
    return n, uniq


def _expert_count(words: np.ndarray, placement: ExpertPlacement | None) -> int:
    """|U| on one device, U_max under EP."""
    if placement is None:
        return int(np.bitwise_count(words).sum())
    return int(placement.busiest_np(words))


def _new_experts(cand_bits: np.ndarray, ref: np.ndarray, placement: ExpertPlacement | None) -> np.ndarray:
    """[C] cost growth of adding each candidate's path set [C, W] to `ref` [W]."""
    if placement is None:
        return np.bitwise_count(cand_bits & ~ref).sum(1)
    return placement.busiest_np(ref[None, :] | cand_bits) - placement.busiest_np(ref)


def joint_token_cost(c_tok: float, c_exp: float) -> float:
    """The joint greedy's token cost: c_tok kept strictly positive, so a node that wakes
    no new expert is ranked by its score instead of by 0/0 or a division by zero."""
    return max(c_tok, 1e-6 * max(c_exp, 1e-12), 1e-15)


def joint_prefix(
    greedy: GreedyOrder, c0: float, c_tok: float, c_exp: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Utility-peak prefix of a greedy order: j* = argmax_j (1 + S_j) / (c0 + c_tok*j + c_exp*U_j).

    Returns (j* [B] int64, expected tokens [B] float64, predicted cost [B] float64).
    """
    M = greedy.cu_scores.shape[1] - 1
    j = torch.arange(M + 1, device=greedy.cu_scores.device, dtype=torch.float64)
    cost = c0 + c_tok * j[None, :] + c_exp * greedy.unique_experts.double()
    if (cost <= 0).any():
        raise ValueError(f"cost model predicts a non-positive step cost (c0={c0}, c_tok={c_tok}, c_exp={c_exp})")
    expected = 1.0 + greedy.cu_scores
    utility = torch.where(j[None, :] <= greedy.num_selected[:, None], expected / cost, float("-inf"))
    j_star = utility.argmax(1)
    rows = torch.arange(len(j_star), device=j_star.device)
    return j_star, expected[rows, j_star], cost[rows, j_star]
