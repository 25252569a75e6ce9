"""Chat templates rendered with jinja2 alone, to the same text transformers 5's
`apply_chat_template(..., tokenize=False)` gives, for the tokenizers `tokenizer.Tokenizer` reads
without transformers (see `tokenizer._plain_reading`).

What the template sees, as transformers gives it: a sandboxed environment (immutable, blocks
trimmed and left-stripped, `break`/`continue`), a `tojson` that does not escape HTML,
`raise_exception` (a TemplateError), `strftime_now`, a `dict` and a `namespace` that refuse
underscore names; `messages` (keys whose value is None dropped, reasoning under its aliases),
`tools`, `documents` (None), `add_generation_prompt`, and the tokenizer's named special tokens
(`bos_token`, `eos_token`, ...) as variables.
"""

from __future__ import annotations

import copy
import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# A message's reasoning may come under any of these names; templates read the first (gpt-oss's the
# second), so a message carries it under both.
_REASONING_NAMES = ("reasoning_content", "thinking", "reasoning")
# Appended to the final message's text for `continue_final_message`, then cut off with all after it.
_CONTINUE_MARK = "CONTINUE_FINAL_MESSAGE_TAG "


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which some templates use to mark the assistant's
    text for training masks: rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` in a template, without the type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _check_attr(name):
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a chat template cannot set the attribute {name!r} on a namespace")


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing attribute names that begin with an underscore."""

    def __init__(*args, **kwargs):  # noqa: N805 -- jinja2's own signature, so `namespace(self=...)` works
        self, rest = args[0], args[1:]
        values = dict(*rest, **kwargs)
        for name in values:
            _check_attr(name)
        jinja2.utils.Namespace.__init__(self, values)

    def __setitem__(self, name, value):
        _check_attr(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=_strftime_now, dict=_Dict(), namespace=_Namespace)
    return env.from_string(source)


def pick_template(templates: str | dict[str, str], tools: list | None) -> str:
    """The template to render: the only one, else the "tool_use" one when tools are given, else the
    "default" one."""
    if isinstance(templates, str):
        return templates
    if tools is not None and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    raise ValueError(f"the tokenizer has several chat templates ({', '.join(sorted(templates))}) and none "
                     "named default")


def _message_view(message: dict) -> dict:
    """A copy of `message` as the template sees it: no None values, reasoning under each name."""
    view = {key: copy.deepcopy(value) for key, value in message.items() if value is not None}
    reasoning = next((view[name] for name in _REASONING_NAMES if view.get(name) is not None), None)
    if reasoning is not None:
        view = {"thinking": reasoning, **view, "reasoning_content": reasoning}
    return view


def _mark_final(chat: list[dict], source: str) -> str:
    """Append `_CONTINUE_MARK` to the final message's text (its last text part where the content
    is a list of parts); returns that text as it was."""
    if not chat:
        raise ValueError("continue_final_message is set but the conversation is empty")
    final = chat[-1]
    text = final.get("content")
    if text is None:
        raise ValueError('continue_final_message is set but the final message has no "content" to continue')
    if "content" not in source:
        raise ValueError('continue_final_message needs a chat template that reads "content"')
    if isinstance(text, (list, tuple)):
        for part in reversed(text):
            if "text" in part:
                text, part["text"] = part["text"], part["text"] + _CONTINUE_MARK
                return text
        raise ValueError("continue_final_message is set but the final message has no text to continue")
    final["content"] = text + _CONTINUE_MARK
    return text


def _cut_at_mark(rendered: str, text: str) -> str:
    """The rendering up to where the final message's text ends (see `_mark_final`)."""
    mark = _CONTINUE_MARK.strip()
    if text.strip() not in rendered or mark not in rendered:
        raise ValueError("the chat template drops or changes the final message's text, so it cannot be continued")
    at = rendered.rindex(mark)
    if rendered[at:at + len(_CONTINUE_MARK)] == _CONTINUE_MARK:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the mark's trailing space: trim the text's too


def render_chat(templates: str | dict[str, str], messages: list[dict], *, special_tokens: dict[str, str],
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                tools: list[dict] | None = None) -> str:
    """`messages` rendered by the chat template (`pick_template`); a TemplateError where the
    template raises one, a ValueError where the final message cannot be continued."""
    if not messages:
        raise ValueError("cannot render an empty conversation")
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message and add_generation_prompt exclude each other")
    source = pick_template(templates, tools)
    chat = [_message_view(message) for message in messages]
    text = _mark_final(chat, source) if continue_final_message else None
    rendered = compile_template(source).render(
        **special_tokens, messages=chat, tools=copy.deepcopy(tools), documents=None,
        add_generation_prompt=add_generation_prompt)
    return rendered if text is None else _cut_at_mark(rendered, text)
