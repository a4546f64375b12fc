"""The server's state and the work behind each request: checked bodies -> tokenized engine requests
(`Choice`s) -> the scheduler; vLLM's tokenizer endpoints; the chat template, checked at start-up.

Everything here that tokenizes or renders a template runs in the server's worker threads, never on
the event loop: a prompt of megabytes takes seconds to tokenize, and on the loop it would stall
/health and every stream. Each thread (the workers and the event loop, which decodes stream deltas)
uses its own copy of the tokenizer, so a long encode holds no lock that a decode waits on; the
model's own tokenizer is left to `LLM.make_request` and the engine's stop-string checks, under
`tokenizer_lock` (Hugging Face fast tokenizers are not safe under concurrent use).
"""

from __future__ import annotations

import asyncio
import copy
import queue
import re
import threading
import time
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from ..api import LLM
from ..core.logprobs import TokenLogprob
from ..detokenize import TextStream
from ..engine.engine import Request
from .body import DEFAULT_MAX_REQUEST_BYTES, decode_json
from .engine import make_request
from .protocol import BadRequest, GenerationRequest, now, parse_chat, parse_completion, parse_detokenize, parse_tokenize
from .scheduler import Scheduler, Ticket
from .tools import Tools

class UnknownModel(LookupError):
    """The request names a model this server does not serve (HTTP 404)."""


TEMPLATE_PROBE = [{"role": "user", "content": "hello"}]  # what a chat template must render at start-up


@dataclass
class Choice:
    """One sequence of an HTTP request (a prompt, or choice j of n), as the handler follows it."""

    index: int
    request: Request
    text: TextStream
    ticket: Ticket | None = None
    ids: list[int] = field(default_factory=list)  # tokens as delivered (the request's own list is the engine's)
    finish_reason: str | None = None
    error: str | None = None
    status: int = 500  # with `error`: the HTTP status it stands for (500 engine failure, 503 shutdown)
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
    """The app's state: the model (for tokenization and limits), the scheduler, the worker threads."""

    def __init__(self, llm: LLM, scheduler: Scheduler, model_name: str, chat_template: str | None = None,
                 tool_call_parser: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 workers: int = 4, api_key: str | None = None):
        self.llm = llm
        self.scheduler = scheduler
        self.model_name = model_name
        self.chat_template = chat_template
        self.tool_call_parser = tool_call_parser  # how "auto" tool choice finds calls in the text (tools.PARSERS)
        self.max_request_bytes = max_request_bytes
        self.api_key = api_key
        self.created = now()
        self.tokenizer_lock = threading.Lock()  # the model's tokenizer: make_request and the stop checks
        self._local = threading.local()  # this thread's copy of the tokenizer
        self.pool = WorkerPool(workers, "moespec-prepare")

    async def run(self, fn: Callable, *args) -> Any:
        """`fn(*args)` in a worker thread (tokenizing, templates, grammars: never on the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def close(self) -> None:
        self.pool.shutdown()

    # ------------------------------------------------------------------ requests (worker threads)
    def prepare_body(self, raw: bytes, chat: bool) -> tuple[GenerationRequest, list[Choice]]:
        """A raw /v1/completions or /v1/chat/completions body -> the request and its checked choices."""
        body = decode_json(raw)
        req = parse_chat(body) if chat else parse_completion(body)
        return req, self.prepare(req)

    def prepare(self, req: GenerationRequest) -> list[Choice]:
        """Tokenize and check every prompt of a request (ValueError -> 400, UnknownModel -> 404)."""
        if req.model is not None and req.model != self.model_name:
            raise UnknownModel(f"the model '{req.model}' does not exist; this server serves '{self.model_name}'")
        if req.tools is not None and req.tools.choice == "auto" and self.tool_call_parser is None:
            raise BadRequest("tool_choice \"auto\" needs the server started with --tool-call-parser (hermes); "
                             "\"required\" or a named function work without one", "tool_choice")
        batch = (self._encode(req.prompts, req.add_special_tokens) if req.prompts else
                 [self._chat_ids(req.messages, req.tools.functions if req.tools else None, dict(req.template_kwargs))])
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
                request = make_request(self.llm, ids, seeded, self.tokenizer_lock)
                choices.append(Choice(len(choices), request, TextStream(decode, params.stop), counts_prompt=j == 0,
                                      echo=echo, prompt_only=req.max_tokens == 0,
                                      tools=req.tools if req.tools is not None and req.tools.choice != "none" else None,
                                      decode=decode, prompt_logprobs=req.prompt_logprobs is not None))
        return choices

    def _encode(self, prompts: Sequence[str | tuple[int, ...]], add_special_tokens: bool) -> list[list[int]]:
        """Token ids of each prompt: text through this thread's tokenizer, ids checked by `LLM.encode`."""
        batch = [self.encode_text(p, add_special_tokens) if isinstance(p, str) else self.llm.encode([list(p)])[0]
                 for p in prompts]
        if not all(batch):
            raise ValueError("empty prompt: give at least one token")
        return batch

    def encode_text(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`tokenizer.encode(text)`. A fast tokenizer is called without transformers' wrapper: its
        batch encode releases the GIL throughout and only the ids cross into Python, where the wrapper
        also builds masks and offsets per token under the GIL (seconds, at megabytes of text, during
        which the event loop could not run). Equal ids: the copy's truncation and padding are off, as
        the wrapper sets them for a plain encode (tests/serve/test_robustness.py compares them)."""
        tokenizer = self._tokenizer()
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def _chat_ids(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                  template_kwargs: dict | None = None) -> list[int]:
        """The chat's prompt through the chat template. `template_kwargs` (default: add the generation
        prompt) go to the template; one that names a variable the template never reads is refused, since
        Jinja would drop it silently (e.g. enable_thinking with a template that has no thinking switch)."""
        tokenizer = self._tokenizer()
        template = self.chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError(f"the model '{self.model_name}' has no chat template; use /v1/completions or start the "
                             "server with --chat-template FILE")
        kwargs = dict(template_kwargs or {"add_generation_prompt": True})
        variables = [k for k in kwargs if k not in ("add_generation_prompt", "continue_final_message")]
        source = template if isinstance(template, str) else " ".join(map(str, dict(template).values()))
        unread = next((k for k in variables if not re.search(rf"\b{k}\b", source)), None)
        if unread is not None:
            raise BadRequest(f"the chat template does not read '{unread}'", "reasoning_effort"
                             if unread == "reasoning_effort" else "chat_template_kwargs")
        ids = render_chat(tokenizer, template, list(messages), self.encode_text, tools=list(tools) if tools else None,
                          **kwargs)
        if not ids:
            raise ValueError("the chat template produced an empty prompt")
        return [int(t) for t in ids]

    # ------------------------------------------------------------------ tokenizer endpoints (worker threads)
    def tokenize(self, raw: bytes) -> dict:
        """vLLM's /tokenize: a prompt (with the tokenizer's special tokens unless add_special_tokens is
        false) or chat messages through the chat template -> their token ids."""
        req = parse_tokenize(decode_json(raw))
        ids = self._chat_ids(req.messages) if req.prompt is None else self.encode_text(req.prompt, req.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.llm.target.max_position_embeddings, "tokens": ids}

    def detokenize(self, raw: bytes) -> dict:
        """vLLM's /detokenize: token ids -> their text."""
        self._tokenizer()
        return {"prompt": self.decode(parse_detokenize(decode_json(raw), self.llm.target.vocab_size))}

    def tokenizer_info(self) -> dict:
        """vLLM's /tokenizer_info: the special tokens, the chat template and the context length."""
        tokenizer = self._tokenizer()
        info = {name: getattr(tokenizer, name, None) for name in ("eos_token", "bos_token", "pad_token", "unk_token")}
        return {"tokenizer_class": type(tokenizer).__name__, **info, "model_max_length":
                self.llm.target.max_position_embeddings,
                "chat_template": self.chat_template or getattr(tokenizer, "chat_template", None)}

    def _tokenizer(self):
        """This thread's copy of the model's tokenizer (BadRequest when the model has none)."""
        if self.llm.tokenizer is None:
            raise BadRequest(f"the model '{self.model_name}' has no tokenizer")
        own = getattr(self._local, "tokenizer", None)
        if own is None:
            with self.tokenizer_lock:
                own = copy.deepcopy(self.llm.tokenizer)
            backend = getattr(own, "backend_tokenizer", None)
            if backend is not None:  # what transformers sets for a plain encode (encode_text calls the backend)
                backend.no_truncation()
                backend.no_padding()
            self._local.tokenizer = own
        return own

    def decode_raw(self, ids: Sequence[int]) -> str:
        """`decode` with the special tokens kept (harmony's channel markers are special tokens)."""
        return self._tokenizer().decode(list(ids), skip_special_tokens=False) if self.llm.tokenizer else ""

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer().decode(list(ids), skip_special_tokens=True) if self.llm.tokenizer else ""

    # ------------------------------------------------------------------ the scheduler (event loop)
    def submit(self, choices: list[Choice], arrival: float | None = None) -> asyncio.Queue:
        """Queue every choice, all or none (QueueFull, NeverFits); events arrive as (index, event)."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def sink_of(index: int):
            def sink(event) -> None:
                try:
                    loop.call_soon_threadsafe(events.put_nowait, (index, event))
                except RuntimeError:  # the event loop closed (server shut down): nobody listens any more
                    pass
            return sink

        tickets = self.scheduler.submit_all([(c.request, sink_of(c.index)) for c in choices],
                                            time.monotonic() if arrival is None else arrival)
        for choice, ticket in zip(choices, tickets):
            choice.ticket = ticket
        return events

    def cancel(self, choices: list[Choice]) -> None:
        for choice in choices:
            if choice.ticket is not None:
                self.scheduler.cancel(choice.ticket)


class WorkerPool(Executor):
    """A fixed pool of daemon threads (what `Server.run` hands work to). ThreadPoolExecutor's threads
    are joined at interpreter exit, so a prompt of megabytes still being tokenized when SIGTERM comes
    would hold the process past --shutdown-timeout; these threads end with the process."""

    def __init__(self, workers: int, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = False, *, cancel_futures: bool = True) -> None:
        """Stop the threads once their current job is done; jobs not started are cancelled."""
        while cancel_futures:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)
        if wait:
            for thread in self._threads:
                thread.join()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting handler
                future.set_exception(e)


def render_chat(tokenizer, template: str, messages: list[dict], encode: Callable[[str], list[int]] | None = None,
                **kwargs) -> list[int]:
    """apply_chat_template's token ids: the rendered text through `encode` (default: the tokenizer's,
    without special tokens: the template placed them), as apply_chat_template(tokenize=True) encodes
    it. A template that fails on this conversation is a BadRequest carrying its message (templates
    raise for conversations they do not take, e.g. roles out of order)."""
    import jinja2

    try:
        text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)
    except jinja2.TemplateError as e:
        raise BadRequest(f"the chat template failed on these messages: {type(e).__name__}: {e}", "messages") from None
    return encode(text) if encode is not None else list(tokenizer.encode(text, add_special_tokens=False))


def compile_chat_template(source: str, name: str) -> None:
    """Parse a chat template as transformers will (its Jinja environment and extensions): ValueError
    naming the file, the line and Jinja's message on a syntax error. Needs no model."""
    import jinja2

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # another transformers: `check_chat_template` renders it once the model is loaded
        return
    try:
        _compile_jinja_template(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template {name}: line {e.lineno}: {e.message}") from None
    except jinja2.TemplateError as e:
        raise ValueError(f"--chat-template {name}: {e}") from None


def check_chat_template(tokenizer, source: str, name: str = "template") -> None:
    """The template compiles and renders a one-message chat with this tokenizer (ValueError naming the
    file otherwise): a broken template stops the server at start-up instead of failing every chat."""
    if tokenizer is None:
        raise ValueError(f"--chat-template {name}: this model has no tokenizer to apply it with")
    compile_chat_template(source, name)
    try:
        render_chat(tokenizer, source, TEMPLATE_PROBE, add_generation_prompt=True)
    except BadRequest as e:
        raise ValueError(f"--chat-template {name}: rendering one user message fails: "
                         f"{str(e).split(': ', 1)[-1]}") from None
    except Exception as e:  # noqa: BLE001 - whatever the template does wrong, say so in one line
        raise ValueError(f"--chat-template {name}: rendering one user message fails: {type(e).__name__}: {e}") from None
