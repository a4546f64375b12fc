"""Server metrics on `prometheus_client`: our names (DESIGN.md's, prefixed `moespec_`) and, beside
them, the names vLLM's dashboards read (`vllm:...`, labelled with `model_name`).

    moespec_*   tokens/s over the last `window_s` s, Mat, verified tokens, experts per layer, queue,
                batch, counters of tokens / steps / requests, errors by HTTP status, prefix cache,
                histograms of time to first token, inter-token latency, end-to-end latency, queue time
    vllm:*      num_requests_running / waiting, prompt / generation tokens, request_success
                {finished_reason}, the same four latency histograms, request_prompt_tokens /
                request_generation_tokens, prefix_cache_queries / hits, spec_decode_num_drafts /
                num_draft_tokens / num_accepted_tokens

Running totals live here as plain numbers (the scheduler thread writes them under a lock; tests and
the runtime read them as attributes) and are exposed by a collector at scrape time; latencies go to
`prometheus_client` histograms. Each server has its own registry (several run in one test process).
Inter-token latency is observed per delivery, as vLLM does per engine iteration: one speculative step
delivers several tokens at once, and the gap between deliveries is what a streaming client waits.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Iterator

import prometheus_client
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..engine.stats import StepStats
from .engine import BatchStepStats

# The *_created samples double the output and no dashboard reads them (vLLM leaves them out too).
prometheus_client.disable_created_metrics()

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
# Histogram buckets (seconds): a tiny CPU model answers in ms, a 235B MoE in seconds; both must resolve.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000)


class _LatencyPair:
    """One latency histogram under our name and under vLLM's (observed together)."""

    def __init__(self, registry: CollectorRegistry, ours: str, vllm: str | None, help_text: str, buckets,
                 model_name: str):
        self.ours = Histogram(f"moespec_{ours}", help_text, buckets=buckets, registry=registry)
        self.vllm = None if vllm is None else Histogram(f"vllm:{vllm}", help_text, ["model_name"], buckets=buckets,
                                                        registry=registry).labels(model_name=model_name)

    def observe(self, value: float) -> None:
        self.ours.observe(value)
        if self.vllm is not None:
            self.vllm.observe(value)


class ServeMetrics:
    """Thread-safe running totals and latency histograms; `render()` is the /metrics body."""

    def __init__(self, model_name: str = "moespec", window_s: float = 10.0, prefix_cache=None):
        self.model_name, self.window_s, self.prefix_cache = model_name, window_s, prefix_cache
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (end time, tokens) per step
        self.tokens = 0  # generated tokens (prefill tokens included)
        self.prompt_tokens = 0  # prompt tokens of finished requests
        self.engine_steps = 0  # engine steps (one per batch iteration)
        self.batch_size_sum = 0  # requests over all engine steps (mean batch size = this / engine_steps)
        self.iterations = 0  # request-iterations (speculative steps of single requests)
        self.committed = 0
        self.verified = 0
        self.drafts = 0  # request-iterations that verified at least one drafted node
        self.accepted = 0  # drafted nodes accepted
        self.verify_steps = 0  # engine steps that verified (not only prefills)
        self.unique_experts_sum = 0.0  # over verify steps: experts the step's verify forward(s) woke
        self.step_seconds = 0.0
        self.finished = 0  # engine requests (sequences) that completed
        self.finish_reasons: collections.Counter[str] = collections.Counter()
        self.failed = 0  # engine requests that failed, and HTTP requests answered 5xx before reaching the engine
        self.cancelled = 0  # engine requests abandoned by their client
        self.aborted = 0  # engine requests ended by the server's shutdown
        self.errors: collections.Counter[int] = collections.Counter()  # HTTP error answers by status
        self.queue_depth = 0
        self.batch_size = 0
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_Totals(self))
        pair = lambda ours, vllm, text, buckets: _LatencyPair(self.registry, ours, vllm, text, buckets,  # noqa: E731
                                                              model_name)
        self.ttft = pair("time_to_first_token_seconds", "time_to_first_token_seconds",
                         "time from a request's arrival to its first token", TTFT_BUCKETS)
        self.itl = pair("inter_token_latency_seconds", "inter_token_latency_seconds",
                        "time between two deliveries of tokens to one request (one speculative step each)",
                        ITL_BUCKETS)
        self.e2e = pair("e2e_request_latency_seconds", "e2e_request_latency_seconds",
                        "time from a request's arrival to its last token", E2E_BUCKETS)
        self.queue_time = pair("request_queue_time_seconds", "request_queue_time_seconds",
                               "time a request waited for a batch slot", E2E_BUCKETS)
        self.prompt_hist = Histogram("vllm:request_prompt_tokens", "prompt tokens per finished request",
                                     ["model_name"], buckets=TOKEN_BUCKETS, registry=self.registry).labels(model_name)
        self.output_hist = Histogram("vllm:request_generation_tokens", "generated tokens per finished request",
                                     ["model_name"], buckets=TOKEN_BUCKETS, registry=self.registry).labels(model_name)

    # ------------------------------------------------------------------ writers (scheduler thread, handlers)
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
            self.drafts += sum(s.verified_tokens > 0 for s in steps)
            self.accepted += sum(s.accepted_tokens for s in steps)

    def record_queued(self, seconds: float) -> None:
        self.queue_time.observe(seconds)

    def record_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def record_token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def record_finish(self, failed: bool, reason: str | None = None, e2e_s: float | None = None,
                      prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        """An engine request's end: failed, or finished with `reason` after `e2e_s` seconds."""
        with self._lock:
            if failed:
                self.failed += 1
                return
            self.finished += 1
            self.finish_reasons[reason or "length"] += 1
            self.prompt_tokens += prompt_tokens
        if e2e_s is not None:
            self.e2e.observe(e2e_s)
        self.prompt_hist.observe(prompt_tokens)
        self.output_hist.observe(output_tokens)

    def record_cancel(self) -> None:
        with self._lock:
            self.cancelled += 1

    def record_abort(self) -> None:
        with self._lock:
            self.aborted += 1

    def record_error(self, status: int) -> None:
        """An HTTP request answered with an error (a stream's error event counts with its status)."""
        with self._lock:
            self.errors[int(status)] += 1

    def record_failure(self) -> None:
        """An HTTP request that failed on the server's side before reaching the engine (a 500)."""
        with self._lock:
            self.failed += 1

    def set_load(self, queue_depth: int, batch_size: int) -> None:
        with self._lock:
            self.queue_depth, self.batch_size = queue_depth, batch_size

    # ------------------------------------------------------------------ readers
    def tokens_per_s(self) -> float:
        """Generated tokens over the last `window_s` seconds (or since start), per second."""
        now = time.monotonic()
        with self._lock:
            recent = [(t, n) for t, n in self._recent if t >= now - self.window_s]
        span = max(min(self.window_s, now - self._start), 1e-3)
        return sum(n for _, n in recent) / span

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return prometheus_client.generate_latest(self.registry)


class _Totals:
    """The running totals (and the engine's prefix cache counters) as metric families, read at scrape."""

    def __init__(self, metrics: ServeMetrics):
        self.m = metrics

    def describe(self) -> list:
        return []  # unchecked: the families' names are fixed in collect() and collide with no histogram

    def collect(self) -> Iterator[Metric]:
        m, tps = self.m, self.m.tokens_per_s()
        with m._lock:
            it = max(m.iterations, 1)
            gauges = [
                ("tokens_per_s", "generated tokens per second over the recent window", tps),
                ("mean_accepted_tokens", "Mat: committed tokens per iteration, bonus included", m.committed / it),
                ("verified_tokens", "draft nodes verified per iteration", m.verified / it),
                ("unique_experts_per_layer", "distinct experts woken per engine step, mean over MoE layers",
                 m.unique_experts_sum / max(m.verify_steps, 1)),
                ("queue_depth", "requests waiting for a batch slot", m.queue_depth),
                ("batch_size", "requests in the running batch", m.batch_size),
                ("mean_batch_size", "requests per engine step since start", m.batch_size_sum / max(m.engine_steps, 1)),
            ]
            counters = [
                ("generated_tokens", "tokens generated since start", m.tokens),
                ("prompt_tokens", "prompt tokens of finished requests", m.prompt_tokens),
                ("engine_steps", "engine steps since start", m.engine_steps),
                ("engine_step_seconds", "time spent in engine steps", m.step_seconds),
                ("requests_finished", "engine requests that completed", m.finished),
                ("requests_failed", "requests that failed on the server's side (the 500s)", m.failed),
                ("requests_cancelled", "engine requests abandoned by their client", m.cancelled),
                ("requests_aborted", "engine requests ended by the server's shutdown", m.aborted),
            ]
            errors, reasons = dict(m.errors), dict(m.finish_reasons)
            running, waiting, tokens, prompt = m.batch_size, m.queue_depth, m.tokens, m.prompt_tokens
            drafts, drafted, accepted = m.drafts, m.verified, m.accepted
        for name, text, value in gauges:
            yield GaugeMetricFamily(f"moespec_{name}", text, value=value)
        for name, text, value in counters:
            yield CounterMetricFamily(f"moespec_{name}", text, value=value)
        by_status = CounterMetricFamily("moespec_request_errors", "HTTP requests answered with an error, by status",
                                        labels=["status_code"])
        for status, n in sorted(errors.items()):
            by_status.add_metric([str(status)], n)
        yield by_status
        yield from self._prefix_cache(prompt)
        yield from _vllm_families(m.model_name, running, waiting, prompt, tokens, reasons, drafts, drafted, accepted)

    def _prefix_cache(self, prompt_tokens: int) -> Iterator[Metric]:
        pc = self.m.prefix_cache
        if pc is None:
            return
        # counters the scheduler thread bumps: a read of three ints
        for name, text, value in (("hits", "prompts that reused a kept prefix", pc.hits),
                                  ("misses", "prompts prefilled in full", pc.misses),
                                  ("reused_tokens", "prompt tokens not prefilled thanks to the cache", pc.reused_tokens)):
            yield CounterMetricFamily(f"moespec_prefix_cache_{name}", text, value=value)
        label = [self.m.model_name]
        for name, text, value in (("queries", "prompt tokens looked up in the prefix cache", prompt_tokens),
                                  ("hits", "prompt tokens found in the prefix cache", pc.reused_tokens)):
            family = CounterMetricFamily(f"vllm:prefix_cache_{name}", text, labels=["model_name"])
            family.add_metric(label, value)
            yield family


def _vllm_families(model_name: str, running: int, waiting: int, prompt: int, generated: int, reasons: dict,
                   drafts: int, drafted: int, accepted: int) -> Iterator[Metric]:
    """vLLM's server-level names, as its dashboards query them."""
    label = [model_name]
    for name, text, value in (("num_requests_running", "requests in the running batch", running),
                              ("num_requests_waiting", "requests waiting for a batch slot", waiting)):
        family = GaugeMetricFamily(f"vllm:{name}", text, labels=["model_name"])
        family.add_metric(label, value)
        yield family
    for name, text, value in (("prompt_tokens", "prompt tokens of finished requests", prompt),
                              ("generation_tokens", "generated tokens", generated),
                              ("spec_decode_num_drafts", "speculative iterations that verified drafted tokens", drafts),
                              ("spec_decode_num_draft_tokens", "drafted tokens verified", drafted),
                              ("spec_decode_num_accepted_tokens", "drafted tokens accepted", accepted)):
        family = CounterMetricFamily(f"vllm:{name}", text, labels=["model_name"])
        family.add_metric(label, value)
        yield family
    success = CounterMetricFamily("vllm:request_success", "finished requests by finish reason",
                                  labels=["model_name", "finished_reason"])
    for reason in sorted(set(reasons) | {"stop", "length"}):
        success.add_metric([model_name, reason], reasons.get(reason, 0))
    yield success
