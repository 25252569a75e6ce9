"""Tool calling in the model's own format: the request's tools, the family of call format the chat
template declares, and the grammar a call must follow (the answer is read back as calls by
`tool_scan.py`).

A `ToolSet` is a checked request (`tools`, `tool_choice`, `parallel_tool_calls`). The family is
chosen from the chat template's text, never from the model's name (`family_of`):

- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
  the markers are ordinary added tokens, so the answer is parsed as text. Qwen3's `<think>` block is
  content, never a call. Qwen2.5-Coder's habit of answering with a fenced ```json block holding
  exactly such a call is taken as a call when the name is one of the tools and the arguments are
  valid for it (anything else stays content).
- `llama3` (Llama 3.1+): the whole answer is one JSON object `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`, a special token: found on the token ids, since decoded text
  skips special tokens.

Constraints (the grammar machinery of `structured.py`, so a forbidden draft token is a rejection):
`tool_choice` "required" or a named function constrains the answer from its first token to the
family's wrapper around a call whose JSON is valid for one tool. Under "auto" the constraint is lazy
(`LazyToolGrammar`): free text until the family's opening token, then the call grammar from the
token after it (for Llama also from the answer's first token when that token begins a call's JSON:
an answer that starts as a call is one); within a drafted block the opening may come at any
position, and every later position of that block is masked as the call grammar says.

`strict`: every call, strict or not, follows its tool's schema once begun (stricter than OpenAI,
whose non-strict calls follow nothing), as the grammar engine reads the schema. `strict: true`
adds OpenAI's strict-mode rules (`strict_problem`): the schema must say exactly which keys the
arguments hold (every object `additionalProperties: false` with all its properties required) and
use only keywords strict mode takes, else a 400 saying why; and where "auto" cannot constrain a
call (an opening that is not one token) a strict tool is a 400 rather than parsed unconstrained.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import torch

from .errors import InvalidRequestError
from .structured import StructuredSpec, compile_spec

CHOICES = ("none", "auto", "required")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# The x-guidance settings structured output uses: JSON written as json.dumps writes it.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict
    strict: bool = False


@dataclass(frozen=True)
class ToolSet:
    """A request's tools and how it asks for calls. `choice` is "none", "auto", "required" or the
    name of the one function it must call."""

    tools: tuple[Tool, ...]
    choice: str = "auto"
    parallel: bool = True

    @property
    def named(self) -> bool:
        return self.choice not in CHOICES

    @property
    def constrained(self) -> bool:
        """Whether the answer is a call from its first token."""
        return self.choice == "required" or self.named

    @property
    def callable(self) -> tuple[Tool, ...]:
        return tuple(t for t in self.tools if t.name == self.choice) if self.named else self.tools

    def template_tools(self) -> list[dict]:
        """The tools as chat templates expect them (OpenAI's request shape)."""
        out = []
        for t in self.tools:
            fn = {"name": t.name, "parameters": t.parameters}
            if t.description is not None:
                fn["description"] = t.description
            out.append({"type": "function", "function": fn})
        return out


def _tool(i: int, item: object) -> Tool:
    param = f"tools[{i}]"
    if not isinstance(item, dict):
        raise InvalidRequestError(f"{param}: a tool is an object", param)
    kind = item.get("type")
    if kind == "custom":
        raise InvalidRequestError(f"{param}: custom tools are not supported (only type \"function\")",
                                  f"{param}.type", "unsupported_parameter")
    if kind != "function":
        raise InvalidRequestError(f"{param}.type: must be \"function\"", f"{param}.type")
    fn = item.get("function")
    if not isinstance(fn, dict):
        raise InvalidRequestError(f"{param}.function: an object with a name", f"{param}.function")
    unknown = set(fn) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise InvalidRequestError(f"{param}.function: unknown field {sorted(unknown)[0]!r}", f"{param}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequestError(f"{param}.function.name: 1 to 64 letters, digits, '_' or '-'",
                                  f"{param}.function.name")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError(f"{param}.function.description: a string", f"{param}.function.description")
    parameters = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise InvalidRequestError(f"{param}.function.parameters: a JSON schema object",
                                  f"{param}.function.parameters")
    strict = fn.get("strict") or False
    if not isinstance(strict, bool):
        raise InvalidRequestError(f"{param}.function.strict: true or false", f"{param}.function.strict")
    if strict:
        problem = strict_problem(parameters)
        if problem is not None:
            raise InvalidRequestError(f"{param}.function.parameters: strict mode cannot honour this schema: {problem}",
                                      f"{param}.function.parameters")
    return Tool(name, description, parameters, strict)


# OpenAI's strict mode: the keywords it does not take, and its size limits.
_STRICT_UNSUPPORTED = ("allOf", "oneOf", "not", "if", "then", "else", "dependentRequired", "dependentSchemas",
                       "patternProperties", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
                       "minProperties", "maxProperties", "contains", "minContains", "maxContains", "uniqueItems")
STRICT_DEPTH, STRICT_PROPERTIES = 10, 5000


def strict_problem(schema: dict) -> str | None:
    """Why strict mode (OpenAI's definition) cannot honour a tool's parameters, or None: the root is
    an object; every object lists all its properties in `required` and says `additionalProperties:
    false` (so the arguments hold exactly the schema's keys); none of the keywords strict mode does
    not take; at most STRICT_DEPTH levels of objects and STRICT_PROPERTIES properties."""
    if schema.get("type") != "object":
        return 'the root must be {"type": "object"}'
    stack, count = [(schema, "parameters", 1)], 0
    while stack:
        node, where, depth = stack.pop()
        if not isinstance(node, dict):
            continue
        bad = next((k for k in _STRICT_UNSUPPORTED if k in node), None)
        if bad is not None:
            return f"{where}: {bad!r} is not supported in strict mode"
        props = node.get("properties")
        if node.get("type") == "object" or isinstance(props, dict):
            props = props if isinstance(props, dict) else {}
            if node.get("additionalProperties") is not False:
                return f"{where}: an object needs \"additionalProperties\": false"
            missing = [k for k in props if k not in (node.get("required") or [])]
            if missing:
                return f"{where}: every property must be required (use a null type for an optional one); " \
                       f"{missing[0]!r} is not"
            if depth > STRICT_DEPTH:
                return f"{where}: more than {STRICT_DEPTH} levels of nested objects"
            count += len(props)
            if count > STRICT_PROPERTIES:
                return f"more than {STRICT_PROPERTIES} properties"
            stack += [(v, f"{where}.properties.{k}", depth + 1) for k, v in props.items()]
        for key in ("items", "additionalItems"):
            stack.append((node.get(key), f"{where}.{key}", depth))
        for key in ("anyOf", "prefixItems"):
            stack += [(v, f"{where}.{key}[{i}]", depth) for i, v in enumerate(node.get(key) or [])]
        for key in ("$defs", "definitions"):
            stack += [(v, f"{where}.{key}.{k}", depth) for k, v in (node.get(key) or {}).items()]
    return None


def tool_set(tools: object, tool_choice: object = None, parallel: object = None) -> ToolSet | None:
    """The checked ToolSet of a request's fields, or None without tools. Under `tool_choice`
    "none" the tools are still shown to the template, and no call is parsed."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools", "tool_choice")
        if parallel is not None:
            raise InvalidRequestError("parallel_tool_calls needs tools", "parallel_tool_calls")
        return None
    if not isinstance(tools, list):
        raise InvalidRequestError("tools: a list of tools", "tools")
    parsed = tuple(_tool(i, item) for i, item in enumerate(tools))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools: two tools have the same name", "tools")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls: true or false", "parallel_tool_calls")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        if choice.get("type") == "allowed_tools":
            raise InvalidRequestError("tool_choice: allowed_tools is not supported", "tool_choice",
                                      "unsupported_parameter")
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequestError('tool_choice: {"type": "function", "function": {"name": ...}}', "tool_choice")
        if fn["name"] not in names:
            raise InvalidRequestError(f"tool_choice.function.name: no tool is named {fn['name'][:64]!r}",
                                      "tool_choice.function.name")
        choice = fn["name"]
    elif choice not in CHOICES:
        raise InvalidRequestError('tool_choice: "none", "auto", "required" or a named function', "tool_choice")
    return ToolSet(parsed, choice, parallel is not False)


# -- families ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """A call format: `opening` is the text that starts a call (its token the lazy trigger),
    `args` the key the arguments go under."""

    name: str
    opening: str
    args: str


HERMES = Family("hermes", "<tool_call>", "arguments")
LLAMA3 = Family("llama3", "<|python_tag|>", "parameters")


def family_of(template: str | None) -> Family:
    """The call format a chat template declares; a 400 when it declares none."""
    if template and "<tool_call>" in template and "tools" in template:
        return HERMES
    if template and '"parameters"' in template and "<|start_header_id|>" in template and "tools" in template:
        return LLAMA3
    raise InvalidRequestError("this model's chat template has no tool-call format (hermes-style <tool_call> or "
                              "Llama 3.1 JSON calls), so it cannot take tools", "tools")


def _call_schema(family: Family, tools: tuple[Tool, ...]) -> dict:
    calls = [{"type": "object", "properties": {"name": {"const": t.name}, family.args: t.parameters},
              "required": ["name", family.args], "additionalProperties": False} for t in tools]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {**schema, "x-guidance": _COMPACT}


def call_grammar(family: Family, toolset: ToolSet, lazy: bool, marks: tuple[int, int] | None) -> str:
    """The Lark grammar of the answer. Not lazy: the whole answer is calls (only the family's
    wrapper, no text). Lazy: what follows the opening token once it is emitted. `marks`: the ids
    of the opening and closing tokens (`<[id]>`: the grammar engine counts added tokens special)."""
    body = "body: %json " + json.dumps(_call_schema(family, toolset.callable))
    if family is LLAMA3:
        return "start: body\n" + body
    if marks is None:
        raise InvalidRequestError("this model's tokenizer has no <tool_call> and </tool_call> tokens, which its "
                                  "chat template's call format needs", "tools")
    opening, closing = (f"<[{i}]>" for i in marks)
    more = f' ("\\n" {opening} "\\n" body "\\n" {closing})*' if toolset.parallel else ""
    head = "" if lazy else opening + " "
    return f'start: {head}"\\n" body "\\n" {closing}{more}\n' + body


class LazyToolGrammar:
    """A call grammar that starts lazily (`structured.GrammarState`'s interface: `masks(paths)`,
    `advance(tokens)`): after the trigger token anywhere, or, with `opens_at_start` (Llama's bare
    JSON calls), from the answer's first token when that token is one the call grammar can begin
    with. Before that every token is allowed; a path that starts a call is masked, from the position
    after the trigger (or after its first token), by a scratch copy of the call grammar at its start
    (never advanced, so each probe begins there and rolls back)."""

    def __init__(self, scratch, trigger: int, vocab: int, opens_at_start: bool = False):
        self.scratch = scratch  # a GrammarState at the call grammar's start
        self.trigger = trigger
        self.vocab = vocab
        self.active = None  # the GrammarState once a call is committed
        self.param = scratch.param
        self.begun = False  # some of the answer is committed
        starts = scratch._mask() if opens_at_start else torch.zeros(vocab, dtype=torch.bool)
        starts[scratch.tokens.eos_ids] = False
        self.starts = starts  # [vocab]: first tokens that open a call

    def _call_of(self, path: list[int]) -> list[int] | None:
        """The call's tokens in an uncommitted path (from the answer's start), or None."""
        if not self.begun and path and self.starts[path[0]]:
            return path
        if self.trigger in path:
            return path[path.index(self.trigger) + 1:]
        return None

    def masks(self, paths: list[list[int]]) -> torch.Tensor:
        if self.active is not None:
            return self.active.masks(paths)
        out = torch.ones(len(paths), self.vocab, dtype=torch.bool)
        rows, tails = [], []
        for j, path in enumerate(paths):
            tail = self._call_of(path)
            if tail is not None:
                rows.append(j)
                tails.append(tail)
        if rows:
            out[rows] = self.scratch.masks(tails)
        return out

    def forced(self) -> list[int]:
        return self.active.forced() if self.active is not None else []

    def advance(self, tokens: list[int]) -> None:
        if self.active is None:
            tail = self._call_of(tokens)
            self.begun = self.begun or bool(tokens)
            if tail is None:
                return
            tokens = tail
            self.active = type(self.scratch)(self.scratch.matcher.deep_copy(), self.scratch.tokens, self.param,
                                             self.scratch.allow)
        self.active.advance(tokens)


@dataclass(frozen=True)
class ToolConstraint:
    """What `Engine.compile_structured` compiles for a request with tools (see the module docstring)."""

    family: Family
    toolset: ToolSet
    trigger: int | None  # the opening's token id (lazy "auto"); None: constrained from the start
    marks: tuple[int, int] | None  # hermes: the ids of <tool_call> and </tool_call>
    param: str = "tools"

    def compile(self, tokens) -> object:
        lazy = self.trigger is not None
        grammar = call_grammar(self.family, self.toolset, lazy, self.marks)
        state = compile_spec(StructuredSpec("grammar", grammar, self.param), tokens, self.marks or ())
        # The grammar engine builds a string pattern's lexer when a call reaches it, deep inside the
        # call, past `compile_spec`'s one-token probe: each pattern gets that probe on its own (a
        # string of it, one token in and back), so one past the budget is a 400 here, not a failed row.
        for i, tool in enumerate(self.toolset.tools):
            if tool in self.toolset.callable:
                for where, pattern in _patterns(tool.parameters, f"tools[{i}].function.parameters"):
                    compile_spec(StructuredSpec("json", {"type": "string", "pattern": pattern}, where), tokens)
        return LazyToolGrammar(state, self.trigger, tokens.vocab, self.family is LLAMA3) if lazy else state


_VALUES = ("const", "enum", "default", "examples")  # keywords whose values are data, not schemas


def _patterns(schema: object, where: str) -> list[tuple[str, str]]:
    """(field path, pattern) of every string `pattern` in a schema."""
    out, stack = [], [(schema, where)]
    while stack:
        node, at = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                out.append((f"{at}.pattern", node["pattern"]))
            stack += [(v, f"{at}.{k}") for k, v in node.items()
                      if isinstance(v, (dict, list)) and k not in _VALUES]
        elif isinstance(node, list):
            stack += [(v, f"{at}[{j}]") for j, v in enumerate(node)]
    return out


def constraint(family: Family, toolset: ToolSet, tokenizer) -> ToolConstraint | None:
    """The request's constraint: from the start for "required" or a named function; under "auto"
    lazy at the opening token (for Llama also at a first token that begins a call's JSON), strict
    tools or not: a call once begun always follows its schema. None where the opening is not one
    token of this tokenizer (calls are then parsed, not constrained)."""
    marks = None
    if family is HERMES:
        ids = [tokenizer.encode_plain(text) for text in ("<tool_call>", "</tool_call>")]
        marks = (ids[0][0], ids[1][0]) if all(len(i) == 1 for i in ids) else None
    if toolset.constrained:
        return ToolConstraint(family, toolset, None, marks)
    ids = tokenizer.encode_plain(family.opening)
    if len(ids) == 1:
        return ToolConstraint(family, toolset, ids[0], marks)
    if any(t.strict for t in toolset.tools):
        raise InvalidRequestError(f"strict tools under tool_choice \"auto\" need the call opening {family.opening} "
                                  "to be one token of this model's tokenizer, so that a call can be constrained "
                                  "from it; it is not", "tools")
    return None


# -- history ----------------------------------------------------------------------------------


def history(messages: list[dict], calls_of: list[list[dict] | None]) -> list[dict]:
    """The messages as chat templates take them: an assistant's `tool_calls` with their arguments
    as objects (OpenAI sends them as JSON text), each tool message answering an earlier call.
    `calls_of[i]`: message i's tool_calls as sent, or None."""
    out, seen = [], set()
    for i, (message, calls) in enumerate(zip(messages, calls_of)):
        message = dict(message)
        if calls:
            message["tool_calls"] = [_history_call(i, j, call, seen) for j, call in enumerate(calls)]
        if message["role"] == "tool":
            ref = message.get("tool_call_id")
            if ref is None:
                raise InvalidRequestError(f"messages[{i}].tool_call_id: a tool message answers a call by its id",
                                          f"messages[{i}].tool_call_id")
            if ref not in seen:
                raise InvalidRequestError(f"messages[{i}].tool_call_id: no earlier assistant message made a call "
                                          f"with id {ref[:64]!r}", f"messages[{i}].tool_call_id")
        out.append(message)
    return out


def _history_call(i: int, j: int, call: object, seen: set) -> dict:
    param = f"messages[{i}].tool_calls[{j}]"
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(fn, dict) \
            or not isinstance(call.get("id"), str) or not isinstance(fn.get("name"), str):
        raise InvalidRequestError(f"{param}: {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                                  "\"arguments\"}}}", f"messages[{i}].tool_calls")
    args = fn.get("arguments", "{}")
    try:
        value = json.loads(args) if isinstance(args, str) else None
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{param}.function.arguments: a JSON object as text", f"{param}.function.arguments")
    seen.add(call["id"])
    return {"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": value}}
