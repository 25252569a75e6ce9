"""Structured output: a request's grammar (JSON schema, JSON object, regex, Lark grammar, choice)
as per-row state of the decoding core, on llguidance (the optional extra `specdec[structured]`).

`StructuredSpec` is what a request asks for; `compile_spec` turns it into a `GrammarState` for the
model's tokenizer, or an `InvalidRequestError` (a 400) for a bad schema, an unsupported keyword or
a grammar no token of this tokenizer can start. A `GrammarState` holds one llguidance matcher at
the committed tokens (prompt excluded): `masks(paths)` gives the tokens allowed after each block
row's draft prefix without moving it (each prefix is consumed, its mask read, then rolled back),
and `advance(tokens)` commits what a step emitted. The draft tokens are therefore never left in
the matcher: rolling the grammar back with the caches is not a separate step.

Why the masked verification is exact: see `verify.py` (the target's p' at every block row is the
distribution plain constrained decoding samples from there; a forbidden draft has p' = 0 and is
rejected by the ordinary rule, its recovered token drawn from norm(max(0, p' - q))).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from .errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "grammar", "choice")


def _limits():
    """The grammar engine's work budget per request (llguidance's defaults bound the time of each
    mask: lexer fuel, Earley items per step, lexer states, grammar size), with short errors: its
    verbose ones print the grammar and the parser's state."""
    from llguidance import LLParserLimits

    return LLParserLimits(verbose_errors=False)


def _check_text(value: object, param: str) -> None:
    """A 400 for a string anywhere in `value` that UTF-8 cannot encode (a lone surrogate, which
    JSON's \\ud800 escapes can carry): the grammar engine takes UTF-8 only."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidRequestError(f"{param}: a string holds a lone surrogate at character {exc.start}, "
                                          "which is not valid Unicode text", param) from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


@dataclass(frozen=True)
class StructuredSpec:
    """One constraint: kind in KINDS; value = the schema (dict, bool or JSON text), the regex, the
    grammar (Lark, or GBNF when it has `::=`) or the list of choices; `param` names the request
    field it came from (for error messages)."""

    kind: str
    value: object = None
    param: str = "structured_outputs"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidRequestError(f"unknown structured output kind {self.kind!r}; choose {', '.join(KINDS)}",
                                      self.param)

    @classmethod
    def of(cls, structured: "StructuredSpec | dict | None") -> "StructuredSpec | None":
        """`Engine.generate(structured=...)`: a spec, or a one-key dict like {"json": schema},
        {"regex": "..."}, {"grammar": "..."}, {"choice": [...]} or {"json_object": True}."""
        if structured is None or isinstance(structured, StructuredSpec):
            return structured
        if not isinstance(structured, dict) or len(structured) != 1:
            raise InvalidRequestError("structured must be one of {json|regex|grammar|choice|json_object: value}",
                                      "structured")
        (kind, value), = structured.items()
        return cls(kind, value, "structured")

    def grammar(self) -> str:
        """The llguidance grammar text for this constraint."""
        from llguidance import LLMatcher, gbnf_to_lark

        v = self.value
        _check_text(v, self.param)
        # JSON as json.dumps writes it (", " and ": ", no other whitespace): a free whitespace rule
        # lets a small model spend its whole budget on spaces. A schema's "x-guidance" overrides it.
        compact = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=compact)
        if self.kind == "json":
            if isinstance(v, str):
                try:
                    v = json.loads(v)
                except ValueError as exc:
                    raise InvalidRequestError(f"{self.param}: the JSON schema is not valid JSON ({exc})",
                                              self.param) from None
            if not isinstance(v, (dict, bool)):
                raise InvalidRequestError(f"{self.param}: a JSON schema is an object (or true / false)", self.param)
            try:
                return LLMatcher.grammar_from_json_schema(v, defaults=compact)
            except (ValueError, TypeError) as exc:
                raise InvalidRequestError(f"{self.param}: invalid JSON schema ({exc})", self.param) from None
        if self.kind == "choice":
            if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
                raise InvalidRequestError(f"{self.param}: choice is a non-empty list of non-empty strings",
                                          self.param)
            # Lark string literals take JSON's escapes.
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in v))
        if not isinstance(v, str) or not v:
            raise InvalidRequestError(f"{self.param}: the {self.kind} must be a non-empty string", self.param)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(v)
        if "::=" in v:  # GBNF (llama.cpp's), as vLLM accepts it
            try:
                v = gbnf_to_lark(v)
            except Exception as exc:  # its parser raises plain exceptions for a bad grammar
                raise InvalidRequestError(f"{self.param}: invalid GBNF grammar ({exc})", self.param) from None
        return LLMatcher.grammar_from_lark(v)


class GrammarTokens:
    """The model's tokenizer as llguidance sees it, built once per engine (slow for a big
    vocabulary): its `LLTokenizer`, and which ids may ever be allowed (no special token but EOS)."""

    def __init__(self, tokenizer_json: str, vocab: int, eos_ids, param: str = "response_format"):
        from llguidance import LLTokenizer

        self.vocab = vocab
        self.eos_ids = [e for e in eos_ids if e < vocab]
        try:
            self.ll = LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=self.eos_ids[0] if self.eos_ids else None)
        except ValueError as exc:
            raise InvalidRequestError(f"structured output: this model's tokenizer is not supported by the grammar "
                                      f"engine ({exc})", param) from None
        special = torch.tensor([self.ll.is_special_token(i) for i in range(vocab)], dtype=torch.bool)
        self.usable = ~special  # [vocab]
        self.usable[self.eos_ids] = True


def compile_spec(spec: StructuredSpec, tokens: GrammarTokens, allow: tuple[int, ...] = ()) -> "GrammarState":
    """A fresh `GrammarState` for `spec`; a 400 for anything that cannot constrain a generation.
    `allow`: special token ids the grammar names itself (`<[id]>`), which its masks may hold."""
    from llguidance import LLMatcher

    grammar = spec.grammar()
    try:
        matcher = LLMatcher(tokens.ll, grammar, log_level=0, limits=_limits())
    except Exception as exc:  # documented never to raise for grammar errors; a 400 either way
        raise InvalidRequestError(f"{spec.param}: the grammar engine refuses it: {exc}", spec.param) from None
    if matcher.is_error():
        reason = " ".join(matcher.get_error().split())
        raise InvalidRequestError(f"{spec.param}: the grammar engine refuses it: {reason[:500]}",
                                  spec.param)
    state = GrammarState(matcher, tokens, spec.param, allow)
    first = state._mask()
    eos = torch.zeros_like(first)
    eos[tokens.eos_ids] = True
    starts = (first & ~eos).nonzero().flatten().tolist()
    if not starts and not matcher.is_accepting():
        raise InvalidRequestError(f"{spec.param}: no token of this model's tokenizer can start the required "
                                  "output", spec.param)
    if starts:
        # One token in and back: the engine builds most of a grammar's lexer lazily, at the first
        # token, so a grammar past its budget fails here, in the request's handler, rather than
        # in a decoding step shared with other requests.
        state.masks([[starts[0]]])
    return state


class GrammarState:
    """One request's matcher at its committed tokens (see the module docstring)."""

    def __init__(self, matcher, tokens: GrammarTokens, param: str = "structured_outputs", allow: tuple[int, ...] = ()):
        self.matcher = matcher
        self.tokens = tokens
        self.param = param
        self.allow = allow
        self.usable = tokens.usable
        if allow:
            self.usable = tokens.usable.clone()
            self.usable[list(allow)] = True

    def _gave_up(self) -> InvalidRequestError:
        """The request's grammar went past the engine's work budget (`_limits`) while generating:
        the request's fault, told in one short line (the grammar engine's reason)."""
        reason = (self.matcher.get_error() or "unknown reason").replace("<non-verbose/>", "")
        reason = " ".join(reason.split())[:300]
        return InvalidRequestError(f"{self.param}: the grammar engine gave up on this grammar ({reason}); "
                                   "simplify it", self.param)

    def _mask(self) -> torch.Tensor:
        # [vocab] bool: what the matcher allows now. A dead end (nothing allowed: the tokenizer
        # cannot spell what must come next) ends the output with EOS rather than failing the step.
        raw = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8)[: self.tokens.vocab]
        if self.matcher.is_error():
            raise self._gave_up()
        allowed = torch.zeros(self.tokens.vocab, dtype=torch.bool)
        allowed[: raw.shape[0]] = raw > 0
        allowed &= self.usable
        if not allowed.any():
            allowed[self.tokens.eos_ids] = True
        return allowed

    def masks(self, paths: list[list[int]]) -> torch.Tensor:
        """[len(paths), vocab] bool: row j = the tokens allowed after the committed tokens and
        paths[j]. A row whose path the grammar already refuses can never be reached (its draft
        is rejected at or before that token): it gets every token, so its logits stay finite.
        The matcher is back at the committed tokens on return."""
        out = torch.ones(len(paths), self.tokens.vocab, dtype=torch.bool)
        consumed: list[int] = []  # the path now in the matcher (a chain's rows extend it one by one)
        for j, path in enumerate(paths):
            common = 0
            while common < min(len(consumed), len(path)) and consumed[common] == path[common]:
                common += 1
            if common < len(consumed):
                self.matcher.rollback(len(consumed) - common)
                consumed = consumed[:common]
            rest = path[common:]
            ok = self.matcher.validate_tokens(rest) if rest else 0
            if ok < len(rest):
                continue  # unreachable row
            if rest and not self.matcher.consume_tokens(rest):
                raise self._gave_up()
            consumed += rest
            out[j] = self._mask()
        if consumed:
            self.matcher.rollback(len(consumed))
        return out

    def forced(self) -> list[int]:
        """The tokens the grammar forces next at the committed tokens (its only continuation,
        tokenised as the tokenizer would; `forced.py` drafts them), up to the first one the
        engine's masks never allow; [] where nothing is forced."""
        if self.matcher.is_stopped() or self.matcher.is_error():
            return []
        out = []
        for t in self.matcher.compute_ff_tokens():
            if t >= self.tokens.vocab or not self.usable[t]:
                break
            out.append(t)
        return out

    def advance(self, tokens: list[int]) -> None:
        """Commit emitted tokens (each was allowed by its mask; EOS after the end is a no-op)."""
        for t in tokens:
            if self.matcher.is_stopped():
                return
            if not self.matcher.consume_token(t):
                if t in self.tokens.eos_ids and not self.matcher.is_error():  # `_mask`'s dead-end EOS: the end
                    return
                raise self._gave_up()
