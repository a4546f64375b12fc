"""EVICT's compiled selection and the compiled top-k (core/select_host.py) against the numpy path they
replace: the same nodes in the same order and the same k*, expected tokens and cost, on random trees with
ties in score and depth, with and without a node cap."""

from unittest.mock import patch

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from trtllm_moespec.core import CostTable, DraftTree, make_policy
from trtllm_moespec.core import policies
from trtllm_moespec.core import tree as tree_module
from trtllm_moespec.core.select_host import compiled_evict, compiled_top
from trtllm_moespec.core.tree import top_k_nodes

from .strategies import random_eagle_tree, random_tree, seeds

pytest.importorskip("numba")


def _tied(tree: DraftTree, rng: np.random.Generator) -> DraftTree:
    """Round the scores to a coarse grid: many nodes tie in score, some in score and depth."""
    log = torch.where(tree.valid, torch.log(torch.round(tree.scores * 8) / 8 + 1e-3), tree.log_scores)
    return DraftTree(tree.token_ids, tree.parents, tree.depth, tree.draft_probs, log, tree.valid)


def _table(rng: np.random.Generator, n: int) -> CostTable:
    steps = rng.uniform(0.0, 2.0, n + 1)
    steps[1:2] += rng.uniform(0, 8)  # the first verified node costs most (MoE: its experts); n = 0: C(0) alone
    return CostTable(tuple(np.cumsum(steps) + 10.0))


@settings(max_examples=60, deadline=None)
@given(seeds)
def test_compiled_evict_selects_as_the_numpy_path(seed):
    assert compiled_evict() is not None, "numba is installed: the compiled selection must be on"
    rng = np.random.default_rng(seed)
    tree = random_eagle_tree(rng, 1, int(rng.integers(1, 5)), int(rng.integers(1, 5)), vocab=12) \
        if seed % 2 else random_tree(rng, 1, int(rng.integers(1, 30)), vocab=5)
    if seed % 3 == 0:
        tree = _tied(tree, rng)
    policy = make_policy("evict", cost_table=_table(rng, int(rng.integers(0, 40))),
                         budget=None if seed % 4 else int(rng.integers(1, 10)))
    got = policy.select(tree)
    with patch.object(policies, "compiled_evict", lambda: None):
        ref = policy.select(tree)
    assert got.node_idx.tolist() == ref.node_idx.tolist()
    assert torch.equal(got.num_selected, ref.num_selected)
    assert torch.equal(got.expected_tokens, ref.expected_tokens) and torch.equal(got.predicted_cost, ref.predicted_cost)


def test_a_table_of_c0_alone_selects_nothing_and_writes_nothing_outside_the_order():
    """A cost table of C(0) alone caps the selection at 0 nodes: the compiled top-k gets an empty order, which
    it must leave alone (it once wrote order[-1], before the array: heap corruption that hung a CI run; the suite
    runs numba with bounds checks, tests/conftest.py, so such a write fails here)."""
    tree = DraftTree.from_parents(torch.tensor([[5, 6]]), torch.tensor([[-1, 0]]), torch.tensor([[0.9, 0.8]]))
    got = make_policy("evict", cost_table=CostTable((1.0,))).select(tree)
    assert got.num_selected.tolist() == [0] and got.node_idx.shape == (1, 0)
    order = np.full(0, 7, dtype=np.int64)
    assert compiled_top()(tree.log_scores[0].numpy(), tree.depth[0].numpy(), tree.valid[0].numpy(), order) == 0


def test_a_tie_in_the_ratio_goes_to_the_smaller_prefix():
    # one sure node: (1 + 1) / C(1) = 2 / 2 ties 1 / C(0) = 1 / 1, and one more: 3 / 3 ties too
    tree = DraftTree.from_parents(torch.tensor([[5, 6]]), torch.tensor([[-1, 0]]), torch.tensor([[1.0, 1.0]]))
    policy = make_policy("evict", cost_table=CostTable((1.0, 2.0, 3.0)))
    got = policy.select(tree)
    with patch.object(policies, "compiled_evict", lambda: None):
        ref = policy.select(tree)
    assert got.num_selected.tolist() == ref.num_selected.tolist() == [0]


@settings(max_examples=60, deadline=None)
@given(seeds)
def test_compiled_top_k_orders_as_the_numpy_path(seed):
    """`top_k_nodes` (EAGLE-3's pruning, every fixed-budget policy) through `select_host.top_nodes`: the same
    nodes in the same order, -1 past the valid ones, k below and above the tree's size."""
    assert compiled_top() is not None
    rng = np.random.default_rng(seed)
    tree = random_eagle_tree(rng, 1, int(rng.integers(1, 5)), int(rng.integers(1, 5)), vocab=12) \
        if seed % 2 else random_tree(rng, 1, int(rng.integers(1, 30)), vocab=5)
    if seed % 3 == 0:
        tree = _tied(tree, rng)
    k = int(rng.integers(1, 2 * tree.num_nodes + 2))
    got = top_k_nodes(tree, k)
    with patch.object(tree_module, "compiled_top", lambda: None):
        ref = top_k_nodes(tree, k)
    assert got.tolist() == ref.tolist() and got.dtype == ref.dtype
    eagle3 = make_policy("eagle3", budget=k)
    picked = eagle3.select(tree)
    with patch.object(tree_module, "compiled_top", lambda: None):
        want = eagle3.select(tree)
    assert picked.node_idx.tolist() == want.node_idx.tolist() and torch.equal(picked.expected_tokens, want.expected_tokens)
