"""Loopback load test of `moespec serve`: concurrent streaming clients get exactly their
single-request outputs, nothing is lost, disconnects free their slots, errors are
OpenAI-shaped, and the server stops cleanly. Bounded: a few short requests, hard timeouts."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from trtllm_moespec import SamplingParams
from trtllm_moespec.serve.server import ServerThread

from .sse import TEMPLATE, metric_values, steps_held
from .sse import run as _run

PROMPTS = ["def add(a, b):\n", "import os\n", "class Stack:\n", "for i in range(10):\n", "# a comment\n",
           "def main():\n"]
MAX_TOKENS = 12


async def _chunks(client: httpx.AsyncClient, path: str, body: dict) -> list[dict]:
    """The chunks of one SSE stream, with usage (asserts the [DONE] terminator and no error)."""
    chunks, done = [], False
    async with client.stream("POST", path, json={**body, "stream": True,
                                                 "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ") and not done
            if line == "data: [DONE]":
                done = True
                continue
            chunks.append(json.loads(line[6:]))
            assert "error" not in chunks[-1], chunks[-1]
    assert done
    return chunks


async def _stream(client: httpx.AsyncClient, path: str, body: dict) -> tuple[str, list[str | None], dict | None]:
    """Text, finish reasons and usage of one SSE stream."""
    text, finishes, usage = "", [], None
    for chunk in await _chunks(client, path, body):
        if chunk.get("usage"):
            usage = chunk["usage"]
        for c in chunk["choices"]:
            text += c["delta"].get("content", "") if "delta" in c else c["text"]
            finishes.append(c["finish_reason"])
    return text, finishes, usage


def test_concurrent_clients_get_their_single_request_outputs(tiny_llm):
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    expected = [o.text for o in tiny_llm.generate(PROMPTS, greedy)]
    chat_messages = [{"role": "user", "content": "write a sort function"}]
    chat_ids = tiny_llm.tokenizer.apply_chat_template(chat_messages, chat_template=TEMPLATE,
                                                      add_generation_prompt=True, tokenize=True)
    chat_ids = chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids
    expected_chat = tiny_llm.generate([list(chat_ids)], greedy)[0]

    async def clients(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            streams = [_stream(client, "/v1/completions", {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0})
                       for p in PROMPTS]
            chat = _stream(client, "/v1/chat/completions",
                           {"messages": chat_messages, "max_tokens": MAX_TOKENS, "temperature": 0})
            plain = client.post("/v1/completions", json={"prompt": PROMPTS, "max_tokens": MAX_TOKENS,
                                                          "temperature": 0})
            results = await asyncio.gather(*streams, chat, plain)
            metrics = (await client.get("/metrics")).text
        return results, metrics

    with ServerThread(tiny_llm, max_batch_size=3, max_queue=16, chat_template=TEMPLATE) as server:
        results, metrics = _run(clients(server.url))
        assert server.scheduler.num_running == 0 and server.scheduler.queue_depth == 0
    *streams, chat, plain = results
    for (text, finishes, usage), want in zip(streams, expected):
        assert text == want
        assert finishes[-1] == "length" and usage["completion_tokens"] == MAX_TOKENS
    text, finishes, usage = chat
    assert text == expected_chat.text and usage["prompt_tokens"] == len(chat_ids)
    body = plain.json()
    assert plain.status_code == 200 and [c["text"] for c in body["choices"]] == expected
    assert body["usage"]["completion_tokens"] == MAX_TOKENS * len(PROMPTS)
    values = metric_values(metrics)
    assert float(values["moespec_requests_finished_total"]) == 2 * len(PROMPTS) + 1  # nothing lost
    assert float(values["moespec_generated_tokens_total"]) == MAX_TOKENS * (2 * len(PROMPTS) + 1)
    assert 1 <= float(values["moespec_mean_batch_size"]) <= 3 and float(values["moespec_verified_tokens"]) > 0


def test_seeded_sampling_is_reproducible_and_equals_the_single_request(tiny_llm):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=50, seed=11)
    expected = tiny_llm.generate([PROMPTS[0]], params)[0].text
    body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0.8, "top_k": 50, "seed": 11}

    async def clients(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(*[client.post("/v1/completions", json=body) for _ in range(3)])

    with ServerThread(tiny_llm, max_batch_size=3) as server:
        responses = _run(clients(server.url))
    assert [r.json()["choices"][0]["text"] for r in responses] == [expected] * 3


def test_logit_rules_give_the_single_requests_output(tiny_llm):
    plain = tiny_llm.generate([PROMPTS[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5,
                            repetition_penalty=1.2, logit_bias={plain.token_ids[2]: -100}, min_tokens=4,
                            stop_token_ids=(plain.token_ids[1],))
    want = tiny_llm.generate([PROMPTS[0]], params)[0].text
    assert want != plain.text
    body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "presence_penalty": 0.5,
            "frequency_penalty": 0.5, "repetition_penalty": 1.2, "logit_bias": {str(plain.token_ids[2]): -100},
            "min_tokens": 4, "stop_token_ids": [plain.token_ids[1]]}

    async def clients(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(client.post("/v1/completions", json=body), _stream(client, "/v1/completions", body))

    with ServerThread(tiny_llm, max_batch_size=2) as server:
        plain, (streamed, _, _) = _run(clients(server.url))
    assert plain.json()["choices"][0]["text"] == streamed == want


def test_structured_output_through_response_format_and_guided_fields(tiny_llm):
    """Chat with a JSON schema (streamed too), a completion with vLLM's guided_choice: the single
    request's output, valid; a grammar that does not compile is a 400."""
    pytest.importorskip("xgrammar")
    from trtllm_moespec import StructuredOutput

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    messages = [{"role": "user", "content": "a number"}]
    ids = tiny_llm.tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, add_generation_prompt=True,
                                                 tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = tiny_llm.generate([ids], SamplingParams(max_tokens=24, structured=StructuredOutput.of(json_schema=schema)))[0]
    choice = tiny_llm.generate([PROMPTS[0]], SamplingParams(
        max_tokens=8, structured=StructuredOutput.of(choice=["yes", "no"])))[0].text
    chat = {"messages": messages, "max_tokens": 24, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "number", "schema": schema}}}

    async def clients(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(
                client.post("/v1/chat/completions", json=chat), _stream(client, "/v1/chat/completions", chat),
                client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
                                                     "guided_choice": ["yes", "no"]}),
                client.post("/v1/completions", json={"prompt": PROMPTS[0], "guided_grammar": "root ::= ("}))

    with ServerThread(tiny_llm, max_batch_size=3, chat_template=TEMPLATE) as server:
        whole, (streamed, _, _), picked, bad = _run(clients(server.url))
    text = whole.json()["choices"][0]["message"]["content"]
    assert text == streamed == want.text and isinstance(json.loads(text)["n"], int)
    assert picked.json()["choices"][0]["text"] == choice in ("yes", "no")
    assert bad.status_code == 400 and "cannot compile" in bad.json()["error"]["message"]


TOOLS_TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }} {% endfor %}</tools>\n{% endif %}"
                  + TEMPLATE)


def test_tool_calls_through_the_server(tiny_llm):
    """A named tool choice returns that function's call (arguments valid under its schema, finish
    "stop"); "required" one of the tools (finish "tool_calls"); the tools reach the prompt; "auto"
    needs the server's parser, and with it the text is parsed (moespec-tiny writes no call)."""
    pytest.importorskip("xgrammar")
    weather = {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}
    clock = {"type": "function", "function": {"name": "time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
    base = {"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 96, "temperature": 0,
            "tools": [weather, clock]}

    async def clients(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            post = lambda body: client.post("/v1/chat/completions", json=body)  # noqa: E731
            forced = {**base, "tool_choice": {"type": "function", "function": {"name": "weather"}}}
            return await asyncio.gather(
                post(forced), post({**base, "tool_choice": "required"}), post({**base, "tool_choice": "auto"}),
                post({**base, "tool_choice": "none"}), post({k: v for k, v in base.items() if k != "tools"}),
                _chunks(client, "/v1/chat/completions", forced))

    with ServerThread(tiny_llm, max_batch_size=4, chat_template=TOOLS_TEMPLATE) as server:
        *responses, streamed = _run(clients(server.url))
        named, required, auto_refused, none, plain = (r.json() for r in responses)
    choice = named["choices"][0]
    call = choice["message"]["tool_calls"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
    assert call["type"] == "function" and call["function"]["name"] == "weather" and call["id"].startswith("call_")
    assert isinstance(json.loads(call["function"]["arguments"])["city"], str)
    last = [c for chunk in streamed for c in chunk["choices"]][-1]  # streamed: the call in the last chunk
    assert last["finish_reason"] == "stop" and last["delta"]["tool_calls"][0]["index"] == 0
    assert last["delta"]["tool_calls"][0]["function"] == call["function"]
    choice = required["choices"][0]
    call = choice["message"]["tool_calls"][0]["function"]
    assert choice["finish_reason"] == "tool_calls" and call["name"] in ("weather", "time")
    assert set(json.loads(call["arguments"])) == ({"city"} if call["name"] == "weather" else {"zone"})
    assert auto_refused["error"]["param"] == "tool_choice" and "--tool-call-parser" in auto_refused["error"]["message"]
    assert "tool_calls" not in none["choices"][0]["message"]
    assert none["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]  # the template listed the tools

    async def auto(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(client.post("/v1/chat/completions", json={**base, "tool_choice": "auto"}),
                                        _chunks(client, "/v1/chat/completions", {**base, "tool_choice": "auto"}))

    with ServerThread(tiny_llm, max_batch_size=1, chat_template=TOOLS_TEMPLATE, tool_call_parser="hermes") as server:
        answer, chunks = _run(auto(server.url))
    answer = answer.json()["choices"][0]
    assert "tool_calls" not in answer["message"] and answer["finish_reason"] in ("stop", "length")
    # streamed, the content (no call here) grows chunk by chunk instead of coming whole at the end
    texts = [c["delta"].get("content") for chunk in chunks for c in chunk["choices"] if c["delta"].get("content")]
    assert len(texts) > 1 and "".join(texts) == answer["message"]["content"]


def test_the_harmony_parser_answers_with_content_reasoning_and_calls(tiny_llm):
    """`--tool-call-parser harmony` (GPT-OSS): the output decoded with its special tokens is read by its
    channels; streamed, answer and reasoning arrive as they grow. moespec-tiny's tokenizer has no
    harmony tokens, so its raw decode is replaced by what a GPT-OSS one gives, piece by piece (a
    marker is one token, as there)."""
    import re

    weather = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    outputs = ["<|channel|>analysis<|message|>Think it over.<|end|><|start|>assistant<|channel|>final"
               "<|message|>Done, thanks.<|return|>",
               '<|channel|>commentary to=functions.weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>']
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "temperature": 0, "ignore_eos": True}

    def growing(output):
        pieces = [p for part in re.split(r"(<\|[a-z]+\|>)", output) if part
                  for p in ([part] if part.startswith("<|") else list(part))]
        return lambda ids: "".join(pieces[:2 * len(ids)])  # two pieces per output token

    async def clients(url, body):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(client.post("/v1/chat/completions", json=body),
                                        _chunks(client, "/v1/chat/completions", body))

    with ServerThread(tiny_llm, max_batch_size=2, chat_template=TEMPLATE, tool_call_parser="harmony") as server:
        server.server.decode_raw = growing(outputs[0])
        whole, streamed = _run(clients(server.url, base))
        server.server.decode_raw = growing(outputs[1])
        called, called_streamed = _run(clients(server.url, {**base, "tools": [weather]}))
    message = whole.json()["choices"][0]["message"]
    assert message["content"] == "Done, thanks." and message["reasoning_content"] == "Think it over."
    deltas = [c["delta"] for chunk in streamed for c in chunk["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Think it over."
    assert "".join(d.get("content", "") for d in deltas) == "Done, thanks."
    assert sum("content" in d for d in deltas[1:]) >= 2  # streamed as it grew, not in one piece
    choice = called.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    last = [c for chunk in called_streamed for c in chunk["choices"]][-1]
    assert last["finish_reason"] == "tool_calls" and last["delta"]["tool_calls"][0]["function"]["name"] == "weather"
    assert not any(d.get("content") for c in called_streamed for d in [x["delta"] for x in c["choices"]])


def test_logprobs_are_the_single_requests_and_shaped_as_openai(tiny_llm):
    """Completions (two prompts in one request, batched with a chat request) and chat: each token's
    logprob and alternatives equal `LLM.generate`'s alone, in OpenAI's two shapes."""
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2)
    want = tiny_llm.generate(PROMPTS[:2], greedy)
    messages = [{"role": "user", "content": "sort"}]

    async def clients(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(
                client.post("/v1/completions", json={"prompt": PROMPTS[:2], "max_tokens": MAX_TOKENS, "temperature": 0,
                                                     "logprobs": 2}),
                client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": MAX_TOKENS,
                                                          "temperature": 0, "logprobs": True, "top_logprobs": 1}))

    with ServerThread(tiny_llm, max_batch_size=3, chat_template=TEMPLATE) as server:
        completion, chat = (r.json() for r in _run(clients(server.url)))
    decode = tiny_llm._decode
    for choice, out in zip(completion["choices"], want):
        lp = choice["logprobs"]
        assert choice["text"] == out.text and lp["tokens"] == [decode([t]) for t in out.token_ids]
        assert lp["token_logprobs"] == pytest.approx([e.logprob for e in out.logprobs], abs=1e-4)
        assert [list(d) for d in lp["top_logprobs"]] == [[decode([t]) for t, _ in e.top] for e in out.logprobs]
        assert lp["text_offset"] == [len(decode(out.token_ids[:i])) for i in range(len(out.token_ids))]
    content = chat["choices"][0]["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == chat["choices"][0]["message"]["content"]
    assert all(len(c["top_logprobs"]) == 1 and c["top_logprobs"][0]["logprob"] >= c["logprob"] - 1e-6
               and c["bytes"] == list(c["token"].encode()) for c in content)


def test_streamed_logprobs_add_up_to_the_non_streamed_response(tiny_llm):
    """Each chunk carries its step's tokens' logprobs, also when a stop string holds the text back:
    joined (text_offset included), they are the non-streamed response's, for completions and chat."""
    text = tiny_llm.generate([PROMPTS[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]  # cuts the output halfway: tokens after it are never sent
    completion = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 2, "stop": [stop]}
    chat = {"messages": [{"role": "user", "content": "sort"}], "max_tokens": MAX_TOKENS, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}

    async def clients(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(_chunks(client, "/v1/completions", completion),
                                        client.post("/v1/completions", json=completion),
                                        _chunks(client, "/v1/chat/completions", chat),
                                        client.post("/v1/chat/completions", json=chat))

    with ServerThread(tiny_llm, max_batch_size=4, chat_template=TEMPLATE) as server:
        streamed, whole, streamed_chat, whole_chat = _run(clients(server.url))
    parts = [c["logprobs"] for chunk in streamed for c in chunk["choices"] if c["logprobs"] is not None]
    assert len(parts) > 1  # logprobs came step by step
    want = whole.json()["choices"][0]
    cut = tiny_llm.generate([PROMPTS[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=[stop]))[0]
    assert want["finish_reason"] == "stop" and want["text"] == cut.text == text[:text.index(stop)]
    assert len(cut.token_ids) < MAX_TOKENS
    joined = {key: [x for p in parts for x in p[key]] for key in parts[0]}
    # logprobs to float rounding: the two requests ran in different batches
    assert joined["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-4)
    assert [list(d) for d in joined["top_logprobs"]] == [list(d) for d in want["logprobs"]["top_logprobs"]]
    assert joined["tokens"] == want["logprobs"]["tokens"] and joined["text_offset"] == want["logprobs"]["text_offset"]
    parts = [c["logprobs"] for chunk in streamed_chat for c in chunk["choices"] if c["logprobs"] is not None]
    assert len(parts) > 1 and all(p["refusal"] is None for p in parts)
    content, want = [x for p in parts for x in p["content"]], whole_chat.json()["choices"][0]["logprobs"]["content"]
    assert [(c["token"], [t["token"] for t in c["top_logprobs"]]) for c in content] == \
        [(c["token"], [t["token"] for t in c["top_logprobs"]]) for c in want]
    assert [c["logprob"] for c in content] == pytest.approx([c["logprob"] for c in want], abs=1e-4)


def test_a_stop_string_beginning_inside_a_token_ends_the_text_there(tiny_llm):
    """OpenAI's rule, streamed and not: the text ends where the stop string begins, in the middle of a
    token here, and the tokens (usage) go through the one that completed it; with
    include_stop_str_in_output the text keeps it. `LLM.generate` and `LLM.stream` give the same."""
    full = tiny_llm.generate([PROMPTS[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]
    pieces = [tiny_llm.tokenizer.decode([t]) for t in full.token_ids]
    # a stop string from the middle of token i into token i + 1, found nowhere earlier in the text
    i = next(i for i in range(len(pieces) - 1) if len(pieces[i].strip()) >= 2 and pieces[i + 1]
             and full.text.index(pieces[i][1:] + pieces[i + 1][:1]) == len("".join(pieces[:i])) + 1)
    stop = pieces[i][1:] + pieces[i + 1][:1]
    before = full.text[:full.text.index(stop)]
    assert before == "".join(pieces[:i]) + pieces[i][:1]

    out = tiny_llm.generate([PROMPTS[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=[stop]))[0]
    assert (out.text, out.token_ids, out.finish_reason) == (before, full.token_ids[:i + 2], "stop")
    events = list(tiny_llm.stream(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=[stop])))
    assert "".join(e.text for e in events) == before
    kept = tiny_llm.generate([PROMPTS[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=[stop],
                                                          include_stop_str_in_output=True))[0]
    assert kept.text == before + stop and kept.token_ids == out.token_ids

    body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "stop": [stop]}

    async def clients(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(client.post("/v1/completions", json=body), _stream(client, "/v1/completions", body),
                                        client.post("/v1/completions", json={**body, "include_stop_str_in_output": True}))

    with ServerThread(tiny_llm, max_batch_size=4) as server:
        whole, (streamed, finishes, usage), whole_kept = _run(clients(server.url))
    whole = whole.json()
    assert whole["choices"][0]["text"] == before and whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"]["completion_tokens"] == i + 2
    assert streamed == before and finishes[-1] == "stop" and usage["completion_tokens"] == i + 2
    assert whole_kept.json()["choices"][0]["text"] == before + stop


def test_echo_returns_the_prompt_and_its_logprobs_as_evaluation_harnesses_read_them(tiny_llm):
    """An lm-eval style loglikelihood request (echo, logprobs=1, max_tokens=1), with a token-id prompt
    too, and the same streamed: the prompt's text, then its tokens' logprobs (the first null) equal
    to `LLM.generate(prompt_logprobs=1)`'s, then the completion's."""
    prompt = PROMPTS[0] + PROMPTS[2]
    out = tiny_llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=1, prompt_logprobs=1))[0]
    ids = out.prompt_token_ids
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}

    async def clients(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(client.post("/v1/completions", json=body),
                                        client.post("/v1/completions", json={**body, "prompt": ids}),
                                        _chunks(client, "/v1/completions", {**body, "max_tokens": 4}),
                                        client.post("/v1/completions", json={**body, "max_tokens": 4}),
                                        client.post("/v1/completions", json={**body, "max_tokens": 0}),
                                        _chunks(client, "/v1/completions", {**body, "max_tokens": 0}))

    with ServerThread(tiny_llm, max_batch_size=4) as server:
        text_prompt, id_prompt, streamed, whole, scored, scored_stream = _run(clients(server.url))
    decode = tiny_llm._decode
    for response in (text_prompt, id_prompt):
        choice = response.json()["choices"][0]
        lp = choice["logprobs"]
        assert choice["text"] == prompt + out.text and response.json()["usage"]["prompt_tokens"] == len(ids)
        assert lp["tokens"] == [decode([t]) for t in ids + out.token_ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = [e.logprob for e in out.prompt_logprobs[1:] + out.logprobs]
        assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
        assert [list(d) for d in lp["top_logprobs"][1:]] == [[decode([e.top[0][0]])] for e in out.prompt_logprobs[1:] + out.logprobs]
        assert lp["text_offset"] == [len(decode(ids[:i])) for i in range(len(ids))] + [len(prompt)]
    want = whole.json()["choices"][0]
    chunks = [c for chunk in streamed for c in chunk["choices"]]
    assert chunks[0]["text"].startswith(prompt) and "".join(c["text"] for c in chunks) == want["text"]
    parts = [c["logprobs"] for c in chunks if c["logprobs"] is not None]
    assert len(parts) > 1 and parts[0]["token_logprobs"][0] is None
    for key in ("tokens", "text_offset"):
        assert [x for p in parts for x in p[key]] == want["logprobs"][key], key
    # max_tokens=0: the prompt scored, nothing generated (also streamed)
    choice, usage = scored.json()["choices"][0], scored.json()["usage"]
    assert choice["text"] == prompt and usage["completion_tokens"] == 0
    assert choice["logprobs"]["tokens"] == [decode([t]) for t in ids]
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx([e.logprob for e in out.prompt_logprobs[1:]], abs=1e-4)
    chunks = [c for chunk in scored_stream for c in chunk["choices"]]
    assert "".join(c["text"] for c in chunks) == prompt and scored_stream[-1]["usage"]["completion_tokens"] == 0
    assert [x for c in chunks if c["logprobs"] for x in c["logprobs"]["tokens"]] == choice["logprobs"]["tokens"]


def test_tokenizer_endpoints_answer_as_vllms_for_remote_tokenizers(tiny_llm):
    """lm-eval's remote-tokenizer check (GET /tokenizer_info with eos_token, POST /tokenize) and its
    encode / decode / chat template, against the model's own tokenizer."""
    messages = [{"role": "user", "content": "sort"}]

    async def clients(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(
                client.get("/tokenizer_info"),
                client.post("/tokenize", json={"prompt": PROMPTS[0], "add_special_tokens": False}),
                client.post("/tokenize", json={"messages": messages}),
                client.post("/detokenize", json={"tokens": tiny_llm.encode([PROMPTS[2]])[0]}),
                client.post("/tokenize", json={"prompt": 5}),
                client.post("/detokenize", json={"tokens": [10**7]}),
                client.post("/tokenize", content=b"{not json"))

    with ServerThread(tiny_llm, max_batch_size=1, chat_template=TEMPLATE) as server:
        info, tokens, chat, text, bad_prompt, bad_tokens, bad_json = _run(clients(server.url))
    assert info.json()["eos_token"] == tiny_llm.tokenizer.eos_token and info.json()["chat_template"] == TEMPLATE
    assert info.json()["model_max_length"] == tiny_llm.target.max_position_embeddings
    assert tokens.json()["tokens"] == tiny_llm.encode([PROMPTS[0]])[0] == tokens.json()["tokens"][:tokens.json()["count"]]
    want = tiny_llm.tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, add_generation_prompt=True,
                                                  tokenize=True)
    assert chat.json()["tokens"] == list(want["input_ids"] if hasattr(want, "keys") else want)
    assert text.json() == {"prompt": PROMPTS[2]}
    assert [r.status_code for r in (bad_prompt, bad_tokens, bad_json)] == [400] * 3
    assert bad_prompt.json()["error"]["param"] == "prompt" and bad_tokens.json()["error"]["param"] == "tokens"


def test_a_chats_next_turn_reuses_the_conversation_and_answers_the_same(tiny_llm):
    """A server with a prefix cache: turn 2 resends turn 1 and its answer; both answers are those of
    a server without one (tiny_llm), and the cache reused the conversation."""
    from trtllm_moespec import LLM

    cached = LLM("moespec-tiny", policy="eagle3", prefix_cache=2)
    turn1 = [{"role": "user", "content": "write a function that reverses a list"}]

    def chat(server, messages):
        body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
        return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()

    answers, usages = [], []
    for llm in (tiny_llm, cached):
        with ServerThread(llm, max_batch_size=2, chat_template=TEMPLATE) as server:
            first = chat(server, turn1)
            turn2 = turn1 + [first["choices"][0]["message"], {"role": "user", "content": "now sort it as well"}]
            second = chat(server, turn2)
            answers.append((first["choices"][0]["message"]["content"], second["choices"][0]["message"]["content"]))
            usages.append((first["usage"], second["usage"]))
            metrics = metric_values(httpx.get(f"{server.url}/metrics", timeout=30).text)
    assert answers[0] == answers[1]
    pc = cached.engine.prefix_cache
    assert pc.hits == 1 and pc.reused_tokens > 20
    assert metrics["moespec_prefix_cache_hits_total"] == 1
    assert metrics["moespec_prefix_cache_reused_tokens_total"] == pc.reused_tokens
    assert metrics['vllm:prefix_cache_hits_total{model_name="moespec"}'] == pc.reused_tokens
    # usage.prompt_tokens_details.cached_tokens: the prefix cache's share of turn 2 (none without a cache)
    assert "prompt_tokens_details" not in usages[0][1]
    assert usages[1][0]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert usages[1][1]["prompt_tokens_details"] == {"cached_tokens": pc.reused_tokens}


def test_n_choices_are_the_requests_of_seed_plus_j(tiny_llm):
    """n=3 sampled choices of two prompts (six requests sharing the batch) are LLM.generate's with seeds
    5, 6, 7 in OpenAI's order; a streamed chat with n=2 delivers both choices."""
    params = lambda seed: SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=50, seed=seed)  # noqa: E731
    want = [tiny_llm.generate([p], params(5 + j))[0].text for p in PROMPTS[:2] for j in range(3)]
    body = {"prompt": PROMPTS[:2], "max_tokens": MAX_TOKENS, "temperature": 0.8, "top_k": 50, "seed": 5, "n": 3}

    async def clients(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(
                client.post("/v1/completions", json=body),
                _stream(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 4, "temperature": 0, "n": 2}))

    with ServerThread(tiny_llm, max_batch_size=4, chat_template=TEMPLATE) as server:
        completion, (text, finishes, usage) = _run(clients(server.url))
    choices = completion.json()["choices"]
    assert [c["index"] for c in choices] == list(range(6)) and [c["text"] for c in choices] == want
    assert len(set(want[:3])) > 1  # the seeds differ, so do the samples
    assert finishes.count("length") == 2 and usage["completion_tokens"] == 8
    prompt_tokens = len(tiny_llm.encode(PROMPTS[0])[0]) + len(tiny_llm.encode(PROMPTS[1])[0])
    assert completion.json()["usage"]["prompt_tokens"] == prompt_tokens  # each prompt counted once


def test_disconnected_clients_free_their_slots(tiny_llm):
    long = {"prompt": PROMPTS[0], "max_tokens": 1000, "ignore_eos": True, "temperature": 0}

    async def leave_early(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async with client.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break  # go away after the first chunk
        try:  # a non-streaming client that gives up waiting
            async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(60, read=1.0)) as client:
                await client.post("/v1/completions", json=long)
        except httpx.ReadTimeout:
            pass

    with ServerThread(tiny_llm, max_batch_size=2) as server:
        _run(leave_early(server.url))
        deadline = time.monotonic() + 30
        while (server.scheduler.num_running or server.scheduler.engine.num_active) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.scheduler.num_running == 0 and server.scheduler.engine.num_active == 0
        m = server.scheduler.metrics
        assert m.cancelled == 2, (m.cancelled, m.failed, m.finished, m.tokens)
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200  # the freed slots serve new requests


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "n": 17}, 400, "n"),
    ({"prompt": "x", "max_tokens": 5000}, 400, None),  # longer than the context
    ({"prompt": [999999], "max_tokens": 2}, 400, None),  # token id out of the vocabulary
    ({"prompt": "x", "model": "gpt-4"}, 404, None),
])
def test_bad_requests_get_openai_errors(tiny_llm, body, status, param):
    with ServerThread(tiny_llm, max_batch_size=1) as server:
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error" and error["param"] == param


def test_invalid_json_tokenizer_chat_template_and_full_queue(tiny_llm):
    async def scenario(server):
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            bad = await client.post("/v1/completions", content=b"{not json")
            chat = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                                   "max_tokens": 4, "temperature": 0})
            long = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
            with steps_held(server.scheduler, after=1):  # the long request's first step, then no more
                async with client.stream("POST", "/v1/completions", json=long) as r:
                    async for _ in r.aiter_lines():
                        break  # the one slot is busy now; the queue holds nothing
                    full = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            models = await client.get("/v1/models")
            health = await client.get("/health")
        return bad, chat, full, models, health

    with ServerThread(tiny_llm, max_batch_size=1, max_queue=0, model_name="tiny") as server:
        bad, chat, full, models, health = _run(scenario(server))
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
    # moespec-tiny ships no chat template (it is not chat-tuned): a 400 that says how to give one
    assert chat.status_code == 400 and "--chat-template" in chat.json()["error"]["message"]
    assert full.status_code == 503 and full.json()["error"]["type"] == "server_overloaded"
    assert models.json()["data"][0]["id"] == "tiny" and health.json() == {"status": "ok"}


def test_server_stops_cleanly(tiny_llm):
    server = ServerThread(tiny_llm, max_batch_size=2).start()
    port = server.port
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    server.stop()
    assert not server.scheduler.alive and not server._thread.is_alive()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_joint_batch_server_matches_single_requests():
    """`--policy joint-batch`: nodes chosen across the batch; T=0 text still equals running alone."""
    from trtllm_moespec import LLM

    llm = LLM(model="moespec-tiny", policy="joint")
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    expected = [o.text for o in llm.generate(PROMPTS[:4], greedy)]

    async def clients(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(*[_stream(client, "/v1/completions", {"prompt": p, "max_tokens": MAX_TOKENS,
                                                                              "temperature": 0}) for p in PROMPTS[:4]])

    with ServerThread(llm, max_batch_size=4, engine="joint-batch") as server:
        results = _run(clients(server.url))
        steps = server.scheduler.metrics.iterations
    assert [text for text, _, _ in results] == expected and steps > 0


THINKING_TEMPLATE = (TEMPLATE + "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
                     "{% if reasoning_effort is defined %}<effort {{ reasoning_effort }}>{% endif %}")


def test_chat_template_fields_reach_the_template(tiny_llm):
    """vLLM's chat_template_kwargs, reasoning_effort, add_generation_prompt and continue_final_message
    change the prompt exactly as apply_chat_template does with them; a keyword the template never reads is
    refused (Jinja would drop it silently)."""
    messages = [{"role": "user", "content": "sort a list"}, {"role": "assistant", "content": "def"}]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)

    def expected(**kwargs) -> tuple[str, int]:
        ids = tiny_llm.tokenizer.apply_chat_template(messages, chat_template=THINKING_TEMPLATE, tokenize=True, **kwargs)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return tiny_llm.generate([ids], greedy)[0].text, len(ids)

    cases = [({}, {"add_generation_prompt": True}),
             ({"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "high"},
              {"add_generation_prompt": True, "enable_thinking": False, "reasoning_effort": "high"}),
             ({"add_generation_prompt": False, "continue_final_message": True},
              {"add_generation_prompt": False, "continue_final_message": True})]
    base = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}

    async def clients(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            answers = await asyncio.gather(*(client.post("/v1/chat/completions", json={**base, **extra})
                                             for extra, _ in cases))
            unread = await client.post("/v1/chat/completions", json={**base, "chat_template_kwargs": {"thinking": 1}})
            return answers, unread

    with ServerThread(tiny_llm, max_batch_size=4, chat_template=THINKING_TEMPLATE) as server:
        answers, unread = _run(clients(server.url))
    prompts = set()
    for answer, (_, kwargs) in zip(answers, cases):
        text, n = expected(**kwargs)
        body = answer.json()
        assert body["choices"][0]["message"]["content"] == text and body["usage"]["prompt_tokens"] == n
        prompts.add(n)
    assert len(prompts) == 3  # each case made another prompt
    assert unread.status_code == 400 and unread.json()["error"]["param"] == "chat_template_kwargs"
    assert "does not read 'thinking'" in unread.json()["error"]["message"]


def test_truncated_prompts_and_special_tokens_in_the_text(tiny_llm):
    """truncate_prompt_tokens keeps the prompt's last tokens (usage counts them); skip_special_tokens false
    keeps special tokens in the text (here eos, forced by a logit bias), streamed and not."""
    ids = tiny_llm.encode(PROMPTS[0])[0]
    want = tiny_llm.generate([ids[-3:]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0].text
    eos = tiny_llm.target.eos_token_ids[0]
    forced = {"prompt": PROMPTS[1], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
              "logit_bias": {str(eos): 100}}
    raw = tiny_llm.tokenizer.decode([eos] * 3, skip_special_tokens=False)
    assert raw and "endoftext" in raw

    async def clients(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(
                client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0,
                                                     "truncate_prompt_tokens": 3}),
                client.post("/v1/completions", json=forced),
                client.post("/v1/completions", json={**forced, "skip_special_tokens": False}),
                _stream(client, "/v1/completions", {**forced, "skip_special_tokens": False}))

    with ServerThread(tiny_llm, max_batch_size=4) as server:
        truncated, skipped, kept, (streamed, _, _) = _run(clients(server.url))
    assert truncated.json()["choices"][0]["text"] == want and truncated.json()["usage"]["prompt_tokens"] == 3
    assert skipped.json()["choices"][0]["text"] == ""
    assert kept.json()["choices"][0]["text"] == raw == streamed


def test_prompt_logprobs_come_back_in_vllms_shape(tiny_llm):
    """vLLM's prompt_logprobs: per prompt token (None first) its logprob, rank and text, with the most likely
    alternatives; equal to `SamplingParams(prompt_logprobs=2)`. Completions per choice, chat at the top."""
    out = tiny_llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))[0]
    chat_ids = list(tiny_llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=TEMPLATE,
                                                           add_generation_prompt=True, tokenize=True)["input_ids"])

    async def clients(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(
                client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0,
                                                     "prompt_logprobs": 2}),
                client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 2, "temperature": 0, "prompt_logprobs": 0}))

    with ServerThread(tiny_llm, max_batch_size=2, chat_template=TEMPLATE) as server:
        completion, chat = (r.json() for r in _run(clients(server.url)))
    got = completion["choices"][0]["prompt_logprobs"]
    assert len(got) == len(out.prompt_token_ids) and got[0] is None
    for entry, want, token in zip(got[1:], out.prompt_logprobs[1:], out.prompt_token_ids[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(want.logprob, abs=1e-4)
        assert entry[str(token)]["rank"] == want.rank >= 1
        assert entry[str(token)]["decoded_token"] == tiny_llm.tokenizer.decode([token])
        for r, (t, lp) in enumerate(want.top):
            assert entry[str(t)]["logprob"] == pytest.approx(lp, abs=1e-4)
            assert entry[str(t)]["rank"] == (want.rank if t == token else r + 1)
    assert len(chat["prompt_logprobs"]) == len(chat_ids) and chat["usage"]["prompt_tokens"] == len(chat_ids)
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # the prompt's token alone (0 alternatives)
