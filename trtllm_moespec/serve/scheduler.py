"""The serving scheduler: a bounded waiting queue and one background loop over a `ServingEngine`.

    submit() -> [waiting queue, at most max_queue] -> admit (up to max_batch_size)
             -> engine.step() ... -> events to the request's sink -> retire

Admission and retirement happen only between steps (continuous batching). The loop
runs in its own thread because engine steps are long, blocking tensor work; the HTTP
side lives on an asyncio loop and receives events through thread-safe callbacks.
A cancelled request (its client went away) leaves the queue, or the engine before the
next step, so its slot is free for the next waiting request.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable

from ..core.logprobs import TokenLogprob
from ..engine.engine import Request
from .engine import ServingEngine, StepOutput
from .metrics import ServeMetrics

log = logging.getLogger("trtllm_moespec.serve")


class QueueFull(Exception):
    """The waiting queue is at its bound (HTTP 503)."""


@dataclass(frozen=True)
class TokenEvent:
    """Tokens committed for one request by one engine step (final: stop strings were applied), with
    their logprobs when the request asks for them. On a request's last event, `text_trim` is the
    characters a stop string cut off the end of the text of all its tokens (Request.stop_trim)."""

    token_ids: list[int]
    logprobs: tuple[TokenLogprob, ...] = ()
    text_trim: int = 0


@dataclass(frozen=True)
class FinishEvent:
    """The request is done; `reason` is "stop" or "length", or "error" with `error` set."""

    reason: str
    error: str | None = None


Sink = Callable[[TokenEvent | FinishEvent], None]  # called from the scheduler thread; must not block


@dataclass(eq=False)
class Ticket:
    """A submitted request as the scheduler tracks it."""

    id: int
    request: Request
    sink: Sink
    cancelled: bool = False
    state: str = "waiting"  # waiting -> running -> done
    num_tokens: int = field(default=0)


class Scheduler:
    """Admits, steps and retires requests on one background thread."""

    def __init__(self, engine: ServingEngine, max_queue: int = 64, metrics: ServeMetrics | None = None):
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, got {max_queue!r}")
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics or ServeMetrics()
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._running: dict[int, Ticket] = {}  # id(request) -> ticket
        self._cond = threading.Condition()
        self._ids = itertools.count()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ client side (any thread)
    def submit(self, request: Request, sink: Sink) -> Ticket:
        """Queue a request; raises QueueFull when `max_queue` requests already wait."""
        with self._cond:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            # Requests the free batch slots will take at the next admission do not count as queued.
            capacity = self.max_queue + self.engine.max_batch_size - len(self._running)
            if len(self._waiting) >= capacity:
                raise QueueFull(f"queue full: {len(self._waiting)} requests waiting (max_queue={self.max_queue})")
            ticket = Ticket(next(self._ids), request, sink)
            self._waiting.append(ticket)
            self._cond.notify()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Abandon a request (client disconnected); its slot is freed before the next step."""
        with self._cond:
            if ticket.state == "done":
                return
            ticket.cancelled = True
            self._cond.notify()

    @property
    def alive(self) -> bool:
        """The loop thread runs and is not stopping."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("scheduler already started")
        self._thread = threading.Thread(target=self._loop, name="moespec-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish nothing more: fail waiting and running requests, end the loop, join it."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"scheduler loop did not stop within {timeout}s")

    # ------------------------------------------------------------------ the loop (scheduler thread)
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._running:
                    self._cond.wait()
                if self._stopping:
                    break
                self._retire_cancelled()
                self._admit()
            if not self._running:
                continue
            try:
                outputs, stats = self.engine.step()
            except Exception as e:  # noqa: BLE001 - a failed step fails its batch, not the server
                log.exception("engine step failed")
                self._fail_all(f"{type(e).__name__}: {e}")
                continue
            self.metrics.record_step(stats, [o.step for o in outputs if o.step is not None],
                                     sum(len(o.new_ids) for o in outputs))
            for out in outputs:
                self._deliver(out)
            self.metrics.set_load(len(self._waiting), len(self._running))
        self._shutdown()

    def _retire_cancelled(self) -> None:
        for ticket in [t for t in self._waiting if t.cancelled]:
            self._waiting.remove(ticket)
            ticket.state = "done"
            self.metrics.record_cancel()
        for ticket in [t for t in self._running.values() if t.cancelled]:
            self.engine.abort(ticket.request)
            del self._running[id(ticket.request)]
            ticket.state = "done"
            self.metrics.record_cancel()

    def _admit(self) -> None:
        while self._waiting and self.engine.num_active < self.engine.max_batch_size:
            ticket = self._waiting.popleft()
            try:
                self.engine.add(ticket.request)
            except ValueError as e:  # the engine refused this request (e.g. it cannot fit a slot)
                ticket.state = "done"
                ticket.sink(FinishEvent("error", str(e)))
                continue
            ticket.state = "running"
            self._running[id(ticket.request)] = ticket
        self.metrics.set_load(len(self._waiting), len(self._running))

    def _deliver(self, out: StepOutput) -> None:
        ticket = self._running.get(id(out.request))
        if ticket is None:
            return
        if out.new_ids:
            start, ticket.num_tokens = ticket.num_tokens, ticket.num_tokens + len(out.new_ids)
            logprobs = () if out.request.logprobs is None else tuple(out.request.output_logprobs[start:ticket.num_tokens])
            ticket.sink(TokenEvent(out.new_ids, logprobs, out.request.stop_trim if out.finished else 0))
        if out.error is not None or out.finished:
            with self._cond:
                del self._running[id(out.request)]
                ticket.state = "done"
            # Counted before the caller hears of it: a client that reads /metrics right after its
            # response must see its request finished.
            self.metrics.record_finish(out.error is not None)
            if out.error is not None:
                ticket.sink(FinishEvent("error", out.error))
            else:
                ticket.sink(FinishEvent(out.request.finish_reason or "length"))

    def _fail_all(self, message: str) -> None:
        with self._cond:
            tickets = list(self._running.values())
            self._running.clear()
        for ticket in tickets:
            self.engine.abort(ticket.request)
            ticket.state = "done"
            self.metrics.record_finish(True)
            ticket.sink(FinishEvent("error", message))

    def _shutdown(self) -> None:
        with self._cond:
            tickets = list(self._waiting) + list(self._running.values())
            self._waiting.clear()
            self._running.clear()
        for ticket in tickets:
            self.engine.abort(ticket.request)
            if ticket.state != "done":
                ticket.state = "done"
                ticket.sink(FinishEvent("error", "the server is shutting down"))
