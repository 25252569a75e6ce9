"""The one exception family of specdec.

The CLI turns a `SpecdecError` into one line on stderr and a nonzero exit; the server into the
OpenAI error object `{"error": {"message", "type", "param", "code"}}`: `http_status` says which
status that object gets, `error_type` its `type`, and `code` its `code` (as in OpenAI's API, a
short string such as "unsupported_parameter", or None).
"""

from __future__ import annotations

from dataclasses import dataclass


class SpecdecError(Exception):
    """Base of every error specdec raises on purpose."""

    http_status = 500
    error_type = "internal_error"
    code: str | None = None


class InvalidRequestError(SpecdecError, ValueError):
    """Bad user input: sampling values, prompts, lengths, options."""

    http_status = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class ModelLoadError(SpecdecError):
    """A model file or folder that cannot be read, or is of a kind specdec does not support."""

    http_status = 500
    error_type = "model_load_error"


@dataclass(frozen=True)
class Fault:
    """What a request that failed inside the decoding loop is told: its own error and nothing else.

    A `SpecdecError` of the request's own making (its status below 500) says what was wrong with
    the request, as a 400 would have; anything else is a fault of the server, told only as such
    with the request's id, since an exception's text may hold data the request never sent (the
    full traceback goes to the server's log under that id).
    """

    status: int
    type: str
    message: str
    param: str | None = None

    @classmethod
    def of(cls, exc: BaseException, request_id: object) -> "Fault":
        if isinstance(exc, SpecdecError) and exc.http_status < 500:
            return cls(exc.http_status, exc.error_type, str(exc), getattr(exc, "param", None))
        return cls(500, "internal_error", f"internal error while generating request {request_id}; "
                   "the server's log has the details")
