"""Selection policies: closure, budgets, and equality with brute-force / slow references."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from trtllm_moespec.core import CostTable, ExpertCostModel, ExpertSets, ddd_should_stop, make_policy
from trtllm_moespec.core.experts import words_to_bools

from .strategies import random_eagle_tree, random_experts, random_tree, seeds


def _expert_set(bits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(words_to_bools(bits)).flatten().tolist())


def _assert_closed(tree, sel, cap):
    for b in range(tree.batch_size):
        idx = [i for i in sel.node_idx[b].tolist() if i >= 0]
        assert len(idx) == int(sel.num_selected[b]) <= cap
        assert sel.node_idx[b, len(idx):].eq(-1).all()
        seen = set()
        for i in idx:
            assert bool(tree.valid[b, i])
            p = int(tree.parents[b, i])
            assert p == -1 or p in seen
            seen.add(i)
        expected = 1 + sum(float(tree.scores[b, i]) for i in idx)
        assert math.isclose(float(sel.expected_tokens[b]), expected, rel_tol=1e-6)


def _table(rng, K):
    # Increasing costs with random convexity, as profiled tables look.
    steps = np.cumsum(rng.uniform(0.0, 0.3, size=K))
    return CostTable(tuple([1.0] + list(1.0 + steps)))


@settings(max_examples=50, deadline=None)
@given(seeds)
def test_all_policies_are_parent_closed_and_within_budget(seed):
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, 3, int(rng.integers(0, 20)))
    experts = random_experts(rng, tree, layers=3, experts=8, topk=2, num_popular=5)
    root = experts.bits[:, 0] if tree.num_nodes else torch.zeros(3, experts.bits.shape[2], dtype=torch.int64)
    budget = int(rng.integers(1, 12))
    policies = [
        make_policy("eagle3", budget=budget),
        make_policy("evict", cost_table=_table(rng, 12), budget=budget),
        make_policy("ecospec", budget=budget),
        make_policy("ecospec", budget=budget, global_cost=True),
        make_policy("joint", cost_model=ExpertCostModel(1.0, 0.01, 0.05), budget=budget),
        make_policy("coverage", rho=0.8, budget=budget),
        make_policy("oracle"),
    ]
    target = torch.from_numpy(rng.uniform(0, 1, tree.scores.shape)).float()
    for policy in policies:
        sel = policy.select(tree, experts=experts, root_experts=root, target_scores=target)
        cap = budget if policy.name != "oracle" else tree.num_nodes
        if policy.name == "oracle":
            _assert_closed_oracle(tree, sel)
        else:
            _assert_closed(tree, sel, cap)


def _assert_closed_oracle(tree, sel):
    for b in range(tree.batch_size):
        seen = set()
        for i in [i for i in sel.node_idx[b].tolist() if i >= 0]:
            p = int(tree.parents[b, i])
            assert p == -1 or p in seen
            seen.add(i)


@settings(max_examples=60, deadline=None)
@given(seeds)
def test_evict_equals_brute_force_argmax(seed):
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, 2, int(rng.integers(0, 20)))
    table = _table(rng, int(rng.integers(1, 25)))
    sel = make_policy("evict", cost_table=table).select(tree)
    for b in range(2):
        scores = sorted((float(s) for s, v in zip(tree.scores[b], tree.valid[b]) if v), reverse=True)
        K = min(len(scores), table.max_nodes)
        utilities = [(1 + sum(scores[:k])) / table.costs[k] for k in range(K + 1)]
        best = max(range(K + 1), key=lambda k: (utilities[k], -k))
        assert int(sel.num_selected[b]) == best
        assert math.isclose(float(sel.predicted_cost[b]), table.costs[best])


def _slow_greedy(tree, experts, root, b, budget, token_cost, expert_cost, marginal):
    """Textbook greedy with Python sets (the papers' Alg. 4 with our tie rule)."""
    N = tree.num_nodes
    node_sets = [_expert_set(experts.bits[b, i]) for i in range(N)]
    traj = []
    for i in range(N):
        p = int(tree.parents[b, i])
        traj.append(node_sets[i] | (traj[p] if p >= 0 else set()))
    buf = _expert_set(root[b]) if root is not None else set()
    static = set(buf)
    chosen, uniques = [], [len(buf)]
    while len(chosen) < budget:
        best, best_key = None, None
        for i in range(N):
            p = int(tree.parents[b, i])
            if not tree.valid[b, i] or i in chosen or (p >= 0 and p not in chosen):
                continue
            new = len(traj[i] - (buf if marginal else static))
            key = float(tree.scores[b, i].double()) / (token_cost + expert_cost * new)
            if best_key is None or key > best_key:
                best, best_key = i, key
        if best is None:
            break
        chosen.append(best)
        buf |= traj[best]
        uniques.append(len(buf))
    return chosen, uniques


@settings(max_examples=40, deadline=None)
@given(seeds)
def test_ecospec_and_joint_equal_slow_reference(seed):
    rng = np.random.default_rng(seed)
    tree = random_eagle_tree(rng, 2, steps=int(rng.integers(1, 4)), topk=int(rng.integers(1, 4)))
    experts = random_experts(rng, tree, layers=4, experts=16, topk=2, num_popular=6)
    root = random_experts(rng, tree, 4, 16, 2).bits[:, 0]
    budget = int(rng.integers(1, 10))
    for global_cost in (False, True):
        sel = make_policy("ecospec", budget=budget, eps=0.5, global_cost=global_cost).select(tree, experts, root)
        for b in range(2):
            chosen, _ = _slow_greedy(tree, experts, None if global_cost else root, b, budget, 0.5, 1.0, not global_cost)
            assert [i for i in sel.node_idx[b].tolist() if i >= 0] == chosen
    model = ExpertCostModel(c0=1.0, c_tok=0.02, c_exp=0.01)
    sel = make_policy("joint", cost_model=model, budget=budget).select(tree, experts, root)
    for b in range(2):
        chosen, uniques = _slow_greedy(tree, experts, root, b, budget, 0.02, 0.01, True)
        util = [(1 + sum(float(tree.scores[b, i].double()) for i in chosen[:j])) / (1.0 + 0.02 * j + 0.01 * uniques[j])
                for j in range(len(chosen) + 1)]
        j_star = max(range(len(util)), key=lambda j: (util[j], -j))
        assert [i for i in sel.node_idx[b].tolist() if i >= 0] == chosen[:j_star]
        assert math.isclose(float(sel.predicted_cost[b]), 1.0 + 0.02 * j_star + 0.01 * uniques[j_star])


def test_ecospec_prefers_expert_reuse_over_slightly_higher_score():
    # Two root children: A (score .5, experts {0}) and B (score .45, experts {5}).
    # Root already uses expert 0, so A is free; then B vs C(child of A, .4, {0}) -> C wins.
    from trtllm_moespec.core import DraftTree
    tree = DraftTree.from_parents(torch.tensor([[1, 2, 3]]), torch.tensor([[-1, -1, 0]]), torch.tensor([[0.5, 0.45, 0.8]]))
    ids = torch.tensor([[[[0]], [[5]], [[0]]]])
    experts = ExpertSets.from_topk_ids(ids, num_experts=8)
    root = ExpertSets.from_topk_ids(torch.tensor([[[[0]]]]), 8).bits[:, 0]
    sel = make_policy("ecospec", budget=2).select(tree, experts, root)
    assert sel.node_idx[0].tolist() == [0, 2]
    assert make_policy("eagle3", budget=2).select(tree).node_idx[0].tolist() == [0, 1]


@settings(max_examples=40, deadline=None)
@given(seeds)
def test_coverage_is_smallest_prefix_reaching_rho(seed):
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, 2, int(rng.integers(1, 16)))
    rho = float(rng.uniform(0.05, 1.0))
    sel = make_policy("coverage", rho=rho, budget=8).select(tree)
    for b in range(2):
        scores = sorted((float(s) for s, v in zip(tree.scores[b], tree.valid[b]) if v), reverse=True)[:8]
        total = sum(scores)
        k = 0 if total == 0 else next(k for k in range(1, len(scores) + 1) if sum(scores[:k]) >= rho * total * (1 - 1e-9))
        assert int(sel.num_selected[b]) == k


def test_oracle_at_temperature_zero_selects_exactly_the_accepted_chain():
    from trtllm_moespec.core import DraftTree
    tree = DraftTree.from_parents(torch.tensor([[1, 2, 3, 4]]), torch.tensor([[-1, -1, 1, 1]]), torch.full((1, 4), 0.5))
    target = torch.tensor([[0.0, 1.0, 0.0, 1.0]])  # local one-hot: the argmax path is node 1 then node 3
    sel = make_policy("oracle").select(tree, target_scores=target)
    assert sel.node_idx[0].tolist()[:2] == [1, 3] and int(sel.num_selected[0]) == 2
    with pytest.raises(ValueError, match="target_scores"):
        make_policy("oracle").select(tree)


def test_evict_can_choose_plain_decoding_when_drafts_are_not_worth_it():
    from trtllm_moespec.core import DraftTree
    tree = DraftTree.from_parents(torch.tensor([[1]]), torch.tensor([[-1]]), torch.tensor([[0.1]]))
    sel = make_policy("evict", cost_table=CostTable((1.0, 2.0))).select(tree)
    assert int(sel.num_selected[0]) == 0 and math.isclose(float(sel.expected_tokens[0]), 1.0)


@pytest.mark.parametrize("name,options", [
    ("eagle3", {"budget": 0}), ("eagle3", {"budget": -3}), ("ecospec", {"budget": 0}), ("joint", {"budget": 0, "cost_model": ExpertCostModel(1, 0, 0)}),
    ("coverage", {"rho": 0.0}), ("evict", {"cost_table": None}), ("nope", {}), ("eagle3", {"bogus": 1}),
    ("ecospec", {"eps": 0.0}),
])
def test_bad_policy_options_raise_value_error(name, options):
    with pytest.raises(ValueError):
        make_policy(name, **options)


def test_expert_policies_require_expert_sets():
    tree = random_tree(np.random.default_rng(0), 1, 4, pad=False)
    with pytest.raises(ValueError, match="expert"):
        make_policy("ecospec").select(tree)


def test_ddd_stop_rule():
    assert ddd_should_stop(torch.tensor([[0.1, 0.2], [0.5, 0.4]]), 0.5).tolist() == [True, False]
    with pytest.raises(ValueError):
        ddd_should_stop(torch.zeros(1, 1), float("nan"))


def test_ar_selects_nothing():
    tree = random_tree(np.random.default_rng(0), 2, 5)
    sel = make_policy("ar").select(tree)
    assert sel.node_idx.shape == (2, 0) and sel.num_selected.tolist() == [0, 0]


@settings(max_examples=40, deadline=None)
@given(seeds)
def test_joint_without_its_expert_term_selects_as_evict(seed):
    """Where the profile shows the expert term cannot pay, joint reads no expert sets and its selection is
    EVICT's on the measured C(k): the same nodes, count, expected tokens and predicted cost."""
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, 2, int(rng.integers(0, 20)))
    table = _table(rng, int(rng.integers(1, 25)))
    budget = int(rng.integers(1, 12))
    joint = make_policy("joint", cost_model=ExpertCostModel(1.0, 0.01, 0.05), budget=budget, cost_table=table,
                        expert_term=False)
    assert not joint.reads_experts and make_policy("joint", cost_model=ExpertCostModel(1.0, 0.01, 0.05)).reads_experts
    got, want = joint.select(tree), make_policy("evict", cost_table=table, budget=budget).select(tree)
    for a, b in zip((got.node_idx, got.num_selected, got.expected_tokens, got.predicted_cost),
                    (want.node_idx, want.num_selected, want.expected_tokens, want.predicted_cost)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("options,match", [({"expert_term": False}, "CostTable"),
                                           ({"expert_term": "no"}, "True or False")])
def test_joint_without_its_expert_term_needs_a_measured_table(options, match):
    with pytest.raises(ValueError, match=match):
        make_policy("joint", cost_model=ExpertCostModel(1.0, 0.01, 0.05), **options)
