"""The compiled drafting step (models/eagle3/fused_step.py) against the torch/numpy path it replaces:
the same trees, node by node, with and without stop rules, alone and packed; its two helpers against
numpy's stable sorts, ties included."""

from unittest.mock import patch

import numpy as np
import pytest
import torch

from trtllm_moespec.core.tree import _next_frontier_host
from trtllm_moespec.models.eagle3 import drafting, fused_step
from trtllm_moespec.models.eagle3.drafting import draft_eagle3_tree, draft_eagle3_trees

from .test_eagle3_static import _prefilled

pytest.importorskip("numba")


@pytest.fixture
def reference():
    """A context in which drafting takes the torch/numpy path."""
    return patch.object(drafting, "fused_grow_step", lambda: None)


def _assert_same_draft(got, ref):
    for name in ("token_ids", "parents", "depth", "valid", "draft_probs"):
        assert torch.equal(getattr(got.tree, name), getattr(ref.tree, name)), name
    # the log is numba's in the kernel, torch's in the reference: equal up to the last bit
    torch.testing.assert_close(got.tree.log_scores, ref.tree.log_scores, rtol=1e-6, atol=1e-6)
    assert torch.equal(got.node_hidden, ref.node_hidden)
    assert got.num_forwards == ref.num_forwards


@pytest.mark.parametrize("S,steps,topk", [(5, 2, 2), (9, 4, 3), (12, 5, 4), (7, 6, 8)])
def test_fused_drafting_drafts_the_reference_tree(drafter, reference, S, steps, topk):
    assert drafting.fused_grow_step() is not None, "numba is installed: the fused step must be on"
    cache, _ = _prefilled(drafter, S, seed=S + steps)
    got = draft_eagle3_tree(drafter, cache, steps, topk)
    with reference:
        ref = draft_eagle3_tree(drafter, cache, steps, topk)
    assert ref.num_forwards == steps - 1 and got.tree.num_nodes == topk + (steps - 1) * topk * topk
    _assert_same_draft(got, ref)
    assert cache.num_tokens == S  # drafting never changes the committed cache


def test_fused_drafting_with_stop_rules_and_packed_requests(drafter, reference):
    """Stop rules read the tree between forwards; packed requests share each forward's rows."""
    caches = [_prefilled(drafter, S, seed=S)[0] for S in (6, 11, 8)]
    stops = [None, lambda tree, f: tree.num_nodes < 12, lambda tree, f: True]  # the second stops after one forward
    got = draft_eagle3_trees(drafter, caches, 4, 3, should_expand=stops)
    with reference:
        ref = draft_eagle3_trees(drafter, caches, 4, 3, should_expand=stops)
    assert [d.num_forwards for d in got] == [3, 1, 3]
    for g, r in zip(got, ref):
        _assert_same_draft(g, r)
    got_ddd = draft_eagle3_tree(drafter, caches[0], 5, 4, ddd_threshold=0.5)
    with reference:
        _assert_same_draft(got_ddd, draft_eagle3_tree(drafter, caches[0], 5, 4, ddd_threshold=0.5))


def test_fused_step_turns_off(monkeypatch, drafter, reference):
    monkeypatch.setenv("MOESPEC_FUSED_DRAFT", "0")
    assert fused_step.fused_grow_step() is None
    cache, _ = _prefilled(drafter, 6, seed=1)
    off = draft_eagle3_tree(drafter, cache, 3, 4)
    with reference:
        assert torch.equal(off.tree.log_scores, draft_eagle3_tree(drafter, cache, 3, 4).tree.log_scores)


@pytest.mark.parametrize("seed", range(6))
def test_top_indices_is_a_stable_descending_top_k(seed):
    rng = np.random.default_rng(seed)
    p = rng.integers(0, 6, size=40).astype(np.float32) / 5  # many ties
    fused_step.fused_grow_step()  # the helpers compiled
    for k in (1, 3, 8, 40):
        out = np.empty(k, dtype=np.int64)
        fused_step._top_indices(p, k, out)
        assert out.tolist() == np.argsort(-p, kind="stable")[:k].tolist()


@pytest.mark.parametrize("seed", range(6))
def test_next_frontier_matches_the_host_reference(seed):
    rng = np.random.default_rng(seed)
    with np.errstate(divide="ignore"):  # ties, and -inf (probability 0)
        log = np.log(rng.integers(0, 4, size=(1, 12)).astype(np.float32) / 3)
    fused_step.fused_grow_step()
    for topk in (1, 4, 12, 16):
        out = np.empty(topk, dtype=np.int64)
        fused_step._next_frontier(log[0], 7, out)
        assert out.tolist() == _next_frontier_host(log, 7, topk)[0].tolist()
