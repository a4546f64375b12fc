"""Node values: isotonic fit, path composition, online calibration, persistence, and the
policies ranking on values (parent-closed, within budget)."""

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from trtllm_moespec.core import CostTable, DraftTree, ExpertCostModel, SamplingConfig, make_policy
from trtllm_moespec.core.values import (
    CalibratedValues, Calibrator, RawValues, accepted_nodes, isotonic_fit, observed_trials, path_values, with_values,
)

from .strategies import random_eagle_tree, random_experts, random_tree, seeds
from .test_policies import _assert_closed


def _brute_isotonic(y, w):
    """Least-squares non-decreasing fit by checking every monotone step function on a grid of pooled means."""
    n = len(y)
    best, best_fit = math.inf, None
    # Every isotonic solution is piecewise constant on consecutive blocks at their weighted means.
    for cuts in itertools.product([0, 1], repeat=n - 1):
        blocks, start = [], 0
        for i, c in enumerate(cuts, 1):
            if c:
                blocks.append((start, i)), None
                start = i
        blocks.append((start, n))
        fit = np.concatenate([np.full(b - a, np.average(y[a:b], weights=w[a:b])) for a, b in blocks])
        if (np.diff(fit) >= -1e-12).all():
            err = float((w * (fit - y) ** 2).sum())
            if err < best - 1e-12:
                best, best_fit = err, fit
    return best_fit


@settings(max_examples=40, deadline=None)
@given(seeds)
def test_isotonic_fit_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 8))
    y, w = rng.uniform(0, 1, n), rng.uniform(0.1, 3, n)
    np.testing.assert_allclose(isotonic_fit(y, w), _brute_isotonic(y, w), atol=1e-9)


def _hand_tree():
    # root -> 0 (q .5) -> 2 (q .5) -> 3 (q .9); root -> 1 (q .25)
    return DraftTree.from_parents(torch.tensor([[10, 11, 12, 13]]), torch.tensor([[-1, -1, 0, 2]]),
                                  torch.tensor([[0.5, 0.25, 0.5, 0.9]]))


def test_path_values_multiply_along_the_path():
    tree = _hand_tree()
    v = path_values(tree, torch.tensor([[0.8, 0.5, 0.5, 1.0]]))
    torch.testing.assert_close(v, torch.tensor([[0.8, 0.5, 0.4, 0.4]]))
    assert torch.equal(RawValues().values(tree), tree.scores)


def test_with_values_keeps_parent_before_child_on_ties():
    tree = _hand_tree()
    valued = with_values(tree, path_values(tree, torch.tensor([[1.0, 1.0, 1.0, 1.0]])))
    sel = make_policy("coverage", rho=1.0, budget=4).select(valued)
    order = sel.node_idx[0].tolist()
    assert order.index(0) < order.index(2) < order.index(3)


def test_observed_trials_are_verified_nodes_with_accepted_parents():
    tree = _hand_tree()
    node_idx = torch.tensor([[0, 1, 2, 3]])
    accepted = torch.tensor([[0, -1]])  # 0 accepted, then 2 rejected: 3 was never tried
    rows, nodes, depth, hit = observed_trials(tree, node_idx, accepted)
    assert nodes.tolist() == [0, 1, 2] and depth.tolist() == [1, 1, 2] and hit.tolist() == [1.0, 0.0, 0.0]
    assert accepted_nodes(node_idx, torch.tensor([[1, 3, -1]])).tolist() == [[0, 2, -1]]
    two = accepted_nodes(torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]]), torch.tensor([[1, 3, -1], [2, -1, -1]]))
    assert two.tolist() == [[0, 2, -1], [2, -1, -1]]  # a batch: the numpy path, the same rule


def test_calibrator_learns_online_and_stays_monotone():
    cal = Calibrator()  # identity prior: conditional = q before any observation
    state = cal.start(0.0)
    q = np.array([0.05, 0.225, 0.6])
    g = cal.group_ids(np.ones(3, dtype=np.int64), np.zeros(3, dtype=np.int64), np.zeros(3, dtype=np.int64))
    np.testing.assert_allclose(state.conditional(g, q), q, atol=0.02)
    # Every depth-1 best child with q ~ 0.22 is accepted: its conditional rises towards 1.
    state.update(np.full(100, g[0]), np.full(100, 0.225), np.ones(100))
    after = state.conditional(g, q)
    assert after[1] > 0.9 and after[2] >= after[1] >= after[0]
    # Other groups (second-ranked siblings) are untouched; deeper depths than num_depths share the last.
    other = cal.group_ids(np.array([1]), np.array([1]), np.array([0]))
    assert state.conditional(other, np.array([0.225]))[0] < 0.3
    assert cal.group_ids(np.array([9]), np.array([5]), np.array([1]))[0] == cal.num_groups - 1


def test_node_groups_split_by_depth_rank_and_copy():
    tree = _hand_tree()  # tokens 10 11 12 13; node 0 (q .5) outranks its sibling 1 (q .25)
    cal = Calibrator()
    groups = cal.node_groups(tree, [7, 10, 12, 4, 7])  # after the root "7" came "10" last time
    d, r, c = np.array([1, 1, 2, 3]), np.array([0, 1, 0, 0]), np.array([0, 0, 0, 0])
    expected = cal.group_ids(d, r, c)
    # copy flag (order 2): node 0 = "10" follows "4 7"? no; node 2 = "12" follows "7 10" -> yes (most recent)
    expected[2] = cal.group_ids(np.array([2]), np.array([0]), np.array([1]))[0]
    assert groups[0].tolist() == expected.tolist()


def test_calibrated_values_per_request_state_is_independent():
    tree = _hand_tree()
    model = CalibratedValues(Calibrator())
    a, b = model.for_request(SamplingConfig()), model.for_request(SamplingConfig())
    before = b.values(tree).clone()
    a.values(tree)
    for _ in range(20):
        a.observe(tree, torch.tensor([[0, 1, 2]]), torch.tensor([[0, 2]]))
    assert a.values(tree)[0, 2] > before[0, 2]
    torch.testing.assert_close(b.values(tree), before)


def test_calibrator_round_trips_and_rejects_bad_files(tmp_path):
    rng = np.random.default_rng(0)
    depth, score = rng.integers(1, 5, 500), rng.uniform(0, 1, 500)
    hit = (rng.uniform(0, 1, 500) < np.minimum(1.0, 3 * score)).astype(float)
    group = Calibrator().group_ids(depth, rng.integers(0, 3, 500), rng.integers(0, 2, 500))
    cal = Calibrator().fit({0.0: (group, score, hit), 1.0: (group, score, hit * 0)}, source="test")
    path = cal.save(tmp_path / "c.json")
    back = Calibrator.load(path)
    assert back == cal
    # The nearest temperature's table is used.
    q, g = np.array([0.3]), group[:1]
    assert back.start(0.2).conditional(g, q)[0] > back.start(0.9).conditional(g, q)[0]
    (tmp_path / "bad.json").write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="malformed"):
        Calibrator.load(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError):
        Calibrator.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="edges"):
        Calibrator(edges=(0.0, 0.5, 0.4, 1.0))


@settings(max_examples=40, deadline=None)
@given(seeds)
def test_policies_on_calibrated_values_are_parent_closed_and_within_budget(seed):
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, 2, int(rng.integers(0, 16))) if seed % 2 else random_eagle_tree(rng, 2, 3, 3)
    experts = random_experts(rng, tree, layers=2, experts=8, topk=2, num_popular=5)
    root = experts.bits[:, 0] if tree.num_nodes else torch.zeros(2, experts.bits.shape[2], dtype=torch.int64)
    # A calibrator that learnt something: deep nodes are accepted far more often than q says.
    state = Calibrator().start(0.0)
    state.update(rng.integers(0, Calibrator().num_groups, 300), rng.uniform(0, 1, 300),
                 (rng.uniform(0, 1, 300) < 0.8).astype(float))
    model = CalibratedValues(Calibrator()).for_request(SamplingConfig())
    model.state = state
    values = model.values(tree)
    valued = with_values(tree, values)
    budget = int(rng.integers(1, 10))
    steps = np.cumsum(rng.uniform(0.0, 0.3, size=12))
    policies = [make_policy("evict", cost_table=CostTable(tuple([1.0] + list(1.0 + steps))), budget=budget),
                make_policy("ecospec", budget=budget), make_policy("coverage", rho=0.8, budget=budget),
                make_policy("joint", cost_model=ExpertCostModel(1.0, 0.01, 0.05), budget=budget)]
    for policy in policies:
        assert policy.uses_values
        _assert_closed(valued, policy.select(valued, experts=experts, root_experts=root), budget)
    assert not make_policy("eagle3").uses_values and not make_policy("oracle").uses_values


def _copies_by_definition(tree, context, n=2):
    """copies_recent's definition, node by node: v's token is the most recent follower, in the context, of
    the last n tokens of (context + v's path up to its parent)."""
    tokens, parents, valid = tree.token_ids[0].tolist(), tree.parents[0].tolist(), tree.valid[0].tolist()
    recent = {tuple(context[i:i + n]): context[i + n] for i in range(len(context) - n)}
    def path(v):
        return [] if v < 0 else path(parents[v]) + [tokens[v]]
    out = []
    for v, tok in enumerate(tokens):
        prev = tuple((list(context) + path(parents[v]))[-n:])
        out.append(int(valid[v] and len(prev) >= n and recent.get(prev, -1) == tok))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_copies_recent_follows_its_definition(seed):
    from trtllm_moespec.core.node_features import copies_recent

    rng = np.random.default_rng(seed)
    tree = random_eagle_tree(rng, 1, 4, 3, vocab=5)  # a small vocabulary: many copies, many misses
    for length in (0, 1, 2, 3, 40):
        context = [int(t) for t in rng.integers(0, 5, length)]
        for n in (1, 2, 3):
            assert copies_recent(tree, context, n=n).tolist() == _copies_by_definition(tree, context, n)


def test_incremental_context_index_equals_a_fresh_one():
    from trtllm_moespec.core.node_features import ContextFollowers, copies_recent

    rng = np.random.default_rng(0)
    tree = random_eagle_tree(rng, 1, 3, 3, vocab=6)
    context, index = list(rng.integers(0, 6, 30)), ContextFollowers()
    for _ in range(5):
        context += list(rng.integers(0, 6, 3))
        assert copies_recent(tree, context, index=index).tolist() == copies_recent(tree, context).tolist()
    assert copies_recent(tree, context[:10], index=index).tolist() == copies_recent(tree, context[:10]).tolist()
