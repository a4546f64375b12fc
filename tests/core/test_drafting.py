"""core.drafting: speculate-or-not and the drafting stop rule on hand-built numbers and trees."""

import numpy as np
import pytest
import torch

from trtllm_moespec.core.drafting import (DraftingCosts, DraftStopRule, expand_pays, level_continuation, raw_values,
                                          speculation_pays)
from trtllm_moespec.core.tree import DraftTree


def test_speculation_pays_compares_tokens_per_second():
    # plain: 1 token / 10 ms = 100 tok/s; spec: 3 tokens / 40 ms = 75 tok/s -> plain.
    assert not speculation_pays(3.0, 0.040, 0.010)
    assert speculation_pays(5.0, 0.040, 0.010)  # 125 tok/s
    assert not speculation_pays(1.1, 0.010, 0.010, margin=0.2)  # 110 tok/s is not 20% better
    with pytest.raises(ValueError, match="positive"):
        speculation_pays(1.0, 0.0, 0.010)


def test_drafting_costs_are_checked():
    with pytest.raises(ValueError, match="draft_forward_s"):
        DraftingCosts(0.01, -1.0)
    assert DraftingCosts(0.01, 0.002).draft_forward_s == 0.002


def _flat_table(c0, slope, K=8):
    return torch.tensor([c0 + slope * k for k in range(K + 1)], dtype=torch.float64)


def test_expand_pays_when_the_frontier_is_valuable():
    table = _flat_table(0.030, 0.001)  # 30 ms + 1 ms per node, 2 drafter forwards of 5 ms counted in it
    sorted_values = torch.tensor([[0.9, 0.8, 0.1, 0.0]])
    # Now: best rate (1 + 1.7) / (32 - 10 ms) = 122.7/s at k = 2. Frontier value 0.9 on one more node:
    # (2.7 + 0.9) / (23 + 5 ms) = 128.6/s is better; 0.7 gives 121.4/s, which is not.
    assert expand_pays(sorted_values, torch.tensor([[0.9, 0.0]]), table, 2, 0.005).tolist() == [True]
    assert expand_pays(sorted_values, torch.tensor([[0.7, 0.0]]), table, 2, 0.005).tolist() == [False]
    # A frontier worth 0.01 tokens cannot pay 5 ms + its verification.
    assert expand_pays(sorted_values, torch.tensor([[0.01, 0.0]]), table, 2, 0.005).tolist() == [False]


def test_expand_pays_hand_numbers_at_the_boundary():
    # C(k) = 30 ms flat, one 10 ms forward left.
    table = torch.tensor([0.030, 0.030, 0.030], dtype=torch.float64)
    vals = torch.tensor([[0.5, 0.0]])
    # Stop now: forwards_left=1, C_now = 20 ms, best = (1 + 0.5) / 20 ms = 75/s (k=1).
    # Expand with gain g, one more node: (1.5 + g) / 30 ms > 75/s  <=>  g > 0.75.
    assert expand_pays(vals, torch.tensor([[0.76]]), table, 1, 0.010).tolist() == [True]
    assert expand_pays(vals, torch.tensor([[0.74]]), table, 1, 0.010).tolist() == [False]


def _chain_tree(probs):
    """A chain root -> n1 -> n2 ... with the given local draft probabilities."""
    n = len(probs)
    return DraftTree.from_parents(torch.arange(n)[None] + 10, torch.tensor([[-1] + list(range(n - 1))]),
                                  torch.tensor([probs], dtype=torch.float32))


def test_stop_rule_on_a_tree_uses_values_and_frontier():
    tree = _chain_tree([0.9, 0.9])  # scores 0.9, 0.81; frontier = the last node
    frontier = torch.tensor([[1]])
    table = tuple(0.030 + 0.001 * k for k in range(9))
    cheap = DraftStopRule(table, draft_forward_s=0.001, steps=4)
    dear = DraftStopRule(table, draft_forward_s=0.050, steps=4)
    assert cheap(tree, frontier, 1).tolist() == [False]  # keep drafting
    assert dear(tree, frontier, 1).tolist() == [True]  # a 50 ms forward cannot pay for <= 0.81 tokens
    # Values plug in: a value model that says the frontier is worthless stops even cheap drafting.
    worthless = DraftStopRule(table, 0.001, 4, values=lambda t: torch.where(t.depth >= 2, 0.0, raw_values(t)))
    assert worthless(tree, frontier, 1).tolist() == [True]
    with pytest.raises(ValueError, match="steps"):
        DraftStopRule(table, 0.001, 0)


def test_expand_charges_the_frontiers_effective_node_count():
    # C(k) rises 10 ms per verified node. One dominant frontier node (0.8 of 0.83) is about one node to
    # verify: 10 ms + the 5 ms forward for +0.83 tokens pays; eight equal nodes would be charged 80 ms.
    table = torch.tensor([0.030 + 0.010 * k for k in range(17)], dtype=torch.float64)
    vals = torch.tensor([[0.9] + [0.001] * 7])
    dominant = torch.tensor([[0.8] + [0.03 / 7] * 7])
    spread = torch.full((1, 8), 0.83 / 8)
    assert expand_pays(vals, dominant, table, 1, 0.005).tolist() == [True]
    assert expand_pays(vals, spread, table, 1, 0.005).tolist() == [False]


def test_expand_looks_several_levels_ahead_when_the_first_node_is_dear():
    # C(k): 20 ms, 30 ms for the first verified node, then +1 ms per node; 2 forwards of 1 ms left.
    # Now: only the root (best 1 / 18 ms = 55.6/s). One level (+0.6 tokens): 1.6 / 29 ms = 55.2/s, no;
    # two levels (+0.6 + 0.54): 2.14 / 31 ms = 69.0/s, yes -- unless deeper levels keep nothing.
    table = torch.tensor([0.020, 0.030, 0.031, 0.032], dtype=torch.float64)
    vals, front = torch.zeros(1, 3), torch.tensor([[0.6]])
    assert expand_pays(vals, front, table, 2, 0.001, continuation=0.9).tolist() == [True]
    assert expand_pays(vals, front, table, 2, 0.001, continuation=0.0).tolist() == [False]


def test_level_continuation_is_the_ratio_of_the_last_two_levels():
    values = np.array([[0.8, 0.1, 0.6, 0.05]])
    depth = np.array([[1, 1, 2, 2]])
    assert level_continuation(values, depth, 1).tolist() == pytest.approx([0.9])  # depth 1 over the root
    assert level_continuation(values, depth, 2).tolist() == pytest.approx([0.65 / 0.9])
    assert level_continuation(np.array([[2.0, 0.5]]), np.array([[1, 1]]), 1).tolist() == [1.0]  # clipped
