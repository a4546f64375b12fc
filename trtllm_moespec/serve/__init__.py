"""Serving: an OpenAI-compatible HTTP server over a continuous-batching scheduler.

    scheduler.py   waiting queue (unbounded, or bounded) + one background loop (admit / step / retire), drain
    engine.py      the step interface the scheduler drives, and the per-request implementation
    protocol.py    OpenAI / vLLM request bodies -> checked requests; error and usage shapes
    body.py        request bodies within a size limit, JSON checked for depth and lone surrogates
    state.py       the server's state: tokenizing and chat templates in worker threads -> engine requests
    responses.py   scheduler events -> OpenAI responses and SSE streams
    middleware.py  API key, X-Request-Id, JSON 500s, error counts
    metrics.py     /metrics on prometheus_client (ours and vLLM's names)
    app.py         FastAPI routes
    server.py      `moespec serve` (drains on SIGTERM) and an in-process server thread for tests and benchmarks

The HTTP stack (fastapi, uvicorn, prometheus_client) is the `serve` extra and is imported only here.
"""
