"""The serving scheduler: a waiting queue (unbounded by default) and one background loop over a `ServingEngine`.

    submit_all() -> [waiting queue, unbounded or max_queue] -> admit (up to max_batch_size)
                 -> engine.step() ... -> events to the request's sink -> retire

Admission and retirement happen only between steps (continuous batching). The loop
runs in its own thread because engine steps are long, blocking tensor work; the HTTP
side lives on an asyncio loop and receives events through thread-safe callbacks.
A cancelled request (its client went away) leaves the queue, or the engine before the
next step, so its slot is free for the next waiting request. Every sink call happens under the
scheduler's lock, so a request's events never interleave with the shutdown's end of it.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from ..core.logprobs import TokenLogprob
from ..engine.engine import Request
from .engine import ServingEngine, StepOutput
from .metrics import ServeMetrics

log = logging.getLogger("trtllm_moespec.serve")


SHUTTING_DOWN = "the server is shutting down"
RETRY_AFTER_S = 1  # what a refused client is told to wait (HTTP Retry-After) before it tries again


class QueueFull(Exception):
    """The waiting queue is at its bound, or the server is shutting down (HTTP 503 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: int = RETRY_AFTER_S):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NeverFits(ValueError):
    """A request of more sequences than the server holds at once, even idle (HTTP 400: retrying cannot help)."""


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
    """The request is done; `reason` is "stop" or "length", or "error" with `error` set and `status` the
    HTTP status it stands for (500: it failed in the engine; 503: the server shut down before it ended)."""

    reason: str
    error: str | None = None
    status: int = 500


Sink = Callable[[TokenEvent | FinishEvent], None]  # called from the scheduler thread; must not block


@dataclass(eq=False)
class Ticket:
    """A submitted request as the scheduler tracks it (times: time.monotonic())."""

    id: int
    request: Request
    sink: Sink
    arrival: float  # when its HTTP request arrived (latencies count from here)
    cancelled: bool = False  # its client went away: no more events
    ended: bool = False  # it got its FinishEvent from the shutdown while running; the loop still aborts it
    state: str = "waiting"  # waiting -> running -> done
    num_tokens: int = 0
    last_delivery: float | None = None


class Scheduler:
    """Admits, steps and retires requests on one background thread.

    `max_queue` None (the default) queues every request; an integer bounds the requests waiting beyond
    the batch (more: QueueFull, HTTP 503), and a request of more sequences than batch + queue can hold
    at all is NeverFits (HTTP 400). `drain()` stops taking requests and ends what is left at a deadline.
    """

    def __init__(self, engine: ServingEngine, max_queue: int | None = None, metrics: ServeMetrics | None = None):
        if max_queue is not None and (not isinstance(max_queue, int) or max_queue < 0):
            raise ValueError(f"max_queue must be None (unbounded) or an integer >= 0, got {max_queue!r}")
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics or ServeMetrics()
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._running: dict[int, Ticket] = {}  # id(request) -> ticket
        self._cond = threading.Condition()  # guards the queue, the running set and every sink call
        self._ids = itertools.count()
        self._stopping = False
        self._draining = False
        self._timer: threading.Timer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ client side (any thread)
    def submit(self, request: Request, sink: Sink, arrival: float | None = None) -> Ticket:
        """Queue a request (QueueFull / NeverFits: see `submit_all`)."""
        return self.submit_all([(request, sink)], arrival)[0]

    def submit_all(self, items: Sequence[tuple[Request, Sink]], arrival: float | None = None) -> list[Ticket]:
        """Queue the sequences of one HTTP request together, or none of them: QueueFull when the
        bounded queue has no room for all of them now, NeverFits when it never could."""
        arrival = time.monotonic() if arrival is None else arrival
        with self._cond:
            if self._stopping or self._draining:
                raise QueueFull(SHUTTING_DOWN)
            if self.max_queue is not None:
                most = self.max_queue + self.engine.max_batch_size
                if len(items) > most:
                    raise NeverFits(f"this request makes {len(items)} sequences (prompts x n); the server holds at "
                                    f"most {most} at once ({self.engine.max_batch_size} running + {self.max_queue} "
                                    "waiting: --max-batch-size, --max-queue)")
                # Requests the free batch slots will take at the next admission do not count as queued.
                capacity = most - len(self._running)
                if len(self._waiting) + len(items) > capacity:
                    raise QueueFull(f"queue full: {len(self._waiting)} requests waiting (max_queue={self.max_queue})")
            tickets = [Ticket(next(self._ids), request, sink, arrival) for request, sink in items]
            self._waiting.extend(tickets)
            self._cond.notify()
        return tickets

    def cancel(self, ticket: Ticket) -> None:
        """Abandon a request (client disconnected); its slot is freed before the next step."""
        with self._cond:
            if ticket.state == "done":
                return
            ticket.cancelled = True
            self._cond.notify()

    @property
    def alive(self) -> bool:
        """The loop thread runs and is neither stopping nor draining."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping and not self._draining

    @property
    def draining(self) -> bool:
        return self._draining

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

    def drain(self, timeout: float) -> None:
        """Take no new requests; serve the taken ones for up to `timeout` seconds, then end what is left
        with FinishEvent("error", status 503). A second call ends them now. Returns at once."""
        with self._cond:
            if self._stopping:  # stop() ended everything already
                return
            again, self._draining = self._draining, True
        if again or timeout <= 0:
            self.end_all(SHUTTING_DOWN)
            return
        # A timer, not the loop: the loop may be inside a long engine step when the deadline comes.
        self._timer = threading.Timer(timeout, self.end_all, args=(SHUTTING_DOWN,))
        self._timer.daemon = True
        self._timer.start()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is waiting or running; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._waiting or any(not t.ended for t in self._running.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
        return True

    def end_all(self, message: str) -> None:
        """End every open request now with FinishEvent("error", message, status 503) (any thread).
        Running ones leave the engine before the loop's next step."""
        with self._cond:
            for ticket in self._waiting:
                ticket.state = "done"
            ended = [t for t in self._waiting if not t.cancelled]
            self._waiting.clear()
            running = [t for t in self._running.values() if not t.ended and not t.cancelled]
            for ticket in running:
                ticket.ended = True
            for ticket in ended + running:
                self.metrics.record_abort()
                ticket.sink(FinishEvent("error", message, status=503))
            self._cond.notify_all()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish nothing more: end waiting and running requests (503), end the loop, join it."""
        if self._timer is not None:
            self._timer.cancel()
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"scheduler loop did not stop within {timeout}s")
        else:
            self.end_all(SHUTTING_DOWN)

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
            with self._cond:
                for out in outputs:
                    self._deliver(out)
                self.metrics.set_load(len(self._waiting), len(self._running))
        self._shutdown()

    def _retire_cancelled(self) -> None:
        """(lock held) Drop requests whose client went away, and those the shutdown already ended."""
        for ticket in [t for t in self._waiting if t.cancelled]:
            self._waiting.remove(ticket)
            ticket.state = "done"
            self.metrics.record_cancel()
        for ticket in [t for t in self._running.values() if t.cancelled or t.ended]:
            self.engine.abort(ticket.request)
            del self._running[id(ticket.request)]
            ticket.state = "done"
            if not ticket.ended:
                self.metrics.record_cancel()
        self._cond.notify_all()  # wait_idle

    def _admit(self) -> None:
        """(lock held) Waiting requests into free batch slots, oldest first."""
        now = time.monotonic()
        while self._waiting and self.engine.num_active < self.engine.max_batch_size:
            ticket = self._waiting.popleft()
            try:
                self.engine.add(ticket.request)
            except ValueError as e:  # the engine refused this request (e.g. it cannot fit a slot)
                ticket.state = "done"
                self.metrics.record_finish(True)
                ticket.sink(FinishEvent("error", str(e)))
                continue
            ticket.state = "running"
            self._running[id(ticket.request)] = ticket
            self.metrics.record_queued(now - ticket.arrival)
        self.metrics.set_load(len(self._waiting), len(self._running))

    def _deliver(self, out: StepOutput) -> None:
        """(lock held) One step's tokens and end, if any, to the request's sink; latencies to the metrics."""
        ticket = self._running.get(id(out.request))
        if ticket is None or ticket.ended or ticket.cancelled:
            return
        now = time.monotonic()
        if out.new_ids:
            if ticket.last_delivery is None:
                self.metrics.record_first_token(now - ticket.arrival)
            else:
                self.metrics.record_token_gap(now - ticket.last_delivery)
            ticket.last_delivery = now
            start, ticket.num_tokens = ticket.num_tokens, ticket.num_tokens + len(out.new_ids)
            logprobs = () if out.request.logprobs is None else tuple(out.request.output_logprobs[start:ticket.num_tokens])
            ticket.sink(TokenEvent(out.new_ids, logprobs, out.request.stop_trim if out.finished else 0))
        if out.error is not None or out.finished:
            del self._running[id(out.request)]
            ticket.state = "done"
            # Counted, and the running gauge lowered, before the caller hears of it: a client that reads
            # /metrics right after its response must see its request finished and no longer running.
            self.metrics.record_finish(out.error is not None, out.request.finish_reason, now - ticket.arrival,
                                       len(out.request.prompt_ids), len(out.request.output_ids))
            self.metrics.set_load(len(self._waiting), len(self._running))
            if out.error is not None:
                ticket.sink(FinishEvent("error", out.error))
            else:
                ticket.sink(FinishEvent(out.request.finish_reason or "length"))
            self._cond.notify_all()  # wait_idle

    def _fail_all(self, message: str) -> None:
        with self._cond:
            tickets = [t for t in self._running.values() if not t.ended and not t.cancelled]
            for ticket in self._running.values():
                self.engine.abort(ticket.request)
                ticket.state = "done"
            self._running.clear()
            for ticket in tickets:
                self.metrics.record_finish(True)
                ticket.sink(FinishEvent("error", message))
            self._cond.notify_all()

    def _shutdown(self) -> None:
        self.end_all(SHUTTING_DOWN)
        with self._cond:
            for ticket in self._running.values():
                self.engine.abort(ticket.request)
                ticket.state = "done"
            self._running.clear()
