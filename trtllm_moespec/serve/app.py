"""The OpenAI-compatible HTTP app (FastAPI): /v1/completions, /v1/chat/completions (SSE
streaming), /v1/models, /v1/models/{id}, /health, /metrics, /version, and vLLM's /tokenize,
/detokenize and /tokenizer_info (what evaluation harnesses use to tokenize through the server,
e.g. lm-eval's remote tokenizer).

Handlers only translate, and never block the event loop: the body is read within
--max-request-bytes (413 beyond), then decoded, checked and tokenized in a worker thread
(`Server.run`), handed to the `Scheduler` as engine requests, and its events turned into OpenAI
responses (responses.py). Every failure is OpenAI's JSON error object: 400 bad body, 401 API key
(middleware.py), 404 model or path, 413 too large, 503 queue bound or shutdown (with Retry-After),
500 a failure inside the server. A streaming client that disconnects has its requests cancelled
(their batch slots freed); a non-streaming one is polled for disconnection while it waits.
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from .body import TooLarge, read_body
from .metrics import CONTENT_TYPE
from .middleware import ServeMiddleware
from .protocol import BadRequest, error_body, new_id, now
from .responses import error_kind, final, stream, wait_all
from .scheduler import NeverFits, QueueFull
from .state import Server, UnknownModel


def build_app(server: Server) -> FastAPI:
    """The FastAPI app around a started scheduler, wrapped in `ServeMiddleware`."""
    app = FastAPI(title="moespec", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, e: StarletteHTTPException):  # unknown path (404), wrong method (405): OpenAI's shape
        return _error(e.status_code, str(e.detail), headers=e.headers)

    @app.exception_handler(Exception)
    async def crash(_, e: Exception):  # a bug in a handler: JSON, not Starlette's plain text (middleware.py logs it)
        return _error(500, f"{type(e).__name__}: {e}", kind="internal_error")

    @app.get("/health")
    async def health():
        if server.scheduler.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not server.scheduler.alive:
            return JSONResponse({"status": "scheduler stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.scheduler.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(server)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != server.model_name:
            return _error(404, f"the model '{model_id}' does not exist; this server serves '{server.model_name}'",
                          code="model_not_found")
        return _model_card(server)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return await _answer(server, http=None, handler=server.tokenizer_info)

    @app.post("/tokenize")
    async def tokenize(http: HttpRequest):
        return await _answer(server, http, server.tokenize)

    @app.post("/detokenize")
    async def detokenize(http: HttpRequest):
        return await _answer(server, http, server.detokenize)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await _generate(server, http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        return await _generate(server, http, chat=True)

    return ServeMiddleware(app, server.scheduler.metrics, server.api_key)


def _model_card(server: Server) -> dict:
    return {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "moespec",
            "root": server.model_name, "max_model_len": server.llm.target.max_position_embeddings}


async def _generate(server: Server, http: HttpRequest, chat: bool):
    arrival = time.monotonic()
    try:
        raw = await read_body(http, server.max_request_bytes)
        req, choices = await server.run(server.prepare_body, raw, chat)
        events = server.submit(choices, arrival)
    except (TooLarge, UnknownModel, ValueError, QueueFull) as e:
        return _refusal(e)
    given = http.headers.get("x-request-id")
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{given}" if given else new_id("chatcmpl" if chat else "cmpl")
    headers = {"X-Request-Id": given or rid}
    if req.stream:
        return StreamingResponse(stream(server, choices, events, rid, now(), chat, req.include_usage,
                                        req.continuous_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **headers})
    created = now()
    try:
        await wait_all(choices, events, http)
    finally:
        server.cancel([c for c in choices if c.finish_reason is None])
    failed = [c for c in choices if c.error is not None]
    if failed:
        return _error(failed[0].status, failed[0].error, kind=error_kind(failed[0].status), headers=headers)
    return JSONResponse(final(server, choices, rid, created, chat), headers=headers)


async def _answer(server: Server, http: HttpRequest | None, handler):
    """A small handler's result, computed in a worker thread (from the raw body when `http` is given),
    or its refusal."""
    try:
        if http is None:
            return await server.run(handler)
        return await server.run(handler, await read_body(http, server.max_request_bytes))
    except (TooLarge, ValueError) as e:
        return _refusal(e)


def _refusal(e: Exception) -> JSONResponse:
    """A request refused before it reached the engine, as OpenAI's error object."""
    if isinstance(e, TooLarge):
        return _error(413, str(e))
    if isinstance(e, QueueFull):
        return _error(503, str(e), kind="server_overloaded", headers={"Retry-After": str(e.retry_after_s)})
    if isinstance(e, UnknownModel):
        return _error(404, str(e), code="model_not_found")
    if isinstance(e, NeverFits):
        return _error(400, str(e), param="n")
    return _error(400, str(e), param=e.param if isinstance(e, BadRequest) else None)


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict | None = None) -> JSONResponse:
    if status == 503 and not (headers and "Retry-After" in headers):
        headers = {**(headers or {}), "Retry-After": "1"}
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)
