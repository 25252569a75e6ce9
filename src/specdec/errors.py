"""The one exception family of specdec.

The CLI turns a `SpecdecError` into one line on stderr and a nonzero exit; the server (later) into
the OpenAI error object. `http_status` says which status that object gets.
"""


class SpecdecError(Exception):
    """Base of every error specdec raises on purpose."""

    http_status = 500
    error_type = "internal_error"


class InvalidRequestError(SpecdecError, ValueError):
    """Bad user input: sampling values, prompts, lengths, options."""

    http_status = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ModelLoadError(SpecdecError):
    """A model file or folder that cannot be read, or is of a kind specdec does not support."""

    http_status = 500
    error_type = "model_load_error"
