"""Request bodies of the OpenAI-compatible endpoints, as strict pydantic models.

Strict types: `"10"` is not an integer and `true` is not a number, as in the OpenAI API. Unknown
fields are ignored (like vLLM), so clients that send extra options keep working; fields the
server knows but does not implement are accepted only at their neutral value and otherwise get
a 400 that names them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import InvalidRequestError

MAX_STOP = 16
MAX_TOP_LOGPROBS = 20


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class SpeculativeOptions(_Strict):
    """Per-request speculation: which of the drafters the server loaded at start (by name; the
    scheduler checks it), and how many tokens it may draft per step."""

    model_config = ConfigDict(strict=True, extra="forbid")
    drafter: str | None = None
    num_tokens: int | None = Field(None, ge=0)


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # -1 or 0 = off (vLLM uses -1)
    min_p: float = Field(0.0, ge=0.0, lt=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    # A speculation override: `false` turns drafting off; an object picks the drafter and k.
    speculative: bool | SpeculativeOptions | None = None
    # Known but not implemented: accepted at their neutral value only.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def checked(self) -> "_Sampling":
        if self.n != 1:
            raise InvalidRequestError("only n = 1 is supported", "n")
        if self.presence_penalty or self.frequency_penalty:
            param = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            raise InvalidRequestError(f"{param} is not supported (only 0)", param)
        if self.logit_bias:
            raise InvalidRequestError("logit_bias is not supported", "logit_bias")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise InvalidRequestError(f"at most {MAX_STOP} stop sequences", "stop")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed with stream = true", "stream_options")
        return self

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def checked(self) -> "CompletionRequest":
        super().checked()
        if self.echo:
            raise InvalidRequestError("echo is not supported", "echo")
        if self.best_of not in (None, 1):
            raise InvalidRequestError("only best_of = 1 is supported", "best_of")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", "suffix")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            if len(self.prompt) != 1:
                raise InvalidRequestError("one prompt per request is supported (got a batch of prompts)", "prompt")
        return self

    @property
    def single_prompt(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            return self.prompt[0]
        return self.prompt


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        # Templates know "system"; "developer" is OpenAI's newer name for it.
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def checked(self) -> "ChatCompletionRequest":
        super().checked()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs = true", "top_logprobs")
        return self


def parse(model: type[_Strict], body: object) -> _Strict:
    """Validate a JSON body into `model`, turning pydantic's errors into one InvalidRequestError."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    try:
        return model.model_validate(body).checked()
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _param(first["loc"])
        raise InvalidRequestError(f"{param}: {first['msg']}" if param else first["msg"], param) from None


def _param(loc: tuple) -> str | None:
    # Union members add their type name to the location ("prompt", "str"); keep field names and
    # list indices only.
    parts = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif isinstance(item, str) and item.isidentifier() and item not in {"str", "int", "float", "bool", "list", "dict"}:
            parts.append(("." if parts else "") + item)
        else:
            break
    return "".join(parts) or None
