"""`joint-batch`: choose draft nodes across all requests of a batch against the batch's
shared expert union (ours; the reference every batched backend is tested against).

In a batched verify forward every MoE layer runs each expert that *any* token of the
batch routes to, so a node's marginal cost is the experts it adds to the union of the
whole batch, not to its own request's. EcoSpec (H200, Qwen3-235B) measures EAGLE-3's
speedup falling to 1.00x at B=4 and below plain decoding at B=8 when each request picks
its tree alone; nobody chose nodes across requests.

Algorithm (greedy by value per marginal cost, stopped at the batch's utility peak):
  U   <- union of every request's root experts (the plain step each request always gets)
  repeat: among the frontier nodes of all requests (children of a root or of a selected
          node, request under its per-request cap), pick v maximising
              score(v) / (c_tok + c_exp * |E_path(v) \\ U|),   U <- U | E_path(v)
  j*  =  argmax_j  (B + S_j) / (c0 + c_tok * j + c_exp * U_j)      (j = 0: decode plainly)
B + S_j counts every request's bonus token plus the scores of the first j nodes; the cost
model (c0, c_tok, c_exp) is the one fitted for this batch size. Ties go to the lowest
(request, node) index, so the result is deterministic. Each request's nodes come out in
pick order, which is parent-closed and ordered (a node becomes a candidate only after its
parent is picked).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .cost import ExpertCostModel
from .select import joint_token_cost


@dataclass(frozen=True)
class BatchSelection:
    node_idx: torch.Tensor  # [B, K] int64 per request, pick order (parent before child), -1 pad
    num_selected: torch.Tensor  # [B] int64
    expected_tokens: float  # B + sum of the selected scores (the whole batch)
    predicted_cost: float  # C(j*, U_j*) seconds for the whole batch step
    unique_experts: int  # U_j*: predicted (layer, expert) pairs the batch wakes


def joint_batch_select(
    scores: torch.Tensor,
    parents: torch.Tensor,
    valid: torch.Tensor,
    traj_bits: torch.Tensor,
    root_bits: torch.Tensor,
    cost: ExpertCostModel,
    max_nodes: int,
    max_nodes_per_request: int,
) -> BatchSelection:
    """Select nodes for a batch of B requests.

    scores/parents/valid: [B, N] draft trees (padded; parent index < child index);
    traj_bits: [B, N, W] int64 path expert sets (core.select.path_bits);
    root_bits: [B, W] int64 each root token's predicted experts;
    cost: C(k, U) for this batch size; max_nodes: cap on the batch's total draft nodes;
    max_nodes_per_request: cap per request (the tree config's max_draft_tokens).
    """
    if max_nodes < 0 or max_nodes_per_request < 0:
        raise ValueError(f"node caps must be >= 0, got {max_nodes} and {max_nodes_per_request}")
    B, N = scores.shape
    if B == 0:
        raise ValueError("joint_batch_select needs at least one request")
    if traj_bits.shape[:2] != (B, N) or root_bits.shape != (B, traj_bits.shape[2]):
        raise ValueError(f"expert sets {tuple(traj_bits.shape)} / roots {tuple(root_bits.shape)} do not match "
                         f"trees [{B}, {N}]")
    token_cost = joint_token_cost(cost.c_tok, cost.c_exp)
    s = scores.detach().double().cpu().numpy().ravel()
    p = parents.detach().cpu().numpy()
    v = valid.detach().cpu().numpy().ravel()
    bits = traj_bits.detach().cpu().contiguous().numpy().view(np.uint64).reshape(B * N, -1)
    union = np.bitwise_or.reduce(root_bits.detach().cpu().contiguous().numpy().view(np.uint64), axis=0)
    # Flat node f = b * N + i; children lists per flat node, plus one root entry per request.
    children: list[list[int]] = [[] for _ in range(B * N + B)]
    flat_parents = p.ravel()
    for f in np.flatnonzero(v):
        b, parent = f // N, flat_parents[f]
        children[b * N + parent if parent >= 0 else B * N + b].append(int(f))
    is_cand = np.zeros(B * N, dtype=bool)
    for b in range(B):
        is_cand[children[B * N + b]] = True
    picked, per_request = [], np.zeros(B, dtype=np.int64)
    cu, uniq = [0.0], [int(np.bitwise_count(union).sum())]
    while len(picked) < max_nodes:
        cand = np.flatnonzero(is_cand & (per_request[np.arange(B * N) // N] < max_nodes_per_request))
        if cand.size == 0:
            break
        new = np.bitwise_count(bits[cand] & ~union).sum(1)
        f = int(cand[int(np.argmax(s[cand] / (token_cost + cost.c_exp * new)))])
        is_cand[f] = False
        is_cand[children[f]] = True
        union |= bits[f]
        picked.append(f)
        per_request[f // N] += 1
        cu.append(cu[-1] + s[f])
        uniq.append(int(np.bitwise_count(union).sum()))
    j = np.arange(len(picked) + 1)
    expected = B + np.asarray(cu)
    predicted = cost.c0 + cost.c_tok * j + cost.c_exp * np.asarray(uniq, dtype=np.float64)
    if (predicted <= 0).any():
        raise ValueError(f"cost model predicts a non-positive step cost ({cost})")
    j_star = int(np.argmax(expected / predicted))  # the first maximum: fewer nodes on ties
    return _per_request(picked[:j_star], B, N, float(expected[j_star]), float(predicted[j_star]), uniq[j_star],
                        scores.device)


def _per_request(picked: list[int], B: int, N: int, expected: float, predicted: float, unique: int,
                 device: torch.device) -> BatchSelection:
    rows: list[list[int]] = [[] for _ in range(B)]
    for f in picked:
        rows[f // N].append(f % N)
    K = max((len(r) for r in rows), default=0)
    node_idx = torch.full((B, K), -1, dtype=torch.int64)
    for b, r in enumerate(rows):
        node_idx[b, : len(r)] = torch.tensor(r, dtype=torch.int64)
    counts = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    return BatchSelection(node_idx.to(device), counts.to(device), expected, predicted, unique)
