"""Function calling's parsing and its constraints, without a model: tools and tool_choice checked
with a 400 naming the field, the structured output each choice makes, hermes-style calls found in
text, and a conversation's earlier calls handed to the chat template."""

from __future__ import annotations

import json

import pytest

from trtllm_moespec.serve.protocol import BadRequest, parse_chat
from trtllm_moespec.serve.tools import Tools, hermes_calls, parse_tools

WEATHER = {"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "time"}}
CHAT = {"messages": [{"role": "user", "content": "weather in Paris?"}]}


def test_tool_choices_make_their_constraints():
    assert parse_tools(CHAT) is None
    auto = parse_tools({"tools": [WEATHER, TIME]})
    assert auto.choice == "auto" and auto.constraint() is None and auto.names == ["weather", "time"]
    named = parse_tools({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "weather"}}})
    assert named.named and json.loads(named.constraint().spec) == WEATHER["function"]["parameters"]
    required = json.loads(parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"}).constraint().spec)
    assert [c["properties"]["name"]["const"] for c in required["anyOf"]] == ["weather", "time"]
    assert required["anyOf"][1]["properties"]["arguments"] == {"type": "object"}  # no parameters: any object


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "time"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tools_name_the_field(extra, param):
    with pytest.raises(BadRequest) as e:
        parse_chat({**CHAT, **extra})
    assert e.value.param == param


def test_calls_come_out_of_each_kind_of_output():
    tools = (WEATHER, TIME)
    named = Tools(tools, "weather", named=True)
    assert [(c.name, json.loads(c.arguments)) for c in named.calls('{"city": "Paris"}', None)[0]] == \
        [("weather", {"city": "Paris"})]
    assert named.calls('{"city": "Pa', None) == ([], '{"city": "Pa')  # cut by max_tokens: content, no call
    calls, content = Tools(tools, "required").calls('{"name": "time", "arguments": {}}', None)
    assert [(c.name, c.arguments) for c in calls] == [("time", "{}")] and content is None
    text = 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    calls, content = Tools(tools, "auto").calls(text, "hermes")
    assert [c.name for c in calls] == ["weather"] and content == "Let me look."
    assert Tools(tools, "auto").calls(text, None) == ([], text)  # no parser: plain text


def test_parallel_tool_calls_false_returns_the_first_call_only():
    text = ('<tool_call>{"name": "weather", "arguments": {"city": "A"}}</tool_call>'
            '<tool_call>{"name": "time", "arguments": {}}</tool_call>')
    both = parse_tools({"tools": [WEATHER, TIME]})
    one = parse_tools({"tools": [WEATHER, TIME], "parallel_tool_calls": False})
    assert [c.name for c in both.calls(text, "hermes")[0]] == ["weather", "time"]
    assert [c.name for c in one.calls(text, "hermes")[0]] == ["weather"]


def test_hermes_keeps_blocks_it_cannot_use_in_the_content():
    text = ('<tool_call>{"name": "weather", "arguments": {"city": "A"}}</tool_call> and '
            '<tool_call>{"name": "unknown", "arguments": {}}</tool_call><tool_call>not json</tool_call>')
    calls, content = hermes_calls(text, ["weather"])
    assert [json.loads(c.arguments) for c in calls] == [{"city": "A"}]
    assert content == 'and <tool_call>{"name": "unknown", "arguments": {}}</tool_call><tool_call>not json</tool_call>'
    assert hermes_calls("", ["weather"]) == ([], None)


def test_earlier_calls_and_results_reach_the_template():
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    parsed = parse_chat({"messages": messages, "tools": [WEATHER]}).messages
    assert parsed[1]["content"] == "" and parsed[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert parsed[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_harmony_outputs_split_into_answer_reasoning_and_calls():
    from trtllm_moespec.serve.tools import harmony_reply

    answer = harmony_reply("<|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant<|channel|>final"
                           "<|message|>Hello!<|return|>", [])
    assert (answer.content, answer.reasoning, answer.calls) == ("Hello!", "The user greets.", [])
    for header in ("<|channel|>commentary to=functions.weather <|constrain|>json",  # both orders occur
                   " to=functions.weather<|channel|>commentary json"):
        call = harmony_reply(f"<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant{header}"
                             '<|message|>{"city": "Oslo"}<|call|>', ["weather"])
        assert call.content is None and call.reasoning == "Need it."
        assert [(c.name, json.loads(c.arguments)) for c in call.calls] == [("weather", {"city": "Oslo"})]
    unknown = harmony_reply('<|channel|>commentary to=functions.other<|message|>{}<|call|>', ["weather"])
    assert unknown.calls == [] and unknown.content is None
    cut = harmony_reply("<|channel|>analysis<|message|>still thinking", [])  # max_tokens ended the reasoning
    assert (cut.content, cut.reasoning) == (None, "still thinking")
    assert harmony_reply("no channels here", []).content == "no channels here"


def test_hermes_content_streams_until_the_first_call_block_and_calls_as_their_blocks_close():
    """Streamed under the hermes parser, the content before the first <tool_call> block goes out as it grows
    (nothing that may begin a block), each call once its block has closed, and content and calls join to
    the final message's; with parallel_tool_calls false, only the first call."""
    from transformers import AutoTokenizer

    from trtllm_moespec.resolve import resolve_model
    from trtllm_moespec.serve.tools import HermesStream

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("moespec-tiny", None, None).target))
    decode = lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)  # noqa: E731
    text = ('  Let me look it up.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            'Then <tool the time.\n<tool_call>{"name": "time", "arguments": {}}</tool_call>')
    ids = tokenizer.encode(text, add_special_tokens=False)
    for parallel in (True, False):
        tools = parse_tools({"tools": [WEATHER, TIME], "parallel_tool_calls": parallel})
        stream = HermesStream(decode, tools)
        pushes = [stream.push(ids[:n]) for n in range(1, len(ids) + 1)]
        deltas = [text for text, _ in pushes]
        streamed = [(n, call.name) for n, (_, calls) in enumerate(pushes, 1) for call in calls]
        calls, content = tools.calls(decode(ids), "hermes")
        assert "".join(deltas) == "Let me look it up." and not any("<" in d for d in deltas)
        assert sum(1 for d in deltas if d) > 3  # it streamed, word by word
        first_close = next(n for n in range(1, len(ids) + 1) if "</tool_call>" in decode(ids[:n]))
        assert streamed[0] == (first_close, "weather")  # the step its block closed in, not at the end
        assert [name for _, name in streamed] == [c.name for c in calls] == (["weather", "time"] if parallel else ["weather"])
        rest, unsent = stream.finish(content, [c.to_openai() for c in calls])
        assert "".join(deltas) + rest == content == "Let me look it up.\n\nThen <tool the time." and unsent == []
