"""The op's CPU reference equals the core policies it stands for, and rejects bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.core.strategies import random_eagle_tree, random_experts, random_tree
from trtllm_moespec.core import CostTable, ExpertCostModel, make_policy
from trtllm_moespec.kernels import score_rank_order, select_tree_reference
from trtllm_moespec.core.tree import score_order

from .cases import assert_same_selection, random_case


def _pad(sel, budget):
    B, K = sel.node_idx.shape
    idx = torch.cat([sel.node_idx, sel.node_idx.new_full((B, max(0, budget - K)), -1)], 1)[:, :budget]
    return type(sel)(idx, sel.num_selected, sel.expected_tokens, sel.predicted_cost.double())


def _inputs(tree, experts, root):
    return (tree.scores, tree.parents, tree.valid, tree.depth, experts.bits, root)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 4), num_nodes=st.integers(0, 14),
       budget=st.integers(1, 16))
def test_greedy_modes_equal_policies(seed, batch, num_nodes, budget):
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, batch, num_nodes)
    experts = random_experts(rng, tree, 3, 16, 2, num_popular=5)
    root = experts.bits[:, :1, :].clone().squeeze(1) if num_nodes else torch.zeros(batch, experts.bits.shape[2],
                                                                                   dtype=torch.int64)
    table = torch.ones(1, dtype=torch.float64)
    for global_cost in (False, True):
        policy = make_policy("ecospec", budget=budget, eps=1e-3, global_cost=global_cost)
        want = _pad(policy.select(tree, experts, root), budget)
        mode = "ecospec_global" if global_cost else "ecospec"
        got = select_tree_reference(*_inputs(tree, experts, root), table, mode, budget, eps=1e-3)
        assert_same_selection(want, got, mode)
    model = ExpertCostModel(c0=1.0, c_tok=0.03, c_exp=0.004)
    want = _pad(make_policy("joint", cost_model=model, budget=budget).select(tree, experts, root), budget)
    got = select_tree_reference(*_inputs(tree, experts, root), table, "joint", budget, 1.0, 0.03, 0.004)
    assert_same_selection(want, got, "joint")


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 4), steps=st.integers(1, 4), topk=st.integers(1, 4),
       budget=st.integers(1, 20))
def test_evict_equals_policy_on_eagle_trees(seed, batch, steps, topk, budget):
    # Continuous draft probabilities: no two log-scores round to the same float32 score,
    # so ranking by scores (the op) and by log-scores (score_order) agree.
    rng = np.random.default_rng(seed)
    tree = random_eagle_tree(rng, batch, steps, topk)
    costs = tuple(1.0 + 0.02 * k + 0.001 * k * k for k in range(int(rng.integers(1, 24))))
    want = _pad(make_policy("evict", cost_table=CostTable(costs), budget=budget).select(tree), budget)
    W = 1
    bits = torch.zeros(*tree.token_ids.shape, W, dtype=torch.int64)
    got = select_tree_reference(tree.scores, tree.parents, tree.valid, tree.depth, bits,
                                torch.zeros(batch, W, dtype=torch.int64), torch.tensor(costs, dtype=torch.float64),
                                "evict", budget)
    assert_same_selection(want, got, "evict")
    ours, core = score_rank_order(tree.scores, tree.valid, tree.depth), score_order(tree)
    for b, n in enumerate(tree.valid.sum(1).tolist()):
        assert ours[b, :n].tolist() == core[b, :n].tolist()


def test_hand_built_tree():
    # root -> 0 (0.5) -> 1 (0.25); root -> 2 (0.5). Node 2 shares node 0's score: index breaks the tie.
    scores = torch.tensor([[0.5, 0.25, 0.5]])
    parents = torch.tensor([[-1, 0, -1]])
    valid = torch.ones(1, 3, dtype=torch.bool)
    depth = torch.tensor([[1, 2, 1]])
    # Node 0 wakes expert bits {0, 1}, node 1 adds {2}, node 2 wakes {5, 6, 7}; the root has {0}.
    bits = torch.tensor([[[0b11], [0b100], [0b11100000]]])
    root = torch.tensor([[0b1]])
    table = torch.tensor([1.0, 1.2, 1.5, 2.5], dtype=torch.float64)
    ev = select_tree_reference(scores, parents, valid, depth, bits, root, table, "evict", 3)
    # utilities: 1/1, 1.5/1.2 = 1.25, 2/1.5 = 1.333, 2.25/2.5 = 0.9 -> k* = 2: nodes 0 then 2.
    assert ev.node_idx.tolist() == [[0, 2, -1]] and ev.num_selected.item() == 2
    assert ev.expected_tokens.item() == 2.0 and ev.predicted_cost.item() == 1.5
    eco = select_tree_reference(scores, parents, valid, depth, bits, root, table, "ecospec", 2, eps=1e-3)
    # round 1: node 0 adds 1 expert (0.5/1.001), node 2 adds 3 (0.5/3.001) -> 0;
    # round 2: node 1 adds 1 (0.25/1.001) beats node 2 (0.5/3.001).
    assert eco.node_idx.tolist() == [[0, 1]] and torch.isnan(eco.predicted_cost).all()
    glob = select_tree_reference(scores, parents, valid, depth, bits, root, table, "ecospec_global", 3, eps=1e-3)
    # static costs |E_path|: node 0: 2, node 1: 3, node 2: 3 -> 0 (0.25), then 2 (0.1666) over 1 (0.0833).
    assert glob.node_idx.tolist() == [[0, 2, 1]]
    joint = select_tree_reference(scores, parents, valid, depth, bits, root, table, "joint", 3, 1.0, 0.0, 0.5)
    # U = 1, 2, 3, 6: utilities 1/1.5, 1.5/2, 1.75/2.5, 2.25/4 -> stop after node 0.
    assert joint.node_idx.tolist() == [[0, -1, -1]] and joint.predicted_cost.item() == 2.0


@pytest.mark.parametrize("change, message", [
    (dict(mode="greedy"), "unknown select_tree mode"),
    (dict(budget=0), "budget"),
    (dict(mode="ecospec", eps=0.0), "eps"),
    (dict(mode="joint", c0=0.1, c_tok=-0.05), "non-positive"),
    (dict(mode="joint", c_exp=-1.0), "c_exp"),
    (dict(mode="evict", cost_table=torch.zeros(0, dtype=torch.float64)), "cost table"),
    (dict(parents=torch.zeros(2, 5, dtype=torch.int64)), "parents"),
    (dict(node_bits=torch.zeros(2, 4, 1, dtype=torch.int32)), "node_bits"),
    (dict(root_bits=torch.zeros(2, 3, dtype=torch.int64)), "root_bits"),
    (dict(scores=torch.zeros(2, 4, dtype=torch.int64)), "scores"),
])
def test_bad_inputs_raise(change, message):
    case = random_case(0, 2, 4)
    kw = dict(zip(("scores", "parents", "valid", "depth", "node_bits", "root_bits", "cost_table"), case.args()))
    kw.update(case.kwargs())
    kw["mode"] = "joint"
    kw.update(change)
    with pytest.raises(ValueError, match=message):
        select_tree_reference(**kw)
