"""`BatchedBackend`: the runtime Executor's backend protocol (generate / stream / shutdown) on
the batched engine, so the Executor and the Triton model serve through one continuous batch.

Every `generate` or `stream` call, from any thread (Triton runs `execute` calls concurrently
in decoupled mode), submits its requests to one `Scheduler`; requests of different calls
share engine steps. Outputs are the `trtllm_moespec.LLM` ones (`RequestOutput`,
`StreamEvent`), identical to `LLM.generate` at T=0.
"""

from __future__ import annotations

import queue
import threading
from typing import Iterator, Sequence

from ..api import LLM, RequestOutput, SamplingParams, StreamEvent
from ..engine.engine import Request
from ..detokenize import TextStream
from .engine import make_engine, make_request
from .scheduler import FinishEvent, Scheduler, TokenEvent


class BatchedBackend:
    """generate / stream / shutdown over a started scheduler (see module docstring)."""

    batched = True  # concurrent calls share engine steps (`runtime.Executor.batched`)

    def __init__(self, llm: LLM, max_batch_size: int = 8, max_queue: int = 1024, engine: str = "batched"):
        self.llm = llm
        self.scheduler = Scheduler(make_engine(llm, max_batch_size, engine), max_queue)
        self.scheduler.start()
        self._lock = threading.Lock()  # the tokenizer is shared with the scheduler thread's stop checks

    def generate(self, prompts: Sequence[str] | Sequence[list[int]], params: SamplingParams | None = None
                 ) -> list[RequestOutput]:
        params = params or SamplingParams()
        requests = [self._request(ids, params) for ids in self._encode(prompts)]
        done = [threading.Event() for _ in requests]
        errors: list[str | None] = [None] * len(requests)

        def sink(i: int):
            def on_event(event) -> None:
                if isinstance(event, FinishEvent):
                    errors[i] = event.error
                    done[i].set()
            return on_event

        for i, request in enumerate(requests):
            self.scheduler.submit(request, sink(i))
        for event in done:
            event.wait()
        failed = [e for e in errors if e is not None]
        if failed:
            raise RuntimeError(f"generation failed: {failed[0]}")
        return [self._output(r) for r in requests]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[StreamEvent]:
        params = params or SamplingParams()
        request = self._request(self._encode([prompt])[0], params)
        events: queue.Queue = queue.Queue()
        ticket = self.scheduler.submit(request, events.put)
        text, ids = TextStream(self._decode, params.stop), []
        try:
            while True:
                event = events.get()
                if isinstance(event, TokenEvent):
                    ids += event.token_ids
                    yield StreamEvent(list(event.token_ids), text.push(ids))
                    continue
                if event.error is not None:
                    raise RuntimeError(f"generation failed: {event.error}")
                tail = text.finish(request.output_ids)
                if tail:
                    yield StreamEvent([], tail)
                yield StreamEvent([], "", self._output(request))
                return
        finally:  # the caller stopped iterating early: free the slot
            self.scheduler.cancel(ticket)

    def shutdown(self) -> None:
        self.scheduler.stop()

    # ------------------------------------------------------------------ helpers
    def _encode(self, prompts) -> list[list[int]]:
        with self._lock:
            return self.llm.encode(prompts)

    def _decode(self, ids) -> str:
        with self._lock:
            return self.llm._decode(ids)

    def _request(self, ids: list[int], params: SamplingParams) -> Request:
        return make_request(self.llm, ids, params, self._lock)

    def _output(self, request: Request) -> RequestOutput:
        return RequestOutput.of(request, self._decode(request.output_ids))
