"""Expert placement under EP: rank masks, per-rank unions, and EP-aware greedy selection
against slow Python-set references."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from trtllm_moespec.core import DraftTree, ExpertCostModel, ExpertSets, make_policy
from trtllm_moespec.core.experts import words_to_bools
from trtllm_moespec.core.placement import ExpertPlacement, unique_per_rank_per_layer

from .strategies import random_eagle_tree, random_experts, seeds


def _pairs(bits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(words_to_bools(bits)).flatten().tolist())


def _rank_of(placement: ExpertPlacement, pair: int) -> int:
    return placement.owner[pair // placement.num_experts][pair % placement.num_experts]


def _busiest(placement: ExpertPlacement, pairs: set[int]) -> int:
    """U_max: per MoE layer the busiest rank's count, summed over layers."""
    counts = np.zeros((placement.num_layers, placement.num_ranks), dtype=int)
    for p in pairs:
        counts[p // placement.num_experts, _rank_of(placement, p)] += 1
    return int(counts.max(1).sum())


def test_contiguous_blocks_like_tensorrt_llm():
    p = ExpertPlacement.contiguous(num_layers=3, num_experts=8, num_ranks=4)
    assert p.owner == ((0, 0, 1, 1, 2, 2, 3, 3),) * 3
    assert p.local_experts(2, layer=1) == (4, 5)
    ids = torch.tensor([[[0, 1, 2], [3, 4, 5], [6, 7, 0]]])  # [T=1, L=3, topk=3]
    words = ExpertSets.from_topk_ids(ids[None], 8).bits[0, 0]
    # layer 0 {0,1,2}: ranks 0,0,1 -> [2,1,0,0]; layer 1 {3,4,5}: [0,1,2,0]; layer 2 {6,7,0}: [1,0,0,2]
    assert p.layer_rank_counts(words).tolist() == [[2, 1, 0, 0], [0, 1, 2, 0], [1, 0, 0, 2]]
    assert int(p.busiest_unique(words)) == 6  # every layer's busiest rank computes 2 experts


@pytest.mark.parametrize("experts,ranks", [(8, 3), (32, 5), (6, 0)])
def test_ep_that_does_not_divide_the_experts_is_rejected(experts, ranks):
    with pytest.raises(ValueError, match="--ep"):
        ExpertPlacement.contiguous(2, experts, ranks)


def test_bad_owner_maps_are_rejected():
    with pytest.raises(ValueError, match="rank 2 outside"):
        ExpertPlacement(((0, 1, 2),), num_ranks=2)
    with pytest.raises(ValueError, match="layer 1 lists 2 experts"):
        ExpertPlacement(((0, 1, 1), (0, 1)), num_ranks=2)


@settings(max_examples=30, deadline=None)
@given(seeds)
def test_layer_rank_counts_match_python_sets(seed):
    rng = np.random.default_rng(seed)
    L, E, N = int(rng.integers(1, 5)), 16, int(rng.choice([1, 2, 4, 8]))
    owner = tuple(tuple(int(r) for r in rng.integers(0, N, size=E)) for _ in range(L))  # any placement, not only blocks
    placement = ExpertPlacement(owner, N)
    ids = torch.from_numpy(rng.integers(-1, E, size=(5, L, 3)))
    words = ExpertSets.from_topk_ids(ids[None], E).bits[0]  # [5, W]
    counts = placement.layer_rank_counts(words)  # [5, L, N]
    for i in range(5):
        pairs = _pairs(words[i])
        assert counts[i].tolist() == [[sum(p // E == l and _rank_of(placement, p) == r for p in pairs)
                                       for r in range(N)] for l in range(L)]
        assert int(placement.busiest_unique(words[i])) == _busiest(placement, pairs)
    if N == 1:
        assert placement.busiest_unique(words).tolist() == [len(_pairs(w)) for w in words]


def test_unique_per_rank_per_layer_from_router_ids():
    placement = ExpertPlacement.contiguous(2, 8, 2)
    ids = torch.tensor([[[0, 5], [1, 2]], [[0, 7], [6, 2]]])  # [T=2, L=2, topk=2]
    # layer 0 uses {0, 5, 7}: rank 0 {0}, rank 1 {5, 7}; layer 1 uses {1, 2, 6}: rank 0 {1, 2}, rank 1 {6}
    assert unique_per_rank_per_layer(ids, placement).tolist() == [[1, 2], [2, 1]]


def _slow_ep_greedy(tree, experts, root, b, budget, token_cost, expert_cost, placement):
    """Textbook marginal greedy with Python sets, pricing the busiest rank's union."""
    N = tree.num_nodes
    node_sets = [_pairs(experts.bits[b, i]) for i in range(N)]
    traj = []
    for i in range(N):
        p = int(tree.parents[b, i])
        traj.append(node_sets[i] | (traj[p] if p >= 0 else set()))
    buf = _pairs(root[b])
    chosen, uniques = [], [_busiest(placement, buf)]
    while len(chosen) < budget:
        best, best_key = None, None
        for i in range(N):
            p = int(tree.parents[b, i])
            if not tree.valid[b, i] or i in chosen or (p >= 0 and p not in chosen):
                continue
            new = _busiest(placement, buf | traj[i]) - _busiest(placement, buf)
            key = float(tree.scores[b, i].double()) / (token_cost + expert_cost * new)
            if best_key is None or key > best_key:
                best, best_key = i, key
        if best is None:
            break
        chosen.append(best)
        buf |= traj[best]
        uniques.append(_busiest(placement, buf))
    return chosen, uniques


@settings(max_examples=30, deadline=None)
@given(seeds)
def test_ep_ecospec_and_joint_equal_slow_reference(seed):
    rng = np.random.default_rng(seed)
    tree = random_eagle_tree(rng, 2, steps=int(rng.integers(1, 4)), topk=int(rng.integers(1, 4)))
    experts = random_experts(rng, tree, layers=3, experts=16, topk=2, num_popular=10)
    root = random_experts(rng, tree, 3, 16, 2).bits[:, 0]
    placement = ExpertPlacement.contiguous(3, 16, int(rng.choice([2, 4])))
    budget = int(rng.integers(1, 10))
    sel = make_policy("ecospec", budget=budget, eps=0.5, placement=placement).select(tree, experts, root)
    for b in range(2):
        chosen, _ = _slow_ep_greedy(tree, experts, root, b, budget, 0.5, 1.0, placement)
        assert [i for i in sel.node_idx[b].tolist() if i >= 0] == chosen
    model = ExpertCostModel(c0=1.0, c_tok=0.02, c_exp=0.03)
    sel = make_policy("joint", cost_model=model, budget=budget, placement=placement).select(tree, experts, root)
    for b in range(2):
        chosen, uniques = _slow_ep_greedy(tree, experts, root, b, budget, 0.02, 0.03, placement)
        util = [(1 + sum(float(tree.scores[b, i].double()) for i in chosen[:j])) / (1.0 + 0.02 * j + 0.03 * uniques[j])
                for j in range(len(chosen) + 1)]
        j_star = max(range(len(util)), key=lambda j: (util[j], -j))
        assert [i for i in sel.node_idx[b].tolist() if i >= 0] == chosen[:j_star]
        assert math.isclose(float(sel.predicted_cost[b]), 1.0 + 0.02 * j_star + 0.03 * uniques[j_star])


@settings(max_examples=20, deadline=None)
@given(seeds)
def test_one_rank_placement_is_the_single_device_policy(seed):
    rng = np.random.default_rng(seed)
    tree = random_eagle_tree(rng, 2, steps=3, topk=3)
    experts = random_experts(rng, tree, layers=3, experts=8, topk=2, num_popular=6)
    root = random_experts(rng, tree, 3, 8, 2).bits[:, 0]
    one = ExpertPlacement.contiguous(3, 8, 1)
    model = ExpertCostModel(c0=1.0, c_tok=0.02, c_exp=0.03)
    for name, opts in (("ecospec", {"budget": 6}), ("joint", {"cost_model": model, "budget": 8})):
        a = make_policy(name, **opts).select(tree, experts, root)
        b = make_policy(name, placement=one, **opts).select(tree, experts, root)
        assert torch.equal(a.node_idx, b.node_idx) and torch.equal(a.predicted_cost.isnan(), b.predicted_cost.isnan())


def test_ep_pricing_takes_experts_on_an_idle_rank_as_free():
    # One MoE layer, 4 experts on 2 ranks: rank 0 holds {0, 1}, rank 1 holds {2, 3}.
    # The root already wakes {0, 1}: rank 0 is the busiest with 2, rank 1 idle.
    placement = ExpertPlacement.contiguous(1, 4, 2)
    root = ExpertSets.from_topk_ids(torch.tensor([[[[0, 1]]]]), 4).bits[:, 0]
    tree = DraftTree.from_parents(torch.tensor([[1, 2, 3]]), torch.tensor([[-1, -1, -1]]),
                                  torch.tensor([[0.5, 0.5, 0.9]]))
    ids = torch.tensor([[[[0, 2]], [[1, 3]], [[2, 3]]]])  # A {0, 2}, B {1, 3}, C {2, 3}
    experts = ExpertSets.from_topk_ids(ids, 4)
    # Global pricing: A .5/1, B .5/1, C .9/2 -> A. Busiest-rank pricing: C's experts both land on the idle
    # rank 1, which then holds 2 = rank 0's load, so U_max stays 2 and C costs only eps -> C.
    glob = make_policy("ecospec", budget=1, eps=1e-3).select(tree, experts, root)
    ep = make_policy("ecospec", budget=1, eps=1e-3, placement=placement).select(tree, experts, root)
    assert int(glob.node_idx[0, 0]) == 0 and int(ep.node_idx[0, 0]) == 2
    # joint's predicted cost counts U_max: C(1, U_max=2) with the root's experts included.
    model = ExpertCostModel(c0=1.0, c_tok=0.01, c_exp=0.1)
    sel = make_policy("joint", cost_model=model, budget=1, placement=placement).select(tree, experts, root)
    assert int(sel.node_idx[0, 0]) == 2 and math.isclose(float(sel.predicted_cost[0]), 1.0 + 0.01 + 0.1 * 2)


def test_placement_must_match_the_expert_sets():
    tree = DraftTree.from_parents(torch.tensor([[1]]), torch.tensor([[-1]]), torch.tensor([[0.5]]))
    experts = ExpertSets.from_topk_ids(torch.tensor([[[[0, 1]]]]), 4)
    with pytest.raises(ValueError, match="placement covers 2 layers x 4 experts"):
        make_policy("ecospec", placement=ExpertPlacement.contiguous(2, 4, 2)).select(tree, experts, None)
