"""Packed drafter forwards (several requests' rows in one forward, attention per request): each
request's outputs, cache writes and drafted tree equal running it alone. A float64 drafter keeps
matmul rounding (which may differ with the number of rows) far below the tolerances."""

from __future__ import annotations

import pytest
import torch

from trtllm_moespec.models.eagle3 import PackedSegment, load_eagle3, write_random_drafter
from trtllm_moespec.models.eagle3.drafting import draft_eagle3_tree, draft_eagle3_trees

from .conftest import count_calls, qwen3_moe_config

TOL = dict(atol=1e-10, rtol=0)
PROMPT_LENS = (5, 9, 3)


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    path = write_random_drafter(qwen3_moe_config(), tmp_path_factory.mktemp("eagle3"), seed=3, draft_vocab_size=96,
                                init_std=0.2)
    return load_eagle3(path).double()


def _features(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (1, n), generator=gen), torch.randn(1, n, 3 * 64, generator=gen, dtype=torch.float64)


def _caches(drafter, lens=PROMPT_LENS):
    caches = []
    for i, n in enumerate(lens):
        cache = drafter.new_cache()
        drafter.extend(cache, *_features(n, seed=i))
        caches.append(cache)
    return caches


def test_packed_forward_rows_equal_each_request_alone(drafter):
    caches, alone = _caches(drafter), _caches(drafter)
    rows = (3, 1, 4)
    inputs = [_features(n, seed=10 + i) for i, n in enumerate(rows)]
    segments = []
    for c, n in zip(caches, rows):
        kv = c.reserve(c.num_tokens + n, 2, 16, torch.float64, "cpu")
        segments.append(PackedSegment(kv, c.num_tokens, n))
    positions = torch.cat([torch.arange(s.start, s.start + s.length) for s in segments])[None]
    out = drafter.forward_packed(torch.cat([h for _, h in inputs], 1), torch.cat([i for i, _ in inputs], 1),
                                 positions, segments)
    row = 0
    for c, (ids, hidden), n, seg in zip(alone, inputs, rows, segments):
        kv = c.reserve(c.num_tokens + n, 2, 16, torch.float64, "cpu")
        with torch.no_grad():
            ref = drafter(hidden, input_ids=ids, cache_kv=kv, cache_start=c.num_tokens)
        torch.testing.assert_close(out.logits[:, row:row + n], ref.logits, **TOL)
        torch.testing.assert_close(out.hidden[:, row:row + n], ref.hidden, **TOL)
        end = c.num_tokens + n
        torch.testing.assert_close(seg.cache_kv[:, :, :, :end], kv[:, :, :, :end], **TOL)  # keys written in place
        row += n


def test_packed_forward_rejects_segments_that_miss_rows(drafter):
    cache = _caches(drafter, (4,))[0]
    ids, hidden = _features(3, seed=1)
    with pytest.raises(ValueError, match="segments cover 2 rows"):
        drafter.forward_packed(hidden, ids, torch.arange(4, 7)[None], [PackedSegment(cache.kv, 4, 2)])


def test_extend_packed_equals_extend_one_by_one(drafter):
    lens = (5, 250, 3, 7)  # the second outgrows its 256-position buffer
    packed, alone = _caches(drafter, lens), _caches(drafter, lens)
    new = [_features(n, seed=20 + i) for i, n in enumerate((2, 9, 0, 1))]  # a request with nothing to add
    drafter.extend_packed(packed, [i for i, _ in new], [h for _, h in new])
    for c, (ids, hidden) in zip(alone, new):
        drafter.extend(c, ids, hidden)
    for p, a in zip(packed, alone):
        assert p.num_tokens == a.num_tokens
        torch.testing.assert_close(p.keys, a.keys, **TOL)
        torch.testing.assert_close(p.values, a.values, **TOL)
        torch.testing.assert_close(p.last_logits, a.last_logits, **TOL)
        torch.testing.assert_close(p.last_hidden, a.last_hidden, **TOL)


def _stop_after(n: int):
    asked = []

    def rule(tree, frontier) -> bool:
        asked.append(frontier.numel())
        return len(asked) <= n

    return rule


@pytest.mark.parametrize("ddd_threshold", [None, 0.05])
def test_trees_drafted_together_equal_trees_drafted_alone(drafter, ddd_threshold, monkeypatch):
    """Requests of different lengths, one with a stop rule that ends its drafting after one
    expansion: every tree, score and node hidden is the one drafted alone, the committed caches are
    untouched, and each drafting step ran one forward for all requests still expanding."""
    caches = _caches(drafter)
    alone = [draft_eagle3_tree(drafter, c, 4, 3, ddd_threshold, rule)  # drafting leaves the cache as it was
             for c, rule in zip(caches, [None, _stop_after(1), None])]
    forwards = count_calls(monkeypatch, drafter, "_forward_fused")
    together = draft_eagle3_trees(drafter, caches, 4, 3, ddd_threshold, [None, _stop_after(1), None])
    for t, a in zip(together, alone):
        assert t.num_forwards == a.num_forwards
        assert torch.equal(t.tree.token_ids, a.tree.token_ids) and torch.equal(t.tree.parents, a.tree.parents)
        torch.testing.assert_close(t.tree.scores, a.tree.scores, **TOL)
        torch.testing.assert_close(t.node_hidden, a.node_hidden, **TOL)
    assert forwards[0] == max(a.num_forwards for a in alone)
    assert [c.num_tokens for c in caches] == list(PROMPT_LENS)
    assert [a.num_forwards for a in alone] == ([3, 1, 3] if ddd_threshold is None else [2, 1, 2])  # DDD stopped some


def test_a_static_frontier_runner_drafts_one_request(drafter):
    caches = _caches(drafter, (4, 5))
    with pytest.raises(ValueError, match="one request at a time"):
        draft_eagle3_trees(drafter, caches, 3, 2, frontier_runner=object())
