"""The static-shape drafter forward (models/eagle3/static.py: what a CUDA graph of a drafter
forward captures) equals `Eagle3Drafter.forward` for extensions padded to a bucket and for
tree-drafting steps with the frontier padded to its full width."""

import pytest
import torch

from trtllm_moespec.models.eagle3.static import extension_inputs, frontier_visibility, static_drafter_forward

ATOL = 2e-5


def _prefilled(drafter, S: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    cache = drafter.new_cache()
    width = drafter.fc.in_features
    drafter.extend(cache, torch.randint(0, 128, (1, S), generator=gen), torch.randn(1, S, width, generator=gen))
    a = drafter.midlayer.self_attn
    cache.reserve(S + 64, a.num_kv_heads, a.head_dim, cache.kv.dtype, cache.kv.device)
    return cache, gen


@pytest.mark.parametrize("T,bucket", [(1, 1), (1, 4), (3, 4), (5, 8), (8, 8)])
def test_static_extension_equals_the_drafter_forward(drafter, T, bucket):
    cache, gen = _prefilled(drafter, 9, seed=T + bucket)
    S, width = cache.num_tokens, drafter.fc.in_features
    ids, hidden = torch.randint(0, 128, (1, T), generator=gen), torch.randn(1, T, width, generator=gen)
    ref_kv, static_kv = cache.kv.clone(), cache.kv.clone()
    ref = drafter(hidden, input_ids=ids, cache_kv=ref_kv, cache_start=S)
    pad = bucket - T
    ids_b = torch.cat([ids, torch.zeros(1, pad, dtype=torch.int64)], 1)
    hidden_b = torch.cat([hidden, torch.zeros(1, pad, width)], 1)
    pos, write_idx, visible = extension_inputs(torch.tensor([S]), bucket, static_kv.shape[3])
    out = static_drafter_forward(drafter, static_kv, hidden_b, ids_b, pos, write_idx, visible)
    torch.testing.assert_close(out.logits[:, :T], ref.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.hidden[:, :T], ref.hidden, atol=ATOL, rtol=0)
    torch.testing.assert_close(static_kv[..., :S + T, :], ref_kv[..., :S + T, :], atol=ATOL, rtol=0)
    assert torch.equal(static_kv[..., :S, :], cache.kv[..., :S, :])  # committed keys untouched


@pytest.mark.parametrize("F_,topk,slots", [(2, 2, 0), (3, 4, 2), (4, 4, 6)])
def test_static_frontier_step_equals_the_drafter_forward(drafter, F_, topk, slots):
    """A drafting step: F frontier rows at S + slots.., each seeing the prefix, some earlier tree
    slots and itself (a random ancestor pattern); the static forward pads the frontier to topk."""
    cache, gen = _prefilled(drafter, 7, seed=F_ * 10 + slots)
    S, H = cache.num_tokens, drafter.config.hidden_size
    start = S + slots
    cache.kv[..., S:start, :] = torch.randn(cache.kv[..., S:start, :].shape, generator=gen)  # earlier tree keys
    allowed = torch.zeros(F_, start + F_, dtype=torch.bool)
    allowed[:, :S] = True
    allowed[:, S:start] = torch.rand(F_, slots, generator=gen) < 0.5
    allowed[:, start:] = torch.eye(F_, dtype=torch.bool)
    mask = torch.zeros(1, 1, F_, start + F_).masked_fill_(~allowed[None, None], torch.finfo(torch.float32).min)
    ids, hidden = torch.randint(0, 128, (1, F_), generator=gen), torch.randn(1, F_, H, generator=gen)
    pos = torch.full((1, F_), S + 1)
    ref_kv, static_kv = cache.kv.clone(), cache.kv.clone()
    ref = drafter(hidden, input_ids=ids, position_ids=pos, attention_mask=mask, cache_kv=ref_kv, cache_start=start)
    write_idx = start + torch.arange(topk)
    visible = frontier_visibility(mask, static_kv.shape[3], write_idx)
    pad = topk - F_
    out = static_drafter_forward(drafter, static_kv, torch.cat([hidden, torch.zeros(1, pad, H)], 1),
                                 torch.cat([ids, torch.zeros(1, pad, dtype=torch.int64)], 1),
                                 torch.full((1, topk), S + 1), write_idx, visible)
    torch.testing.assert_close(out.logits[:, :F_], ref.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.hidden[:, :F_], ref.hidden, atol=ATOL, rtol=0)
    torch.testing.assert_close(static_kv[..., :start + F_, :], ref_kv[..., :start + F_, :], atol=ATOL, rtol=0)


def test_frontier_visibility_rejects_masks_that_do_not_fit():
    mask = torch.zeros(1, 1, 3, 10)
    with pytest.raises(ValueError, match="exceeds"):
        frontier_visibility(mask, 8, torch.arange(3))
    with pytest.raises(ValueError, match="do not fit"):
        frontier_visibility(mask, 16, torch.arange(2))


@pytest.mark.parametrize("n", [1, 3, 5])
def test_static_extend_runner_equals_drafter_extend(drafter, n):
    """`StaticDrafterExtend.run` (what DrafterGraphs captures) leaves the drafter buffer and the
    last-position outputs as `Eagle3Drafter.extend` does."""
    from trtllm_moespec.models.eagle3.graphs import StaticDrafterExtend

    cache, gen = _prefilled(drafter, 6, seed=n)
    S = cache.num_tokens
    ids, hidden = torch.randint(0, 128, (1, n), generator=gen), torch.randn(1, n, drafter.fc.in_features, generator=gen)
    ref_kv = cache.kv.clone()
    out = StaticDrafterExtend(drafter, (1, 2, 4, 8)).run(cache.kv, S, ids, hidden)
    static_kv = cache.kv.clone()
    cache.kv.copy_(ref_kv)
    drafter.extend(cache, ids, hidden)
    torch.testing.assert_close(out.logits[:, -1], cache.last_logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.hidden[:, -1], cache.last_hidden, atol=ATOL, rtol=0)
    torch.testing.assert_close(static_kv[..., :S + n, :], cache.kv[..., :S + n, :], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        StaticDrafterExtend(drafter, (1, 2)).run(cache.kv, S, ids.repeat(1, 3), hidden.repeat(1, 3, 1))


def _count_runs(runner):
    """Wrap runner.run to record the frontier width of every real use."""
    calls, run = [], runner.run
    runner.run = lambda kv, hidden, ids, *a: calls.append(ids.shape[1]) or run(kv, hidden, ids, *a)
    return calls


@pytest.mark.parametrize("S,steps,topk,width", [(5, 2, 2, 2), (9, 4, 3, 3), (12, 5, 4, 4), (3, 3, 2, 5), (7, 1, 4, 4)])
def test_static_frontier_runner_drafts_the_default_tree(drafter, S, steps, topk, width):
    """`draft_eagle3_tree` with the static frontier runner (what `DrafterFrontierGraphs` captures),
    the frontier padded to `width` rows, drafts the tree the default path drafts: same tokens and
    parents, same scores and node features up to float rounding; the committed cache is untouched."""
    from trtllm_moespec.models.eagle3.drafting import draft_eagle3_tree
    from trtllm_moespec.models.eagle3.graphs import StaticDrafterFrontier

    cache, _ = _prefilled(drafter, S, seed=S * 7 + steps)
    committed = cache.kv[..., :S, :].clone()
    ref = draft_eagle3_tree(drafter, cache, steps, topk)
    runner = StaticDrafterFrontier(drafter, width)
    calls = _count_runs(runner)
    got = draft_eagle3_tree(drafter, cache, steps, topk, frontier_runner=runner)
    assert torch.equal(got.tree.token_ids, ref.tree.token_ids)
    assert torch.equal(got.tree.parents, ref.tree.parents)
    torch.testing.assert_close(got.tree.scores, ref.tree.scores, atol=1e-6, rtol=0)
    torch.testing.assert_close(got.node_hidden, ref.node_hidden, atol=ATOL, rtol=0)
    assert got.num_forwards == ref.num_forwards == steps - 1
    assert len(calls) == steps - 1 and all(1 <= c <= topk for c in calls)
    assert torch.equal(cache.kv[..., :S, :], committed) and cache.num_tokens == S


def test_static_frontier_runner_keeps_ddd_and_the_stop_hook(drafter):
    """DDD's rule and `should_expand` stop drafting at the same step with the runner as without."""
    from trtllm_moespec.models.eagle3.drafting import draft_eagle3_tree
    from trtllm_moespec.models.eagle3.graphs import StaticDrafterFrontier

    cache, _ = _prefilled(drafter, 8, seed=5)
    runner = StaticDrafterFrontier(drafter, 3)
    for kwargs in (dict(ddd_threshold=2.0), dict(ddd_threshold=0.0),
                   dict(should_expand=lambda tree, f: int(tree.depth[0, f].max()) < 3)):
        ref = draft_eagle3_tree(drafter, cache, 5, 3, **kwargs)
        got = draft_eagle3_tree(drafter, cache, 5, 3, frontier_runner=runner, **kwargs)
        assert got.num_forwards == ref.num_forwards
        assert torch.equal(got.tree.token_ids, ref.tree.token_ids) and torch.equal(got.tree.parents, ref.tree.parents)
    assert draft_eagle3_tree(drafter, cache, 5, 3, frontier_runner=runner,
                             should_expand=lambda tree, f: int(tree.depth[0, f].max()) < 3).num_forwards == 2


def test_static_frontier_runner_rejects_inputs_that_do_not_fit(drafter):
    from trtllm_moespec.models.eagle3.graphs import StaticDrafterFrontier, make_frontier_runner

    cache, _ = _prefilled(drafter, 6, seed=1)
    H = drafter.config.hidden_size
    runner = StaticDrafterFrontier(drafter, 2)
    with pytest.raises(ValueError, match="does not fit"):
        runner.run(cache.kv, torch.zeros(1, 3, H), torch.zeros(1, 3, dtype=torch.int64), 6, 6, torch.zeros(1, 1, 3, 9))
    with pytest.raises(ValueError, match="does not match"):
        runner.run(cache.kv, torch.zeros(1, 2, H), torch.zeros(1, 2, dtype=torch.int64), 6, 6, torch.zeros(1, 1, 2, 9))
    cap = cache.kv.shape[3]
    with pytest.raises(ValueError, match="padded frontier needs"):
        runner.run(cache.kv, torch.zeros(1, 1, H), torch.zeros(1, 1, dtype=torch.int64), 6, cap - 1,
                   torch.zeros(1, 1, 1, cap))
    with pytest.raises(ValueError, match=">= 1"):
        StaticDrafterFrontier(drafter, 0)
    with pytest.raises(ValueError, match="runner kind"):
        make_frontier_runner("eager", drafter, 2)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA device"):
            make_frontier_runner("graphs", drafter, 2)
