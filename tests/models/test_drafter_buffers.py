"""Drafter K/V buffers reused across requests (`eagle3.cache.DrafterKVPool`) and the drafter's CUDA graphs
kept per buffer (`eagle3.graphs.DrafterGraphStore`): a reused buffer drafts exactly what a fresh one
does, a finished request's buffer goes to the next request, and graphs are captured once per buffer.
The graph store's bookkeeping runs here with a stand-in for CUDA capture (`graph_stand_in.py`: this machine has no GPU;
`tests/engine/test_cuda_engine.py` checks real capture and replay)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from trtllm_moespec.models.eagle3.cache import DrafterKVPool, Eagle3Cache
from trtllm_moespec.models.eagle3.drafting import draft_eagle3_tree
from trtllm_moespec.models.eagle3.graphs import DrafterGraphStore, DrafterGraphs, StaticDrafterExtend, StaticDrafterFrontier

from .graph_stand_in import RecomputeCapture


def _extend(drafter, cache, n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    drafter.extend(cache, torch.randint(0, 128, (1, n), generator=gen),
                   torch.randn(1, n, drafter.fc.in_features, generator=gen))


def _shape(drafter) -> tuple[int, int]:
    a = drafter.midlayer.self_attn
    return a.num_kv_heads, a.head_dim


def test_a_finished_request_hands_its_buffer_to_the_next(drafter):
    drafter.kv_pool = DrafterKVPool()
    cache = drafter.new_cache()
    _extend(drafter, cache, 20, seed=0)
    first = cache.kv
    del cache
    gc.collect()
    cache = drafter.new_cache()
    _extend(drafter, cache, 30, seed=1)
    assert cache.kv is first and drafter.kv_pool.allocated == 1
    other = drafter.new_cache()  # a request alive beside it gets a buffer of its own
    _extend(drafter, other, 5, seed=2)
    assert other.kv is not first and drafter.kv_pool.allocated == 2


def test_growing_keeps_the_committed_keys_and_returns_the_outgrown_buffer(drafter):
    drafter.kv_pool = pool = DrafterKVPool()
    cache = drafter.new_cache()
    _extend(drafter, cache, 200, seed=0)
    small, keys = cache.kv, cache.keys.clone()
    _extend(drafter, cache, 100, seed=1)  # 300 positions: past the first buffer's 256
    assert cache.kv is not small and cache.kv.shape[3] >= 300
    assert torch.equal(cache.keys[:, :, :200], keys)
    assert pool.take(10, _shape(drafter), small.dtype, small.device) is small  # the pool got it back


def test_a_reused_buffer_drafts_what_a_fresh_buffer_drafts(drafter):
    """A reused buffer holds the previous request's keys (zeroed when taken); the tree drafted over
    it, eagerly and through the static frontier forward that attends over the whole buffer, equals
    the tree drafted over a buffer of its own."""
    drafter.kv_pool = DrafterKVPool()
    dirty = drafter.new_cache()
    _extend(drafter, dirty, 120, seed=0)
    draft_eagle3_tree(drafter, dirty, steps=4, topk=4)  # tree keys written past the committed ones too
    del dirty
    gc.collect()
    reused, fresh = drafter.new_cache(), Eagle3Cache()
    for cache in (reused, fresh):
        _extend(drafter, cache, 40, seed=1)
    assert drafter.kv_pool.allocated == 1 and fresh.pool is None
    for runner in (None, StaticDrafterFrontier(drafter, 4)):
        a = draft_eagle3_tree(drafter, reused, steps=4, topk=4, frontier_runner=runner)
        b = draft_eagle3_tree(drafter, fresh, steps=4, topk=4, frontier_runner=runner)
        assert torch.equal(a.tree.token_ids, b.tree.token_ids) and torch.equal(a.tree.parents, b.tree.parents)
        assert torch.equal(a.tree.scores, b.tree.scores)


def test_the_pool_hands_out_the_smallest_fitting_buffer_and_keeps_what_the_busiest_moment_used():
    pool = DrafterKVPool()
    bufs = [pool.take(n, (2, 8), torch.float32, "cpu") for n in (100, 600, 1200)]
    assert [b.shape[3] for b in bufs] == [256, 600, 1200] and pool.peak == 3
    bufs[1].fill_(1.0)
    for b in bufs:
        pool.give(b)
    got = pool.take(300, (2, 8), torch.float32, "cpu")
    assert got is bufs[1] and not got.any()  # the smallest that fits, zeroed
    assert pool.take(10, (2, 8), torch.float64, "cpu").dtype == torch.float64  # never another dtype or shape
    assert pool.allocated == 4 and pool.peak == 3 and pool.in_use == 2
    extra = pool.take(2000, (2, 8), torch.float32, "cpu")  # nothing free fits: a fifth buffer, a third in use
    for b in (got, extra):
        pool.give(b)
    assert pool.in_use == 1 and len(pool._free) == 3  # at most `peak` kept: the smallest (256) went
    assert all(b.shape[3] >= 600 for b in pool._free)



@pytest.mark.parametrize("threshold", [20, 50])
def test_a_buffer_the_collector_gives_back_inside_take_does_not_deadlock(threshold):
    """A cache in a reference cycle is freed by the garbage collector, which can run inside `take` (any
    allocation may start a collection): the cache's finalizer then gives its buffer back while `take`
    holds the pool's lock. Frequent collections (a low threshold) make that happen within a few
    requests; the requests run on a thread so that a deadlock fails the test instead of hanging it."""
    pool = DrafterKVPool()

    def requests() -> None:
        for _ in range(300):
            cache = Eagle3Cache(pool=pool)
            cache.cycle = cache  # only the cyclic collector frees it
            cache.reserve(8, 1, 4, torch.float32, "cpu")
            del cache

    before = gc.get_threshold()
    gc.set_threshold(threshold, 2, 2)
    try:
        worker = threading.Thread(target=requests, daemon=True)
        worker.start()
        worker.join(60)
    finally:
        gc.set_threshold(*before)
    assert not worker.is_alive(), "a finalizer's give waited for the lock its own take held"
    gc.collect()
    assert pool.in_use == 0 and len(pool._free) <= pool.peak and pool.allocated < 300  # buffers came back and were reused

def test_graphs_are_captured_once_per_buffer_and_replayed_after(drafter):
    capture = RecomputeCapture()
    store = DrafterGraphStore(drafter, pool=None, capture=capture)
    a, b = torch.zeros(3), torch.zeros(3)
    for kv in (a, b, a, b, a):  # two live requests, drafting in turn
        store.replay(kv, "frontier", lambda kv=kv: kv.add_(1))
    assert capture.calls == 2 and store.captures == 2 and store.num_buffers == 2
    assert a.tolist() == [4.0] * 3 and b.tolist() == [3.0] * 3  # the stand-in's capture call, then a replay per use
    store.replay(a, 4, lambda: None)  # another graph name over the same buffer
    assert store.captures == 3 and store.num_buffers == 2


def test_graphs_go_with_their_buffer_or_when_the_drafter_tables_change(drafter):
    drafter._fused_weights()  # built here, whether or not an earlier test in this process ran a forward
    capture = RecomputeCapture()
    store = DrafterGraphStore(drafter, pool=None, capture=capture)
    a, b = torch.zeros(1), torch.zeros(1)
    for kv in (a, b):
        store.replay(kv, "frontier", lambda: None)
    del b, kv  # a freed buffer's memory may be reused: its graphs must never replay
    gc.collect()
    assert store.num_buffers == 1
    c = torch.zeros(1)
    store.replay(c, "frontier", lambda: None)
    assert capture.calls == 3 and store.num_buffers == 2
    fused = drafter._fused
    drafter._fused = None  # new fused weights (reloaded weights): every graph points at the old ones
    try:
        store.replay(a, "frontier", lambda: None)
        assert capture.calls == 4 and store.num_buffers == 1
    finally:
        drafter._fused = fused


def test_tables_built_by_the_first_capture_drop_the_graphs_captured_before(drafter):
    """A capture's warm-up may build the drafter's tables (its first forward): graphs captured
    earlier point at the old ones and must not replay."""
    fused = drafter._fused_weights()  # built here: the test may be the first of this module's drafter's uses
    drafter._fused = None
    capture = RecomputeCapture()
    store = DrafterGraphStore(drafter, pool=None, capture=capture)
    a = torch.zeros(1)
    try:
        store.replay(a, 1, lambda: None)
        capture.on_capture = lambda: setattr(drafter, "_fused", fused)  # the next capture builds the table
        store.replay(a, 2, lambda: None)
        store.replay(a, 1, lambda: None)
        assert capture.calls == 3  # graph 1 recaptured over the new table
        store.replay(a, 2, lambda: None)
        assert capture.calls == 3
    finally:
        drafter._fused = fused


def test_extension_graphs_are_captured_once_per_bucket_and_buffer(drafter):
    """`DrafterGraphs` over a stand-in capture: extensions of every bucket size, over two buffers in
    turn, equal the eager extension, and each (buffer, bucket) is captured once: a new bucket's first
    use does not drop the graphs of the others."""
    drafter.kv_pool = DrafterKVPool()
    capture = RecomputeCapture()
    buckets = (1, 2, 4, 5)
    graphs = DrafterGraphs(drafter, buckets, graphs=DrafterGraphStore(drafter, pool=None, capture=capture))
    eager = StaticDrafterExtend(drafter, buckets)
    caches = [drafter.new_cache(), drafter.new_cache()]
    for c in caches:
        _extend(drafter, c, 20, seed=0)
    a = drafter.midlayer.self_attn
    gen = torch.Generator().manual_seed(1)
    for n in (4, 1, 4, 2, 5, 1, 3, 4):
        for c in caches:
            ids = torch.randint(0, 128, (1, n), generator=gen)
            hidden = torch.randn(1, n, drafter.fc.in_features, generator=gen)
            kv = c.reserve(c.num_tokens + graphs.bucket(n), a.num_kv_heads, a.head_dim, c.kv.dtype, c.kv.device)
            ref_kv = kv.clone()
            want = eager.run(ref_kv, c.num_tokens, ids, hidden)
            got = graphs.run(kv, c.num_tokens, ids, hidden)
            torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)
            torch.testing.assert_close(kv[:, :, :, :c.num_tokens + n], ref_kv[:, :, :, :c.num_tokens + n], atol=1e-5, rtol=0)
            c.num_tokens += n
    assert capture.calls == graphs.captures == 2 * len(buckets)  # each bucket once per buffer
