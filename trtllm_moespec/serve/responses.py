"""OpenAI responses from the scheduler's events: the whole answer (`final`), or SSE chunks as tokens
commit (`stream`); logprobs in OpenAI's completions and chat shapes, vLLM's prompt_logprobs, chat
replies read for tool calls and reasoning (tools.py), and usage with the prefix cache's share.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator, Callable, Sequence

from fastapi import Request as HttpRequest

from ..core.logprobs import TokenLogprob
from ..detokenize import IncrementalText, cut_text
from ..engine.engine import Request
from .protocol import error_body, usage
from .scheduler import FinishEvent, TokenEvent
from .state import Choice, Server
from .tools import HarmonyStream, HermesStream, harmony_reply

log = logging.getLogger("trtllm_moespec.serve")
DISCONNECT_POLL_S = 0.25  # how often a waiting non-streaming handler checks its client


async def wait_all(choices: list[Choice], events: asyncio.Queue, http: HttpRequest) -> None:
    """Collect events until every choice finished; return early if the client disconnects
    (checked every DISCONNECT_POLL_S, also while events keep arriving)."""
    loop = asyncio.get_running_loop()
    next_check = loop.time() + DISCONNECT_POLL_S
    while any(c.finish_reason is None for c in choices):
        try:
            index, event = await asyncio.wait_for(events.get(), max(next_check - loop.time(), 0.0))
            _apply(choices[index], event)
        except asyncio.TimeoutError:
            pass
        if loop.time() >= next_check:
            if await http.is_disconnected():
                return
            next_check = loop.time() + DISCONNECT_POLL_S


def _apply(choice: Choice, event: TokenEvent | FinishEvent) -> None:
    if isinstance(event, TokenEvent):
        choice.ids.extend(event.token_ids)
    else:  # after this event the engine no longer touches choice.request
        choice.finish_reason = event.reason
        choice.error, choice.status = event.error, event.status


def final(server: Server, choices: list[Choice], rid: str, created: int, chat: bool) -> dict:
    out = []
    for c in choices:
        ids, entries = c.output()
        text = (c.echo or "") + cut_text(c.decode(ids), c.trim)
        logprobs = None
        if c.request.logprobs is not None:
            logprobs = (_chat_logprobs(c.decode, entries) if chat else
                        _completion_logprobs(c.decode, ids, entries, 0, IncrementalText(c.decode),
                                             shift=len(c.echo or "")))
            if c.echo is not None:
                logprobs = _joined(_echo_logprobs(server, c.request), logprobs)
        if chat:
            message, finish = _chat_reply(server, c, text)
            out.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish})
        else:
            out.append({"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason})
            if c.prompt_logprobs:
                out[-1]["prompt_logprobs"] = _prompt_logprobs(server, c.request)
    body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": server.model_name, "choices": out, "usage": _usage(server, choices)}
    if chat and choices[0].prompt_logprobs:  # vLLM's place for a chat's (one prompt)
        body["prompt_logprobs"] = _prompt_logprobs(server, choices[0].request)
    return body


def _prompt_logprobs(server: Server, request: Request) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token (None for the first, which has no context) a map from
    token id to its logprob, rank and text, for the prompt's token and the most likely alternatives."""

    def entry(token_id: int, logprob: float, rank: int) -> tuple[str, dict]:
        return str(token_id), {"logprob": logprob, "rank": rank, "decoded_token": server.decode([token_id])}

    return [None, *({**dict(entry(t, lp, r + 1) for r, (t, lp) in enumerate(e.top)),
                     **dict([entry(e.token_id, e.logprob, e.rank)])} for e in request.prompt_token_logprobs)]


def _chat_reply(server: Server, c: Choice, text: str) -> tuple[dict, str | None]:
    """(the assistant message, finish reason) of a finished chat choice. A call its tool choice forced
    comes from the constrained text; with the harmony parser (GPT-OSS) the output is read by its
    channels (answer, reasoning, calls); else calls are parsed from the text beside the content."""
    tools, reasoning = c.tools, None
    if tools is not None and (tools.named or tools.choice == "required"):
        calls, content = tools.calls(text, None)
    elif server.tool_call_parser == "harmony":
        reply = harmony_reply(cut_text(server.decode_raw(c.output()[0]), c.trim), tools.names if tools is not None else [])
        calls, content, reasoning = tools.allowed(reply.calls) if tools else [], reply.content, reply.reasoning
    elif tools is not None:
        calls, content = tools.calls(text, server.tool_call_parser)
    else:
        calls, content = [], text
    message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if not calls:
        return message, c.finish_reason
    message["tool_calls"] = [call.to_openai() for call in calls]
    return message, "stop" if tools is not None and tools.named else "tool_calls"  # (OpenAI's)


def _completion_logprobs(decode: Callable[[Sequence[int]], str], ids: Sequence[int], entries: Sequence[TokenLogprob],
                         start: int, text: IncrementalText, shift: int = 0) -> dict:
    """The legacy completions `logprobs` object for tokens start.. of `ids` (whose entries these are):
    each token's text and logprob, its top alternatives and where its text starts in the returned
    text (`shift` characters precede `ids`' own: the echoed prompt). `text` decodes prefixes of `ids`;
    a stream passes the same one for every chunk."""
    return {"tokens": [decode([e.token_id]) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{decode([t]): lp for t, lp in e.top} for e in entries],
            "text_offset": [shift + len(text.text(ids[:i])) for i in range(start, start + len(entries))]}


def _echo_logprobs(server: Server, request: Request) -> dict:
    """The echoed prompt's part of the completions `logprobs` object: the first token's logprob and
    alternatives are null (it has no context), the others' come from the prefill."""
    ids = request.prompt_ids
    rest = _completion_logprobs(server.decode, ids, request.prompt_token_logprobs, 1, IncrementalText(server.decode))
    return {"tokens": [server.decode(ids[:1]), *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}


def _joined(first: dict, then: dict) -> dict:
    """Two parts of a completions `logprobs` object, one after the other."""
    return {key: first[key] + then[key] for key in first}


def _chat_logprobs(decode: Callable[[Sequence[int]], str], entries: Sequence[TokenLogprob]) -> dict:
    """The chat `logprobs` object: per token its text, logprob, UTF-8 bytes and top alternatives."""

    def entry(token_id: int, logprob: float) -> dict:
        token = decode([token_id])
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(e.token_id, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


async def stream(server: Server, choices: list[Choice], events: asyncio.Queue, rid: str, created: int,
                 chat: bool, include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[str]:
    """SSE chunks: deltas as tokens commit, a finishing chunk per choice, usage if asked, [DONE].

    Every stream ends with [DONE]: after its last chunk, or after an error event (the engine failed,
    status 500, or the server shut down before the request ended, status 503; the event carries the
    status in `code`, since the HTTP status went out with the first chunk). With
    `continuous_usage` (vLLM's stream_options.continuous_usage_stats) every chunk carries the usage
    so far: the request's prompt tokens and the tokens delivered to all its choices."""
    chunks = _Chunks(server, choices, rid, created, chat, continuous_usage)
    try:
        if chat:
            yield chunks.chunk([chunks.piece(c, "", None, first=True) for c in choices])
        while any(c.finish_reason is None for c in choices):
            index, event = await events.get()
            c = choices[index]
            _apply(c, event)
            if c.error is not None:
                server.scheduler.metrics.record_error(c.status)
                yield _sse(error_body(c.error, kind=error_kind(c.status), code=c.status))
                break
            for text in (chunks.tokens(c, event) if isinstance(event, TokenEvent) else chunks.finish(c)):
                yield text
        else:
            if include_usage:
                yield chunks.chunk([], usage=chunks.usage())
        yield "data: [DONE]\n\n"
    except Exception as e:  # noqa: BLE001 - the status went out already: end the stream with an error event
        log.error("a stream failed: %s: %s", type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))
        server.scheduler.metrics.record_failure()
        server.scheduler.metrics.record_error(500)
        yield _sse(error_body(f"{type(e).__name__}: {e}", kind="internal_error", code=500))
        yield "data: [DONE]\n\n"
    finally:  # normal end, error, or the client went away (the task is cancelled)
        server.cancel([c for c in choices if c.finish_reason is None])


def error_kind(status: int) -> str:
    """OpenAI's error `type` for an HTTP status."""
    return {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
            413: "invalid_request_error", 503: "server_overloaded"}.get(status, "internal_error")


class _Chunks:
    """The SSE chunks of one streamed request, event by event.

    With logprobs, every step's tokens come with their logprobs in the chunk of that step, even when
    its text is held back (an incomplete character, the possible start of a stop string) and the
    chunk's text is empty: delivered tokens are final, so the chunks' logprobs add up to the
    non-streamed response's, as their texts do."""

    def __init__(self, server: Server, choices: list[Choice], rid: str, created: int, chat: bool,
                 continuous_usage: bool):
        self.server, self.choices, self.rid, self.created, self.chat = server, choices, rid, created, chat
        self.continuous_usage = continuous_usage
        self.kind = "chat.completion.chunk" if chat else "text_completion"
        self.offsets = {c.index: IncrementalText(c.decode) for c in choices}  # text_offset of completion tokens
        # harmony (GPT-OSS): answer and reasoning stream as their channels grow; other tool parsers need the whole text
        self.harmony = {c.index: HarmonyStream(server.decode_raw, c.text.hold) for c in choices} if (
            chat and server.tool_call_parser == "harmony") else {}
        # hermes ("auto" tools): the content before the first call block streams, each call once its block closed
        self.hermes = {c.index: HermesStream(c.decode, c.tools, c.text.hold) for c in choices if chat
                       and c.tools is not None and c.tools.choice == "auto" and server.tool_call_parser == "hermes"}

    def chunk(self, choice_list: list[dict], **extra) -> str:
        if self.continuous_usage and "usage" not in extra:
            extra["usage"] = self.usage(delivered=True)
        return _sse({"id": self.rid, "object": self.kind, "created": self.created, "model": self.server.model_name,
                     "choices": choice_list, **extra})

    def usage(self, delivered: bool = False) -> dict:
        """The request's usage: of the finished choices, or (`delivered`) of the tokens sent so far."""
        return _usage(self.server, self.choices, delivered)

    def piece(self, c: Choice, text: str, finish: str | None, first: bool = False, logprobs: dict | None = None) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            return {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def step_logprobs(self, c: Choice, event: TokenEvent) -> dict | None:
        if c.request.logprobs is None:
            return None
        if c.prompt_only:
            return _echo_logprobs(self.server, c.request)
        if self.chat:
            return _chat_logprobs(c.decode, event.logprobs)
        start = len(c.ids) - len(event.token_ids)
        part = _completion_logprobs(c.decode, c.ids, event.logprobs, start, self.offsets[c.index],
                                    shift=len(c.echo or ""))
        return _joined(_echo_logprobs(self.server, c.request), part) if c.echo is not None and start == 0 else part

    def tokens(self, c: Choice, event: TokenEvent) -> list[str]:
        """The chunks of one step's tokens for choice c."""
        logprobs = self.step_logprobs(c, event)
        if c.index in self.harmony:
            delta = self.harmony[c.index].push(c.ids, event.text_trim)
            return [self.chunk([{"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}])
                    ] if delta or logprobs else []
        if c.index in self.hermes:
            text, calls = self.hermes[c.index].push(c.ids, event.text_trim)
            out = [self.chunk([self.piece(c, text, None, logprobs=logprobs)])] if text or logprobs else []
            if calls:  # numbered after the ones sent before
                first = self.hermes[c.index].calls_sent - len(calls)
                deltas = [{"index": first + i, **call.to_openai()} for i, call in enumerate(calls)]
                out.append(self.chunk([{"index": c.index, "delta": {"tool_calls": deltas}, "logprobs": None,
                                        "finish_reason": None}]))
            return out
        # a chat whose output is a forced call (named or "required") is answered when it finishes
        held = c.prompt_only or (self.chat and c.tools is not None)
        delta = "" if held else c.text.push(c.ids, event.text_trim)
        if c.echo is not None and len(c.ids) == len(event.token_ids):  # the first tokens: the prompt first
            delta = c.echo + delta
        return [self.chunk([self.piece(c, delta, None, logprobs=logprobs)])] if delta or logprobs else []

    def finish(self, c: Choice) -> list[str]:
        """The finishing chunk of choice c."""
        if not (self.chat and (c.tools is not None or c.index in self.harmony)):
            return [self.chunk([self.piece(c, c.text.finish(c.output()[0], c.trim), c.finish_reason)])]
        message, finish = _chat_reply(self.server, c, cut_text(c.decode(c.output()[0]), c.trim))
        calls, first = message.get("tool_calls") or [], 0
        if c.index in self.harmony:  # what the channels had not yet sent
            delta = self.harmony[c.index].finish(message)
        elif c.index in self.hermes:  # the content and the calls not yet sent
            rest, calls = self.hermes[c.index].finish(message["content"], calls)
            delta, first = ({"content": rest} if rest else {}), self.hermes[c.index].calls_sent
        else:
            delta = {k: v for k, v in message.items() if k in ("content", "reasoning_content") and v}
        if calls:
            delta["tool_calls"] = [{"index": first + i, **call} for i, call in enumerate(calls)]
        return [self.chunk([{"index": c.index, "delta": delta, "logprobs": None, "finish_reason": finish}])]


def _usage(server: Server, choices: list[Choice], delivered: bool = False) -> dict:
    """OpenAI's usage: each prompt counted once, the choices' output tokens (`delivered`: those sent so
    far), and with a prefix cache `prompt_tokens_details.cached_tokens` (prompt tokens it supplied)."""
    prompt = sum(len(c.request.prompt_ids) for c in choices if c.counts_prompt)
    completion = sum(len(c.ids) if delivered else len(c.output()[0]) for c in choices if not c.prompt_only)
    cached = None
    if server.llm.engine.prefix_cache is not None:
        cached = sum(getattr(c.request, "cached_tokens", 0) for c in choices if c.counts_prompt)
    return usage(prompt, completion, cached)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


