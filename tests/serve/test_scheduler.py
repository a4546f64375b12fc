"""The scheduler over the per-request engine: exact outputs, batch bound, queue bound,
cancellation that frees the slot, and a clean stop."""

from __future__ import annotations

import threading
import time

import pytest

from trtllm_moespec import SamplingParams
from trtllm_moespec.serve.engine import RoundRobinEngine
from trtllm_moespec.serve.scheduler import FinishEvent, QueueFull, Scheduler, TokenEvent
from trtllm_moespec.serve.server import make_engine

PROMPTS = ["def add(a, b):\n", "import os\n", "class Stack:\n", "for i in range(10):\n", "# a comment\n"]


class _Collector:
    """Gathers a request's events (the sink runs on the scheduler thread)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.finish: FinishEvent | None = None
        self.done = threading.Event()

    def __call__(self, event):
        if isinstance(event, TokenEvent):
            self.tokens.extend(event.token_ids)
        else:
            self.finish = event
            self.done.set()


class _Watched:
    """A real serving engine, recording every step's batch size."""

    def __init__(self, inner):
        self.inner, self.max_batch_size = inner, inner.max_batch_size
        self.batch_sizes: list[int] = []

    @property
    def num_active(self) -> int:
        return self.inner.num_active

    def add(self, request) -> None:
        self.inner.add(request)

    def abort(self, request) -> None:
        self.inner.abort(request)

    def step(self):
        outputs, stats = self.inner.step()
        self.batch_sizes.append(stats.batch_size)
        return outputs, stats


def _wait(collectors, timeout=120.0):
    deadline = time.monotonic() + timeout
    for c in collectors:
        assert c.done.wait(max(deadline - time.monotonic(), 0.1)), "a request never finished"


@pytest.mark.parametrize("kind", ["round-robin", "batched"])
def test_outputs_equal_single_requests_and_batch_is_bounded(tiny_llm, kind):
    params = [SamplingParams(max_tokens=10, temperature=0.0), SamplingParams(max_tokens=10, temperature=0.9, seed=3)]
    engine = _Watched(make_engine(tiny_llm, 2, kind))
    scheduler = Scheduler(engine, max_queue=8)
    scheduler.start()
    try:
        jobs = []
        for i, prompt in enumerate(PROMPTS):
            request = tiny_llm.make_request(tiny_llm.encode(prompt)[0], params[i % 2])
            collector = _Collector()
            scheduler.submit(request, collector)
            jobs.append((prompt, params[i % 2], request, collector))
        _wait([c for *_, c in jobs])
    finally:
        scheduler.stop()
    for prompt, p, request, collector in jobs:
        alone = tiny_llm.generate([prompt], p)[0]
        assert collector.finish.error is None
        assert collector.tokens == request.output_ids == alone.token_ids
        assert collector.finish.reason == alone.finish_reason
    assert max(engine.batch_sizes) == 2 and engine.num_active == 0
    assert scheduler.metrics.finished == len(PROMPTS) and scheduler.metrics.tokens == 10 * len(PROMPTS)


def test_queue_bound(tiny_llm):
    scheduler = Scheduler(RoundRobinEngine(tiny_llm.engine, max_batch_size=1), max_queue=1)  # loop not started
    request = lambda: tiny_llm.make_request([1, 2, 3], SamplingParams(max_tokens=2))  # noqa: E731
    scheduler.submit(request(), _Collector())  # takes the free batch slot at the next admission
    scheduler.submit(request(), _Collector())  # waits
    with pytest.raises(QueueFull):
        scheduler.submit(request(), _Collector())
    assert scheduler.queue_depth == 2


@pytest.mark.parametrize("kind", ["round-robin", "batched"])
def test_cancel_frees_the_slot_for_the_next_request(tiny_llm, kind):
    engine = make_engine(tiny_llm, 1, kind)
    scheduler = Scheduler(engine, max_queue=4)
    long = tiny_llm.make_request(tiny_llm.encode(PROMPTS[0])[0], SamplingParams(max_tokens=500, ignore_eos=True))
    short = tiny_llm.make_request(tiny_llm.encode(PROMPTS[1])[0], SamplingParams(max_tokens=4))
    first, second = _Collector(), _Collector()
    scheduler.start()
    try:
        ticket = scheduler.submit(long, first)
        scheduler.submit(short, second)
        deadline = time.monotonic() + 60
        while not first.tokens and time.monotonic() < deadline:
            time.sleep(0.01)
        scheduler.cancel(ticket)
        _wait([second])
    finally:
        scheduler.stop()
    assert first.finish is None and 0 < len(long.output_ids) < 500  # abandoned mid-way, no event after
    assert second.finish.reason == "length" and len(second.tokens) == 4
    assert engine.num_active == 0 and scheduler.metrics.cancelled == 1


def test_stop_fails_open_requests_and_ends_the_loop(tiny_llm):
    scheduler = Scheduler(RoundRobinEngine(tiny_llm.engine, max_batch_size=1), max_queue=4)
    collectors = [_Collector() for _ in range(3)]
    scheduler.start()
    for c in collectors:
        scheduler.submit(tiny_llm.make_request([5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True)), c)
    time.sleep(0.2)
    scheduler.stop()
    assert not scheduler.alive and scheduler.num_running == 0 and scheduler.queue_depth == 0
    assert all(c.finish is not None and c.finish.reason == "error" for c in collectors)
    with pytest.raises(QueueFull):
        scheduler.submit(tiny_llm.make_request([5], SamplingParams(max_tokens=1)), _Collector())
