"""What users of vLLM's and OpenAI's servers expect beside generation: --api-key, /version,
/v1/models/{id}, X-Request-Id, stream_options.continuous_usage_stats, and /metrics on
prometheus_client with vLLM's names and latency histograms. Real servers over loopback."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from trtllm_moespec import __version__
from trtllm_moespec.serve.server import ServerThread

from .sse import events, metric_values, run

openai = pytest.importorskip("openai")


def test_api_key_version_and_model_card(tiny_llm):
    """--api-key: 401 (OpenAI's error object) without the key or with another, the answer with it, through
    the openai client too; /health, /metrics and /version stay open. /v1/models/{id} for the served
    name (slashes included), 404 for another."""
    with ServerThread(tiny_llm, max_batch_size=1, api_key="sekret", model_name="org/tiny") as server:
        url = server.url
        missing = httpx.get(f"{url}/v1/models", timeout=30)
        wrong = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"}, timeout=30)
        tokenize = httpx.post(f"{url}/tokenize", json={"prompt": "x"}, timeout=30)
        open_paths = [httpx.get(f"{url}{p}", timeout=30).status_code for p in ("/health", "/metrics", "/version")]
        version = httpx.get(f"{url}/version", timeout=30).json()
        auth = {"Authorization": "Bearer sekret"}
        card = httpx.get(f"{url}/v1/models/org/tiny", headers=auth, timeout=30)
        other = httpx.get(f"{url}/v1/models/gpt-4", headers=auth, timeout=30)
        client = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        text = client.completions.create(model="org/tiny", prompt="def f():", max_tokens=2, temperature=0)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    assert missing.status_code == wrong.status_code == tokenize.status_code == 401
    assert missing.json()["error"]["code"] == "invalid_api_key" and missing.headers["www-authenticate"] == "Bearer"
    assert open_paths == [200, 200, 200] and version == {"version": __version__}
    assert card.json()["id"] == "org/tiny" and card.json()["max_model_len"] == tiny_llm.target.max_position_embeddings
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    assert text.usage.completion_tokens == 2


def test_request_ids_and_continuous_usage(tiny_llm):
    """X-Request-Id comes back (and names the response); without one the response's id is sent. With
    stream_options.continuous_usage_stats every chunk carries the usage so far, ending at the final usage."""
    body = {"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    async def scenario(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            given = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "req-42"})
            fresh = await client.post("/v1/completions", json=body)
            health = await client.get("/health", headers={"X-Request-Id": "probe-1"})
            streamed = await events(client, "/v1/completions", {**body, "stream_options": {
                "include_usage": True, "continuous_usage_stats": True}}, headers={"X-Request-Id": "req-43"})
            plain = await events(client, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
            return given, fresh, health, streamed, plain

    with ServerThread(tiny_llm, max_batch_size=2) as server:
        given, fresh, health, (r, payloads, done), (_, plain, _) = run(scenario(server.url))
    assert given.headers["x-request-id"] == "req-42" and given.json()["id"] == "cmpl-req-42"
    assert fresh.headers["x-request-id"] == fresh.json()["id"] and health.headers["x-request-id"] == "probe-1"
    assert r.headers["x-request-id"] == "req-43" and done
    usages = [p["usage"] for p in payloads]
    assert all(u is not None for u in usages)  # every chunk, the choice chunks too
    completions = [u["completion_tokens"] for u in usages]
    assert completions == sorted(completions) and completions[-1] == 8 and usages[-1]["prompt_tokens"] > 0
    assert [p.get("usage") is not None for p in plain] == [False] * (len(plain) - 1) + [True]


def test_metrics_have_vllms_names_histograms_and_counts(tiny_llm):
    """/metrics (prometheus_client): vLLM's gauges, counters and TTFT / inter-token / end-to-end / queue
    histograms beside ours, counting what was served; request_success by finish reason; errors by status."""
    n = 4

    async def scenario(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            await asyncio.gather(*(client.post("/v1/completions", json={
                "prompt": f"def f{i}():", "max_tokens": 6, "temperature": 0, "ignore_eos": True}) for i in range(n)))
            await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})  # a 400
            return await client.get("/metrics")

    with ServerThread(tiny_llm, max_batch_size=2, model_name="tiny") as server:
        response = run(scenario(server.url))
    assert response.headers["content-type"].startswith("text/plain")
    m, label = metric_values(response.text), '{model_name="tiny"}'
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert m[f"vllm:{name}_count{label}"] == m[f"moespec_{name}_count"] > 0, name
        assert m[f'vllm:{name}_bucket{{le="+Inf",model_name="tiny"}}'] == m[f"vllm:{name}_count{label}"]
    assert m[f"vllm:time_to_first_token_seconds_count{label}"] == n == m[f"vllm:e2e_request_latency_seconds_count{label}"]
    assert m[f"vllm:inter_token_latency_seconds_count{label}"] >= n  # 6 tokens: a prefill and >= 1 more delivery
    assert m[f"vllm:generation_tokens_total{label}"] == 6 * n == m[f"vllm:request_generation_tokens_sum{label}"]
    assert m['vllm:request_success_total{finished_reason="length",model_name="tiny"}'] == n
    assert m[f"vllm:num_requests_running{label}"] == 0 == m[f"vllm:num_requests_waiting{label}"]
    assert m[f"vllm:spec_decode_num_drafts_total{label}"] > 0  # eagle3 drafted
    assert m['moespec_request_errors_total{status_code="400"}'] == 1 and m["moespec_requests_finished_total"] == n
