"""Tree drafting without reading the frontier back (`sync_free`, what a CUDA drafter runs with no
stop rule): the frontier's -1 pads are fed through the forward instead of being dropped on the host.
On CPU tensors the same code drafts what the host-read path drafts: the same tree when every child
scores above 0 (scores to the last bit: the host-read path's logs are numba's, fused_step.py), the same
valid nodes (by token path) when some score exactly 0."""

import pytest
import torch

from trtllm_moespec.models.eagle3.drafting import draft_eagle3_tree
from trtllm_moespec.models.eagle3.graphs import StaticDrafterFrontier

from .test_eagle3_static import _prefilled


def _valid_paths(tree) -> dict[tuple[int, ...], float]:
    """{token path from the root's child: log score} of the tree's valid nodes of nonzero probability
    (which tokens of probability 0 fill a top-k is a tie each top-k breaks its own way)."""
    tokens, parents, valid = tree.token_ids[0].tolist(), tree.parents[0].tolist(), tree.valid[0].tolist()
    scores = tree.log_scores[0].tolist()
    out = {}
    for v in range(len(tokens)):
        if not valid[v] or scores[v] == float("-inf"):
            continue
        path, u = [], v
        while u >= 0:
            path.append(tokens[u])
            u = parents[u]
        out[tuple(reversed(path))] = scores[v]
    return out


@pytest.mark.parametrize("runner", [False, True])
@pytest.mark.parametrize("S,steps,topk", [(5, 2, 2), (9, 4, 3), (12, 5, 4)])
def test_sync_free_drafts_the_same_tree(drafter, S, steps, topk, runner):
    """No child's probability underflows here: every frontier is full, nothing is padded."""
    cache, _ = _prefilled(drafter, S, seed=S * 3 + steps)
    kwargs = dict(frontier_runner=StaticDrafterFrontier(drafter, topk)) if runner else {}
    ref = draft_eagle3_tree(drafter, cache, steps, topk, sync_free=False, **kwargs)
    got = draft_eagle3_tree(drafter, cache, steps, topk, sync_free=True, **kwargs)
    assert ref.tree.num_nodes == topk + (steps - 1) * topk * topk  # every frontier was full
    for name in ("token_ids", "parents", "depth", "valid"):
        assert torch.equal(getattr(got.tree, name), getattr(ref.tree, name)), name
    # the host-read path's bookkeeping is compiled on CPU (fused_step.py): its logs may differ in the last bit
    torch.testing.assert_close(got.tree.log_scores, ref.tree.log_scores, rtol=1e-6, atol=1e-6)
    assert torch.equal(got.node_hidden, ref.node_hidden)
    assert got.num_forwards == ref.num_forwards == steps - 1
    assert cache.num_tokens == S


def test_sync_free_pads_grow_only_invalid_children(drafter):
    """A drafter so sure of itself that most children's probabilities underflow to exactly 0: the
    host-read path drops those frontier entries, the sync-free path feeds them as pads. Both trees
    hold the same valid nodes with the same scores; the sync-free one also holds the pads' invalid
    children, and no valid node descends from a pad."""
    weight = drafter.lm_head.weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(400.0)
        cache, _ = _prefilled(drafter, 10, seed=4)
        steps, topk = 4, 4
        runner = StaticDrafterFrontier(drafter, topk)
        ref = draft_eagle3_tree(drafter, cache, steps, topk, frontier_runner=runner, sync_free=False)
        got = draft_eagle3_tree(drafter, cache, steps, topk, frontier_runner=runner, sync_free=True)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    # the host-read path expanded fewer nodes (frontier entries dropped); the pads' children are kept, invalid
    assert ref.tree.num_nodes < got.tree.num_nodes, "no child underflowed: the test needs a surer drafter"
    assert int(got.tree.valid.sum()) == ref.tree.num_nodes
    ref_paths, got_paths = _valid_paths(ref.tree), _valid_paths(got.tree)
    assert ref_paths.keys() == got_paths.keys()
    for path, score in ref_paths.items():
        assert got_paths[path] == pytest.approx(score, abs=1e-5)
    parents, valid = got.tree.parents[0], got.tree.valid[0]
    has_parent = parents >= 0
    assert bool(valid[parents[has_parent]][valid[has_parent]].all())  # a valid node's parent is valid
