"""An answer read as content and tool calls, piece by piece as it is generated (`CallScanner`), so
a stream can send a call's name as soon as it is written and its arguments as they grow, and the
whole answer (`parse_answer`) is the same scanner fed everything at once: a streamed answer
assembles into exactly the non-streamed one, however the text was split.

What is a call (the family's format, `tools.Family`):

- hermes: `<tool_call>` then a JSON object `{"name": ..., "arguments": {...}}` then `</tool_call>`.
  Once the object's head (`{"name": "<a callable tool>", "arguments": ` and the `{` after it) is
  written, it is a call: its name goes out, then its arguments as the model writes them (the
  model's own text, as OpenAI returns it; a call cut by max_tokens keeps what was written). A head
  in another shape (keys in another order) waits for `</tool_call>` and is a call if the whole
  object is one. Qwen2.5-Coder's fenced ```json block is a call only when exactly a call to a given
  tool with arguments valid for its schema: it waits for the closing fence. Inside a Qwen3
  `<think>` block nothing is a call. Anything that is not a call is content.
- llama3: the answer's first non-blank character `{`, or the text after `<|python_tag|>` (a special
  token, found on the ids), is a call by the same head rule; its end is the answer's end.

The blanks around a call are kept only where content follows it and content came before it (held
back until that is known), so streamed content equals the whole answer's. With
`parallel_tool_calls` false, calls after the first are dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .tools import HERMES, LLAMA3, Family, Tool, ToolSet

_BLANK = " \t\r\n"
# Characters a JSON value may hold outside its strings: another one ends a model's arguments.
_JSON_CHARS = set(_BLANK + "{}[],:-+.0123456789eE" + "truefalsn")
_OPEN, _CLOSE, _FENCE, _THINK, _UNTHINK = "<tool_call>", "</tool_call>", "```", "<think>", "</think>"
_FENCE_HEAD = re.compile(r"```(j(s(o(n)?)?)?)?[ \t]*")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI returns it

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _valid(tool: Tool, args: object) -> bool:
    if not isinstance(args, dict):
        return False
    try:
        import jsonschema
    except ImportError:  # without the validator: the schema's required keys at least
        return all(key in args for key in tool.parameters.get("required", []))
    try:
        jsonschema.validate(args, tool.parameters)
    except (jsonschema.ValidationError, jsonschema.SchemaError):
        return False
    return True


def _whole_call(toolset: ToolSet, family: Family, text: str, exact: bool) -> tuple[str, str] | None:
    """(name, arguments) of one JSON object's text that is a call to a callable tool (arguments
    valid for its schema when `exact`: the fenced-block rule), else None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or set(value) != {"name", family.args}:
        return None
    tool = next((t for t in toolset.callable if t.name == value["name"]), None)
    args = value[family.args]
    if tool is None or not isinstance(args, dict) or (exact and not _valid(tool, args)):
        return None
    return tool.name, json.dumps(args, ensure_ascii=False)


def _skip(s: str, i: int) -> int:
    while i < len(s) and s[i] in _BLANK:
        i += 1
    return i


def call_head(s: str, key: str) -> tuple[str, int] | bool | None:
    """`s` from a call object's start: (name, offset of the arguments' `{`) once it holds
    `{"name": "...", "<key>": {`; None while it may still become that; False when it cannot."""
    name, i = None, 0
    for lit in ("{", '"name"', ":", None, ",", f'"{key}"', ":", "{"):
        i = _skip(s, i)
        if i >= len(s):
            return None
        if lit is None:  # the name: a JSON string
            if s[i] != '"':
                return False
            j = i + 1
            while j < len(s) and s[j] != '"':
                j += 2 if s[j] == "\\" else 1
            if j >= len(s):
                return None
            try:
                name = json.loads(s[i: j + 1])
            except ValueError:
                return False
            i = j + 1
            continue
        part = s[i: i + len(lit)]
        if part != lit[: len(part)]:
            return False
        if len(part) < len(lit):
            return None
        i += len(lit)
    return name, i - 1


class CallScanner:
    """Push an answer's text (and its token ids) piece by piece; each push returns what it makes
    known: ("content", text), ("call", index, id, name), ("args", index, text). `finish` settles
    what was held. See the module docstring for the rules."""

    def __init__(self, family: Family, toolset: ToolSet, tokenizer):
        self.family, self.toolset, self.tokenizer = family, toolset, tokenizer
        self.text, self.ids = "", []
        self.pos = 0  # text before pos is settled
        self.mode = "text"  # text | head | whole | args | tail | fence | fenced
        self.start = 0  # where the held piece (a call's opening or a fence) begins
        self.body = 0  # where a call object (or a fenced block's body) begins
        self.blank = ""  # content's trailing blanks, held while a call may follow
        self.held_blank = ""  # the blanks before a held piece (given back if it is content)
        self.after_call = False  # a call ended: blanks go to `gap` until content follows
        self.gap = ""  # the blanks around the calls since the last content
        self.emitted = False  # some content went out
        self.think_from = None  # inside a <think> block: where to look for its end
        self.calls = 0
        self.index = None  # the streamed call's index; None: dropped (parallel_tool_calls false)
        self.depth, self.in_str, self.esc = 0, False, False
        tag = tokenizer.encode_plain(LLAMA3.opening) if family is LLAMA3 else []
        self.tag = tag[0] if len(tag) == 1 else None

    # -- pushing ---------------------------------------------------------------------------------

    def push(self, text: str, ids: list[int] = ()) -> list[tuple]:
        out: list[tuple] = []
        if self.tag is not None and self.tag in ids and self.mode == "text":
            at = len(self.ids) + list(ids).index(self.tag)
            before = self.tokenizer.decode(self.ids + list(ids)[: at - len(self.ids)])
            self.text += text
            self.ids += ids
            start = max(self.pos, min(len(before), len(self.text)))
            self._content(self.text[self.pos: start], out)
            self._open(start, start, "head")
        else:
            self.text += text
            self.ids += ids
        while self._step(out):
            pass
        return out

    def _step(self, out: list) -> bool:
        """Scan from pos in the current mode; True when it moved on to another mode."""
        return getattr(self, "_" + self.mode)(out)

    def _content(self, s: str, out: list) -> None:
        if self.after_call:  # the blanks around calls stay only between content on both sides
            body = s.lstrip(_BLANK)
            self.gap += s[: len(s) - len(body)]
            if not body:
                return
            s, self.gap, self.after_call = (self.gap if self.emitted else "") + body, "", False
        s = self.blank + s
        body = s.rstrip(_BLANK)
        self.blank = s[len(body):]
        if body:
            self.emitted = True
            out.append(("content", body))

    def _open(self, start: int, body: int, mode: str) -> None:
        """A call (or fence) may begin at `start`: the blanks before it are held with it."""
        self.start, self.body, self.mode, self.pos = start, body, mode, start
        self.held_blank, self.blank = self.blank, ""

    def _release(self, end: int, out: list) -> None:
        """The held piece up to `end` was not a call: content, with the blanks before it."""
        self.blank = self.held_blank + self.blank
        self._content(self.text[self.start: end], out)
        self.pos, self.mode = end, "text"

    def _text(self, out: list) -> bool:
        if self.family is LLAMA3:
            return self._llama_text(out)
        if self.think_from is not None:
            end = self.text.find(_UNTHINK, self.think_from)
            if end < 0:
                self.think_from = max(self.think_from, len(self.text) - len(_UNTHINK) + 1)
                self._content(self.text[self.pos:], out)
                self.pos = len(self.text)
                return False
            self._content(self.text[self.pos: end + len(_UNTHINK)], out)
            self.pos, self.think_from = end + len(_UNTHINK), None
            return True
        found = [(i, m) for m in (_OPEN, _FENCE, _THINK) if (i := self.text.find(m, self.pos)) >= 0]
        if not found:
            self._content(self.text[self.pos: self._partial_marker()], out)
            self.pos = max(self.pos, self._partial_marker())
            return False
        i, marker = min(found)
        self._content(self.text[self.pos: i], out)
        self.pos = i
        if marker == _THINK:
            self._content(_THINK, out)
            self.pos = self.think_from = i + len(_THINK)
        elif marker == _OPEN:
            self._open(i, i + len(_OPEN), "head")
        else:
            self._open(i, i, "fence")
        return True

    def _partial_marker(self) -> int:
        """Where a marker that the text so far only begins may start (the text's length if none)."""
        for j in range(max(self.pos, len(self.text) - len(_OPEN) + 1), len(self.text)):
            tail = self.text[j:]
            if any(m.startswith(tail) for m in (_OPEN, _FENCE, _THINK)):
                return j
        return len(self.text)

    def _llama_text(self, out: list) -> bool:
        # A bare JSON call only as the answer's first non-blank character (blanks before it held).
        if not (self.calls or self.emitted):
            first = _skip(self.text, self.pos)
            if first >= len(self.text):
                return False
            if self.text[first] == "{":
                self._open(self.pos, first, "head")
                return True
        self._content(self.text[self.pos:], out)
        self.pos = len(self.text)
        return False

    def _head(self, out: list) -> bool:
        body = _skip(self.text, self.body)
        head = call_head(self.text[body:], self.family.args)
        if head is None:
            return False
        names = {t.name for t in self.toolset.callable}
        if head is False or head[0] not in names:
            self.mode = "whole"
            return True
        self.index = self.calls if (self.toolset.parallel or self.calls == 0) else None
        self.calls += 1
        if self.index is not None:
            out.append(("call", self.index, f"call_{uuid.uuid4().hex[:24]}", head[0]))
        self.gap += self.held_blank
        self.pos, self.mode = body + head[1], "args"
        self.depth, self.in_str, self.esc = 0, False, False
        return True

    def _args(self, out: list) -> bool:
        i, text = self.pos, self.text
        done = False
        while i < len(text):
            c = text[i]
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
            elif c not in _JSON_CHARS and c != '"':
                done = True
                break
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    i += 1
                    done = True
                    break
            i += 1
        if i > self.pos and self.index is not None:
            out.append(("args", self.index, text[self.pos: i]))
        self.pos = i
        if done:
            self.mode = "tail"
        return done

    def _tail(self, out: list) -> bool:
        """After a call's arguments: up to the call's close, which is dropped."""
        if self.family is LLAMA3:
            self.pos = len(self.text)
            return False
        end = self.text.find(_CLOSE, self.pos)
        if end < 0:
            self.pos = max(self.pos, len(self.text) - len(_CLOSE) + 1)
            return False
        self.pos, self.mode, self.after_call = end + len(_CLOSE), "text", True
        return True

    def _whole(self, out: list) -> bool:
        """A call in another shape: settled at its close (hermes) or the answer's end (llama)."""
        if self.family is LLAMA3:
            return False
        end = self.text.find(_CLOSE, self.body)
        if end < 0:
            return False
        self._settle(self.text[self.body: end].strip(_BLANK), end + len(_CLOSE), False, out)
        return True

    def _settle(self, obj: str, end: int, exact: bool, out: list) -> None:
        """A held piece ending at `end`: a call if `obj` is one, else content."""
        call = _whole_call(self.toolset, self.family, obj, exact)
        if call is None:
            self._release(end, out)
            return
        if self.toolset.parallel or self.calls == 0:
            out.append(("call", self.calls, f"call_{uuid.uuid4().hex[:24]}", call[0]))
            out.append(("args", self.calls, call[1]))
        self.calls += 1
        self.gap += self.held_blank
        self.pos, self.mode, self.after_call = end, "text", True

    def _fence(self, out: list) -> bool:
        held = self.text[self.start:]
        m = _FENCE_HEAD.match(held)
        if m.end() == len(held):
            return False  # may still become a fence's opening line
        if held[m.end()] == "\n" and m.group(1) in (None, "json"):
            self.body, self.mode = self.start + m.end() + 1, "fenced"
            return True
        self._release(self.start + 1, out)  # not a fence here: its first backtick is content
        return True

    def _fenced(self, out: list) -> bool:
        end = self.text.find(_FENCE, self.body)
        if end < 0:
            return False
        self._settle(self.text[self.body: end], end + len(_FENCE), True, out)
        return True

    # -- the end ---------------------------------------------------------------------------------

    def finish(self) -> list[tuple]:
        """What was held, settled at the answer's end."""
        out: list[tuple] = []
        if self.mode == "whole" and self.family is LLAMA3:
            self._settle(self.text[self.body:].strip(_BLANK), len(self.text), False, out)
        elif self.mode in ("head", "whole", "fence", "fenced"):
            self._release(len(self.text), out)
        elif self.mode == "text":
            self._content(self.text[self.pos:], out)
        if self.blank and not self.after_call:
            out.append(("content", self.blank))
        self.blank, self.pos = "", len(self.text)
        return out


def parse_answer(family: Family, toolset: ToolSet, ids: list[int], tokenizer) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole answer's token ids; content None when only calls remain."""
    scanner = CallScanner(family, toolset, tokenizer)
    return assemble(scanner.push(tokenizer.decode(ids), ids) + scanner.finish())


def parse_text(family: Family, toolset: ToolSet, text: str, tokenizer) -> tuple[str | None, list[ToolCall]]:
    """`parse_answer` of decoded text (no special-token ids to look at)."""
    scanner = CallScanner(family, toolset, tokenizer)
    return assemble(scanner.push(text) + scanner.finish())


def assemble(events: list[tuple]) -> tuple[str | None, list[ToolCall]]:
    """The (content, calls) that a scanner's events add up to (what a streaming client assembles)."""
    content, heads, args = [], {}, {}
    for event in events:
        if event[0] == "content":
            content.append(event[1])
        elif event[0] == "call":
            heads[event[1]] = (event[2], event[3])
            args[event[1]] = []
        else:
            args[event[1]].append(event[2])
    calls = [ToolCall(heads[i][0], heads[i][1], "".join(args[i])) for i in sorted(heads)]
    text = "".join(content)
    return (text or None) if calls else text, calls


__all__ = ["HERMES", "LLAMA3", "CallScanner", "ToolCall", "assemble", "call_head", "parse_answer", "parse_text"]
