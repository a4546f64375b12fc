"""A stand-in for CUDA-graph capture, so the drafter runners' graph bookkeeping runs on CPU.

`capture(call, pool)` runs `call()` once and returns (graph, its outputs); `graph.replay()` runs
`call()` again and copies the result into those same output tensors, which is what a CUDA graph
replay amounts to for a capture of `call` (it rewrites its static outputs in place). Only capture
itself (kernels recorded, memory pools) is left to `tests/engine/test_cuda_engine.py`.
"""

from __future__ import annotations

import dataclasses


class RecomputeCapture:
    def __init__(self, on_capture=None):
        self.calls = 0  # captures made
        self.on_capture = on_capture  # run at each capture (a test may change the drafter's tables there)

    def __call__(self, call, pool):
        self.calls += 1
        if self.on_capture is not None:
            self.on_capture()
        output = call()

        class Graph:
            def replay(self):
                fresh = call()
                if dataclasses.is_dataclass(output):
                    for f in dataclasses.fields(output):
                        getattr(output, f.name).copy_(getattr(fresh, f.name))
        return Graph(), output
