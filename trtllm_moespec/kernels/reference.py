"""CPU implementation of `moespec::select_tree` through the core reference.

It calls the very functions the policies call (core.select: evict_select,
path_bits, greedy_expert_select, joint_prefix), so the op on CPU and the policies
agree by construction, and every kernel is tested against this module.
"""

from __future__ import annotations

import math

import torch

from ..core.policies import Selection
from ..core.select import evict_select, greedy_expert_select, joint_prefix, path_bits
from .spec import Mode, check_inputs, greedy_costs, parse_mode


def score_rank_order(scores: torch.Tensor, valid: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """[B, N] node idx sorted by (valid first, score desc, depth asc, index asc).

    core.tree.score_order with the float scores as the key instead of log-scores.
    """
    return rank_order(-scores.double(), valid, depth)


def rank_order(neg_key: torch.Tensor, valid: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """[B, N] node idx sorted by (valid first, neg_key asc, depth asc, index asc): stable sorts from the
    least significant key up, torch ops only (no host read, any device)."""
    B, N = neg_key.shape
    order = torch.arange(N, device=neg_key.device).expand(B, N)
    key_depth = torch.where(valid, depth.long(), N + 1)
    order = order.gather(1, key_depth.gather(1, order).argsort(dim=1, stable=True))
    key_score = torch.where(valid, neg_key, math.inf)
    order = order.gather(1, key_score.gather(1, order).argsort(dim=1, stable=True))
    key_valid = (~valid).to(torch.int8)
    return order.gather(1, key_valid.gather(1, order).argsort(dim=1, stable=True))


def _prefix(order: torch.Tensor, k: torch.Tensor, scores: torch.Tensor, cost: torch.Tensor | None,
            budget: int) -> Selection:
    """The first k[b] entries of order[b], padded with -1 to width `budget`."""
    B = order.shape[0]
    if order.shape[1] < budget:
        order = torch.cat([order, order.new_full((B, budget - order.shape[1]), -1)], 1)
    order = order[:, :budget]
    keep = torch.arange(budget, device=order.device)[None, :] < k[:, None]
    node_idx = torch.where(keep, order, -1)
    picked = torch.where(keep, scores.double().gather(1, order.clamp(min=0)), 0.0) if scores.shape[1] else \
        torch.zeros(B, budget, dtype=torch.float64)
    expected = 1.0 + picked.sum(1)
    cost = cost.double() if cost is not None else torch.full_like(expected, math.nan)
    return Selection(node_idx, k.long(), expected, cost)


def select_tree_reference(
    scores: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, depth: torch.Tensor,
    node_bits: torch.Tensor, root_bits: torch.Tensor, cost_table: torch.Tensor,
    mode: str | int, budget: int, c0: float = 0.0, c_tok: float = 0.0, c_exp: float = 0.0, eps: float = 1e-3,
) -> Selection:
    """The reference semantics of the op (see spec.py); inputs on CPU."""
    m = parse_mode(mode)
    check_inputs(scores, parents, valid, depth, node_bits, root_bits, cost_table, m, budget, c0, c_tok, c_exp, eps)
    scores = torch.where(valid, scores, torch.zeros_like(scores))
    parents, depth = parents.long(), depth.long()
    if m == Mode.EVICT:
        cap = min(budget, cost_table.shape[0] - 1)
        order = score_rank_order(scores, valid, depth)[:, :cap]
        num_valid = torch.clamp(valid.sum(1), max=cap)
        k, _, cost = evict_select(scores.gather(1, order), num_valid, cost_table.double())
        return _prefix(order, k, scores, cost, budget)
    g = greedy_costs(m, c_tok, c_exp, eps)
    traj = path_bits(node_bits, parents, depth)
    greedy = greedy_expert_select(scores, parents, valid, traj, root_bits if g.use_root else None, budget,
                                  g.token_cost, g.expert_cost, marginal=g.marginal)
    if m == Mode.JOINT:
        j, _, cost = joint_prefix(greedy, c0, c_tok, c_exp)
        return _prefix(greedy.node_idx, j, scores, cost, budget)
    return _prefix(greedy.node_idx, greedy.num_selected, scores, None, budget)
