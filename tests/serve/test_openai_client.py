"""The official `openai` Python client against `moespec serve` on moespec-tiny: every response and
stream it reads parses into its own types (completions with logprobs and a stop string, a stream with
usage, chat with n and top logprobs, a forced tool call, a streamed "required" call, vLLM extras through
extra_body, a refused unknown field), and the answers equal `LLM.generate`'s."""

from __future__ import annotations

import pytest

from trtllm_moespec import SamplingParams
from trtllm_moespec.serve.server import ServerThread

openai = pytest.importorskip("openai")

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}


def test_the_openai_client_reads_every_kind_of_answer(tiny_llm):
    prompt = "def add(a, b):\n"
    want = tiny_llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, stop=[":"]))[0]
    with ServerThread(tiny_llm, max_batch_size=4, chat_template=TEMPLATE, tool_call_parser="hermes") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        done = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, logprobs=2,
                                         stop=[":"])
        chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stop=[":"],
                                                stream=True, stream_options={"include_usage": True}))
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                              temperature=0.8, seed=3, n=2, logprobs=True, top_logprobs=2)
        named = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "weather?"}],
                                               max_tokens=64, temperature=0, tools=[WEATHER],
                                               tool_choice={"type": "function", "function": {"name": "weather"}})
        streamed = list(client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "weather?"}], max_tokens=64, temperature=0,
            tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, stream=True))
        extra = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0,
                                          extra_body={"top_k": 5, "prompt_logprobs": 1, "skip_special_tokens": True})
        with pytest.raises(openai.BadRequestError, match="unrecognized request field 'temprature'"):
            client.completions.create(model=model, prompt=prompt, max_tokens=4, extra_body={"temprature": 0})

    assert (done.choices[0].text, done.choices[0].finish_reason) == (want.text, want.finish_reason)
    assert done.usage.completion_tokens == len(want.token_ids) and len(done.choices[0].logprobs.tokens) == len(want.token_ids)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text and chunks[-1].usage.total_tokens > 0
    assert len(chat.choices) == 2 and chat.choices[0].logprobs.content[0].top_logprobs
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "weather" and "city" in call.function.arguments
    calls = [tc for c in streamed for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in calls] == ["weather"] and streamed[-1].choices[0].finish_reason == "tool_calls"
    prompt_logprobs = extra.choices[0].model_extra["prompt_logprobs"]  # vLLM's extra field, kept by the client
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == extra.usage.prompt_tokens
