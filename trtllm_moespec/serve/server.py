"""`moespec serve`: load the model, start the scheduler loop, serve HTTP with uvicorn.

    moespec serve --model moespec-tiny --policy eagle3 --host 127.0.0.1 --port 8000 --max-batch-size 8

SIGTERM (or Ctrl-C) drains: the listening socket closes, new requests on open connections get 503,
and what was taken is served for up to --shutdown-timeout seconds; what is left then ends with an
error event (streams) or a 503 (the others), and the process exits 0. A second signal ends them now.

`ServerThread` runs the same server inside a process (tests, benchmarks): uvicorn on a
socket bound here (port 0 = any free port), stopped cleanly by `stop()`.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path


class MissingExtra(ImportError, ValueError):
    """The serve extra is not installed (a ValueError too: the CLI reports it in one line, exit 2)."""


try:
    import uvicorn

    from .app import build_app
except ImportError as e:
    raise MissingExtra(f"`moespec serve` needs the serve extra: pip install 'trtllm-moespec[serve]' ({e})") from None

from ..api import LLM
from .body import DEFAULT_MAX_REQUEST_BYTES
from .engine import ServingEngine, make_engine  # noqa: F401  (make_engine: re-exported)
from .metrics import ServeMetrics
from .scheduler import SHUTTING_DOWN, Scheduler
from .state import Server, check_chat_template, compile_chat_template
from .tools import PARSERS

log = logging.getLogger("trtllm_moespec.serve")


class DrainingServer(uvicorn.Server):
    """uvicorn whose shutdown first drains the scheduler (`Scheduler.drain`), waits for the streams to
    end, and does not re-raise the signal afterwards (uvicorn's own handler does: the process would
    then die by SIGTERM, exit 143, or by a KeyboardInterrupt that prints CancelledError tracebacks)."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, shutdown_timeout: float):
        super().__init__(config)
        self.scheduler, self.shutdown_timeout = scheduler, shutdown_timeout
        self.signals = 0

    def handle_exit(self, sig: int, frame) -> None:
        """SIGTERM / SIGINT: drain; a second one ends every request now, a third stops waiting for them."""
        self.signals += 1
        if self.signals == 2:  # the scheduler takes its lock: not from inside a signal handler
            threading.Thread(target=self.scheduler.end_all, args=(SHUTTING_DOWN,), daemon=True).start()
        elif self.signals > 2:
            self.force_exit = True
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        self.scheduler.drain(self.shutdown_timeout)
        await super().shutdown(sockets)


class ServerThread:
    """A started scheduler plus uvicorn on its own thread; `url` once started."""

    def __init__(self, llm: LLM, *, max_batch_size: int = 8, max_queue: int | None = None, host: str = "127.0.0.1",
                 port: int = 0, model_name: str = "moespec", chat_template: str | None = None,
                 engine: ServingEngine | str = "batched", log_level: str = "warning", tool_call_parser: str | None = None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, api_key: str | None = None,
                 shutdown_timeout: float = 30.0, chat_template_name: str = "template", warm_up: bool = False):
        if chat_template is not None:  # a broken template stops the server here, not at every chat
            check_chat_template(llm.tokenizer, chat_template, chat_template_name)
        if isinstance(engine, str):
            engine = make_engine(llm, max_batch_size, engine)
        if warm_up:  # the first request then pays no one-time costs (kernel caches loading, first allocations)
            log.info("warmed up in %.2f s", llm.warm_up(engine=engine))
        self.scheduler = Scheduler(engine, max_queue, ServeMetrics(model_name, prefix_cache=llm.engine.prefix_cache))
        self.server = Server(llm, self.scheduler, model_name, chat_template, tool_call_parser, max_request_bytes,
                             api_key=api_key)
        self.app = build_app(self.server)
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        # uvicorn waits this long for the connections to close; the scheduler ends its requests before
        config = uvicorn.Config(self.app, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout + 5,
                                lifespan="off")
        self.uvicorn = DrainingServer(config, self.scheduler, shutdown_timeout)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.scheduler.start()
        self._thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self._sock]},
                                        name="moespec-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self.uvicorn.started:
            self.stop()
            raise RuntimeError("the HTTP server did not start")
        return self

    def serve(self) -> None:
        """Serve on this thread until a signal ends it (`moespec serve`), then stop the scheduler."""
        self.scheduler.start()
        try:
            self.uvicorn.run(sockets=[self._sock])
        finally:
            self.scheduler.stop()
            self.server.close()

    def stop(self, timeout: float = 30.0) -> None:
        """Fail what is still running, then stop HTTP and the scheduler loop."""
        self.scheduler.stop(timeout)
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"the HTTP server did not stop within {timeout}s")
        self._sock.close()
        self.server.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def build_parser() -> argparse.ArgumentParser:
    from ..cli import _add_model_args

    p = argparse.ArgumentParser(prog="moespec serve", description="OpenAI-compatible HTTP server")
    _add_model_args(p, batch_policies=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch-size", type=int, default=8, help="requests decoded together (default 8)")
    p.add_argument("--engine", default="batched", choices=["batched", "round-robin"],
                   help="batched: one target forward per step for the whole batch (default); round-robin: one "
                        "forward per request (the reference)")
    p.add_argument("--max-queue", type=int, default=None,
                   help="bound the requests waiting beyond the batch: more get 503 with Retry-After, and one request "
                        "of more sequences than batch + queue a 400 (default: no bound, requests wait their turn)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"largest request body; larger ones get 413 before they are read "
                        f"(default {DEFAULT_MAX_REQUEST_BYTES} = 8 MiB)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM / Ctrl-C, serve the requests taken for up to this many seconds, then end the rest "
                        "with an error event or 503 (default 30)")
    p.add_argument("--api-key", default=os.environ.get("MOESPEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (401 otherwise) on every path but /health, /metrics and "
                        "/version (default: $MOESPEC_API_KEY; none: open)")
    p.add_argument("--served-model-name", default=None, help="the 'model' clients name (default: --model)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file (default: the tokenizer's)")
    p.add_argument("--tool-call-parser", default=None, choices=PARSERS,
                   help="how tool_choice \"auto\" finds calls in the text (hermes: <tool_call> blocks, Qwen's format; "
                        "harmony: GPT-OSS's channels, which also split every chat answer from its reasoning); "
                        "without it only \"required\" and named tool choices are served")
    p.add_argument("--prefix-cache", type=int, default=8,
                   help="keep the K/V of this many finished prompts for requests that begin alike (a chat's next "
                        "turn, a shared system prompt); one KV-cache slot each; 0 = off (default 8)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `moespec serve` (bad arguments: ValueError -> exit 2 in the CLI)."""
    args = build_parser().parse_args(argv)
    if args.max_batch_size < 1 or (args.max_queue is not None and args.max_queue < 0) or args.prefix_cache < 0:
        raise ValueError("--max-batch-size must be >= 1, --max-queue and --prefix-cache >= 0")
    if args.max_request_bytes < 1024 or not args.shutdown_timeout >= 0:
        raise ValueError("--max-request-bytes must be >= 1024 and --shutdown-timeout >= 0")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty")
    if args.model_impl != "lean":
        args.prefix_cache = 0  # transformers' forward keeps no static cache to copy prompts from
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must lie in [0, 65535], got {args.port}")
    template = Path(args.chat_template).read_text(encoding="utf-8") if args.chat_template else None
    if template is not None:  # a syntax error stops here, before the model loads; rendering is checked after
        compile_chat_template(template, args.chat_template)
    from ..cli import BATCH_POLICY_CHOICES, _llm_from_args

    kind = args.engine
    if args.policy in BATCH_POLICY_CHOICES:  # X-batch: policy X's drafter, predictor and costs, selected across the batch
        if kind != "batched":
            raise ValueError(f"--policy {args.policy} needs --engine batched")
        args.policy, kind = args.policy.removesuffix("-batch"), args.policy
    llm = _llm_from_args(args)
    name = args.served_model_name or args.model
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    server = ServerThread(llm, max_batch_size=args.max_batch_size, max_queue=args.max_queue, host=args.host,
                          port=args.port, model_name=name, chat_template=template, engine=kind,
                          log_level=args.log_level, tool_call_parser=args.tool_call_parser,
                          max_request_bytes=args.max_request_bytes, api_key=args.api_key,
                          shutdown_timeout=args.shutdown_timeout, chat_template_name=args.chat_template or "template",
                          warm_up=True)
    log.info("serving %s (policy %s, %s engine, max batch %d) at %s", name, args.policy, kind, args.max_batch_size,
             server.url)
    server.serve()  # blocks; SIGTERM / Ctrl-C drain it
    log.info("stopped")
    _exit_now(0)


def _exit_now(code: int) -> None:
    """End the process without interpreter finalization. Daemon threads (the worker pool, by design
    possibly inside a tokenization) end with the process; finalization would instead unwind any of
    them that comes back from native code, which aborts the process ("terminate called without an
    active exception", exit -6: seen once in about 40 signalled shutdowns on a loaded machine)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
