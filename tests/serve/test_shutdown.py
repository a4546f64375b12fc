"""Shutdown: SIGTERM / Ctrl-C drain the server. In-process, the drain's rules (what finishes, what
ends with a terminal event, when); in a real `moespec serve` process, the exit: status 0 and no
traceback, for SIGTERM and SIGINT alike."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from trtllm_moespec.serve.server import ServerThread

from .sse import events, run

REPO = Path(__file__).resolve().parents[2]


def test_a_drain_finishes_short_streams_and_ends_long_ones_with_a_terminal_event(tiny_llm):
    """case serve-sigterm-drain: after the signal, a short stream finishes as usual, a long one ends with
    an error event (code 503) and [DONE] at --shutdown-timeout, a waiting non-streamed request gets a
    503 JSON error; the listening socket is closed and the HTTP thread ends."""
    timeout_s = 3.0
    long = {"prompt": "def f():", "max_tokens": 1900, "ignore_eos": True, "temperature": 0}

    async def scenario(server):
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            long_task = asyncio.create_task(events(client, "/v1/completions", long))
            # short, but not so short that it ends between two polls below (2 tokens did, on a fast machine,
            # and the loop then waited for a second running stream that was already gone)
            short_task = asyncio.create_task(events(client, "/v1/completions", {**long, "max_tokens": 32}))
            while server.scheduler.num_running < 2:  # both streams admitted (the batch holds two)
                await asyncio.sleep(0.01)
            waiting = asyncio.create_task(client.post("/v1/completions", json=long))
            while server.scheduler.queue_depth < 1:
                await asyncio.sleep(0.01)
            t0 = time.monotonic()
            server.uvicorn.handle_exit(signal.SIGTERM, None)
            (_, long_events, long_done), (_, short_events, short_done) = await asyncio.gather(long_task, short_task)
            took = time.monotonic() - t0
            return long_events, long_done, short_events, short_done, await waiting, took

    server = ServerThread(tiny_llm, max_batch_size=2, shutdown_timeout=timeout_s).start()
    try:
        long_events, long_done, short_events, short_done, waiting, took = run(scenario(server))
        server._thread.join(30)
        assert not server._thread.is_alive()  # uvicorn returned: every connection closed
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/health", timeout=5)
    finally:
        server.stop()
    assert short_done and short_events[-1]["choices"][0]["finish_reason"] == "length"
    assert long_done and long_events[-1]["error"]["code"] == 503
    assert "shutting down" in long_events[-1]["error"]["message"] and len(long_events) > 1
    assert waiting.status_code == 503 and waiting.headers["retry-after"] == "1"
    assert timeout_s <= took < timeout_s + 20


def _serve(extra: list[str]) -> tuple[subprocess.Popen, str, list[str], threading.Thread]:
    """`moespec serve` on a free port; (process, its URL, its stderr lines as they come, their reader)."""
    exe = shutil.which("moespec")
    command = [exe] if exe else [sys.executable, "-m", "trtllm_moespec.cli"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    proc = subprocess.Popen(command + ["serve", "--model", "moespec-tiny", "--policy", "eagle3", "--port", "0",
                                       *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    found = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if re.search(r" at http://\S+", line):
                found.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if not found.wait(600):  # a loaded machine takes minutes to load even moespec-tiny
        proc.kill()
        raise AssertionError("the server did not start: " + "".join(lines)[-3000:])
    url = re.search(r" at (http://\S+)", next(line for line in lines if " at http://" in line)).group(1)
    return proc, url, lines, reader


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_moespec_serve_exits_0_without_a_traceback_on_a_signal(sig):
    """case serve-sigterm-exit-0, case serve-sigint-no-traceback: a real process with a stream in flight gets
    the signal; the stream ends with a terminal event, the process exits 0 within the timeout and prints
    no traceback (it was: SIGTERM -> exit 143 after streams were cut with none; SIGINT -> two
    CancelledError tracebacks)."""
    proc, url, lines, reader = _serve(["--shutdown-timeout", "1"])
    try:
        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                task = asyncio.create_task(events(client, "/v1/completions", {
                    "prompt": "def f():", "max_tokens": 1900, "ignore_eos": True, "temperature": 0}))
                while not (await client.get("/metrics")).text.count("moespec_batch_size 1.0"):
                    await asyncio.sleep(0.05)
                proc.send_signal(sig)
                return await task

        _, payloads, done = run(scenario(), timeout=120)
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    err = "".join(lines)
    assert done and payloads[-1]["error"]["code"] == 503, payloads[-1]
    assert rc == 0, err[-3000:]
    assert "Traceback" not in err and "CancelledError" not in err, err[-3000:]


def test_worker_threads_do_not_hold_the_process_at_exit():
    """A job still running in the server's worker pool (a prompt of megabytes being tokenized when
    SIGTERM comes) must not keep the process alive past its shutdown: the process exits at once."""
    code = ("import threading; from trtllm_moespec.serve.state import WorkerPool; "
            "pool = WorkerPool(2, 'w'); pool.submit(threading.Event().wait); pool.submit(lambda: 1).result(); "
            "print('exiting', flush=True)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and done.stdout == "exiting\n", done.stderr[-2000:]
