"""The step interface the server's scheduler drives, and its per-request implementation.

A serving engine holds up to `max_batch_size` admitted requests and advances all of
them by one speculative iteration per `step()`; the scheduler admits and retires
requests only between steps (continuous batching). Two engines implement it:

- `RoundRobinEngine`: each admitted request keeps its own `SpecEngine.run` generator
  (its own KV cache) and `step()` advances them one after another. Outputs are those
  of running each request alone, by construction.
- `BatchedServingEngine`: `engine.batch.BatchedEngine`, one target forward for all requests
  (K/V in per-request slots of the static cache), optionally with `joint-batch` selection.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Protocol

from ..engine.batch import BATCH_POLICIES, BatchedEngine
from ..engine.engine import Request, SpecEngine
from ..engine.stats import StepStats

if TYPE_CHECKING:
    from ..api import LLM, SamplingParams


def make_request(llm: "LLM", ids: list[int], params: "SamplingParams", tokenizer_lock: threading.Lock) -> Request:
    """A checked engine request (ValueError on bad input) whose stop-string check, which runs on
    the scheduler thread, takes `tokenizer_lock`: the tokenizer is shared with the caller's threads
    (so is it while a structured-output request builds its grammar, which reads the vocabulary)."""
    with tokenizer_lock:
        request = llm.make_request(ids, params)
    check = request.stop_check
    if check is not None:
        def locked_check(output_ids: list[int]) -> int | None:
            with tokenizer_lock:
                return check(output_ids)

        request.stop_check = locked_check
    return request


@dataclass(frozen=True)
class StepOutput:
    """What one `step()` produced for one request."""

    request: Request
    new_ids: list[int]  # tokens committed by this step (the first step's is the prefill token)
    finished: bool  # the request is done (eos, stop string or max_tokens) and has left the engine
    error: str | None = None  # set when the request failed; it has left the engine
    step: StepStats | None = None  # the speculative iteration's record (None for the prefill step)


@dataclass(frozen=True)
class BatchStepStats:
    """One `step()` over the whole batch (what /metrics reports)."""

    batch_size: int  # requests advanced by this step
    step_s: float  # wall time of the step
    unique_experts_per_layer: float  # experts the step's verify forward(s) woke, mean over MoE layers


class ServingEngine(Protocol):
    """What the scheduler needs from an engine."""

    max_batch_size: int

    @property
    def num_active(self) -> int:
        """Requests admitted and not yet finished."""

    def add(self, request: Request) -> None:
        """Admit a request (its prefill runs in the next `step()`); raises ValueError when full."""

    def abort(self, request: Request) -> None:
        """Drop an admitted request and free its slot (no-op when it already left)."""

    def step(self) -> tuple[list[StepOutput], BatchStepStats]:
        """Advance every admitted request by one iteration."""

    def warm_up(self, requests: list[Request]) -> float:
        """Decode `requests` apart from the admitted ones, paying the process's one-time costs
        (`SpecEngine.warm_up`); seconds."""


class RoundRobinEngine:
    """`ServingEngine` over the per-request `SpecEngine`: one iteration of each request in turn.

    Finished, failed and aborted requests release their generator (and with it their KV
    cache) before `step()` returns.
    """

    def __init__(self, engine: SpecEngine, max_batch_size: int):
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
        self.engine = engine
        self.max_batch_size = max_batch_size
        self._runs: dict[int, tuple[Request, Iterator[list[int]]]] = {}  # id(request) -> (request, generator)

    @property
    def num_active(self) -> int:
        return len(self._runs)

    def warm_up(self, requests: list[Request]) -> float:
        return self.engine.warm_up(requests)

    def add(self, request: Request) -> None:
        if len(self._runs) >= self.max_batch_size:
            raise ValueError(f"engine full: {self.max_batch_size} requests already admitted")
        self._runs[id(request)] = (request, self.engine.run(request))

    def abort(self, request: Request) -> None:
        entry = self._runs.pop(id(request), None)
        if entry is not None:
            entry[1].close()

    def step(self) -> tuple[list[StepOutput], BatchStepStats]:
        t0 = time.perf_counter()
        outputs = [self._advance(request, run) for request, run in list(self._runs.values())]
        for out in outputs:
            if out.finished or out.error is not None:
                self.abort(out.request)
        steps = [o.step for o in outputs if o.step is not None]
        experts = sum(s.unique_experts_per_layer for s in steps) / len(steps) if steps else 0.0
        return outputs, BatchStepStats(len(outputs), time.perf_counter() - t0, experts)

    @staticmethod
    def _advance(request: Request, run: Iterator[list[int]]) -> StepOutput:
        num_steps = len(request.steps)
        try:
            new_ids = next(run)
        except StopIteration:  # cannot happen: run() returns right after yielding the last tokens
            return StepOutput(request, [], True)
        except Exception as e:  # noqa: BLE001 - one failing request must not take the others down
            return StepOutput(request, [], False, error=f"{type(e).__name__}: {e}")
        step = request.steps[-1] if len(request.steps) > num_steps else None
        return StepOutput(request, list(new_ids), request.finish_reason is not None, step=step)


class BatchedServingEngine:
    """`ServingEngine` over `engine.batch.BatchedEngine` (one target forward per step)."""

    def __init__(self, engine: BatchedEngine):
        self.engine = engine
        self.max_batch_size = engine.max_batch_size

    @property
    def num_active(self) -> int:
        return self.engine.num_active

    def warm_up(self, requests: list[Request]) -> float:
        return self.engine.warm_up(requests)

    def add(self, request: Request) -> None:
        self.engine.add(request)

    def abort(self, request: Request) -> None:
        self.engine.abort(request)

    def step(self) -> tuple[list[StepOutput], BatchStepStats]:
        t0 = time.perf_counter()
        outputs, experts = self.engine.step()
        return ([StepOutput(o.request, o.new_ids, o.finished, step=o.step) for o in outputs],
                BatchStepStats(len(outputs), time.perf_counter() - t0, experts))


ENGINES = ("batched", *BATCH_POLICIES, "round-robin")


def make_engine(llm: "LLM", max_batch_size: int, kind: str = "batched") -> ServingEngine:
    """The serving engine for a loaded model: "batched" (one target forward per step for the whole
    batch, each request with its own policy), a batch policy ("joint-batch", "evict-batch",
    "ecospec-batch": batched, nodes chosen across the batch; needs the model loaded with policy
    joint, evict, ecospec) or "round-robin" (requests stepped one after another, each with its own
    forward: the reference the batched engine is tested against)."""
    if kind not in ENGINES:
        raise ValueError(f"unknown serving engine {kind!r}; choose one of {', '.join(ENGINES)}")
    if kind == "round-robin":
        return RoundRobinEngine(llm.engine, max_batch_size)
    return BatchedServingEngine(BatchedEngine(llm.engine, max_batch_size,
                                              batch_policy=None if kind == "batched" else kind))
