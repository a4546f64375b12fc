"""Request bodies: read within a size limit, then decoded as JSON that the rest of the server can
handle (bounded nesting, text without lone surrogates).

    read_body(http, limit)  async, on the event loop: Content-Length checked before anything is
                            read, the stream counted as it arrives (chunked bodies) -> TooLarge (413)
    decode_json(raw)        in a worker thread: JSON, nesting depth, lone surrogates -> BadRequest (400)

A lone surrogate (JSON "\\ud800") is valid JSON but not text: the tokenizer refuses it with a
TypeError and UTF-8 encoders with a UnicodeEncodeError, so it is refused here, naming the field.
Nesting is bounded because the JSON decoder and later recursive code (schemas, templates, our own
responses) would otherwise stop with a RecursionError somewhere past a thousand levels.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request as HttpRequest

from .protocol import BadRequest

MAX_JSON_DEPTH = 128  # objects and lists inside each other; a JSON schema or tool call needs far fewer
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024  # above any prompt a 262k-token context takes, escaped JSON included


class TooLarge(Exception):
    """The body is larger than the server's limit (HTTP 413)."""


async def read_body(http: HttpRequest, limit: int) -> bytes:
    """The request body, refused (TooLarge) as soon as it is known to exceed `limit` bytes: before
    reading anything when Content-Length says so, else once the received part does."""
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"the request body has {int(declared)} bytes; this server takes at most {limit} "
                       "(--max-request-bytes)")
    parts, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"the request body has more than {limit} bytes; this server takes at most {limit} "
                           "(--max-request-bytes)")
        parts.append(chunk)
    return b"".join(parts)


def decode_json(raw: bytes) -> Any:
    """The body as JSON, checked for depth and text (BadRequest naming the problem)."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise BadRequest(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("the request body is not valid JSON") from None
    check_json(value)
    return value


def check_json(value: Any) -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH and strings (keys too) holding lone surrogates.
    Iterative: the check itself must not recurse on the depth it is there to bound."""
    stack: list[tuple[Any, tuple, int]] = [(value, (), 0)]  # (value, its path, its depth)
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise BadRequest(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels", _field(path))
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path)
                if isinstance(item, (str, dict, list)):
                    stack.append((item, (*path, key), depth + 1))
        else:
            stack.extend((item, (*path, i), depth + 1) for i, item in enumerate(value)
                         if isinstance(item, (str, dict, list)))


def _check_text(text: str, path: tuple) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        where = _field(path)
        raise BadRequest(f"{where or 'the request body'} holds a lone surrogate (U+{ord(text[e.start]):04X} at "
                         f"character {e.start}): not valid Unicode text", where) from None


def _field(path: tuple) -> str | None:
    """('messages', 0, 'content') -> 'messages[0].content' (None for the body itself)."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None
