"""Serving: an OpenAI-compatible HTTP server over a continuous-batching scheduler.

    scheduler.py  bounded queue + one background loop (admit / step / retire)
    engine.py     the step interface the scheduler drives, and the per-request implementation
    app.py        FastAPI handlers: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics
    server.py     `moespec serve` and an in-process server thread for tests and benchmarks

The HTTP stack (fastapi, uvicorn) is the `serve` extra and is imported only here.
"""
