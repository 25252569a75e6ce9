"""The app's error answers, always OpenAI's error object (`wire.error_body`) with its HTTP status.

`APIError` is a failure with its status outside `SpecdecError` (auth, routing, media type, a model
not loaded); `RowFault` is a request that failed inside the decoding loop (`errors.Fault`: its own
error only). `error_response` adds `Retry-After` to 429 and 503. `add_error_handlers` installs the
answers for everything a route may raise: a body over the limit (413, connection closed), a
`SpecdecError` (its own status), an `APIError`, Starlette's routing errors (404 / 405) and a bug
(500 with `Connection: close`).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import Fault, SpecdecError
from ..request import Delta
from .wire import BodyTooLarge, error_body, too_large_body

RETRY_AFTER_S = {429: 1, 503: 5}  # a full queue frees up fast; a load or a drain takes longer
log = logging.getLogger("specdec.server")


class APIError(Exception):
    """An error with its HTTP status, for failures outside `SpecdecError` (auth, routing, media type)."""

    def __init__(self, status: int, message: str, error_type: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.error_type, self.param, self.code = status, error_type, param, code


class RowFault(APIError):
    """A request that failed inside the decoding loop (`errors.Fault`): its own error only."""

    def __init__(self, fault: Fault):
        super().__init__(fault.status, fault.message, fault.type, fault.param)


def raise_fault(last: Delta) -> None:
    if last.finish_reason == "error":
        raise RowFault(last.error)


def error_response(status: int, message: str, error_type: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if status in RETRY_AFTER_S:
        headers.setdefault("Retry-After", str(RETRY_AFTER_S[status]))
    return JSONResponse(error_body(message, error_type, param, code), status_code=status, headers=headers)


def specdec_error_response(exc: SpecdecError) -> JSONResponse:
    code = exc.code or ("rate_limit_exceeded" if exc.http_status == 429 else None)
    return error_response(exc.http_status, str(exc), exc.error_type, getattr(exc, "param", None), code)


async def _too_large(request: Request, exc: BodyTooLarge):
    limit = request.app.state.specdec.body_limit
    return JSONResponse(too_large_body(limit), status_code=413, headers={"Connection": "close"})


async def _specdec_error(request: Request, exc: SpecdecError):
    return specdec_error_response(exc)


async def _api_error(request: Request, exc: APIError):
    return error_response(exc.status, str(exc), exc.error_type, exc.param, exc.code)


async def _http_error(request: Request, exc: StarletteHTTPException):
    # Routing: 404 for an unknown path, 405 (with the `Allow` header Starlette sets) for a
    # known path and a wrong method.
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(exc.status_code, str(exc.detail), kind, None, None, exc.headers)


async def _fault(request: Request, exc: Exception):
    # A bug. Starlette re-raises it after this response and uvicorn then closes the
    # connection, so say so: a pooling client must not send its next request on it.
    log.exception("specdec: internal error on %s %s", request.method, request.url.path)
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error",
                          headers={"Connection": "close"})


def add_error_handlers(app: FastAPI) -> None:
    for kind, handler in ((BodyTooLarge, _too_large), (SpecdecError, _specdec_error), (APIError, _api_error),
                          (StarletteHTTPException, _http_error), (Exception, _fault)):
        app.add_exception_handler(kind, handler)
