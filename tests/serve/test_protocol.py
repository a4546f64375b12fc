"""OpenAI request bodies: defaults, vLLM extras, and refusals that name the field."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_moespec.serve.protocol import _KNOWN_CHAT, _KNOWN_COMPLETION, BadRequest, parse_chat, parse_completion


def test_completion_defaults_follow_openai():
    req = parse_completion({"prompt": "hi"})
    assert req.prompts == ("hi",)
    assert req.max_tokens == 16 and req.params.max_tokens == 16
    assert req.params.temperature == 1.0 and req.params.top_p == 1.0 and req.params.top_k == 0
    assert not req.stream and not req.include_usage and req.params.seed is None


def test_vllm_extras_are_accepted():
    req = parse_completion({"prompt": [[1, 2], [3]], "top_k": 5, "seed": 7, "ignore_eos": True, "stop": "\n",
                            "temperature": 0, "max_tokens": 3, "stream": True,
                            "stream_options": {"include_usage": True}, "user": "x"})
    assert req.prompts == ((1, 2), (3,))
    assert req.params.top_k == 5 and req.params.seed == 7 and req.params.ignore_eos
    assert req.params.stop == ("\n",) and req.stream and req.include_usage
    assert parse_completion({"prompt": "a", "top_k": -1}).params.top_k == 0  # vLLM's "off"


def test_chat_defaults_to_the_rest_of_the_context():
    req = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]}]})
    assert req.max_tokens is None and req.messages == ({"role": "user", "content": "ab"},)
    assert parse_chat({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 4}).max_tokens == 4


@pytest.mark.parametrize("body, param", [
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": True}, "max_tokens"),
    ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"prompt": "a", "top_k": -2}, "top_k"),
    ({"prompt": "a", "seed": -1}, "seed"),
    ({"prompt": "a", "seed": 1.5}, "seed"),
    ({"prompt": "a", "stop": ["", "x"]}, "stop"),
    ({"prompt": "a", "stream": "yes"}, "stream"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "n": 17}, "n"),
    ({"prompt": "a", "n": "2"}, "n"),
    ({"prompt": "a", "n": 2, "seed": 2**63 - 1}, "seed"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "logprobs": True}, "logprobs"),
    ({"prompt": "a", "echo": 1}, "echo"),
    ({"prompt": "a", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "a", "frequency_penalty": "1"}, "frequency_penalty"),
    ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "a", "logit_bias": {"1": 500}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"x": 5}}, "logit_bias"),
    ({"prompt": "a", "min_p": 2}, "min_p"),
    ({"prompt": "a", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "a", "stop_token_ids": 5}, "stop_token_ids"),
    ({"prompt": "a", "stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"prompt": "a", "best_of": 2}, "best_of"),
    ({"prompt": "a", "response_format": {"type": "xml"}}, "response_format"),
    ({"prompt": "a", "response_format": {"type": "json_schema"}}, "response_format"),
    ({"prompt": "a", "response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format"),
    ({"prompt": "a", "guided_choice": "yes"}, "guided_choice"),
    ({"prompt": "a", "guided_json": "{not json"}, "guided_json"),
    ({"prompt": "a", "structured_outputs": {"xml": "x"}}, "structured_outputs"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({}, "prompt"),
])
def test_bad_completion_fields_name_the_field(body, param):
    with pytest.raises(BadRequest) as e:
        parse_completion(body)
    assert e.value.param == param


def test_n_choices_per_prompt():
    assert parse_completion({"prompt": "a"}).n == 1
    assert parse_completion({"prompt": "a", "n": 3}).n == 3
    assert parse_chat({"messages": [{"role": "user", "content": "x"}], "n": 2}).n == 2


def test_echo_asks_for_the_prompts_logprobs_only_with_logprobs():
    assert not parse_completion({"prompt": "a"}).echo
    plain = parse_completion({"prompt": "a", "echo": True})
    assert plain.echo and plain.params.prompt_logprobs is None
    scored = parse_completion({"prompt": "a", "echo": True, "logprobs": 1, "max_tokens": 1})
    assert scored.params.prompt_logprobs == scored.params.logprobs == 1
    assert parse_completion({"prompt": "a", "echo": True, "logprobs": 1, "max_tokens": 0}).max_tokens == 0
    with pytest.raises(BadRequest, match="0 only with echo"):
        parse_completion({"prompt": "a", "max_tokens": 0})
    assert parse_completion({"prompt": "a", "logprobs": 1}).params.prompt_logprobs is None


def test_penalties_reach_the_sampling_params():
    params = parse_completion({"prompt": "a", "presence_penalty": 0.5, "frequency_penalty": -1,
                               "repetition_penalty": 1.2}).params
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -1.0, 1.2)
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 0.3}).params
    assert chat.frequency_penalty == 0.3 and chat.repetition_penalty == 1.0
    rules = parse_completion({"prompt": "a", "logit_bias": {"7": -100, "12": 2.5}, "min_tokens": 3,
                              "stop_token_ids": [5, 6], "min_p": 0.1}).params
    assert dict(rules.logit_bias) == {7: -100, 12: 2.5} and rules.min_tokens == 3
    assert rules.stop_token_ids == (5, 6) and rules.min_p == 0.1


def test_structured_output_fields_map_to_one_constraint():
    from trtllm_moespec import StructuredOutput

    chat = {"messages": [{"role": "user", "content": "x"}]}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert parse_completion({"prompt": "a"}).params.structured is None
    assert parse_completion({"prompt": "a", "response_format": {"type": "text"}}).params.structured is None
    assert parse_chat({**chat, "response_format": {"type": "json_object"}}).params.structured == StructuredOutput("json")
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    assert parse_chat({**chat, "response_format": fmt}).params.structured == StructuredOutput.of(json_schema=schema)
    assert parse_completion({"prompt": "a", "guided_json": schema}).params.structured == \
        StructuredOutput.of(json_schema=schema)
    assert parse_completion({"prompt": "a", "guided_choice": ["x", "y"]}).params.structured == \
        StructuredOutput("choice", ("x", "y"))
    assert parse_completion({"prompt": "a", "structured_outputs": {"regex": "a+"}}).params.structured == \
        StructuredOutput("regex", "a+")
    assert parse_completion({"prompt": "a", "guided_grammar": "root ::= \"a\""}).params.structured.kind == "grammar"


def test_logprobs_map_to_the_number_of_alternatives():
    assert parse_completion({"prompt": "a"}).params.logprobs is None
    assert parse_completion({"prompt": "a", "logprobs": 0}).params.logprobs == 0
    assert parse_completion({"prompt": "a", "logprobs": 5}).params.logprobs == 5
    assert parse_completion({"prompt": "a", "logprobs": 5, "stream": True}).params.logprobs == 5
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert parse_chat(chat).params.logprobs is None
    assert parse_chat({**chat, "logprobs": True}).params.logprobs == 0
    assert parse_chat({**chat, "logprobs": True, "top_logprobs": 3}).params.logprobs == 3
    assert parse_chat({**chat, "logprobs": False, "top_logprobs": 0}).params.logprobs is None


@pytest.mark.parametrize("extra, param", [
    ({"top_logprobs": 2}, "top_logprobs"),  # OpenAI: top_logprobs needs logprobs=true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": 1}, "logprobs"),
    ({"echo": True}, "echo"),  # a completions field
])
def test_bad_chat_logprobs_name_the_field(extra, param):
    with pytest.raises(BadRequest) as e:
        parse_chat({"messages": [{"role": "user", "content": "x"}], **extra})
    assert e.value.param == param


@pytest.mark.parametrize("body", [
    {"prompt": "a", "temperature": -1},
    {"prompt": "a", "top_p": 0},
])
def test_bad_sampling_values_are_refused(body):
    with pytest.raises(BadRequest, match="temperature|top_p"):
        parse_completion(body)


@pytest.mark.parametrize("body", [
    [1, 2], {"messages": []}, {"messages": [{"content": "x"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    {"messages": [{"role": "user", "content": 3}]},
])
def test_bad_chat_bodies(body):
    with pytest.raises(BadRequest):
        parse_chat(body)


CHAT = {"messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize("parse, body, field", [
    (parse_completion, {"prompt": "a", "temprature": 0}, "temprature"),  # a typo must not silently sample at T=1
    (parse_completion, {"prompt": "a", "messages": []}, "messages"),  # a chat field
    (parse_completion, {"prompt": "a", "tools": []}, "tools"),
    (parse_chat, {**CHAT, "prompt": "a"}, "prompt"),  # a completions field
    (parse_chat, {**CHAT, "verbosity": "low"}, "verbosity"),
    (parse_chat, {**CHAT, "thinking": {"type": "enabled"}}, "thinking"),
])
def test_unknown_fields_are_refused_by_name(parse, body, field):
    """OpenAI's API refuses a field it does not know; so does this server, rather than drop one that could
    change the output (vLLM only logs them)."""
    with pytest.raises(BadRequest, match=f"unrecognized request field '{field}'") as e:
        parse(body)
    assert e.value.param == field


def test_fields_that_change_nothing_are_accepted():
    ignored = {"user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "priority": 1,
               "request_id": "r", "prompt_cache_key": "k", "safety_identifier": "s", "prediction": None}
    assert parse_completion({"prompt": "a", **ignored}).prompts == ("a",)
    assert parse_chat({**CHAT, **ignored, "modalities": ["text"], "function_call": "none"}).messages


@pytest.mark.parametrize("field, value", [
    ("length_penalty", 0.5),
    ("spaces_between_special_tokens", False), ("guided_whitespace_pattern", " "), ("chat_template", "{{ x }}"),
    ("modalities", ["text", "audio"]), ("function_call", {"name": "f"}), ("early_stopping", True),
])
def test_known_fields_the_engine_cannot_honour_are_refused(field, value):
    for parse, base in ((parse_completion, {"prompt": "a"}), (parse_chat, CHAT)):
        with pytest.raises(BadRequest, match="not supported") as e:
            parse({**base, field: value})
        assert e.value.param == field


def test_vllm_output_and_prompt_fields_reach_the_request():
    req = parse_completion({"prompt": "a", "skip_special_tokens": False, "truncate_prompt_tokens": 3,
                            "add_special_tokens": True, "include_stop_str_in_output": True, "stop": "x"})
    assert not req.params.skip_special_tokens and req.truncate_prompt_tokens == 3 and req.add_special_tokens
    assert req.params.include_stop_str_in_output
    assert parse_completion({"prompt": "a"}).params.skip_special_tokens
    assert parse_completion({"prompt": "a", "bad_words": ["foo", " bar"]}).params.bad_words == ("foo", " bar")
    for bad in ("foo", [""], [3]):
        with pytest.raises(BadRequest) as e:
            parse_completion({"prompt": "a", "bad_words": bad})
        assert e.value.param == "bad_words"
    allowed = parse_completion({"prompt": "a", "allowed_token_ids": [7, 3, 7]}).params
    assert allowed.allowed_token_ids == (3, 7) and allowed.logit_rules().allowed == (3, 7)
    for bad in (5, ["a"], [-1]):
        with pytest.raises(BadRequest) as e:
            parse_completion({"prompt": "a", "allowed_token_ids": bad})
        assert e.value.param == "allowed_token_ids"


def test_chat_template_fields_become_template_keywords():
    assert dict(parse_chat(CHAT).template_kwargs) == {"add_generation_prompt": True, "continue_final_message": False}
    req = parse_chat({**CHAT, "chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low",
                      "add_generation_prompt": False, "continue_final_message": True})
    assert dict(req.template_kwargs) == {"add_generation_prompt": False, "continue_final_message": True,
                                         "enable_thinking": False, "reasoning_effort": "low"}


@pytest.mark.parametrize("extra, param", [
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 2.5}, "truncate_prompt_tokens"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),  # a parameter of the call, not a variable
    ({"chat_template_kwargs": {"not an identifier": 1}}, "chat_template_kwargs"),
    ({"reasoning_effort": "max"}, "reasoning_effort"),
    ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
    ({"continue_final_message": True}, "continue_final_message"),  # needs add_generation_prompt: false
    ({"add_special_tokens": True}, "add_special_tokens"),  # a completions field
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
])
def test_bad_chat_template_and_output_fields_name_the_field(extra, param):
    with pytest.raises(BadRequest) as e:
        parse_chat({**CHAT, **extra})
    assert e.value.param == param


def test_prompt_logprobs_ask_the_prefill_for_them():
    req = parse_completion({"prompt": "a", "prompt_logprobs": 2})
    assert req.prompt_logprobs == req.params.prompt_logprobs == 2 and req.params.logprobs is None
    both = parse_completion({"prompt": "a", "prompt_logprobs": 1, "echo": True, "logprobs": 1})
    assert both.prompt_logprobs == both.params.prompt_logprobs == 1
    assert parse_chat({**CHAT, "prompt_logprobs": 0}).params.prompt_logprobs == 0
    for extra in ({"prompt_logprobs": 21}, {"prompt_logprobs": "1"}, {"prompt_logprobs": 1, "stream": True},
                  {"prompt_logprobs": 2, "echo": True, "logprobs": 1}):
        with pytest.raises(BadRequest) as e:
            parse_completion({"prompt": "a", **extra})
        assert e.value.param == "prompt_logprobs"


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 2**70) | st.floats(allow_nan=True) | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                     max_leaves=6)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(_KNOWN_CHAT | _KNOWN_COMPLETION)), _JSON, max_size=6), st.booleans())
def test_any_json_in_known_fields_is_parsed_or_refused_with_a_400(body, chat):
    """Whatever JSON a known field holds, parsing returns a request or raises a ValueError (the server's
    400), never a TypeError or KeyError from deep inside (a 500)."""
    body.setdefault("messages" if chat else "prompt", [{"role": "user", "content": "x"}] if chat else "x")
    try:
        (parse_chat if chat else parse_completion)(body)
    except ValueError:
        pass
