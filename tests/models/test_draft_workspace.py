"""The compiled drafting path's buffers kept between a request's steps (models/eagle3/workspace.py): reused
when nothing holds an earlier tree, never when something does (the earlier tree stays as drafted), and the
next tree drafted in them is the tree fresh buffers draft."""

from unittest.mock import patch

import pytest
import torch

from trtllm_moespec import LLM, SamplingParams
from trtllm_moespec.models.eagle3 import drafting, workspace
from trtllm_moespec.models.eagle3.drafting import draft_eagle3_tree

from .test_eagle3_static import _prefilled
from .test_fused_step import _assert_same_draft

pytest.importorskip("numba")

FIELDS = ("token_ids", "parents", "depth", "draft_probs", "log_scores", "valid")


def _snapshot(draft) -> dict:
    return {**{name: getattr(draft.tree, name).clone() for name in FIELDS}, "node_hidden": draft.node_hidden.clone()}


def _extend(drafter, cache, gen, n: int = 2) -> None:
    drafter.extend(cache, torch.randint(0, 128, (1, n), generator=gen), torch.randn(1, n, drafter.fc.in_features, generator=gen))


def test_a_tree_still_held_is_never_drafted_over(drafter):
    cache, gen = _prefilled(drafter, 9, seed=4)
    first = draft_eagle3_tree(drafter, cache, 4, 3)
    before, ws = _snapshot(first), cache.workspace
    assert ws is not None and not ws.unshared()  # `first` views its buffers
    _extend(drafter, cache, gen)
    second = draft_eagle3_tree(drafter, cache, 4, 3)
    assert cache.workspace is not ws  # drafted in new buffers ...
    after = _snapshot(first)
    assert all(torch.equal(before[k], after[k]) for k in before)  # ... so the first tree is as it was drafted
    assert not torch.equal(second.tree.token_ids, first.tree.token_ids[:, :second.tree.num_nodes]) or \
        not torch.equal(second.node_hidden, first.node_hidden)  # (the second tree is another tree)
    held = first.tree.draft_probs.detach()  # any alias of the storage counts, not only the views handed out
    del first, second
    _extend(drafter, cache, gen)
    draft_eagle3_tree(drafter, cache, 4, 3)
    assert torch.equal(held, before["draft_probs"])


def test_a_released_workspace_is_reused_and_drafts_the_fresh_tree(drafter):
    cache, gen = _prefilled(drafter, 7, seed=5)
    draft_eagle3_tree(drafter, cache, 5, 4)  # dropped at once: nothing holds its buffers
    ws = cache.workspace
    assert ws.unshared()
    for steps in range(3):  # the prefix grows past the mask's first allocation too
        _extend(drafter, cache, gen, n=1 + 150 * (steps == 1))
        with patch.object(drafting, "fused_grow_step", lambda: None):  # the reference path, fresh tensors
            want = draft_eagle3_tree(drafter, cache, 5, 4)
        got = draft_eagle3_tree(drafter, cache, 5, 4)
        assert cache.workspace is ws
        _assert_same_draft(got, want)
        del got


def test_a_workspace_of_another_shape_is_replaced(drafter):
    cache, _ = _prefilled(drafter, 6, seed=6)
    draft_eagle3_tree(drafter, cache, 4, 3)
    ws = cache.workspace
    draft_eagle3_tree(drafter, cache, 5, 3)  # a deeper tree: more nodes and slots
    assert cache.workspace is not ws and cache.workspace.shape != ws.shape


@pytest.mark.parametrize("policy", ["eagle3", "evict", "joint"])
def test_a_request_drafts_every_step_in_one_workspace(policy, monkeypatch):
    """Nothing in the engine keeps a step's tree past the step (the calibrated values drop theirs once
    observed): one workspace serves every speculative step of a request."""
    made = []
    init = workspace.DraftWorkspace.__init__
    monkeypatch.setattr(workspace.DraftWorkspace, "__init__", lambda self, *a: (made.append(1), init(self, *a))[1])
    llm = LLM("moespec-tiny", policy=policy, guard="off")
    out = llm.generate(["def fibonacci(n):\n"], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    steps = [s for s in out.steps if s.speculated]
    assert len(steps) > 3 and sum(s.accepted_tokens for s in steps) > 0
    assert len(made) == 1


def test_a_draft_is_cut_to_the_depth_its_request_can_emit(drafter):
    """`Draft.tree_within`: a tree the drafter could not draft past the limit comes back as it is (no read of
    its depths); a deeper one loses exactly its deeper nodes, as `limit_depth` cuts them."""
    from trtllm_moespec.core.tree import limit_depth
    from trtllm_moespec.engine.drafters import Draft

    cache, _ = _prefilled(drafter, 8, seed=7)
    drafted = draft_eagle3_tree(drafter, cache, 4, 3)  # 3 forwards: depths 1-4
    draft = Draft(drafted.tree, drafted)
    assert int(drafted.tree.depth.max()) == 4
    assert draft.tree_within(4) is drafted.tree and draft.tree_within(9) is drafted.tree
    for limit in (1, 2, 3):
        cut, want = draft.tree_within(limit), limit_depth(drafted.tree, limit)
        assert int(cut.depth[cut.valid].max()) == limit and torch.equal(cut.valid, want.valid)
