"""The server's failure cases (issue 27's probes), each against a real server over loopback: bodies
over the size limit, a huge prompt tokenized off the event loop, bodies that used to end in a
traceback or a plain-text 500, a broken chat template, admission (queueing, the optional bound, a
request that can never fit) and the load test. Bounded: short requests, hard timeouts."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest

from trtllm_moespec.cli import main
from trtllm_moespec.serve.server import ServerThread
from trtllm_moespec.serve.state import Server

from .sse import events, metric_values, run, steps_held


def _raw_post_head(host: str, port: int, length: int) -> tuple[int, bytes]:
    """Send only the headers of a POST announcing `length` body bytes; (status, body) of the answer."""
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % length)
        reader = sock.makefile("rb")
        status = int(reader.readline().split()[1])
        headers = {}
        while (line := reader.readline().strip()):
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        return status, reader.read(int(headers[b"content-length"]))


def test_a_body_over_the_limit_is_refused_before_it_is_read(tiny_llm):
    """case serve-10mb-prompt: a 10 MB prompt gets 413 under the default --max-request-bytes (8 MiB):
    announced by Content-Length it is answered with no body byte sent; chunked, once 8 MiB arrived."""
    import json

    ten_mb = json.dumps({"prompt": "hello world, this is text. " * (10_000_000 // 27), "max_tokens": 4})

    def chunked():
        for _ in range(9):
            yield b" " * (1 << 20)

    with ServerThread(tiny_llm, max_batch_size=1) as server:
        status, body = _raw_post_head(server.host, server.port, 10_000_000)
        t0 = time.monotonic()
        whole = httpx.post(f"{server.url}/v1/completions", content=ten_mb,
                           headers={"content-type": "application/json"}, timeout=60)
        took = time.monotonic() - t0
        streamed = httpx.post(f"{server.url}/v1/completions", content=chunked(), timeout=60)
        health = httpx.get(f"{server.url}/health", timeout=10)
        metrics = metric_values(httpx.get(f"{server.url}/metrics", timeout=10).text)
    assert status == 413 and "--max-request-bytes" in json.loads(body)["error"]["message"]
    assert whole.status_code == 413 and "10000" in whole.json()["error"]["message"] and took < 30
    assert streamed.status_code == 413 and "more than 8388608 bytes" in streamed.json()["error"]["message"]
    assert health.status_code == 200 and metrics['moespec_request_errors_total{status_code="413"}'] == 3


def test_a_huge_prompt_is_tokenized_off_the_event_loop(tiny_llm):
    """case serve-health-during-tokenize: with the limit raised, a 1 MB prompt takes seconds to
    tokenize; meanwhile /health answers and a running stream keeps receiving tokens (both waited for
    the whole tokenization when it ran on the event loop). Then it gets its 400: too long."""
    big = "hello world, this is text. " * 40_000  # 1.08 MB, ~360k tokens

    async def scenario(url):
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            arrivals: list[float] = []

            async def long_stream():
                async with client.stream("POST", "/v1/completions", json={
                        "prompt": "def f():", "max_tokens": 1500, "ignore_eos": True, "temperature": 0,
                        "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            arrivals.append(time.monotonic())

            streaming = asyncio.create_task(long_stream())
            while not arrivals:
                await asyncio.sleep(0.01)
            started = time.monotonic()
            posted = asyncio.create_task(client.post("/v1/completions", json={"prompt": big, "max_tokens": 2}))
            await asyncio.sleep(0.2)  # the body is in (loopback: milliseconds); its tokenization runs
            health = await client.get("/health")
            health_at = time.monotonic()
            answer = await posted
            answered_at = time.monotonic()
            streaming.cancel()
            during = [t for t in arrivals if started < t < answered_at]
            return health, health_at, answer, answered_at, during

    with ServerThread(tiny_llm, max_batch_size=2, max_request_bytes=4 << 20) as server:
        health, health_at, answer, answered_at, during = run(scenario(server.url))
    assert answer.status_code == 400 and "exceeds the model's context" in answer.json()["error"]["message"]
    assert health.status_code == 200 and health_at < answered_at, (health_at, answered_at)
    assert len(during) >= 2  # the stream went on while the prompt was tokenized


def test_the_servers_tokenizer_copy_gives_the_tokenizers_ids(tiny_llm):
    """The server encodes text with its own copy of the tokenizer through the Rust backend (no GIL held
    throughout); the ids are tokenizer.encode's, special tokens in the text and add_special_tokens included."""
    server = Server(tiny_llm, None, "tiny")
    try:
        for text in ("hello world", "  two spaces", "<|endoftext|>x<|endoftext|>", "héllo ✓ 漢字 😀", "def f():\n\t1\n"):
            for special in (False, True):
                assert server.encode_text(text, special) == tiny_llm.tokenizer.encode(text, add_special_tokens=special)
    finally:
        server.close()


STRICT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system messages') }}"
                   "{% endif %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>")


def test_bad_bodies_get_openai_json_errors(tiny_llm):
    """case serve-lone-surrogate, case serve-nested-json, case serve-unknown-path, case serve-template-raises,
    case serve-failure-counters: every failure is OpenAI's JSON error object (no plain-text 500, no
    traceback), and /metrics counts the 400s and the 500s."""
    bodies = {
        "surrogate": b'{"prompt": "a\\ud800b", "max_tokens": 2}',
        "chat_surrogate": b'{"messages": [{"role": "user", "content": "x\\udc00"}], "max_tokens": 2}',
        "deep": b'{"prompt": "x", "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "deep_200": b'{"prompt": "x", "metadata": {"a": ' + b"[" * 200 + b"]" * 200 + b"}}",
        "not_utf8": b'{"prompt": "\xff\xfe", "max_tokens": 2}',
    }
    paths = {"surrogate": "/v1/completions", "chat_surrogate": "/v1/chat/completions", "deep": "/v1/completions",
             "deep_200": "/v1/completions", "not_utf8": "/v1/completions"}

    async def scenario(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            answers = {name: await client.post(paths[name], content=body, headers={"content-type": "application/json"})
                       for name, body in bodies.items()}
            answers["tokenize"] = await client.post("/tokenize", content=b'{"prompt": "\\udbff"}')
            answers["unknown_path"] = await client.get("/v1/nothing")
            answers["wrong_method"] = await client.get("/v1/completions")
            answers["template_raises"] = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                "max_tokens": 2})
            answers["pair_ok"] = await client.post("/v1/completions", content='{"prompt": "\\ud83d\\ude00", '
                                                   '"max_tokens": 1}'.encode())  # a surrogate pair is one emoji
            return answers

    with ServerThread(tiny_llm, max_batch_size=2, chat_template=STRICT_TEMPLATE) as server:
        answers = run(scenario(server.url))
        server.server.tokenizer_info = lambda: {}["no such key"]  # a bug inside a handler
        crashed = httpx.get(f"{server.url}/tokenizer_info", timeout=30)
        metrics = metric_values(httpx.get(f"{server.url}/metrics", timeout=30).text)
    errors = {name: r.json()["error"] for name, r in answers.items() if name != "pair_ok"}
    assert {name: answers[name].status_code for name in errors} == {
        "surrogate": 400, "chat_surrogate": 400, "deep": 400, "deep_200": 400, "not_utf8": 400, "tokenize": 400,
        "unknown_path": 404, "wrong_method": 405, "template_raises": 400}
    assert errors["surrogate"]["param"] == "prompt" and "lone surrogate (U+D800" in errors["surrogate"]["message"]
    assert errors["chat_surrogate"]["param"] == "messages[0].content"
    assert "deeper than 128 levels" in errors["deep"]["message"] and errors["deep_200"]["param"].startswith("metadata.a")
    assert "not valid JSON" in errors["not_utf8"]["message"] and errors["tokenize"]["param"] == "prompt"
    assert "no system messages" in errors["template_raises"]["message"] and errors["template_raises"]["param"] == "messages"
    assert answers["pair_ok"].status_code == 200
    assert crashed.status_code == 500 and crashed.json()["error"]["message"] == "KeyError: 'no such key'"
    assert metrics['moespec_request_errors_total{status_code="400"}'] == 7
    assert metrics['moespec_request_errors_total{status_code="500"}'] == 1 and metrics["moespec_requests_failed_total"] == 1


def test_a_broken_chat_template_stops_the_server_at_start_up(tiny_llm, tmp_path, capsys):
    """case serve-chat-template-error: a Jinja syntax error (before the model loads: one line naming
    the file and the line, exit 2), or a template that cannot render one user message."""
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    assert main(["serve", "--chat-template", str(broken)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "broken.jinja: line 2:" in err
    with pytest.raises(ValueError, match="line 1"):
        ServerThread(tiny_llm, chat_template="{% if %}")
    with pytest.raises(ValueError, match="rendering one user message fails: ZeroDivisionError"):
        ServerThread(tiny_llm, chat_template="{{ 1 // 0 }}")


def test_admission_queues_by_default_and_refuses_only_what_never_fits(tiny_llm):
    """case serve-queue-by-default, case serve-never-fits: with the defaults one request of 80 sequences (the
    old bound was 72 waiting or running) is queued and answered; with --max-queue 2 and one slot, a
    request of 4 sequences can never fit (400, nothing cancelled), and one beyond the full queue gets
    503 with Retry-After."""
    prompts = [f"x{i}" for i in range(40)]

    with ServerThread(tiny_llm) as server:
        many = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompts, "n": 2, "max_tokens": 1,
                                                                "temperature": 0}, timeout=120)
    assert many.status_code == 200 and len(many.json()["choices"]) == 80

    async def scenario(server):
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            never = await client.post("/v1/completions", json={"prompt": prompts[:2], "n": 2, "max_tokens": 1})
            long = {"prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}
            with steps_held(server.scheduler, after=1):  # the long request's first step, then no more
                async with client.stream("POST", "/v1/completions", json=long) as r:
                    async for _ in r.aiter_lines():
                        break  # the one slot is busy now
                    queued = [asyncio.create_task(client.post("/v1/completions", json={"prompt": "y", "max_tokens": 1}))
                              for _ in range(2)]
                    while server.scheduler.queue_depth < 2:
                        await asyncio.sleep(0.01)
                    full = await client.post("/v1/completions", json={"prompt": "z", "max_tokens": 1})
            return never, full, await asyncio.gather(*queued)

    with ServerThread(tiny_llm, max_batch_size=1, max_queue=2) as server:
        never, full, queued = run(scenario(server))
        cancelled = server.scheduler.metrics.cancelled
    assert never.status_code == 400 and never.json()["error"]["param"] == "n"
    assert "4 sequences" in never.json()["error"]["message"]
    assert full.status_code == 503 and full.headers["retry-after"] == "1"
    assert full.json()["error"]["type"] == "server_overloaded" and [r.status_code for r in queued] == [200, 200]
    assert cancelled == 1  # the long stream the client left; not the refused request's sequences


def test_a_hundred_concurrent_clients_get_no_error_with_the_defaults(tiny_llm):
    """case serve-load-100: 100 clients at once (streaming and not) against the default settings (batch
    8, no queue bound): every one gets its answer, and /metrics counts no error."""

    async def scenario(url):
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
            async def one(i: int):
                body = {"prompt": f"def f{i}():", "max_tokens": 3, "temperature": 0}
                if i % 2:
                    r, payloads, done = await events(client, "/v1/completions", body)
                    return r.status_code == 200 and done and not any("error" in p for p in payloads)
                r = await client.post("/v1/completions", json=body)
                return r.status_code == 200 and len(r.json()["choices"][0]["text"]) >= 0

            ok = await asyncio.gather(*(one(i) for i in range(100)))
            return ok, metric_values((await client.get("/metrics")).text)

    with ServerThread(tiny_llm) as server:
        ok, metrics = run(scenario(server.url))
    assert all(ok) and metrics["moespec_requests_finished_total"] == 100
    assert not any(name.startswith("moespec_request_errors_total") for name in metrics)
    assert metrics["moespec_requests_failed_total"] == 0 and metrics["moespec_requests_cancelled_total"] == 0
