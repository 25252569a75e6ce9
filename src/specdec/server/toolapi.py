"""OpenAI's tool calling in /v1/chat/completions on top of `specdec.tools`: the request's tools
checked against the model's chat template, the constraint the request compiles, the messages as the
template takes them, and the answer as `message.tool_calls` (whole, or as streamed deltas).

Streaming: content is sent as it comes until the answer may hold a call (the family's opening token,
a ``` fence for hermes, a `{` first for Llama's bare JSON, or any call under "required" or a named
function); from there the text is held, and at the end the answer is parsed once: the rest of the
content, then each call as OpenAI's chunks do it (index, id, type and name with empty arguments
first, then the arguments in fragments). A client that assembles the chunks gets the call the
non-streaming answer holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import tools as T
from ..errors import InvalidRequestError

ARGUMENT_FRAGMENT = 24  # characters of arguments per streamed chunk


@dataclass
class ToolTurn:
    """One request's tools against one model: its family, its ToolSet (None under "none": the tools
    are shown to the template, no call is parsed) and its constraint (None: calls parsed only)."""

    family: T.Family
    toolset: T.ToolSet | None
    constraint: T.ToolConstraint | None
    template_tools: list[dict]

    def finish_reason(self, reason: str, calls: list) -> str:
        if not calls or reason != "stop":
            return reason
        return "stop" if self.toolset.named else "tool_calls"

    def answer(self, ids: list[int], tokenizer) -> tuple[str | None, list[T.ToolCall]]:
        if self.toolset is None:
            return tokenizer.decode(ids), []
        return T.parse_answer(self.family, self.toolset, ids, tokenizer)


def tool_turn(body, tokenizer) -> ToolTurn | None:
    """The request's tool turn (None without tools); a 400 for what this model or request cannot do."""
    toolset = T.tool_set(body.tools, body.tool_choice, body.parallel_tool_calls)
    if toolset is None:
        return None
    family = T.family_of(tokenizer.chat_template)
    listed = toolset.template_tools()
    if toolset.choice == "none":
        return ToolTurn(family, None, None, listed)
    if body.structured is not None:
        raise InvalidRequestError("one output constraint per request: tools (which constrain the calls) with "
                                  f"{body.structured.param} is not supported", body.structured.param)
    return ToolTurn(family, toolset, T.constraint(family, toolset, tokenizer), listed)


def template_messages(body) -> list[dict]:
    """The request's messages for the chat template, with any assistant tool calls as objects."""
    return T.history([m.as_template_dict() for m in body.messages], [m.tool_calls for m in body.messages])


def message_of(turn: ToolTurn, ids: list[int], tokenizer, finish: str) -> tuple[dict, str]:
    """The non-streaming answer's message and finish reason."""
    content, calls = turn.answer(ids, tokenizer)
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [c.as_dict() for c in calls]
    return message, turn.finish_reason(finish, calls)


@dataclass
class ToolStream:
    """The streamed answer of one tool turn (see the module docstring): `push` each delta's text and
    ids, get the content to send now; `finish` gives the last content and the calls' chunk deltas."""

    turn: ToolTurn
    tokenizer: object
    ids: list[int] = field(default_factory=list)
    text: str = ""
    sent: str = ""
    holding: bool = False

    def push(self, text: str, ids: list[int]) -> str:
        self.ids += ids
        self.text += text
        if self.holding:
            return ""
        cut = self._call_start()
        self.holding = cut is not None
        end = len(self.text) if cut is None else max(cut, len(self.sent))
        out, self.sent = self.text[len(self.sent): end], self.text[:end]
        return out

    def _call_start(self) -> int | None:
        """Where in the text a call may begin (what is before it can go out), or None."""
        turn = self.turn
        if turn.toolset is None:
            return None
        if turn.toolset.constrained:
            return 0
        if turn.family is T.HERMES:
            found = [i for i in (self.text.find("<tool_call>"), self.text.find("`")) if i >= 0]
            return min(found) if found else None
        tag = self.tokenizer.encode_plain(T.LLAMA3.opening)
        if self.text.lstrip().startswith("{") or (len(tag) == 1 and tag[0] in self.ids):
            return 0
        return None

    def finish(self, reason: str) -> tuple[str, list[dict], str]:
        """(content not yet sent, tool-call chunk deltas, finish reason)."""
        content, calls = self.turn.answer(self.ids, self.tokenizer)
        content = content or ""
        rest = content[len(self.sent):] if content.startswith(self.sent) else ""
        chunks = []
        for i, call in enumerate(calls):
            chunks.append({"index": i, "id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": ""}})
            for at in range(0, len(call.arguments), ARGUMENT_FRAGMENT):
                chunks.append({"index": i, "function": {"arguments": call.arguments[at: at + ARGUMENT_FRAGMENT]}})
        return rest, chunks, self.turn.finish_reason(reason, calls)
