"""The one exception family of specdec.

The CLI turns a `SpecdecError` into one line on stderr and a nonzero exit; the server into the
OpenAI error object `{"error": {"message", "type", "param", "code"}}`: `http_status` says which
status that object gets, `error_type` its `type`, and `code` its `code` (as in OpenAI's API, a
short string such as "unsupported_parameter", or None).
"""


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
