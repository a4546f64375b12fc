"""DraftTree construction, EAGLE growth bookkeeping, score order and bad input."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from trtllm_moespec.core import DraftTree, draft_root, grow_tree, limit_depth, score_order, top_k_nodes

from .strategies import random_eagle_tree, random_tree, seeds


@pytest.mark.parametrize("steps,topk", [(1, 1), (1, 4), (3, 2), (4, 8)])
def test_eagle_tree_keeps_every_expanded_candidate(steps, topk):
    tree = random_eagle_tree(np.random.default_rng(0), 2, steps, topk)
    assert tree.num_nodes == topk + (steps - 1) * topk * topk
    assert bool(tree.valid.all())
    tree.validate()
    assert int(tree.depth.max()) == steps


def test_grow_tree_frontier_is_top_topk_children_by_score():
    tree, frontier = draft_root(torch.tensor([[10, 11]]), torch.tensor([[0.6, 0.4]]))
    child_ids = torch.tensor([[[1, 2], [3, 4]]])
    child_probs = torch.tensor([[[0.5, 0.5], [0.9, 0.1]]])
    tree, frontier = grow_tree(tree, frontier, child_ids, child_probs, topk=2)
    # children scores: 0.3, 0.3, 0.36, 0.04 -> frontier = node of token 3 (0.36), then token 1 (0.3, first)
    assert tree.token_ids[0, frontier[0]].tolist() == [3, 1]
    torch.testing.assert_close(tree.scores[0, 2:], torch.tensor([0.3, 0.3, 0.36, 0.04]))
    assert tree.parents[0].tolist() == [-1, -1, 0, 0, 1, 1]


def test_grow_tree_with_padded_frontier_slots():
    tree, frontier = draft_root(torch.tensor([[1, 2]]), torch.tensor([[0.5, 0.5]]))
    frontier = torch.tensor([[0, -1]])
    tree, new_frontier = grow_tree(tree, frontier, torch.tensor([[[3, 4], [5, 6]]]), torch.full((1, 2, 2), 0.5), 2)
    assert tree.valid[0].tolist() == [True, True, True, True, False, False]
    assert set(tree.token_ids[0, new_frontier[0]].tolist()) == {3, 4}
    tree.validate()


@settings(max_examples=60, deadline=None)
@given(seeds)
def test_every_prefix_of_score_order_is_parent_closed(seed):
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, 3, int(rng.integers(0, 24)))
    order = score_order(tree)
    for b in range(tree.batch_size):
        seen = set()
        for idx in order[b].tolist():
            if not tree.valid[b, idx]:
                continue
            p = int(tree.parents[b, idx])
            assert p == -1 or p in seen, "a node came before its parent"
            seen.add(idx)
        s = tree.scores[b, order[b]]
        assert bool((s[:-1] >= s[1:]).all()) if len(s) > 1 else True


def test_ties_keep_parent_before_child():
    # q = 1 gives the child exactly its parent's score: depth must break the tie.
    tree = DraftTree.from_parents(torch.tensor([[5, 6, 7]]), torch.tensor([[-1, 0, 1]]), torch.tensor([[0.5, 1.0, 1.0]]))
    assert score_order(tree)[0].tolist() == [0, 1, 2]
    assert top_k_nodes(tree, 5)[0].tolist() == [0, 1, 2, -1, -1]


@pytest.mark.parametrize(
    "parents,probs,match",
    [
        ([[-1, 1]], [[0.5, 0.5]], "invalid parent"),  # self-parent
        ([[-1, 2, 0]], [[0.5, 0.5, 0.5]], "invalid parent"),  # forward pointer (cycle possible)
        ([[-1, -2]], [[0.5, 0.5]], "invalid parent"),
        ([[-1, 0]], [[0.5, float("nan")]], "finite"),
        ([[-1, 0]], [[0.5, 1.5]], r"\[0, 1\]"),
    ],
)
def test_bad_trees_raise_value_error(parents, probs, match):
    with pytest.raises(ValueError, match=match):
        DraftTree.from_parents(torch.zeros(1, len(parents[0]), dtype=torch.long), torch.tensor(parents), torch.tensor(probs))


def test_validate_catches_inconsistent_fields():
    tree = DraftTree.from_parents(torch.tensor([[1, 2]]), torch.tensor([[-1, 0]]), torch.tensor([[0.5, 0.5]]))
    bad = DraftTree(tree.token_ids, tree.parents, tree.depth, tree.draft_probs,
                    torch.tensor([[-1.0, 0.0]]), tree.valid)  # child above parent
    with pytest.raises(ValueError, match="monotone"):
        bad.validate()
    bad = DraftTree(tree.token_ids, tree.parents, torch.tensor([[1, 3]]), tree.draft_probs, tree.log_scores, tree.valid)
    with pytest.raises(ValueError, match="depth"):
        bad.validate()
    invalid_parent = DraftTree.from_parents(torch.tensor([[1, 2]]), torch.tensor([[-1, -1]]), torch.tensor([[0.5, 0.5]]),
                                            torch.tensor([[False, True]]))
    object.__setattr__(invalid_parent, "parents", torch.tensor([[-1, 0]]))
    with pytest.raises(ValueError, match="padded"):
        invalid_parent.validate()


def test_empty_tree_and_top_k_errors():
    tree = DraftTree.empty(2)
    assert tree.num_nodes == 0 and score_order(tree).shape == (2, 0)
    with pytest.raises(ValueError):
        top_k_nodes(tree, -1)


@settings(max_examples=40, deadline=None)
@given(seeds)
def test_tree_buffer_grows_exactly_like_grow_tree(seed):
    """In-place growth gives the nodes and frontiers of draft_root + grow_tree, padded frontiers included."""
    from trtllm_moespec.core.tree import TreeBuffer

    rng = np.random.default_rng(seed)
    B, topk, steps = 2, int(rng.integers(1, 4)), int(rng.integers(1, 4))
    C = topk
    probs = torch.tensor(rng.dirichlet(np.ones(topk + 1), size=B)[:, :topk], dtype=torch.float32)
    ids = torch.tensor(rng.integers(0, 50, size=(B, topk)))
    ref, ref_frontier = draft_root(ids, probs)
    buf = TreeBuffer(B, topk + (steps - 1) * topk * C)
    frontier = buf.add_root(ids, probs)
    assert torch.equal(frontier, ref_frontier)
    for _ in range(steps - 1):
        if rng.random() < 0.3:  # pad some frontier slots, as the batched engine may
            ref_frontier = torch.where(torch.tensor(rng.random((B, topk)) < 0.4), -1, ref_frontier)
        child_ids = torch.tensor(rng.integers(0, 50, size=(B, topk, C)))
        child_probs = torch.tensor(rng.dirichlet(np.ones(C + 1), size=(B, topk))[..., :C], dtype=torch.float32)
        child_probs[0, 0, -1] = 0.0  # a zero-probability child never joins the frontier
        ref, new_ref = grow_tree(ref, ref_frontier, child_ids, child_probs, topk)
        frontier = buf.grow(ref_frontier, child_ids, child_probs, topk)
        assert torch.equal(frontier, new_ref)
        ref_frontier = new_ref
    got = buf.tree()
    for name in ("token_ids", "parents", "depth", "draft_probs", "log_scores", "valid"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    got.validate()


def test_tree_buffer_dense_growth_and_bad_use():
    from trtllm_moespec.core.tree import TreeBuffer

    ref, frontier = draft_root(torch.tensor([[10, 11]]), torch.tensor([[0.6, 0.4]]))
    child_ids, child_probs = torch.tensor([[[1, 2], [3, 4]]]), torch.tensor([[[0.5, 0.5], [0.9, 0.1]]])
    ref, ref_frontier = grow_tree(ref, frontier, child_ids, child_probs, topk=2)
    buf = TreeBuffer(1, 6)
    buf.add_root(torch.tensor([[10, 11]]), torch.tensor([[0.6, 0.4]]))
    assert torch.equal(buf.grow(frontier, child_ids, child_probs, 2, dense=True), ref_frontier)
    assert torch.equal(buf.tree().log_scores, ref.log_scores) and torch.equal(buf.tree().parents, ref.parents)
    with pytest.raises(ValueError, match="holds 6 nodes"):
        buf.grow(ref_frontier, child_ids, child_probs, 2)
    with pytest.raises(ValueError, match="empty TreeBuffer"):
        buf.add_root(torch.tensor([[1]]), torch.tensor([[1.0]]))


@settings(max_examples=60, deadline=None)
@given(seeds)
def test_keep_top_nodes_keeps_the_parent_closed_top_of_the_score_order(seed):
    """keep_top_nodes (the expert-aware policies' candidates): exactly the top-m nodes by score stay
    valid, every kept node's parent is kept, nothing else of the tree changes for them."""
    from trtllm_moespec.core.tree import keep_top_nodes

    rng = np.random.default_rng(seed)
    B, m = int(rng.integers(1, 4)), int(rng.integers(1, 12))
    tree = random_tree(rng, B, int(rng.integers(0, 24)))
    kept = keep_top_nodes(tree, m)
    top = top_k_nodes(tree, m)
    for b in range(B):
        want = {int(n) for n in top[b] if n >= 0}
        assert {int(n) for n in kept.valid[b].nonzero()[:, 0]} == want
        for n in want:
            p = int(kept.parents[b, n])
            assert p == -1 or p in want
            assert int(kept.token_ids[b, n]) == int(tree.token_ids[b, n])
            assert float(kept.log_scores[b, n]) == float(tree.log_scores[b, n])
    if tree.num_nodes <= m:
        assert kept is tree


@settings(max_examples=60, deadline=None)
@given(seeds)
def test_keep_top_valued_cuts_both_trees_to_the_top_of_the_value_order(seed):
    """keep_top_valued (the expert-aware policies' candidates, `SpecEngine.candidates`): the top-m nodes by
    *value* stay valid in the drafted tree and in its valued copy alike, parent-closed, each keeping its own
    scores; where values and raw scores rank differently, the cut follows the values."""
    from trtllm_moespec.core.tree import keep_top_valued
    from trtllm_moespec.core.values import path_values, with_values

    rng = np.random.default_rng(seed)
    B, m = int(rng.integers(1, 4)), int(rng.integers(1, 12))
    tree = random_tree(rng, B, int(rng.integers(0, 24)))
    valued = with_values(tree, path_values(tree, torch.from_numpy(rng.uniform(0.05, 1.0, tree.token_ids.shape))))
    cut, cut_valued = keep_top_valued(tree, valued, m)
    top = top_k_nodes(valued, m)
    for b in range(B):
        want = {int(n) for n in top[b] if n >= 0}
        for t, source in ((cut, tree), (cut_valued, valued)):
            assert {int(n) for n in t.valid[b].nonzero()[:, 0]} == want
            for n in want:
                p = int(t.parents[b, n])
                assert p == -1 or p in want
                assert float(t.log_scores[b, n]) == float(source.log_scores[b, n])
    if tree.num_nodes <= m:
        assert cut is tree and cut_valued is valued


@settings(max_examples=30, deadline=None)
@given(seeds)
def test_limit_depth_drops_exactly_the_deeper_nodes(seed):
    """limit_depth on a CPU tree (a host check first) as the rule says: nodes deeper than the limit padded,
    the rest unchanged; the same tree object back when none is deeper."""
    rng = np.random.default_rng(seed)
    tree = random_eagle_tree(rng, 1, int(rng.integers(1, 5)), int(rng.integers(1, 4)), vocab=12)
    limit = int(rng.integers(0, 6))
    got = limit_depth(tree, limit)
    keep = tree.valid & (tree.depth <= limit)
    if bool(keep.equal(tree.valid)):
        assert got is tree
        return
    assert torch.equal(got.valid, keep) and torch.equal(got.token_ids, tree.token_ids)
    assert torch.equal(got.parents, torch.where(keep, tree.parents, -1)) and int(got.depth.max()) <= limit
