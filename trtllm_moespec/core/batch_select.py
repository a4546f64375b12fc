"""`joint-batch` (and the batch variants of evict and ecospec): choose draft nodes across all
requests of a batch against the batch's shared expert union (ours; the reference every
batched backend is tested against).

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

`evict-batch`: the requests' EVICT orders merged by value, cut at argmax (B + S_k) / C_B(k)
(C_B: the profiled C(k) with this batch size's measured intercept, engine/batch_cost.py).
`ecospec-batch`: EcoSpec's greedy on the batch's union with B times its fixed budget.
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
    _check_trees(scores, traj_bits, root_bits, max_nodes, max_nodes_per_request)
    B, N = scores.shape
    picked, cu, uniq = _union_greedy(scores, parents, valid, traj_bits, root_bits,
                                     joint_token_cost(cost.c_tok, cost.c_exp), cost.c_exp, max_nodes,
                                     max_nodes_per_request)
    j = np.arange(len(picked) + 1)
    expected = B + np.asarray(cu)
    predicted = cost.c0 + cost.c_tok * j + cost.c_exp * np.asarray(uniq, dtype=np.float64)
    if (predicted <= 0).any():
        raise ValueError(f"cost model predicts a non-positive step cost ({cost})")
    j_star = int(np.argmax(expected / predicted))  # the first maximum: fewer nodes on ties
    return _per_request([divmod(f, N) for f in picked[:j_star]], B, float(expected[j_star]),
                        float(predicted[j_star]), uniq[j_star], scores.device)


def ecospec_batch_select(
    scores: torch.Tensor,
    parents: torch.Tensor,
    valid: torch.Tensor,
    traj_bits: torch.Tensor,
    root_bits: torch.Tensor,
    eps: float,
    max_nodes: int,
    max_nodes_per_request: int,
) -> BatchSelection:
    """`ecospec-batch`: EcoSpec's greedy (score / (eps + new experts)) on the batch's shared union,
    taking `max_nodes` nodes in all (EcoSpec's fixed budget, B times over: nodes go to the requests
    where they are cheap and likely, at most `max_nodes_per_request` each); no cost model, no stop.
    Arguments as `joint_batch_select`; predicted_cost is nan (nothing is priced)."""
    if not eps > 0:
        raise ValueError(f"ecospec eps must be > 0, got {eps}")
    _check_trees(scores, traj_bits, root_bits, max_nodes, max_nodes_per_request)
    B, N = scores.shape
    picked, cu, uniq = _union_greedy(scores, parents, valid, traj_bits, root_bits, eps, 1.0, max_nodes,
                                     max_nodes_per_request)
    return _per_request([divmod(f, N) for f in picked], B, float(B + cu[-1]), float("nan"), uniq[-1],
                        scores.device)


def evict_batch_select(order: torch.Tensor, scores: torch.Tensor, cost: np.ndarray, max_nodes: int) -> BatchSelection:
    """`evict-batch`: EVICT's top nodes by value across the requests, cut at the batch's utility peak.

    order: [B, N] each request's nodes in its EVICT order (every prefix parent-closed), -1 pad;
    scores: [B, N] their values in that order; cost: [M+1] C_B(k) seconds for k = 0..M draft nodes
    in the whole batch (this batch size's cost); max_nodes: cap on the batch's total nodes.
    The requests' orders are merged by value (each request's own order kept, so every request's
    share is a prefix of its order: parent-closed), then k* = argmax_k (B + S_k) / C_B(k).
    """
    if max_nodes < 0:
        raise ValueError(f"node cap must be >= 0, got {max_nodes}")
    if order.shape != scores.shape or order.dim() != 2 or order.shape[0] == 0:
        raise ValueError(f"order {tuple(order.shape)} and scores {tuple(scores.shape)} must both be [B >= 1, N]")
    cost = np.asarray(cost, dtype=np.float64)
    if cost.ndim != 1 or cost.size == 0 or (cost <= 0).any() or not np.isfinite(cost).all():
        raise ValueError("the batch cost table must be a non-empty vector of positive seconds")
    o = order.detach().cpu().numpy()
    s = scores.detach().cpu().double().numpy()
    B, N = o.shape
    length = (o >= 0).sum(1)
    taken, merged, cu = np.zeros(B, dtype=np.int64), [], [0.0]  # merged: (request, node) in pick order
    cap = min(max_nodes, cost.size - 1, int(length.sum()))
    while len(merged) < cap:  # the request whose next node has the highest value (lowest request on ties)
        heads = np.where(taken < length, s[np.arange(B), np.minimum(taken, N - 1)], -np.inf)
        b = int(np.argmax(heads))
        merged.append((b, int(o[b, taken[b]])))
        cu.append(cu[-1] + heads[b])
        taken[b] += 1
    expected = B + np.asarray(cu)
    k_star = int(np.argmax(expected / cost[: len(cu)]))  # the first maximum: fewer nodes on ties
    return _per_request(merged[:k_star], B, float(expected[k_star]), float(cost[k_star]), 0, order.device)


def _check_trees(scores, traj_bits, root_bits, max_nodes: int, max_nodes_per_request: int) -> None:
    if max_nodes < 0 or max_nodes_per_request < 0:
        raise ValueError(f"node caps must be >= 0, got {max_nodes} and {max_nodes_per_request}")
    B, N = scores.shape
    if B == 0:
        raise ValueError("a batch selection needs at least one request")
    if traj_bits.shape[:2] != (B, N) or root_bits.shape != (B, traj_bits.shape[2]):
        raise ValueError(f"expert sets {tuple(traj_bits.shape)} / roots {tuple(root_bits.shape)} do not match "
                         f"trees [{B}, {N}]")


def _union_greedy(scores, parents, valid, traj_bits, root_bits, token_cost: float, expert_cost: float,
                  max_nodes: int, max_nodes_per_request: int) -> tuple[list[int], list[float], list[int]]:
    """Greedy by score / (token_cost + expert_cost * new experts on the batch's union): the flat
    nodes picked (b * N + i, pick order), cumulative scores and union sizes after each pick."""
    B, N = scores.shape
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
        f = int(cand[int(np.argmax(s[cand] / (token_cost + expert_cost * new)))])
        is_cand[f] = False
        is_cand[children[f]] = True
        union |= bits[f]
        picked.append(f)
        per_request[f // N] += 1
        cu.append(cu[-1] + s[f])
        uniq.append(int(np.bitwise_count(union).sum()))
    return picked, cu, uniq


def _per_request(picked: list[tuple[int, int]], B: int, expected: float, predicted: float, unique: int,
                 device: torch.device) -> BatchSelection:
    """picked: (request, node) pairs in pick order -> per-request node lists in that order."""
    rows: list[list[int]] = [[] for _ in range(B)]
    for b, node in picked:
        rows[b].append(node)
    K = max((len(r) for r in rows), default=0)
    node_idx = torch.full((B, K), -1, dtype=torch.int64)
    for b, r in enumerate(rows):
        node_idx[b, : len(r)] = torch.tensor(r, dtype=torch.int64)
    counts = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    return BatchSelection(node_idx.to(device), counts.to(device), expected, predicted, unique)
