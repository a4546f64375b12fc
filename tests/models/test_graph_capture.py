"""`cuda_graphs._capture_graph` on CPU, with torch.cuda's stream and graph calls replaced by fakes:
the second warm-up runs with host synchronisations made errors (a forward that reads the device
from the host fails there, before any capture), and a capture that fails is unwound (the caller's
stream back, allocations no longer routed to the graph's pool) before its error propagates."""

from __future__ import annotations

import contextlib

import pytest
import torch

from trtllm_moespec.models import cuda_graphs
from trtllm_moespec.models.eagle3.graphs import DrafterGraphStore


class FakeStream(str):
    """A stream named by its role ("caller", "side", "capture")."""

    def wait_stream(self, other):
        pass


class FakeCuda:
    def __init__(self, fail_capture: bool = False):
        self.fail_capture = fail_capture
        self.mode = 0  # sync debug mode
        self.modes_seen: list[int] = []  # the mode at each call of the captured function
        self.current = FakeStream("caller")
        self.events: list = []

    def install(self, monkeypatch):
        cuda = torch.cuda
        fake = self

        class Graph:
            def pool(self):
                return ("own", 0)

        @contextlib.contextmanager
        def stream(s):
            previous, fake.current = fake.current, FakeStream("side")
            try:
                yield
            finally:
                fake.current = previous

        class graph:
            def __init__(self, g, pool=None):
                self.pool = pool

            def __enter__(self):
                fake.events.append(("capture", self.pool))
                fake.current = FakeStream("capture")

            def __exit__(self, *exc):
                if fake.fail_capture:  # torch: capture_end raises and the stream stays the capture's
                    raise RuntimeError("operation not permitted when stream is capturing")
                fake.current = FakeStream("caller")

        def set_sync_debug_mode(mode):
            fake.mode = {"default": 0, "warn": 1, "error": 2}.get(mode, mode)

        for name, value in dict(Stream=lambda: FakeStream("side"), CUDAGraph=Graph, stream=stream, graph=graph,
                                current_stream=lambda: fake.current, set_stream=self.set_stream,
                                get_sync_debug_mode=lambda: fake.mode, set_sync_debug_mode=set_sync_debug_mode,
                                current_device=lambda: 0, synchronize=lambda: None).items():
            monkeypatch.setattr(cuda, name, value)
        monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", self.end_routing, raising=False)

    def set_stream(self, s):
        self.events.append(("set_stream", s))
        self.current = s

    def end_routing(self, device, pool):
        self.events.append(("end_routing", device, pool))


def test_the_second_warm_up_runs_with_host_syncs_as_errors(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    out = torch.zeros(1)

    def call():
        fake.modes_seen.append(fake.mode)
        return out

    graph, captured = cuda_graphs._capture_graph(call, ("pool", 1))
    assert captured is out
    assert fake.modes_seen == [0, 2, 0]  # warm-up, warm-up without syncs, capture
    assert fake.mode == 0 and fake.current == "caller"


def test_a_forward_that_syncs_fails_before_any_capture(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)

    def call():
        if fake.mode == 2:
            raise RuntimeError("called a synchronizing CUDA operation")

    with pytest.raises(RuntimeError, match="synchronizing"):
        cuda_graphs._capture_graph(call, ("pool", 1))
    assert fake.events == [] and fake.mode == 0 and fake.current == "caller"  # nothing captured, mode restored


def test_a_failed_capture_is_unwound_before_its_error_propagates(monkeypatch):
    fake = FakeCuda(fail_capture=True)
    fake.install(monkeypatch)
    with pytest.raises(RuntimeError, match="capturing"):
        cuda_graphs._capture_graph(lambda: torch.zeros(1), ("pool", 1))
    assert fake.events[0] == ("capture", ("pool", 1))
    assert fake.events[1:3] == [("set_stream", "caller"), ("end_routing", 0, ("pool", 1))]
    assert fake.current == "caller"


def test_a_capture_failure_becomes_a_graph_capture_error_for_the_runners(monkeypatch):
    """Through `DrafterGraphStore`: the failed capture surfaces as GraphCaptureError (what the engine's
    fallback catches), with the store left without a graph for the buffer."""
    fake = FakeCuda(fail_capture=True)
    fake.install(monkeypatch)

    class Drafter:
        _rope_signed_table, _fused = None, None

    store = DrafterGraphStore(Drafter(), ("pool", 2))
    kv = torch.zeros(2, 1, 1, 4, 2)
    with pytest.raises(cuda_graphs.GraphCaptureError):
        store.replay(kv, "frontier", lambda: torch.zeros(1))
    assert store.captures == 0 and fake.current == "caller"
