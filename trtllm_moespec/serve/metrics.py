"""Server metrics in the Prometheus text format (the names of DESIGN.md, prefixed `moespec_`).

Counters accumulate since start; `moespec_tokens_per_s` is the generation rate over the
last `window_s` seconds of engine steps; the per-iteration means (Mat, verified nodes,
unique experts) are over every request-iteration since start.
"""

from __future__ import annotations

import collections
import threading
import time

from ..engine.stats import StepStats
from .engine import BatchStepStats


class ServeMetrics:
    """Thread-safe running totals, written by the scheduler thread, read by /metrics."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (end time, tokens) per step
        self.tokens = 0  # generated tokens (prefill tokens included)
        self.engine_steps = 0  # engine steps (one per batch iteration)
        self.batch_size_sum = 0  # requests over all engine steps (mean batch size = this / engine_steps)
        self.iterations = 0  # request-iterations (speculative steps of single requests)
        self.committed = 0
        self.verified = 0
        self.verify_steps = 0  # engine steps that verified (not only prefills)
        self.unique_experts_sum = 0.0  # over verify steps: experts the step's verify forward(s) woke
        self.step_seconds = 0.0
        self.finished = 0
        self.failed = 0
        self.cancelled = 0
        self.queue_depth = 0
        self.batch_size = 0

    def record_step(self, batch: BatchStepStats, steps: list[StepStats], num_tokens: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.tokens += num_tokens
            self._recent.append((now, num_tokens))
            while self._recent and self._recent[0][0] < now - self.window_s:
                self._recent.popleft()
            self.engine_steps += 1
            self.batch_size_sum += batch.batch_size
            self.step_seconds += batch.step_s
            if steps:  # a step of prefills only verifies nothing
                self.verify_steps += 1
                self.unique_experts_sum += batch.unique_experts_per_layer
            self.iterations += len(steps)
            self.committed += sum(s.committed_tokens for s in steps)
            self.verified += sum(s.verified_tokens for s in steps)

    def record_finish(self, failed: bool) -> None:
        with self._lock:
            if failed:
                self.failed += 1
            else:
                self.finished += 1

    def record_cancel(self) -> None:
        with self._lock:
            self.cancelled += 1

    def set_load(self, queue_depth: int, batch_size: int) -> None:
        with self._lock:
            self.queue_depth, self.batch_size = queue_depth, batch_size

    def tokens_per_s(self) -> float:
        """Generated tokens over the last `window_s` seconds (or since start), per second."""
        now = time.monotonic()
        with self._lock:
            recent = [(t, n) for t, n in self._recent if t >= now - self.window_s]
        span = max(min(self.window_s, now - self._start), 1e-3)
        return sum(n for _, n in recent) / span

    def render(self, prefix_cache=None) -> str:
        """The Prometheus text exposition of every metric (and of the engine's prefix cache, if any)."""
        tps = self.tokens_per_s()
        with self._lock:
            it = max(self.iterations, 1)
            rows = [
                ("tokens_per_s", "gauge", "generated tokens per second over the recent window", tps),
                ("mean_accepted_tokens", "gauge", "Mat: committed tokens per iteration, bonus included",
                 self.committed / it),
                ("verified_tokens", "gauge", "draft nodes verified per iteration", self.verified / it),
                ("unique_experts_per_layer", "gauge", "distinct experts woken per engine step, mean over MoE layers",
                 self.unique_experts_sum / max(self.verify_steps, 1)),
                ("queue_depth", "gauge", "requests waiting for a batch slot", self.queue_depth),
                ("batch_size", "gauge", "requests in the running batch", self.batch_size),
                ("mean_batch_size", "gauge", "requests per engine step since start",
                 self.batch_size_sum / max(self.engine_steps, 1)),
                ("generated_tokens_total", "counter", "tokens generated since start", self.tokens),
                ("engine_steps_total", "counter", "engine steps since start", self.engine_steps),
                ("engine_step_seconds_total", "counter", "time spent in engine steps", self.step_seconds),
                ("requests_finished_total", "counter", "requests that completed", self.finished),
                ("requests_failed_total", "counter", "requests that ended with an error", self.failed),
                ("requests_cancelled_total", "counter", "requests abandoned by their client", self.cancelled),
            ]
        if prefix_cache is not None:  # counters the scheduler thread bumps: a read of three ints
            rows += [
                ("prefix_cache_hits_total", "counter", "prompts that reused a kept prefix", prefix_cache.hits),
                ("prefix_cache_misses_total", "counter", "prompts prefilled in full", prefix_cache.misses),
                ("prefix_cache_reused_tokens_total", "counter", "prompt tokens not prefilled thanks to the cache",
                 prefix_cache.reused_tokens),
            ]
        lines = []
        for name, kind, help_text, value in rows:
            lines += [f"# HELP moespec_{name} {help_text}", f"# TYPE moespec_{name} {kind}",
                      f"moespec_{name} {float(value):.6g}"]
        return "\n".join(lines) + "\n"
