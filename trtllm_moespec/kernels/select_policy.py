"""Run a core policy as the `moespec::select_tree` device op (the engine's CUDA path).

Policies the op covers (evict, ecospec, joint) select on the device without a host
sync, and so does eagle3 (its top nodes by score, sorted here with torch ops); the others,
and ecospec / joint with an EP placement, fall back to their core implementation.
"""

from __future__ import annotations

import math

import torch

from ..core.cost import CostTable
from ..core.experts import ExpertSets
from ..core.policies import EcoSpecPolicy, Eagle3Policy, EvictPolicy, JointPolicy, Selection, SelectionPolicy
from ..core.tree import DraftTree, gather_nodes
from .op import select_tree
from .reference import rank_order

# C(k) tables already on a device: a table uploaded every step would be a blocking copy (a stream sync).
_TABLES: dict[tuple[tuple[float, ...], str], torch.Tensor] = {}


def select_on_device(policy: SelectionPolicy, tree: DraftTree, experts: ExpertSets | None,
                     root_bits: torch.Tensor | None) -> Selection:
    device = tree.token_ids.device
    B, N = tree.token_ids.shape
    if isinstance(policy, Eagle3Policy):
        return eagle3_top_nodes(tree, policy.budget)
    if isinstance(policy, EvictPolicy) or (isinstance(policy, JointPolicy) and not policy.expert_term):
        table = policy.cost_table  # (joint without its expert term selects as EVICT)
        budget = table.max_nodes if policy.budget is None else min(policy.budget, table.max_nodes)
        empty = torch.zeros(B, N, 1, dtype=torch.int64, device=device)
        return select_tree(tree.scores, tree.parents, tree.valid, tree.depth, empty, empty[:, 0],
                           _table_on(table, device), "evict", budget)
    if isinstance(policy, (EcoSpecPolicy, JointPolicy)) and experts is not None and policy.placement is None:
        # (the op prices the global union; EP-aware pricing runs the core reference below)
        root = root_bits if root_bits is not None else torch.zeros_like(experts.bits[:, 0])
        no_table = torch.zeros(0, dtype=torch.float64, device=device)
        if isinstance(policy, EcoSpecPolicy):
            mode = "ecospec_global" if policy.global_cost else "ecospec"
            return select_tree(tree.scores, tree.parents, tree.valid, tree.depth, experts.bits, root, no_table,
                               mode, policy.budget, eps=policy.eps)
        m = policy.cost_model
        return select_tree(tree.scores, tree.parents, tree.valid, tree.depth, experts.bits, root, no_table,
                           "joint", policy.budget, c0=m.c0, c_tok=m.c_tok, c_exp=m.c_exp)
    return policy.select(tree, experts=experts, root_experts=root_bits)


def _table_on(table: CostTable, device: torch.device) -> torch.Tensor:
    key = (table.costs, str(device))
    if key not in _TABLES:
        _TABLES[key] = table.as_tensor(device)
    return _TABLES[key]


def eagle3_top_nodes(tree: DraftTree, budget: int) -> Selection:
    """`Eagle3Policy.select` without a host read: the top-`budget` valid nodes by score (-1 after
    the valid ones), their count and 1 + their summed scores. The order is `core.tree.score_order`'s:
    ranked on the log scores (two log scores may share one float32 score)."""
    B, N = tree.token_ids.shape
    order = rank_order(-tree.log_scores.double(), tree.valid, tree.depth)[:, :budget]
    node_idx = torch.where(gather_nodes(tree.valid, order, False), order, -1)
    if node_idx.shape[1] < budget:  # fewer nodes than the budget
        node_idx = torch.nn.functional.pad(node_idx, (0, budget - node_idx.shape[1]), value=-1)
    expected = 1.0 + gather_nodes(tree.scores.double(), node_idx, 0.0).sum(1)
    cost = torch.full((B,), math.nan, dtype=torch.float64, device=node_idx.device)
    return Selection(node_idx, (node_idx >= 0).sum(1), expected, cost)
