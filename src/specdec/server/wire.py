"""What the server does around every HTTP request before and after the endpoints see it: the
OpenAI error object, the body size limit, the access log and the shutdown summary, and the 400 for
malformed HTTP in the same error shape.

The body limit is checked twice: from `Content-Length` before a byte of the body is read (413 at
once, connection closed), and while reading, for a chunked body or one that is longer than it
said (`BodyTooLarge`, raised from the app's `receive`, which the app answers 413).

The access log writes one line per request when its response ends (for a stream, at its last
byte) to the `specdec.server` logger: the request's id (the id of the completion it answered),
the tenant, method, path, status, prompt / completion / cached tokens, seconds and tokens per
target forward. Never the prompt, the output or the key.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger("specdec.server")
BODY_BYTES_PER_TOKEN = 64  # room for JSON escapes and token-id lists: a prompt token is rarely > 16 bytes
MIN_BODY_BYTES = 1 << 20  # what a context of a few hundred tokens still gets


def default_body_limit(max_model_len: int) -> int:
    """The request body limit sized to the context window (`--max-body-bytes`' default)."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    # A message or a param quoting the client's text (a field name it sent) could hold a lone
    # surrogate, which UTF-8 cannot encode: escape it rather than fail while reporting the error.
    message = _utf8(message)
    param = None if param is None else _utf8(param)
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def _utf8(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _json_bytes(payload: dict) -> bytes:
    return json.dumps(payload).encode()


class BodyTooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"the request body is larger than this server's limit of {limit} bytes (--max-body-bytes)")


def too_large_body(limit: int) -> dict:
    return error_body(str(BodyTooLarge(limit)), "invalid_request_error", None, "request_too_large")


async def _send_json(send, status: int, payload: dict, close: bool = True) -> None:
    body = _json_bytes(payload)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """ASGI middleware: request bodies of at most `limit()` bytes (413 otherwise, see the module doc)."""

    def __init__(self, app, limit: Callable[[], int]):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit()
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > limit:
            return await _send_json(send, 413, too_large_body(limit))
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, limited, send)


@dataclass
class Access:
    """What the access line says about one request; the endpoints fill in what they learn."""

    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    tenant: str = "-"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    forwards: int = 0  # target forwards that produced its tokens


@dataclass
class Totals:
    """Everything the access log saw, for the line at shutdown."""

    started: float = field(default_factory=time.monotonic)
    statuses: Counter = field(default_factory=Counter)
    completion_tokens: int = 0
    forwards: int = 0

    def summary(self) -> str:
        by_status = ", ".join(f"{status}: {n}" for status, n in sorted(self.statuses.items())) or "none"
        per_forward = f"{self.completion_tokens / self.forwards:.2f}" if self.forwards else "-"
        return (f"specdec: shut down after {time.monotonic() - self.started:.1f} s: "
                f"{sum(self.statuses.values())} requests ({by_status}), {self.completion_tokens} tokens generated, "
                f"{per_forward} tokens per forward")


class AccessLog:
    """ASGI middleware: one log line per HTTP request (see the module doc); `scope["specdec.access"]`
    is the request's `Access` for the endpoints to fill in."""

    def __init__(self, app, totals: Totals):
        self.app, self.totals = app, totals

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        access = scope["specdec.access"] = Access()
        start, status = time.perf_counter(), 500

        async def watched(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            self._line(scope, access, status, time.perf_counter() - start)

    def _line(self, scope, access: Access, status: int, seconds: float) -> None:
        self.totals.statuses[status] += 1
        self.totals.completion_tokens += access.completion_tokens
        self.totals.forwards += access.forwards
        per_forward = f"{access.completion_tokens / access.forwards:.2f}" if access.forwards else "-"
        log.info("specdec: access id=%s tenant=%s %s %s status=%d prompt_tokens=%d completion_tokens=%d "
                 "cached_tokens=%d time=%.3fs tokens_per_forward=%s", access.id, access.tenant, scope["method"],
                 scope["path"], status, access.prompt_tokens, access.completion_tokens, access.cached_tokens,
                 seconds, per_forward)


def http_protocol():
    """Uvicorn's HTTP protocol class (httptools where installed, as uvicorn picks it, else h11) with
    its answer to malformed HTTP in the OpenAI error shape instead of plain text."""
    # uvicorn is the server extra: imported when a server starts, not when the CLI parses options.
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base

    class OpenAIErrorProtocol(base):
        def send_400_response(self, msg: str) -> None:
            body = _json_bytes(error_body(f"malformed HTTP request: {msg}", "invalid_request_error", None,
                                          "malformed_request"))
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
            self.transport.close()

    return OpenAIErrorProtocol
