"""What wraps every HTTP request (a plain ASGI middleware, so streams pass through unbuffered):

- `--api-key`: every path but /health, /metrics and /version needs `Authorization: Bearer KEY`
  (401 otherwise, OpenAI's error object);
- `X-Request-Id`: a client's id comes back on the response (a generation's handler sets its own
  otherwise);
- failures: an exception that escaped the handlers is answered with a JSON 500 with its message
  (app.py's handler, or here if none answered), logged in one line (the traceback at debug level)
  and not raised on to uvicorn, which would print the traceback;
- error counting: each answer with status >= 400 goes to the metrics by status.
"""

from __future__ import annotations

import hmac
import json
import logging

from .metrics import ServeMetrics
from .protocol import error_body

log = logging.getLogger("trtllm_moespec.serve")
OPEN_PATHS = frozenset(("/health", "/metrics", "/version"))  # what monitoring reads without the key


class ServeMiddleware:
    """API key, X-Request-Id, JSON 500s and error counts around the app (see module docstring)."""

    def __init__(self, app, metrics: ServeMetrics, api_key: str | None = None):
        self.app, self.metrics = app, metrics
        self.api_key = None if api_key is None else api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        request_id = headers.get(b"x-request-id")
        started = False

        async def send_tagged(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] >= 400:
                    self.metrics.record_error(message["status"])
                names = {name.lower() for name, _ in message.get("headers", [])}
                if request_id is not None and b"x-request-id" not in names:
                    message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        if self.api_key is not None and scope["path"] not in OPEN_PATHS and not self._authorized(headers):
            await _send_json(send_tagged, 401, error_body("invalid or missing API key: send the header "
                                                          "'Authorization: Bearer <key>' with the server's --api-key",
                                                          code="invalid_api_key"),
                             [(b"www-authenticate", b"Bearer")])
            return
        try:
            await self.app(scope, receive, send_tagged)
        except Exception as e:  # noqa: BLE001 - whatever escaped the handlers, answer in JSON
            # Starlette answered with the app's handler (app.py: a JSON 500) and raises it again to us
            log.error("%s %s failed: %s: %s", scope.get("method"), scope["path"], type(e).__name__, e,
                      exc_info=log.isEnabledFor(logging.DEBUG))
            self.metrics.record_failure()
            if not started:
                await _send_json(send_tagged, 500, error_body(f"{type(e).__name__}: {e}", kind="internal_error"))

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.api_key)


async def _send_json(send, status: int, payload: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})
