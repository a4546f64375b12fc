"""Run a core policy as the `moespec::select_tree` device op (the engine's CUDA path).

Policies the op covers (evict, ecospec, joint) select on the device without a host
sync; the others, and ecospec / joint with an EP placement, fall back to their core
implementation.
"""

from __future__ import annotations

import torch

from ..core.experts import ExpertSets
from ..core.policies import EcoSpecPolicy, EvictPolicy, JointPolicy, Selection, SelectionPolicy
from ..core.tree import DraftTree
from .op import select_tree


def select_on_device(policy: SelectionPolicy, tree: DraftTree, experts: ExpertSets | None,
                     root_bits: torch.Tensor | None) -> Selection:
    device = tree.token_ids.device
    B, N = tree.token_ids.shape
    if isinstance(policy, EvictPolicy):
        table = policy.cost_table
        budget = table.max_nodes if policy.budget is None else min(policy.budget, table.max_nodes)
        empty = torch.zeros(B, N, 1, dtype=torch.int64, device=device)
        return select_tree(tree.scores, tree.parents, tree.valid, tree.depth, empty, empty[:, 0],
                           table.as_tensor(device), "evict", budget)
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
