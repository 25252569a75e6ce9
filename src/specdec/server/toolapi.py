"""OpenAI's tool calling in /v1/chat/completions on top of `specdec.tools`: the request's tools
checked against the model's chat template, the constraint the request compiles, the messages as the
template takes them, and the answer as `message.tool_calls` (whole, or as streamed deltas).

Streaming (`ToolStream`): the answer goes through `tool_scan.CallScanner` as it is generated, so
content is sent as it comes (held only where a call may begin: an opening being written, a ```
fence until it closes), and each call as OpenAI's chunks do it: its index, id, type and name (empty
arguments) as soon as its name is written, then `function.arguments` fragments as the model writes
them. The non-streaming answer is the same scanner over the whole answer, so a client that
assembles the chunks gets exactly the message the non-streaming answer holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import tool_scan as S
from .. import tools as T
from ..errors import InvalidRequestError

@dataclass
class ToolTurn:
    """One request's tools against one model: its family, its ToolSet (None under "none": the tools
    are shown to the template, no call is parsed) and its constraint (None: calls parsed only)."""

    family: T.Family
    toolset: T.ToolSet | None
    constraint: T.ToolConstraint | None
    template_tools: list[dict]

    def finish_reason(self, reason: str, calls) -> str:
        if not calls or reason != "stop":
            return reason
        return "stop" if self.toolset.named else "tool_calls"

    def answer(self, ids: list[int], tokenizer) -> tuple[str | None, list[S.ToolCall]]:
        if self.toolset is None:
            return tokenizer.decode(ids), []
        return S.parse_answer(self.family, self.toolset, ids, tokenizer)


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


class ToolStream:
    """The streamed answer of one tool turn: `push` each delta's text and ids, get the chunk deltas
    to send now (content, a call's head, its argument fragments); `finish` gives the last ones and
    the finish reason. The same scanner as the whole answer (`tool_scan`), so the chunks assemble
    into the non-streaming message."""

    def __init__(self, turn: ToolTurn, tokenizer):
        self.turn = turn
        self.scanner = None if turn.toolset is None else S.CallScanner(turn.family, turn.toolset, tokenizer)
        self.calls = False

    def push(self, text: str, ids: list[int]) -> list[dict]:
        if self.scanner is None:
            return [{"content": text}] if text else []
        return self._deltas(self.scanner.push(text, ids))

    def finish(self, reason: str) -> tuple[list[dict], str]:
        deltas = [] if self.scanner is None else self._deltas(self.scanner.finish())
        return deltas, self.turn.finish_reason(reason, self.calls)

    def _deltas(self, events: list[tuple]) -> list[dict]:
        out: list[dict] = []
        for event in events:
            if event[0] == "content":
                if out and "content" in out[-1]:
                    out[-1]["content"] += event[1]
                else:
                    out.append({"content": event[1]})
            elif event[0] == "call":
                self.calls = True
                out.append({"tool_calls": [{"index": event[1], "id": event[2], "type": "function",
                                            "function": {"name": event[3], "arguments": ""}}]})
            else:
                out.append({"tool_calls": [{"index": event[1], "function": {"arguments": event[2]}}]})
        return out
