"""The OpenAI-compatible HTTP app (FastAPI): /v1/completions, /v1/chat/completions (SSE
streaming), /v1/models, /health, /metrics, and vLLM's /tokenize, /detokenize and /tokenizer_info
(what evaluation harnesses use to tokenize through the server, e.g. lm-eval's remote tokenizer).

Handlers only translate: they check the body (400 on bad input), tokenize, hand engine
requests to the `Scheduler` and turn its events into OpenAI responses. A streaming
client that disconnects has its requests cancelled (their batch slots freed); a
non-streaming one is polled for disconnection while it waits.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable, Sequence

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..api import LLM
from ..core.logprobs import TokenLogprob
from ..engine.engine import Request
from ..detokenize import IncrementalText, TextStream, cut_text
from .engine import make_request
from .protocol import (BadRequest, GenerationRequest, error_body, new_id, now, parse_chat, parse_completion,
                       parse_detokenize, parse_tokenize, usage)
from .scheduler import FinishEvent, QueueFull, Scheduler, Ticket, TokenEvent
from .tools import HarmonyStream, HermesStream, Tools, harmony_reply

DISCONNECT_POLL_S = 0.25  # how often a waiting non-streaming handler checks its client


@dataclass
class _Choice:
    """One prompt of an HTTP request, as the handler follows it."""

    index: int
    request: Request
    text: TextStream
    ticket: Ticket | None = None
    ids: list[int] = field(default_factory=list)  # tokens as delivered (the request's own list is the engine's)
    finish_reason: str | None = None
    error: str | None = None
    counts_prompt: bool = True  # False for choices 2..n of a prompt: usage counts a prompt once
    echo: str | None = None  # completions with echo: the prompt's text, returned before the completion
    prompt_only: bool = False  # echo with max_tokens=0: the request's one token (from the prefill) is not returned
    tools: Tools | None = None  # chat with tools: its finished text is parsed for calls (tools.py)
    decode: Callable[[Sequence[int]], str] | None = None  # its output's text (with or without special tokens)
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs: the prompt's returned with the response

    def output(self) -> tuple[list[int], list[TokenLogprob]]:
        """The returned output tokens and their logprobs (once finished)."""
        return ([], []) if self.prompt_only else (self.request.output_ids, self.request.output_logprobs)

    @property
    def trim(self) -> int:
        """Characters a stop string cut off the end of the returned tokens' text (once finished)."""
        return 0 if self.prompt_only else self.request.stop_trim


class Server:
    """The app's state: the model (for tokenization and limits) and the scheduler."""

    def __init__(self, llm: LLM, scheduler: Scheduler, model_name: str, chat_template: str | None = None,
                 tool_call_parser: str | None = None):
        self.llm = llm
        self.scheduler = scheduler
        self.model_name = model_name
        self.chat_template = chat_template
        self.tool_call_parser = tool_call_parser  # how "auto" tool choice finds calls in the text (tools.PARSERS)
        self.created = now()
        self._tokenizer_lock = threading.Lock()  # HF fast tokenizers are not safe under concurrent encode

    # ------------------------------------------------------------------ requests
    def prepare(self, req: GenerationRequest) -> list[_Choice]:
        """Tokenize and check every prompt of a request (ValueError -> 400)."""
        if req.model is not None and req.model != self.model_name:
            raise LookupError(f"the model '{req.model}' does not exist; this server serves '{self.model_name}'")
        if req.tools is not None and req.tools.choice == "auto" and self.tool_call_parser is None:
            raise BadRequest("tool_choice \"auto\" needs the server started with --tool-call-parser (hermes); "
                             "\"required\" or a named function work without one", "tool_choice")
        with self._tokenizer_lock:
            batch = (self.llm.encode(list(req.prompts), req.add_special_tokens) if req.prompts else
                     [self._chat_ids(req.messages, req.tools.functions if req.tools else None,
                                     dict(req.template_kwargs))])
        if req.truncate_prompt_tokens is not None:  # vLLM's: the prompt's last tokens only
            batch = [ids[-req.truncate_prompt_tokens:] for ids in batch]
        decode = self.decode if req.params.skip_special_tokens else self.decode_raw
        choices = []
        for prompt, ids in zip(req.prompts or [None], batch):
            whole = isinstance(prompt, str) and req.truncate_prompt_tokens is None
            echo = (prompt if whole else self.decode(ids)) if req.echo else None
            params = req.params
            if req.max_tokens is None:  # chat default: the rest of the context
                params = replace(params, max_tokens=max(self.llm.target.max_position_embeddings - len(ids), 1))
            for j in range(req.n):  # OpenAI's order: the choices of prompt 0, then those of prompt 1, ...
                seeded = params if params.seed is None else replace(params, seed=params.seed + j)
                request = make_request(self.llm, ids, seeded, self._tokenizer_lock)
                choices.append(_Choice(len(choices), request, TextStream(decode, params.stop), counts_prompt=j == 0,
                                       echo=echo, prompt_only=req.max_tokens == 0,
                                       tools=req.tools if req.tools is not None and req.tools.choice != "none" else None,
                                       decode=decode, prompt_logprobs=req.prompt_logprobs is not None))
        return choices

    def _chat_ids(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                  template_kwargs: dict | None = None) -> list[int]:
        """The chat's prompt through the chat template. `template_kwargs` (default: add the generation
        prompt) go to the template; one that names a variable the template never reads is refused, since
        Jinja would drop it silently (e.g. enable_thinking with a template that has no thinking switch)."""
        tokenizer = self.llm.tokenizer
        template = self.chat_template or getattr(tokenizer, "chat_template", None)
        if tokenizer is None or not template:
            raise ValueError(f"the model '{self.model_name}' has no chat template; use /v1/completions or start the "
                             "server with --chat-template FILE")
        kwargs = dict(template_kwargs or {"add_generation_prompt": True})
        variables = [k for k in kwargs if k not in ("add_generation_prompt", "continue_final_message")]
        source = template if isinstance(template, str) else " ".join(map(str, dict(template).values()))
        unread = next((k for k in variables if not re.search(rf"\b{k}\b", source)), None)
        if unread is not None:
            raise BadRequest(f"the chat template does not read '{unread}'", "reasoning_effort"
                             if unread == "reasoning_effort" else "chat_template_kwargs")
        ids = tokenizer.apply_chat_template(list(messages), chat_template=template, tokenize=True,
                                            tools=list(tools) if tools else None, **kwargs)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        if not ids:
            raise ValueError("the chat template produced an empty prompt")
        return [int(t) for t in ids]

    # ------------------------------------------------------------------ tokenizer endpoints
    def tokenize(self, body: object) -> dict:
        """vLLM's /tokenize: a prompt (with the tokenizer's special tokens unless add_special_tokens is
        false) or chat messages through the chat template -> their token ids."""
        req = parse_tokenize(body)
        tokenizer = self._tokenizer()
        with self._tokenizer_lock:
            ids = (self._chat_ids(req.messages) if req.prompt is None else
                   list(tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)))
        return {"count": len(ids), "max_model_len": self.llm.target.max_position_embeddings, "tokens": ids}

    def detokenize(self, body: object) -> dict:
        """vLLM's /detokenize: token ids -> their text."""
        self._tokenizer()
        return {"prompt": self.decode(parse_detokenize(body, self.llm.target.vocab_size))}

    def tokenizer_info(self) -> dict:
        """vLLM's /tokenizer_info: the special tokens, the chat template and the context length."""
        tokenizer = self._tokenizer()
        info = {name: getattr(tokenizer, name, None) for name in ("eos_token", "bos_token", "pad_token", "unk_token")}
        return {"tokenizer_class": type(tokenizer).__name__, **info, "model_max_length":
                self.llm.target.max_position_embeddings,
                "chat_template": self.chat_template or getattr(tokenizer, "chat_template", None)}

    def _tokenizer(self):
        if self.llm.tokenizer is None:
            raise BadRequest(f"the model '{self.model_name}' has no tokenizer")
        return self.llm.tokenizer

    def decode_raw(self, ids: Sequence[int]) -> str:
        """`decode` with the special tokens kept (harmony's channel markers are special tokens)."""
        with self._tokenizer_lock:
            return self.llm.tokenizer.decode(list(ids), skip_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        with self._tokenizer_lock:
            return self.llm._decode(ids)

    def submit(self, choices: list[_Choice]) -> asyncio.Queue:
        """Queue every choice; on QueueFull the ones already queued are cancelled."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        for choice in choices:
            def sink(event, index=choice.index):
                try:
                    loop.call_soon_threadsafe(events.put_nowait, (index, event))
                except RuntimeError:  # the event loop closed (server shut down): nobody listens any more
                    pass
            try:
                choice.ticket = self.scheduler.submit(choice.request, sink)
            except QueueFull:
                self.cancel(choices)
                raise
        return events

    def cancel(self, choices: list[_Choice]) -> None:
        for choice in choices:
            if choice.ticket is not None:
                self.scheduler.cancel(choice.ticket)


def build_app(server: Server) -> FastAPI:
    """The FastAPI app around a started scheduler."""
    app = FastAPI(title="moespec", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    async def health():
        if not server.scheduler.alive:
            return JSONResponse({"status": "scheduler stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.scheduler.metrics.render(server.llm.engine.prefix_cache),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "moespec", "max_model_len":
                                            server.llm.target.max_position_embeddings}]}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return await _answer(server.tokenizer_info)

    @app.post("/tokenize")
    async def tokenize(http: HttpRequest):
        return await _answer(server.tokenize, http)

    @app.post("/detokenize")
    async def detokenize(http: HttpRequest):
        return await _answer(server.detokenize, http)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await _generate(server, http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        return await _generate(server, http, chat=True)

    return app


async def _generate(server: Server, http: HttpRequest, chat: bool):
    try:
        body = await _json(http)
        req = parse_chat(body) if chat else parse_completion(body)
        choices = server.prepare(req)
    except BadRequest as e:
        return _error(400, str(e), param=e.param)
    except LookupError as e:
        return _error(404, str(e), code="model_not_found")
    except ValueError as e:
        return _error(400, str(e))
    try:
        events = server.submit(choices)
    except QueueFull as e:
        return _error(503, str(e), kind="server_overloaded")
    rid, created = new_id("chatcmpl" if chat else "cmpl"), now()
    if req.stream:
        return StreamingResponse(_stream(server, choices, events, rid, created, chat, req.include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        await _wait_all(choices, events, http)
    finally:
        server.cancel([c for c in choices if c.finish_reason is None])
    failed = [c for c in choices if c.error is not None]
    if failed:
        return _error(500, failed[0].error, kind="internal_error")
    return _final(server, choices, rid, created, chat)


async def _wait_all(choices: list[_Choice], events: asyncio.Queue, http: HttpRequest) -> None:
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


def _apply(choice: _Choice, event: TokenEvent | FinishEvent) -> None:
    if isinstance(event, TokenEvent):
        choice.ids.extend(event.token_ids)
    else:  # after this event the engine no longer touches choice.request
        choice.finish_reason = event.reason
        choice.error = event.error


def _final(server: Server, choices: list[_Choice], rid: str, created: int, chat: bool) -> dict:
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
    prompt = sum(len(c.request.prompt_ids) for c in choices if c.counts_prompt)
    completion = sum(len(c.output()[0]) for c in choices)
    body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": server.model_name, "choices": out, "usage": usage(prompt, completion)}
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


def _chat_reply(server: Server, c: _Choice, text: str) -> tuple[dict, str | None]:
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


async def _stream(server: Server, choices: list[_Choice], events: asyncio.Queue, rid: str, created: int,
                  chat: bool, include_usage: bool) -> AsyncIterator[str]:
    """SSE chunks: deltas as tokens commit, a finishing chunk per choice, [DONE].

    With logprobs, every step's tokens come with their logprobs in the chunk of that step, even when
    its text is held back (an incomplete character, the possible start of a stop string) and the
    chunk's text is empty: delivered tokens are final, so the chunks' logprobs add up to the
    non-streamed response's, as their texts do."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    offsets = {c.index: IncrementalText(c.decode) for c in choices}  # text_offset of completion tokens
    # harmony (GPT-OSS): answer and reasoning stream as their channels grow; other tool parsers need the whole text
    harmony = {c.index: HarmonyStream(server.decode_raw, c.text.hold) for c in choices} if (
        chat and server.tool_call_parser == "harmony") else {}
    # hermes ("auto" tools): the content before the first call block streams, each call once its block closed
    hermes = {c.index: HermesStream(c.decode, c.tools, c.text.hold) for c in choices if chat and c.tools is not None
              and c.tools.choice == "auto" and server.tool_call_parser == "hermes"}

    def chunk(choice_list: list[dict], **extra) -> str:
        return _sse({"id": rid, "object": kind, "created": created, "model": server.model_name,
                     "choices": choice_list, **extra})

    def piece(c: _Choice, text: str, finish: str | None, first: bool = False, logprobs: dict | None = None) -> dict:
        if chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            return {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def step_logprobs(c: _Choice, event: TokenEvent) -> dict | None:
        if c.request.logprobs is None:
            return None
        if c.prompt_only:
            return _echo_logprobs(server, c.request)
        if chat:
            return _chat_logprobs(c.decode, event.logprobs)
        start = len(c.ids) - len(event.token_ids)
        part = _completion_logprobs(c.decode, c.ids, event.logprobs, start, offsets[c.index], shift=len(c.echo or ""))
        return _joined(_echo_logprobs(server, c.request), part) if c.echo is not None and start == 0 else part

    try:
        if chat:
            yield chunk([piece(c, "", None, first=True) for c in choices])
        while any(c.finish_reason is None for c in choices):
            index, event = await events.get()
            c = choices[index]
            _apply(c, event)
            if c.error is not None:
                yield _sse(error_body(c.error, kind="internal_error"))
                return
            if isinstance(event, TokenEvent) and c.index in harmony:
                delta, logprobs = harmony[c.index].push(c.ids, event.text_trim), step_logprobs(c, event)
                if delta or logprobs:
                    yield chunk([{"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}])
            elif isinstance(event, TokenEvent) and c.index in hermes:
                (text, calls), logprobs = hermes[c.index].push(c.ids, event.text_trim), step_logprobs(c, event)
                if text or logprobs:
                    yield chunk([piece(c, text, None, logprobs=logprobs)])
                if calls:  # numbered after the ones sent before
                    first = hermes[c.index].calls_sent - len(calls)
                    deltas = [{"index": first + i, **call.to_openai()} for i, call in enumerate(calls)]
                    yield chunk([{"index": c.index, "delta": {"tool_calls": deltas}, "logprobs": None,
                                  "finish_reason": None}])
            elif isinstance(event, TokenEvent):
                # a chat whose output is a forced call (named or "required") is answered when it finishes
                held = c.prompt_only or (chat and c.tools is not None)
                delta, logprobs = "" if held else c.text.push(c.ids, event.text_trim), step_logprobs(c, event)
                if c.echo is not None and len(c.ids) == len(event.token_ids):  # the first tokens: the prompt first
                    delta = c.echo + delta
                if delta or logprobs:
                    yield chunk([piece(c, delta, None, logprobs=logprobs)])
            elif chat and (c.tools is not None or c.index in harmony):
                message, finish = _chat_reply(server, c, cut_text(c.decode(c.output()[0]), c.trim))
                calls, first = message.get("tool_calls") or [], 0
                if c.index in harmony:  # what the channels had not yet sent
                    delta = harmony[c.index].finish(message)
                elif c.index in hermes:  # the content and the calls not yet sent
                    rest, calls = hermes[c.index].finish(message["content"], calls)
                    delta, first = ({"content": rest} if rest else {}), hermes[c.index].calls_sent
                else:
                    delta = {k: v for k, v in message.items() if k in ("content", "reasoning_content") and v}
                if calls:
                    delta["tool_calls"] = [{"index": first + i, **call} for i, call in enumerate(calls)]
                yield chunk([{"index": c.index, "delta": delta, "logprobs": None, "finish_reason": finish}])
            else:
                yield chunk([piece(c, c.text.finish(c.output()[0], c.trim), c.finish_reason)])
        if include_usage:
            prompt = sum(len(c.request.prompt_ids) for c in choices if c.counts_prompt)
            completion = sum(len(c.output()[0]) for c in choices)
            yield chunk([], usage=usage(prompt, completion))
        yield "data: [DONE]\n\n"
    finally:  # normal end, error, or the client went away (the task is cancelled)
        server.cancel([c for c in choices if c.finish_reason is None])


async def _json(http: HttpRequest) -> object:
    """The request body as JSON; BadRequest when it is not."""
    try:
        return json.loads(await http.body())
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("the request body is not valid JSON") from None


async def _answer(handler, http: HttpRequest | None = None):
    """A small synchronous handler's result (called with the JSON body when `http` is given), or a
    bad body / its BadRequest / ValueError as a 400."""
    try:
        return handler() if http is None else handler(await _json(http))
    except BadRequest as e:
        return _error(400, str(e), param=e.param)
    except ValueError as e:
        return _error(400, str(e))


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
           code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status)
