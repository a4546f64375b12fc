"""joint-batch: reference cases with known answers, equality with `joint` for one request,
and the invariants every batched selection keeps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from tests.core.strategies import random_eagle_tree, random_experts, random_tree, seeds
from trtllm_moespec.core import DraftTree, ExpertCostModel, ExpertSets, make_policy
from trtllm_moespec.core.batch_select import ecospec_batch_select, evict_batch_select, joint_batch_select
from trtllm_moespec.core.cost import CostTable
from trtllm_moespec.core.tree import gather_nodes, score_order
from trtllm_moespec.core.select import path_bits


def _sets(ids_per_node: list[list[int]], num_experts: int = 16) -> torch.Tensor:
    """[N, W] bitsets of one MoE layer from expert-id lists."""
    ids = torch.tensor([[[e for e in ids] + [-1] * (2 - len(ids))] for ids in ids_per_node])[None]  # [1, N, 1, 2]
    return ExpertSets.from_topk_ids(ids, num_experts).bits[0]


def _one_request_case(rng):
    """A random one-request tree with predicted experts: (tree, experts, root bits [1, W], traj)."""
    tree = random_tree(rng, 1, 12)
    experts = random_experts(rng, tree, layers=2, experts=8, topk=2, num_popular=5)
    root = random_experts(rng, DraftTree.from_parents(torch.zeros(1, 1, dtype=torch.long), torch.tensor([[-1]]),
                                                      torch.ones(1, 1)), 2, 8, 2).bits[:, 0]
    return tree, experts, root, path_bits(experts.bits, tree.parents, tree.depth)


def _batch_case(rng):
    """A random batch: (tree, traj, roots, total cap, per-request cap)."""
    B = int(rng.integers(1, 5))
    tree = random_tree(rng, B, 10)
    experts = random_experts(rng, tree, layers=2, experts=8, topk=2, num_popular=6)
    traj = path_bits(experts.bits, tree.parents, tree.depth)
    roots = torch.zeros(B, traj.shape[2], dtype=torch.int64)
    return tree, traj, roots, int(rng.integers(0, 20)), int(rng.integers(0, 6))


def _assert_parent_closed(tree: DraftTree, b: int, nodes: list[int]) -> None:
    """Every selected node is valid and comes after its parent (or hangs off the root)."""
    for i, n in enumerate(nodes):
        parent = int(tree.parents[b, n])
        assert n >= 0 and bool(tree.valid[b, n]) and (parent == -1 or parent in nodes[:i])


def test_shared_union_prefers_a_node_whose_experts_the_batch_already_wakes():
    # request 0: node a (score 0.9) wakes {1, 2}; request 1: b (0.5) wakes {1, 2}, c (0.6) wakes {7, 8}.
    scores = torch.tensor([[0.9, 0.0], [0.5, 0.6]])
    parents = torch.tensor([[-1, -1], [-1, -1]])
    valid = torch.tensor([[True, False], [True, True]])
    traj = torch.stack([_sets([[1, 2], []]), _sets([[1, 2], [7, 8]])])
    roots = torch.zeros(2, traj.shape[2], dtype=torch.int64)
    cost = ExpertCostModel(c0=1.0, c_tok=0.01, c_exp=0.2)
    sel = joint_batch_select(scores, parents, valid, traj, roots, cost, max_nodes=8, max_nodes_per_request=8)
    # Utilities: j=0 2/1 = 2.0; j=1 (a) 2.9/1.41 = 2.06; j=2 (+b, free) 3.4/1.42 = 2.39; j=3 (+c) 4.0/1.83 = 2.19.
    assert sel.node_idx.tolist() == [[0], [0]] and sel.num_selected.tolist() == [1, 1]
    assert sel.expected_tokens == pytest.approx(3.4) and sel.unique_experts == 2
    assert sel.predicted_cost == pytest.approx(1.0 + 2 * 0.01 + 2 * 0.2)
    # Request 1 choosing alone (`joint`) takes c, its higher-scoring node, first.
    alone = make_policy("joint", cost_model=cost, budget=8).select(
        DraftTree.from_parents(torch.tensor([[3, 4]]), parents[1:], scores[1:]),
        ExpertSets(traj[1:], 1, 16), roots[1:])
    assert alone.node_idx[0, 0].item() == 1


def test_decodes_plainly_when_speculation_cannot_pay():
    rng = np.random.default_rng(0)
    tree = random_eagle_tree(rng, 3, steps=3, topk=4)
    experts = random_experts(rng, tree, layers=2, experts=16, topk=2)
    traj = path_bits(experts.bits, tree.parents, tree.depth)
    roots = torch.zeros(3, traj.shape[2], dtype=torch.int64)
    sel = joint_batch_select(tree.scores, tree.parents, tree.valid, traj, roots, ExpertCostModel(1.0, 5.0, 5.0), 32, 8)
    assert sel.num_selected.tolist() == [0, 0, 0] and sel.expected_tokens == 3.0 and sel.predicted_cost == 1.0


@settings(max_examples=25, deadline=None)
@given(seeds)
def test_one_request_equals_joint(seed):
    rng = np.random.default_rng(seed)
    tree, experts, root, traj = _one_request_case(rng)
    cost = ExpertCostModel(float(rng.uniform(0.5, 2)), float(rng.uniform(0, 0.1)), float(rng.uniform(0, 0.2)))
    budget = int(rng.integers(1, 12))
    want = make_policy("joint", cost_model=cost, budget=budget).select(tree, experts, root)
    got = joint_batch_select(tree.scores, tree.parents, tree.valid, traj, root, cost, budget, budget)
    k = int(want.num_selected[0])
    assert got.num_selected.tolist() == [k]
    assert got.node_idx[0, :k].tolist() == want.node_idx[0, :k].tolist()
    assert got.expected_tokens == pytest.approx(float(want.expected_tokens[0]))
    assert got.predicted_cost == pytest.approx(float(want.predicted_cost[0]))


@settings(max_examples=25, deadline=None)
@given(seeds)
def test_batch_selection_is_parent_closed_ordered_and_within_caps(seed):
    rng = np.random.default_rng(seed)
    tree, traj, roots, total, per_request = _batch_case(rng)
    B = tree.parents.shape[0]
    cost = ExpertCostModel(1.0, float(rng.uniform(0, 0.05)), float(rng.uniform(0, 0.05)))
    sel = joint_batch_select(tree.scores, tree.parents, tree.valid, traj, roots, cost, total, per_request)
    assert int(sel.num_selected.sum()) <= total and int(sel.num_selected.max()) <= per_request
    picked_score = 0.0
    for b in range(B):
        nodes = sel.node_idx[b, : int(sel.num_selected[b])].tolist()
        _assert_parent_closed(tree, b, nodes)
        picked_score += float(tree.scores[b, nodes].double().sum()) if nodes else 0.0
    assert sel.expected_tokens == pytest.approx(B + picked_score)


def test_bad_inputs():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="caps"):
        joint_batch_select(z, z.long(), z.bool(), torch.zeros(2, 3, 1, dtype=torch.int64),
                           torch.zeros(2, 1, dtype=torch.int64), ExpertCostModel(1, 0, 0), -1, 4)
    with pytest.raises(ValueError, match="do not match"):
        joint_batch_select(z, z.long(), z.bool(), torch.zeros(2, 3, 1, dtype=torch.int64),
                           torch.zeros(1, 1, dtype=torch.int64), ExpertCostModel(1, 0, 0), 4, 4)


def _evict_inputs(tree: DraftTree, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's EVICT order (valid nodes, -1 after) and its scores in that order."""
    order = score_order(tree)[:, :cap]
    order = torch.where(gather_nodes(tree.valid, order, False), order, -1)
    return order, gather_nodes(tree.scores, order, 0.0)


@settings(max_examples=25, deadline=None)
@given(seeds)
def test_evict_batch_for_one_request_equals_evict(seed):
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, 1, 12)
    costs = np.cumsum(np.concatenate([[rng.uniform(0.5, 2)], rng.uniform(0, 0.2, 12)]))
    table = CostTable(tuple(float(c) for c in costs))
    want = make_policy("evict", cost_table=table).select(tree)
    order, scores = _evict_inputs(tree, table.max_nodes)
    got = evict_batch_select(order, scores, costs, 12)
    k = int(want.num_selected[0])
    assert got.num_selected.tolist() == [k] and got.node_idx[0, :k].tolist() == want.node_idx[0, :k].tolist()
    assert got.predicted_cost == pytest.approx(costs[k])


def test_evict_batch_gives_nodes_to_the_request_whose_nodes_are_likelier():
    # request 0 drafts a confident chain (path scores 0.9, 0.72), request 1 an unlikely one (0.2, 0.02).
    tree = DraftTree.from_parents(torch.tensor([[4, 5], [6, 7]]), torch.tensor([[-1, 0], [-1, 0]]),
                                  torch.tensor([[0.9, 0.8], [0.2, 0.1]]))
    order, scores = _evict_inputs(tree, 2)
    costs = np.array([2.0, 2.1, 2.2, 2.9, 3.0])  # C_2(k): the third node is dear
    sel = evict_batch_select(order, scores, costs, 4)
    # Utilities (2 + S_k) / C_2(k): k=0 1.0, k=1 2.9/2.1 = 1.38, k=2 3.62/2.2 = 1.65, k=3 3.82/2.9 = 1.32.
    assert sel.node_idx.tolist() == [[0, 1]] + [[-1, -1]] and sel.num_selected.tolist() == [2, 0]
    assert sel.expected_tokens == pytest.approx(3.62) and sel.predicted_cost == pytest.approx(2.2)


@settings(max_examples=25, deadline=None)
@given(seeds)
def test_evict_batch_takes_a_prefix_of_each_requests_order_within_the_cap(seed):
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 5))
    tree = random_tree(rng, B, 10)
    order, scores = _evict_inputs(tree, int(rng.integers(1, 10)))  # orders narrower than the trees
    total = int(rng.integers(0, 20))
    costs = np.cumsum(np.concatenate([[1.0], rng.uniform(0, 0.02, total)]))
    sel = evict_batch_select(order, scores, costs, total)
    assert int(sel.num_selected.sum()) <= total
    for b in range(B):
        k = int(sel.num_selected[b])
        nodes = sel.node_idx[b, :k].tolist()
        assert nodes == order[b, :k].tolist()  # a prefix of the request's order
        _assert_parent_closed(tree, b, nodes)


@settings(max_examples=25, deadline=None)
@given(seeds)
def test_ecospec_batch_for_one_request_equals_ecospec(seed):
    rng = np.random.default_rng(seed)
    tree, experts, root, traj = _one_request_case(rng)
    budget = int(rng.integers(1, 8))
    want = make_policy("ecospec", budget=budget).select(tree, experts, root)
    got = ecospec_batch_select(tree.scores, tree.parents, tree.valid, traj, root, 1e-3, budget, 12)
    k = int(want.num_selected[0])
    assert got.num_selected.tolist() == [k] and got.node_idx[0, :k].tolist() == want.node_idx[0, :k].tolist()


@settings(max_examples=25, deadline=None)
@given(seeds)
def test_ecospec_batch_fills_its_budget_parent_closed(seed):
    rng = np.random.default_rng(seed)
    tree, traj, roots, total, per_request = _batch_case(rng)
    sel = ecospec_batch_select(tree.scores, tree.parents, tree.valid, traj, roots, 1e-3, total, per_request)
    available = int(torch.clamp(tree.valid.sum(1), max=per_request).sum())
    assert int(sel.num_selected.sum()) == min(total, available) and int(sel.num_selected.max()) <= per_request
    for b in range(tree.parents.shape[0]):
        _assert_parent_closed(tree, b, sel.node_idx[b, : int(sel.num_selected[b])].tolist())


def test_batch_variants_reject_bad_inputs():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="eps"):
        ecospec_batch_select(z, z.long(), z.bool(), torch.zeros(2, 3, 1, dtype=torch.int64),
                             torch.zeros(2, 1, dtype=torch.int64), 0.0, 4, 4)
    with pytest.raises(ValueError, match="positive seconds"):
        evict_batch_select(torch.zeros(2, 3, dtype=torch.int64), z, np.array([1.0, -1.0]), 4)
    with pytest.raises(ValueError, match="must both be"):
        evict_batch_select(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 2), np.array([1.0]), 4)
