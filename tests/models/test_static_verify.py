"""Bucketed static-shape verify forwards (models/cuda_graphs.py `StaticVerify`, the exact call a
CUDA graph captures, run eagerly on CPU) equal the eager lean forward: logits, capture hiddens
and router expert ids, for verifies and plain steps of several lengths padded to several buckets."""

import pytest
import torch

from trtllm_moespec.core.layout import build_layout
from trtllm_moespec.core.tree import DraftTree
from trtllm_moespec.models.cuda_graphs import StaticVerify, VerifyGraphs, make_runner, verify_buckets
from trtllm_moespec.models.target import TargetModel

from .conftest import build_hf, gpt_oss_config, qwen3_moe_config
from .test_lean_forward import _tree


def _target(arch: str) -> TargetModel:
    config = qwen3_moe_config() if arch == "qwen3_moe" else gpt_oss_config()
    return TargetModel(build_hf(config, seed=5), model_impl="lean")


def test_verify_buckets_are_a_ladder_capped_by_the_largest_verify():
    assert verify_buckets(32) == (1, 2, 4, 8, 16, 32, 33)
    assert verify_buckets(7) == (1, 2, 4, 8)
    assert verify_buckets(0) == (1,)
    with pytest.raises(ValueError):
        verify_buckets(-1)


def test_a_runner_rejects_bad_buckets_and_oversized_forwards():
    target = _target("qwen3_moe")
    cache = target.new_cache()
    with pytest.raises(ValueError, match="positive"):
        StaticVerify(target.lean, cache.kv, cache.slot, (0, 4))
    runner = StaticVerify(target.lean, cache.kv, cache.slot, (2, 4))
    assert runner.bucket(1) == 2 and runner.bucket(3) == 4
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        runner.bucket(5)
    with pytest.raises(ValueError, match="CUDA"):
        VerifyGraphs(target.lean, cache.kv, cache.slot, (1,))
    with pytest.raises(ValueError, match="runner kind"):
        make_runner("compiled", target.lean, cache.kv, cache.slot, (1,))
    with pytest.raises(ValueError, match="CUDA device"):
        target.use_verify_runner("graphs", (1, 2))
    hf = TargetModel(build_hf(qwen3_moe_config(), seed=5), model_impl="hf")
    with pytest.raises(ValueError, match="lean"):
        hf.use_verify_runner("static", (1, 2))


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("buckets", [(1, 2, 4, 8, 16), (8, 16), (16,)])
def test_bucketed_static_verify_equals_the_eager_verify(arch, buckets):
    """A prompt, then verifies of k = 0 (the plain step), 1, 4, 7, 12 nodes, each followed by a commit
    of some accepted nodes: the static path (padded to its bucket) and the eager path agree on every
    output, and their caches stay interchangeable (every step starts from the eager cache state)."""
    target = _target(arch)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 128, (1, 11), generator=gen)
    caches = {}
    for kind in (None, "static"):
        target.use_verify_runner(kind, buckets)
        cache = target.new_cache()
        target.prefill(cache, prompt)
        caches[kind] = cache
    assert target.verify_runner == "static"
    for step, k in enumerate((0, 1, 4, 7, 12)):
        tree = _tree(k, 10 + step) if k else DraftTree.empty(1)
        layout = build_layout(tree, torch.arange(k)[None], torch.tensor([7 + step]))
        outs = {}
        for kind in (None, "static"):
            target.use_verify_runner(kind, buckets)
            outs[kind] = target.verify(caches[kind], layout)
        assert caches["static"].slot in target._runners  # the verify above ran through the bucketed path
        eager, static = outs[None], outs["static"]
        assert static.logits.shape == eager.logits.shape == (1, k + 1, 128)
        torch.testing.assert_close(static.logits, eager.logits, atol=2e-5, rtol=0)
        torch.testing.assert_close(static.hidden, eager.hidden, atol=2e-5, rtol=0)
        assert torch.equal(static.expert_ids, eager.expert_ids)
        # commit only gathers cache slots: [2, 4] (not a chain) exercises the gather, [1] the in-place chain
        accepted = torch.tensor([2, 4, -1] if k >= 4 else [1, -1, -1] if k else [-1, -1, -1])
        for kind in (None, "static"):
            target.commit(caches[kind], accepted)
    assert caches[None].num_tokens == caches["static"].num_tokens


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_short_prefill_runs_through_the_bucket_and_keeps_the_last_logits(arch):
    """A prefill that fits a bucket runs the static path (logits of the last position only);
    a longer one stays eager. Both equal the eager forward."""
    target = _target(arch)
    gen = torch.Generator().manual_seed(2)
    for T in (3, 20):
        ids = torch.randint(0, 128, (1, T), generator=gen)
        outs = []
        for kind in (None, "static"):
            target.use_verify_runner(kind, (1, 2, 4, 8))
            cache = target.new_cache()
            outs.append(target.prefill(cache, ids))
            if kind == "static":
                assert (cache.slot in target._runners) == (T <= 8)
        assert outs[0].logits.shape == outs[1].logits.shape == (1, 1, 128)
        torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=2e-5, rtol=0)
        assert torch.equal(outs[1].expert_ids, outs[0].expert_ids)


def test_verify_graph_bookkeeping_captures_once_per_bucket_and_again_after_growth():
    """`VerifyGraphs` with capture replaced by the stand-in that replays by recomputing into the captured
    outputs (`graph_stand_in.py`): verifies of several sizes equal the eager ones, each bucket is
    captured once, and growing the cache (which moves the tensors the graphs point at) recaptures."""
    from .graph_stand_in import RecomputeCapture

    target = _target("qwen3_moe")
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 128, (1, 9), generator=gen)
    graph_cache, eager_cache = target.new_cache(), target.new_cache()
    for c in (graph_cache, eager_cache):
        target.prefill(c, prompt)
    capture = RecomputeCapture()
    graphs = VerifyGraphs(target.lean, graph_cache.kv, graph_cache.slot, (1, 2, 4, 8), capture=capture)
    grown = False
    for step, k in enumerate((0, 3, 1, 3, 0, 6, 3)):
        if step == 4:  # past the cache: every graph must be recaptured over the new tensors
            graph_cache.kv.ensure_len(graph_cache.kv.max_len * 2)
            grown = True
        tree = _tree(k, 20 + step) if k else DraftTree.empty(1)
        layout = build_layout(tree, torch.arange(k)[None], torch.tensor([5 + step]))
        P = graph_cache.num_tokens
        got = graphs.run(layout.token_ids, layout.position_ids(P), P, layout.tree_mask() if k else None)
        want = target.verify(eager_cache, layout)
        torch.testing.assert_close(got.logits, want.logits, atol=2e-5, rtol=0)
        assert torch.equal(got.expert_ids, want.expert_ids)
        graph_cache.num_pending = eager_cache.num_pending
        for c in (graph_cache, eager_cache):
            target.commit(c, torch.tensor([1] if k else [-1]))
    assert grown and graphs.captures == capture.calls == 3 + 3  # buckets 1, 4, 2; then 1, 8, 4 again
