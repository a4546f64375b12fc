"""Client helpers of the serving tests: run a coroutine under a hard timeout, read an SSE stream,
parse /metrics, and the small chat template the tests serve with."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading

import httpx

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
TIMEOUT_S = 180


def run(coro, timeout: float = TIMEOUT_S):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@contextlib.contextmanager
def steps_held(scheduler, after: int = 0):
    """Let the scheduler's engine take `after` more steps, then hold it before each further step until
    the block ends, so a running request can neither finish nor free its slot meanwhile. Enter it before
    the request that must stay running: on a loaded machine the test's client (which shares the GIL with
    the server's threads) can read a stream's first token after the stream has ended. Admission runs on."""
    engine, release = scheduler.engine, threading.Event()
    step, taken = engine.step, itertools.count()

    def held_step():
        if next(taken) >= after:
            release.wait(TIMEOUT_S)
        return step()

    engine.step = held_step
    try:
        yield
    finally:
        release.set()


def metric_values(text: str) -> dict[str, float]:
    """A /metrics body's samples: 'name{labels}' -> value."""
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in text.splitlines()
                                                   if line and not line.startswith("#"))}


async def events(client: httpx.AsyncClient, path: str, body: dict, headers: dict | None = None
                 ) -> tuple[httpx.Response, list[dict], bool]:
    """(response, every data payload, whether [DONE] ended it) of one SSE stream; asserts that nothing
    follows [DONE]."""
    payloads, done = [], False
    async with client.stream("POST", path, json={**body, "stream": True}, headers=headers) as r:
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ") and not done, line
            if line == "data: [DONE]":
                done = True
            else:
                payloads.append(json.loads(line[6:]))
    return r, payloads, done
