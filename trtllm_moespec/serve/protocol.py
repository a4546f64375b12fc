"""OpenAI request bodies -> checked requests, and the OpenAI response / error shapes.

Follows the OpenAI completions and chat-completions APIs, plus the extras vLLM users
send (`top_k`, `seed`, `ignore_eos`, `include_stop_str_in_output`, `repetition_penalty`, `min_p`, `min_tokens`, `stop_token_ids`,
`structured_outputs` and the older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`);
OpenAI's `presence_penalty`, `frequency_penalty`, `logit_bias` (core/logit_rules.py),
`response_format` (engine/structured.py) and chat's `tools` / `tool_choice` (tools.py) are applied too. Fields that would change what is generated and
that the engine does not implement (best_of, suffix, ...) are
refused with a 400 naming the field rather than silently ignored; fields that do not
change the output (`user`, ...) are ignored, and a field neither list knows is refused (as OpenAI's
API refuses it). vLLM's `skip_special_tokens`, `truncate_prompt_tokens`, `add_special_tokens`,
`chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`, `reasoning_effort` and
`allowed_token_ids`, `bad_words`, `prompt_logprobs` and OpenAI's `parallel_tool_calls` are applied. `n` > 1 makes n requests of each prompt (choice j
of a seeded request samples with seed + j, so the choices differ and each is reproducible). `logprobs` (completions: how many alternatives;
chat: `logprobs` + `top_logprobs`) is served with and without streaming; completions' `echo` returns the
prompt before the completion, and with `logprobs` the prompt tokens' logprobs too (the first one null).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..api import SamplingParams
from ..core.logprobs import MAX_LOGPROBS
from ..engine.structured import StructuredOutput
from .tools import ToolError, Tools, parse_tools

# Fields accepted only at their "off" value: (name, allowed values).
_UNSUPPORTED = (
    ("best_of", (None, 1)), ("suffix", (None, "")), ("use_beam_search", (None, False)), ("functions", (None, [])),
    ("function_call", (None, "none", "auto")), ("length_penalty", (None, 1, 1.0)), ("early_stopping", (None, False)),
    ("spaces_between_special_tokens", (None, True)), ("guided_decoding_backend", (None, "xgrammar", "auto")),
    ("guided_whitespace_pattern", (None,)), ("modalities", (None, ["text"])), ("audio", (None,)),
    ("chat_template", (None,)),  # a template in the request runs the sender's Jinja: the server's --chat-template only
)
# Fields that change nothing in what is generated (scheduling, caching hints, bookkeeping): accepted, ignored.
_IGNORED = ("user", "metadata", "store", "service_tier", "priority", "request_id", "prompt_cache_key",
            "safety_identifier", "prediction")
_SAMPLING = ("model", "n", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
             "stop", "include_stop_str_in_output", "ignore_eos", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids", "logprobs", "response_format",
             "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
             "skip_special_tokens", "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs", "bad_words")
# Every field each endpoint knows: applied, refused at a value it cannot honour, or ignored. Any other is refused
# (as OpenAI's API refuses it): a field this server does not know might change the output, and must not be dropped.
_KNOWN_COMPLETION = frozenset((*_SAMPLING, *_IGNORED, *(n for n, _ in _UNSUPPORTED), "prompt", "echo",
                               "add_special_tokens"))
_KNOWN_CHAT = frozenset((*_SAMPLING, *_IGNORED, *(n for n, _ in _UNSUPPORTED), "messages", "max_completion_tokens",
                         "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
                         "add_generation_prompt", "continue_final_message", "reasoning_effort", "echo",
                         "add_special_tokens"))
# apply_chat_template's own parameters: `chat_template_kwargs` may not set them (the server does)
_TEMPLATE_PARAMETERS = frozenset(("conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                                  "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                                  "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"))
REASONING_EFFORTS = ("low", "medium", "high")
# vLLM's structured-output fields -> StructuredOutput.of keywords
_GUIDED = (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))
MAX_SEED = 2**63
NUMERIC_RULES = (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                 ("min_p", 0.0))  # (field, off)
MAX_N = 16  # most choices per prompt (`n`): each is a request of its own


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400); `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GenerationRequest:
    """A checked completions or chat request; `max_tokens` None means "the rest of the context", 0 (with
    echo) "the prompt alone"."""

    model: str | None
    prompts: tuple[str | tuple[int, ...], ...]  # completions: one or more; chat: none (see messages)
    messages: tuple[dict, ...]  # chat: {"role", "content": str}
    params: SamplingParams  # max_tokens here is a placeholder when `max_tokens` is None or 0
    max_tokens: int | None
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with token counts
    n: int = 1  # choices per prompt; choice j of a seeded request samples with seed + j
    echo: bool = False  # completions: the prompt comes back before the completion (with its logprobs if asked)
    tools: Tools | None = None  # chat: the functions the model may call, and how (tools.py)
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last this many tokens (vLLM's)
    add_special_tokens: bool = False  # completions: the tokenizer's special tokens (a BOS) around a text prompt
    # chat: keywords of the chat template (vLLM's chat_template_kwargs, add_generation_prompt,
    # continue_final_message, and reasoning_effort for GPT-OSS's template)
    template_kwargs: tuple[tuple[str, Any], ...] = (("add_generation_prompt", True),)
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs (and this many alternatives) returned
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage so far in every chunk


def parse_completion(body: Any) -> GenerationRequest:
    """A /v1/completions body -> GenerationRequest (raises BadRequest)."""
    body = _known(_object(body), _KNOWN_COMPLETION)
    logprobs = body.get("logprobs")
    if logprobs is not None and not (_is_int(logprobs) and 0 <= logprobs <= MAX_LOGPROBS):
        raise BadRequest(f"'logprobs' must be an integer in [0, {MAX_LOGPROBS}], got {logprobs!r}", "logprobs")
    return _request(body, prompts=_prompts(body.get("prompt")), messages=(), max_tokens=body.get("max_tokens"),
                    default_max_tokens=16, logprobs=logprobs, echo=_bool(body, "echo"),
                    add_special_tokens=_bool(body, "add_special_tokens"))


def parse_chat(body: Any) -> GenerationRequest:
    """A /v1/chat/completions body -> GenerationRequest (raises BadRequest)."""
    body = _known(_object(body), _KNOWN_CHAT)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    top = body.get("top_logprobs")
    if top is not None and not (_is_int(top) and 0 <= top <= MAX_LOGPROBS):
        raise BadRequest(f"'top_logprobs' must be an integer in [0, {MAX_LOGPROBS}], got {top!r}", "top_logprobs")
    if top and not _bool(body, "logprobs"):
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    if _bool(body, "echo"):
        raise BadRequest("'echo' is a /v1/completions field", "echo")
    if _bool(body, "add_special_tokens"):
        raise BadRequest("'add_special_tokens' is a /v1/completions field: the chat template places the special "
                         "tokens of a chat", "add_special_tokens")
    try:
        tools = parse_tools(body)
    except ToolError as e:
        raise BadRequest(str(e), e.param) from None
    return _request(body, prompts=(), messages=_messages(body.get("messages")), max_tokens=max_tokens,
                    default_max_tokens=None, logprobs=(top or 0) if _bool(body, "logprobs") else None, tools=tools,
                    template_kwargs=_template_kwargs(body))


def _known(body: dict, known: frozenset[str]) -> dict:
    """The body, once every field in it is one this endpoint knows."""
    unknown = sorted(set(body) - known)
    if unknown:
        raise BadRequest(f"unrecognized request field '{unknown[0]}': this server applies or refuses every field it "
                         "knows (docs/serving.md) and refuses the others rather than drop one that could change "
                         "the output", unknown[0])
    return body


def _template_kwargs(body: dict) -> tuple[tuple[str, Any], ...]:
    """The chat template's keywords: vLLM's add_generation_prompt (default true), continue_final_message,
    chat_template_kwargs (e.g. Qwen3's enable_thinking) and reasoning_effort (GPT-OSS's template)."""
    generation, final = body.get("add_generation_prompt", True), _bool(body, "continue_final_message")
    if not isinstance(generation, bool):
        raise BadRequest(f"'add_generation_prompt' must be true or false, got {generation!r}", "add_generation_prompt")
    if generation and final:
        raise BadRequest("'continue_final_message' continues the last message: it needs 'add_generation_prompt': "
                         "false", "continue_final_message")
    extra = body.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict) or not all(isinstance(k, str) and k.isidentifier() for k in extra):
        raise BadRequest("'chat_template_kwargs' must be an object of template variables", "chat_template_kwargs")
    taken = sorted(set(extra) & _TEMPLATE_PARAMETERS)
    if taken:
        raise BadRequest(f"'chat_template_kwargs' may not set '{taken[0]}' (a parameter of the template call, "
                         "not a template variable)", "chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise BadRequest(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                             "reasoning_effort")
        extra = {**extra, "reasoning_effort": effort}
    return (("add_generation_prompt", generation), ("continue_final_message", final), *sorted(extra.items()))


def _request(body: dict, prompts, messages, max_tokens, default_max_tokens, logprobs: int | None,
             echo: bool = False, tools: Tools | None = None, add_special_tokens: bool = False,
             template_kwargs: tuple[tuple[str, Any], ...] = (("add_generation_prompt", True),)) -> GenerationRequest:
    for name, allowed in _UNSUPPORTED:
        if name in body and body[name] not in allowed:
            raise BadRequest(f"'{name}'={body[name]!r} is not supported by this server", name)
    n = body.get("n")
    n = 1 if n is None else n
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise BadRequest(f"'n' must be an integer in [1, {MAX_N}], got {n!r}", "n")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", "model")
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < (0 if echo else 1)):
        raise BadRequest(f"'max_tokens' must be a positive integer (0 only with echo: the prompt scored, nothing "
                         f"generated), got {max_tokens!r}", "max_tokens")
    temperature = _number(body, "temperature", 1.0)
    top_p = _number(body, "top_p", 1.0)
    top_k = body.get("top_k")
    top_k = 0 if top_k in (None, -1) else top_k  # vLLM: -1 (or 0) disables top-k
    if not _is_int(top_k) or top_k < 0:
        raise BadRequest(f"'top_k' must be an integer >= 0 (or -1 to disable), got {top_k!r}", "top_k")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < MAX_SEED):
        raise BadRequest(f"'seed' must be an integer in [0, 2^63), got {seed!r}", "seed")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise BadRequest("'stream_options' must be an object and needs stream=true", "stream_options")
    options = options or {}
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats", "include_obfuscation"})
    if unknown or not all(isinstance(v, bool) for v in options.values()):  # include_obfuscation: OpenAI's, ignored
        raise BadRequest("'stream_options' takes include_usage and continuous_usage_stats (and OpenAI's "
                         "include_obfuscation, ignored), each true or false", "stream_options")
    stop, ignore_eos, keep_stop = _stop(body.get("stop")), _bool(body, "ignore_eos"), _bool(body, "include_stop_str_in_output")
    skip_special = body.get("skip_special_tokens", True)
    if not isinstance(skip_special, bool):
        raise BadRequest(f"'skip_special_tokens' must be true or false, got {skip_special!r}", "skip_special_tokens")
    truncate = body.get("truncate_prompt_tokens")
    if truncate is not None and not (_is_int(truncate) and truncate >= 1):
        raise BadRequest(f"'truncate_prompt_tokens' must be an integer >= 1, got {truncate!r}", "truncate_prompt_tokens")
    echoed = logprobs if echo else None  # echo with logprobs scores the prompt too
    prompt_logprobs = _prompt_logprobs(body, echoed, stream)
    rules = {name: _number(body, name, off) for name, off in NUMERIC_RULES}
    rules.update(logit_bias=_logit_bias(body.get("logit_bias")), min_tokens=body.get("min_tokens") or 0,
                 stop_token_ids=body.get("stop_token_ids") or None, structured=_structured(body),
                 allowed_token_ids=body.get("allowed_token_ids"), bad_words=_bad_words(body.get("bad_words")))
    calling = tools.constraint() if tools is not None else None
    if calling is not None:
        if rules["structured"] is not None:
            raise BadRequest("a 'tool_choice' that requires a call constrains the output itself: drop "
                             "response_format / structured_outputs", "tool_choice")
        rules["structured"] = calling
    for name in ("stop_token_ids", "allowed_token_ids"):
        if rules[name] is not None and not isinstance(rules[name], list):
            raise BadRequest(f"'{name}' must be a list of token ids", name)
    try:
        params = SamplingParams(max_tokens=max_tokens or 1, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop=stop, ignore_eos=ignore_eos, include_stop_str_in_output=keep_stop,
                                skip_special_tokens=skip_special, logprobs=logprobs,
                                prompt_logprobs=echoed if prompt_logprobs is None else prompt_logprobs, **rules)
    except ValueError as e:  # the message begins with the field's name
        name = str(e).split()[0]
        raise BadRequest(str(e), name if name in body else None) from None
    if n > 1 and seed is not None and seed + n > MAX_SEED:
        raise BadRequest("'seed' + n must stay below 2^63 (choice j samples with seed + j)", "seed")
    return GenerationRequest(model, prompts, messages, params, max_tokens, stream, options.get("include_usage", False),
                             n, echo, tools, truncate, add_special_tokens, template_kwargs, prompt_logprobs,
                             options.get("continuous_usage_stats", False))


def _prompt_logprobs(body: dict, echoed: int | None, stream: bool) -> int | None:
    """vLLM's prompt_logprobs: the alternatives per prompt token (None: not asked)."""
    n = body.get("prompt_logprobs")
    if n is None:
        return None
    if not (_is_int(n) and 0 <= n <= MAX_LOGPROBS):
        raise BadRequest(f"'prompt_logprobs' must be an integer in [0, {MAX_LOGPROBS}], got {n!r}", "prompt_logprobs")
    if stream:
        raise BadRequest("'prompt_logprobs' is returned with the whole response: not with stream=true", "prompt_logprobs")
    if echoed is not None and echoed != n:  # one prefill computes both, with one number of alternatives
        raise BadRequest("'prompt_logprobs' with echo and logprobs must equal 'logprobs'", "prompt_logprobs")
    return n


@dataclass(frozen=True)
class TokenizeRequest:
    """A checked /tokenize body (vLLM's): a prompt, or chat messages through the chat template."""

    prompt: str | None
    messages: tuple[dict, ...]
    add_special_tokens: bool


def parse_tokenize(body: Any) -> TokenizeRequest:
    body = _object(body)
    if "messages" in body:
        return TokenizeRequest(None, _messages(body["messages"]), False)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise BadRequest("'prompt' must be a string (or send 'messages')", "prompt")
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise BadRequest(f"'add_special_tokens' must be true or false, got {special!r}", "add_special_tokens")
    return TokenizeRequest(prompt, (), special)


def parse_detokenize(body: Any, vocab_size: int) -> list[int]:
    tokens = _object(body).get("tokens")
    if not isinstance(tokens, list) or not all(_is_int(t) and 0 <= t < vocab_size for t in tokens):
        raise BadRequest(f"'tokens' must be a list of token ids in [0, {vocab_size})", "tokens")
    return tokens


# ---------------------------------------------------------------------- field checks
def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"'{name}' must be a number, got {value!r}", name)
    return float(value)


def _bool(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be true or false, got {value!r}", name)
    return value


def _stop(stop: Any) -> tuple[str, ...] | None:
    if stop is None or stop == []:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    return tuple(stop)


def _bad_words(words: Any) -> tuple[str, ...] | None:
    if words is None or words == []:
        return None
    if not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words):
        raise BadRequest("'bad_words' must be a list of non-empty strings", "bad_words")
    return tuple(words)


def _structured(body: dict) -> StructuredOutput | None:
    """OpenAI's response_format (json_object, json_schema) or one of vLLM's structured_outputs /
    guided_* fields -> the request's StructuredOutput (None: free text)."""
    given: dict[str, Any] = {}
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            given["json_object"] = True
        elif kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema") if isinstance(fmt.get("json_schema"), dict) else None
            if not isinstance(schema, (dict, str)):
                raise BadRequest("'response_format.json_schema.schema' must be a JSON schema", "response_format")
            given["json_schema"] = schema
        elif kind != "text":
            raise BadRequest("'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                             "response_format")
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict) or not set(outputs) <= {"json", "regex", "choice", "grammar", "json_object"}:
            raise BadRequest("'structured_outputs' takes one of json, regex, choice, grammar, json_object",
                             "structured_outputs")
        given.update({("json_schema" if k == "json" else k): v for k, v in outputs.items() if v not in (None, False)})
    given.update({key: body[name] for name, key in _GUIDED if body.get(name) is not None})
    try:
        return StructuredOutput.of(**given)
    except (ValueError, TypeError) as e:
        param = "response_format" if fmt is not None else "structured_outputs" if outputs is not None else next(
            (name for name, _ in _GUIDED if body.get(name) is not None), None)
        raise BadRequest(str(e), param) from None


def _logit_bias(bias: Any) -> dict[int, float] | None:
    """OpenAI's logit_bias object: token ids (as JSON keys, strings) -> bias."""
    if bias is None or bias == {}:
        return None
    if not isinstance(bias, dict) or not all(isinstance(k, str) and k.isdigit() for k in bias):
        raise BadRequest("'logit_bias' must map token ids (as strings) to numbers in [-100, 100]", "logit_bias")
    return {int(k): v for k, v in bias.items()}


def _prompts(prompt: Any) -> tuple[str | tuple[int, ...], ...]:
    """str | [str] | [int] | [[int]] -> one entry per prompt."""
    if isinstance(prompt, str):
        return (prompt,)
    if isinstance(prompt, list) and prompt:
        if all(_is_int(t) for t in prompt):
            return (tuple(prompt),)
        if all(isinstance(p, str) for p in prompt):
            return tuple(prompt)
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return tuple(tuple(p) for p in prompt)
    raise BadRequest("'prompt' must be a string, a list of strings, a list of token ids, or a list of token-id lists",
                     "prompt")


def _messages(messages: Any) -> tuple[dict, ...]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        calls = m.get("tool_calls")
        if content is None and calls:  # an assistant turn that only called tools
            content = ""
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", "messages")
        message = {"role": m["role"], "content": content}
        if calls is not None:  # earlier calls and their results go to the chat template as given
            if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                      for c in calls):
                raise BadRequest(f"messages[{i}].tool_calls must be a list of calls", "messages")
            message["tool_calls"] = [_template_call(c) for c in calls]
        for key in ("tool_call_id", "name"):
            if isinstance(m.get(key), str):
                message[key] = m[key]
        out.append(message)
    return tuple(out)


def _template_call(call: dict) -> dict:
    """An OpenAI tool call as chat templates read it: arguments as an object (OpenAI sends JSON text)."""
    fn = dict(call["function"])
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass
    return {**call, "function": fn}


# ---------------------------------------------------------------------- response shapes
def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage object; `cached_tokens` (None: no prefix cache) goes to prompt_tokens_details."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out
