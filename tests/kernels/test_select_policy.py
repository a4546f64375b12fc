"""The engine's device selector (the moespec::select_tree op, here on its CPU path) equals policy.select."""

import numpy as np
import torch

from tests.core.strategies import random_eagle_tree, random_experts
from trtllm_moespec.core import CostTable, ExpertCostModel, make_policy
from trtllm_moespec.kernels.select_policy import select_on_device


def test_select_on_device_matches_the_policies():
    rng = np.random.default_rng(3)
    for _ in range(5):
        tree = random_eagle_tree(rng, 2, steps=3, topk=3)
        experts = random_experts(rng, tree, layers=4, experts=16, topk=2, num_popular=6)
        root = experts.bits[:, 0].clone()
        for policy in (make_policy("evict", cost_table=CostTable(tuple(1 + 0.07 * k for k in range(16))), budget=12),
                       make_policy("ecospec", budget=5), make_policy("ecospec", budget=5, global_cost=True),
                       make_policy("joint", cost_model=ExpertCostModel(1.0, 0.01, 0.02), budget=12),
                       make_policy("eagle3", budget=6)):
            want = policy.select(tree, experts, root)
            got = select_on_device(policy, tree, experts, root)
            for b in range(2):
                n = int(want.num_selected[b])
                assert int(got.num_selected[b]) == n, policy.name
                assert got.node_idx[b, :n].tolist() == want.node_idx[b, :n].tolist(), policy.name
            torch.testing.assert_close(got.expected_tokens.double(), want.expected_tokens.double())


def test_eagle3_on_device_orders_ties_and_pads_as_the_host_does():
    """eagle3's device selection (torch sorts, no host read) against `score_order` / `Eagle3Policy`
    on trees with exact score ties, padded nodes, children of probability 0 and fewer nodes than the
    budget (run on CPU tensors: the code has no device-specific branch)."""
    from dataclasses import replace

    from tests.core.strategies import random_tree
    from trtllm_moespec.core.tree import score_order
    from trtllm_moespec.kernels.reference import rank_order
    from trtllm_moespec.kernels.select_policy import eagle3_top_nodes

    rng = np.random.default_rng(7)
    for num_nodes in (0, 1, 5, 20, 40):
        tree = random_tree(rng, 3, num_nodes)
        if num_nodes:  # a few valid nodes whose probability underflowed to 0 (log score -inf)
            zero = torch.from_numpy(rng.random((3, num_nodes)) < 0.15) & tree.valid
            tree = replace(tree, log_scores=torch.where(zero, -torch.inf, tree.log_scores))
        order = rank_order(-tree.log_scores.double(), tree.valid, tree.depth)
        n_valid = tree.valid.sum(1)
        for b in range(3):  # the valid nodes' order (padded ones follow, in an order nothing reads)
            assert order[b, :n_valid[b]].tolist() == score_order(tree)[b, :n_valid[b]].tolist()
        for budget in (1, 6, 32):
            want = make_policy("eagle3", budget=budget).select(tree)
            got = eagle3_top_nodes(tree, budget)
            assert torch.equal(got.node_idx, want.node_idx) and torch.equal(got.num_selected, want.num_selected)
            torch.testing.assert_close(got.expected_tokens, want.expected_tokens)
            assert bool(got.predicted_cost.isnan().all())
