"""Request bodies of the OpenAI-compatible endpoints, as strict pydantic models.

Strict types: `"10"` is not an integer and `true` is not a number, as in the OpenAI API; a whole
float (`1.0`) is an integer, since JSON has one number type; NaN and infinities are refused. Text
must be valid Unicode: a lone surrogate (`"\\ud800"`) is a 400 naming its field.

Three kinds of fields:
- implemented ones, declared below with their types and ranges;
- fields that OpenAI's API or vLLM's well-known extensions define but this server does not
  implement (tools, beam search, ...): accepted only at their neutral value
  (null, or the value that changes nothing, e.g. `ignore_eos: false`), otherwise a 400 that names
  the field with code "unsupported_parameter". They are listed in `NOT_IMPLEMENTED`;
- fields nobody defines: ignored (as vLLM ignores them), so clients that send options of their
  own keep working.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from ..errors import InvalidRequestError
from ..sampling import REPETITION_PENALTY_RANGE
from ..structured import StructuredSpec
from ..tools import tool_set

MAX_STOP = 16
MAX_TOKEN_ID_DIGITS = 9
MAX_TOP_LOGPROBS = 20
MAX_CACHE_SALT_CHARS = 256  # a salt is a secret of a few dozen characters; 256 leaves room
# A prediction is the text an edit starts from (a file): 64k characters is a long source file, and
# bounds the tokenising and the matching of its tokens with the output (`prediction_usage`).
MAX_PREDICTION_CHARS = 65536
_PREDICTION_SHAPE = ('prediction must be {"type": "content", "content": a string or a list of '
                     '{"type": "text", "text": ...}}')


def _whole_number(value: object) -> object:
    # JSON has one number type: clients (and OpenAI's API) treat 1.0 as the integer 1.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _unicode_text(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"contains a lone surrogate (U+{ord(value[exc.start]):04X} at character {exc.start}), "
                         "which is not valid Unicode text") from None
    return value


Int = Annotated[int, BeforeValidator(_whole_number)]
Text = Annotated[str, AfterValidator(_unicode_text)]


def _same(value: object, neutral: object) -> bool:
    # `ignore_eos: 0` is not `false`, and `min_tokens: false` is not 0: booleans match only booleans.
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    if isinstance(value, (int, float)) and isinstance(neutral, (int, float)):
        return value == neutral  # 1 and 1.0
    return type(value) is type(neutral) and value == neutral


# Known fields this server does not implement: name -> (its neutral values besides null, what to
# say). Anything else in the field is a 400 naming it.
_TOOLS = "the legacy functions / function_call are not supported: use tools and tool_choice"
_COMMON_NOT_IMPLEMENTED: dict[str, tuple[tuple, str]] = {
    "length_penalty": ((1,), "beam search is not supported"),
    "use_beam_search": ((False,), "beam search is not supported"),
    "stop_token_ids": (([],), "stop_token_ids is not supported: use stop strings"),
    "bad_words": (([],), "bad_words is not supported"),
    "allowed_token_ids": ((), "allowed_token_ids is not supported"),
    "include_stop_str_in_output": ((False,), "include_stop_str_in_output is not supported (stop strings are cut)"),
    "skip_special_tokens": ((True,), "special tokens are always skipped in the output text"),
    "spaces_between_special_tokens": ((True,), "spaces_between_special_tokens is not supported"),
    "prompt_logprobs": ((), "prompt_logprobs is not supported (only the generated tokens' logprobs)"),
    "truncate_prompt_tokens": ((), "truncate_prompt_tokens is not supported: a prompt that does not fit is a 400"),
    "logits_processors": ((), "logits_processors is not supported"),
    "return_tokens_as_token_ids": ((False,), "return_tokens_as_token_ids is not supported"),
    "priority": ((0,), "request priorities are not supported (first come, first served)"),
    "guided_decoding_backend": ((), "the grammar engine is llguidance, not chosen per request"),
    "guided_whitespace_pattern": ((), "JSON whitespace is fixed (as json.dumps writes it); a schema's "
                                      "x-guidance sets it"),
    "store": ((False,), "stored completions are not supported"),
    "metadata": (({},), "metadata is only used by stored completions, which are not supported"),
    "service_tier": (("auto", "default"), "service tiers are not supported"),
}
_COMPLETION_NOT_IMPLEMENTED = {
    **_COMMON_NOT_IMPLEMENTED,
    "top_logprobs": ((), "top_logprobs is a chat field: /v1/completions takes logprobs = N"),
}
_CHAT_NOT_IMPLEMENTED = {
    **_COMMON_NOT_IMPLEMENTED,
    "functions": (([],), _TOOLS),
    "function_call": (("none",), _TOOLS),
    "echo": ((False,), "echo is not supported"),
    "chat_template": ((), "only the model's own chat template is supported"),
    "chat_template_kwargs": (({},), "chat_template_kwargs is not supported"),
    "documents": ((), "documents are not supported"),
    "modalities": ((["text"],), "only text output is supported"),
    "audio": ((), "audio output is not supported"),
    "reasoning_effort": ((), "reasoning_effort is not supported"),
    "web_search_options": ((), "web search is not supported"),
    "mm_processor_kwargs": ((), "multimodal input is not supported"),
}
_MESSAGE_NOT_IMPLEMENTED = {
    "function_call": ((), _TOOLS),
    "audio": ((), "audio is not supported"),
    "annotations": (([],), "annotations are not supported"),
    "refusal": ((), "refusal is not supported in input messages"),
}
_STREAM_NOT_IMPLEMENTED = {
    "continuous_usage_stats": ((False,), "continuous_usage_stats is not supported (usage comes in the last chunk)"),
    "include_obfuscation": ((False,), "stream obfuscation is not supported"),
}


# The tables by where their fields live (README's server section lists them).
NOT_IMPLEMENTED = {"completions": _COMPLETION_NOT_IMPLEMENTED, "chat": _CHAT_NOT_IMPLEMENTED,
                   "message": _MESSAGE_NOT_IMPLEMENTED, "stream_options": _STREAM_NOT_IMPLEMENTED}


def _refuse_not_implemented(model: BaseModel, table: dict[str, tuple[tuple, str]], prefix: str = "") -> None:
    for name, value in (model.model_extra or {}).items():
        if name in table and value is not None:
            neutral, why = table[name]
            if not any(_same(value, n) for n in neutral):
                allowed = " or ".join(["null"] + [json.dumps(n) for n in neutral])
                raise InvalidRequestError(f"{prefix}{name}: {why} (accepted only as {allowed})", prefix + name,
                                          "unsupported_parameter")


class _Strict(BaseModel):
    # extra="allow": unknown fields are kept in `model_extra` so that the known-but-not-implemented
    # ones can be checked; nothing reads the rest.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class SpeculativeOptions(_Strict):
    """Per-request speculation: which of the drafters the server loaded at start (by name; the
    scheduler checks it), and how many tokens it may draft per step."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    drafter: str | None = None
    num_tokens: Int | None = Field(None, ge=0)


class SpecdecOptions(_Strict):
    """specdec's own stream extension (`server/web.py` documents the chunks' `specdec` field):
    `tokens`: each chunk's text split by where its tokens came from; `stats`: the last chunk
    carries the request's speculation statistics."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    tokens: bool = False
    stats: bool = False


class _Sampling(_Strict):
    model: Text | None = None
    max_tokens: Int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: Int = Field(0, ge=-1)  # -1 or 0 = off (vLLM uses -1)
    min_p: float = Field(0.0, ge=0.0, lt=1.0)
    seed: Int | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Int = Field(1, ge=1)
    # A speculation override: `false` turns drafting off; an object picks the drafter and k.
    speculative: bool | SpeculativeOptions | None = None
    # Applied at every position, drafted or not, as plain decoding applies them (`adjust_logits`).
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    logit_bias: dict[str, float] | None = None  # token id (as a string, JSON keys are) -> [-100, 100]
    min_tokens: Int = Field(0, ge=0)
    ignore_eos: bool = False
    # Structured output (`structured`): OpenAI's response_format, vLLM's structured_outputs, and
    # vLLM's older guided_* fields as aliases. Checked by hand for messages that name the field.
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # OpenAI's end-user id (for abuse monitoring): accepted, changes nothing by definition.
    user: Text | None = None
    # vLLM's prefix-cache salt: only requests of the same tenant and salt share cached prefixes
    # (the server's --cache-salt says whether salts are honoured). OpenAI's prompt_cache_key is a
    # routing hint: accepted; cached prefixes never cross tenants whatever it says.
    cache_salt: Text | None = None
    prompt_cache_key: Text | None = None
    # OpenAI's predicted output: {"type": "content", "content": text or text parts} (`prediction_text`).
    prediction: Any = None
    # specdec's stream extension (a name no standard client sends): what the chat page shows.
    specdec: SpecdecOptions | None = None

    _not_implemented: ClassVar[dict[str, tuple[tuple, str]]] = _COMMON_NOT_IMPLEMENTED

    def checked(self) -> "_Sampling":
        if self.prediction is not None:
            if self.n != 1:
                raise InvalidRequestError("prediction: only with n = 1", "prediction", "unsupported_value")
            # getattr: chat declares `tools` (toolapi); an undeclared field is an extra attribute.
            if any(getattr(self, name, None) not in (None, []) for name in ("tools", "functions")):
                raise InvalidRequestError("prediction cannot be combined with tools (as in OpenAI's API)",
                                          "prediction", "unsupported_parameter")
            self.prediction_text  # noqa: B018 (a malformed prediction is a 400 here)
        if self.n != 1:
            raise InvalidRequestError("only n = 1 is supported", "n", "unsupported_value")
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise InvalidRequestError(f"logit_bias: keys must be token ids, got {key[:40]!r}", "logit_bias")
            if len(key) > MAX_TOKEN_ID_DIGITS:  # no vocabulary is that big; int() refuses 4,300 digits
                raise InvalidRequestError(f"logit_bias: token id {key[:40]}... is out of range", "logit_bias")
            if not -100 <= value <= 100:
                raise InvalidRequestError(f"logit_bias: values must be in [-100, 100], got {value}", "logit_bias")
        for name in ("cache_salt", "prompt_cache_key"):
            value = getattr(self, name)
            if value is not None and not 1 <= len(value) <= MAX_CACHE_SALT_CHARS:
                raise InvalidRequestError(f"{name} must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                                          f"characters, got {len(value)}", name)
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise InvalidRequestError(f"at most {MAX_STOP} stop sequences", "stop")
        if "" in self.stop_list:
            raise InvalidRequestError("a stop sequence must not be empty", "stop")
        if self.stream_options is not None:
            if not self.stream:
                raise InvalidRequestError("stream_options is only allowed with stream = true", "stream_options")
            _refuse_not_implemented(self.stream_options, _STREAM_NOT_IMPLEMENTED, "stream_options.")
        _refuse_not_implemented(self, self._not_implemented)
        self.structured  # noqa: B018 (a malformed constraint is a 400 here, before any work)
        return self

    @property
    def structured(self) -> StructuredSpec | None:
        """The one output constraint the request asks for, or None."""
        found: list[StructuredSpec] = []
        rf = self.response_format
        if rf is not None:
            if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
                raise InvalidRequestError('response_format: type must be "text", "json_object" or "json_schema"',
                                          "response_format")
            if rf["type"] == "json_object":
                found.append(StructuredSpec("json_object", True, "response_format"))
            elif rf["type"] == "json_schema":
                js = rf.get("json_schema")
                if not isinstance(js, dict) or not isinstance(js.get("schema"), (dict, bool)):
                    raise InvalidRequestError("response_format.json_schema: an object with a JSON schema as its "
                                              "\"schema\"", "response_format.json_schema")
                found.append(StructuredSpec("json", js["schema"], "response_format.json_schema.schema"))
        so = self.structured_outputs
        if so is not None:
            if not isinstance(so, dict):
                raise InvalidRequestError("structured_outputs must be an object", "structured_outputs")
            for key, value in so.items():
                if value is None or (key == "json_object" and value is False):
                    continue
                if key not in ("json", "regex", "grammar", "choice", "json_object"):
                    raise InvalidRequestError(f"structured_outputs.{key} is not supported (json, regex, grammar, "
                                              "choice or json_object)", f"structured_outputs.{key}",
                                              "unsupported_parameter")
                found.append(StructuredSpec(key, value, f"structured_outputs.{key}"))
        for key in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{key}")
            if value is not None:
                found.append(StructuredSpec(key, value, f"guided_{key}"))
        if len(found) > 1:
            raise InvalidRequestError(f"one output constraint per request, got {', '.join(f.param for f in found)}",
                                      found[1].param)
        return found[0] if found else None

    @property
    def prediction_text(self) -> str | None:
        """The predicted output's text (its parts joined), or None; a 400 naming `prediction` for a
        wrong type or shape, a lone surrogate, or more than MAX_PREDICTION_CHARS characters."""
        p = self.prediction
        if p is None:
            return None
        if not isinstance(p, dict) or p.get("type") != "content" or set(p) != {"type", "content"}:
            raise InvalidRequestError(_PREDICTION_SHAPE, "prediction")
        content = p["content"]
        if isinstance(content, list) and all(isinstance(part, dict) and set(part) == {"type", "text"}
                                             and part["type"] == "text" and isinstance(part["text"], str)
                                             for part in content):
            content = "".join(part["text"] for part in content)
        if not isinstance(content, str):
            raise InvalidRequestError(_PREDICTION_SHAPE, "prediction.content")
        if len(content) > MAX_PREDICTION_CHARS:
            raise InvalidRequestError(f"prediction: at most {MAX_PREDICTION_CHARS} characters, got {len(content)}",
                                      "prediction.content")
        try:
            return _unicode_text(content)
        except ValueError as exc:
            raise InvalidRequestError(f"prediction.content {exc}", "prediction.content") from None

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(key), value) for key, value in (self.logit_bias or {}).items())

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: Text | list[Int] | list[Text] | list[list[Int]]
    logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: Int | None = None
    suffix: Text | None = None

    _not_implemented: ClassVar[dict[str, tuple[tuple, str]]] = _COMPLETION_NOT_IMPLEMENTED

    def checked(self) -> "CompletionRequest":
        super().checked()
        if self.echo:
            raise InvalidRequestError("echo is not supported", "echo", "unsupported_parameter")
        if self.best_of not in (None, 1):
            raise InvalidRequestError("only best_of = 1 is supported", "best_of", "unsupported_value")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", "suffix", "unsupported_parameter")
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
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    # Passed to the chat template, which renders them if it knows them.
    name: Text | None = None
    tool_call_id: Text | None = None
    tool_calls: list[Any] | None = None  # an assistant's calls, checked by `tools.history`

    def as_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        # Templates know "system"; "developer" is OpenAI's newer name for it.
        role = "system" if self.role == "developer" else self.role
        out = {"role": role, "content": content or ""}
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # How the chat template renders the messages (vLLM's extensions, as transformers defines them).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # Tool calling (server/toolapi.py, checked against the model's chat template there).
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None

    _not_implemented: ClassVar[dict[str, tuple[tuple, str]]] = _CHAT_NOT_IMPLEMENTED

    def checked(self) -> "ChatCompletionRequest":
        super().checked()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs = true", "top_logprobs")
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidRequestError("continue_final_message needs add_generation_prompt = false",
                                      "continue_final_message")
        for i, message in enumerate(self.messages):
            _refuse_not_implemented(message, _MESSAGE_NOT_IMPLEMENTED, f"messages[{i}].")
        tool_set(self.tools, self.tool_choice, self.parallel_tool_calls)  # a malformed tool: a 400 here
        return self


def parse(model: type[_Strict], body: object) -> _Strict:
    """Validate a JSON body into `model`, turning pydantic's errors into one InvalidRequestError."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    try:
        return model.model_validate(body).checked()
    except ValidationError as exc:
        errors = exc.errors()
        # A union reports every member's error; our own value checks (a lone surrogate in a
        # prompt given as a list) say more than "Input should be a valid string" does.
        first = next((e for e in errors if e["type"] == "value_error"), errors[0])
        param = _param(first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise InvalidRequestError(f"{param}: {message}" if param else message, param) from None


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
