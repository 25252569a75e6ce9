"""Predicted outputs: draft from the text the caller expects the answer to be.

OpenAI's `prediction` field: a client asking for an edit of text it holds sends that text along,
and most of the answer is that text again. `PredictionDrafter` follows the output through the
prediction and drafts its next tokens; its drafts are ordinary deterministic drafts (q = None,
one-hot), verified like any other, so the output is exactly what it would be without them.

The track. The prediction is tokenised on its own once (`Prediction`: its ids and the character
where each begins). The drafter keeps a track, token ids that spell the prediction's text from
some character on, and a cursor in it (the next token expected); at the start the track is the
prediction's own tokens and the cursor their first.

Following. Each call compares the output's new tokens with the track at the cursor: while they
agree the cursor moves on, and with it the anchor, the prediction's character after the last
agreement. A token that differs (an inserted, deleted or changed line) loses the cursor.

Rejoining. Without a cursor, the output's recent text (its last `TAIL_TOKENS` tokens decoded) is
matched against the prediction's text: the longest suffix of it that occurs ending at or after the
anchor, at its nearest such occurrence; failing that (at least `MIN_BEFORE` characters), before the
anchor. Where the output has just ended a line and the anchor stands at the start of one or in its
indentation (lines inserted before it, or a preamble such as a code fence), the output rejoins at
the start of the anchor's line, unless the match covers most of the output's last line (a changed
line: the output goes on after the match). The track restarts at the join's character: the
prediction's own tokens where a token begins there; otherwise the text from there is tokenised
again, since the model may split the text differently from the prediction tokenised alone. Only a
window of `WINDOW` characters is re-tokenised: the track goes back to the prediction's own tokens
where the two tokenisations meet again (the same token at the same character, twice in a row),
usually within a line.

Sources. Each proposal says what kind of guess it is (`Proposal.source`), so the draft-length rule
(`policy.CostAwareDraftLength`) keeps one acceptance estimate per kind and sizes each by its own
evidence: `FOLLOW` once `FOLLOW_RUN` tokens have agreed since the last join (long drafts where the
prediction has held), else `(JOIN, kind)` with the kind of the join: "start", "line", "swap" (the
token after one the output replaced while following; "first-swap" where it had not followed yet),
or the length of the text match ("short" / "long"): short
drafts right after a divergence. A kind of join whose proposals keep coming to nothing falls silent
for a while (`GATE`), leaving those steps to the row's own drafter.

Composition. `with_prediction(prediction, drafter)` puts the prediction first and the row's own
drafter where the prediction offers nothing (`PredictionFirst` for a lookup drafter; the
lookup-first combination of `combined.py` for a model drafter, the prediction as its lookup part,
or in front of the lookup part of an existing one).

Usage. `prediction_usage(prediction_ids, output_ids)`: accepted = the prediction's tokens (tokenised
on their own) that difflib's matching blocks between the two id sequences pair with emitted
tokens, each counted once; rejected = the prediction's other tokens.
"""

from __future__ import annotations

import difflib
from bisect import bisect_left
from dataclasses import dataclass

from specdec.drafters.base import DrafterBase, DrafterNeeds, Proposal, check_k
from specdec.drafters.combined import LookupFirstDrafter
from specdec.errors import InvalidRequestError

FOLLOW = "prediction"  # Proposal.source while the output has followed the prediction a while
JOIN = "prediction-join"  # (JOIN, kind): the first drafts after a join
# The sources a row drafts before asking its model (`policy.DraftController.learned_first`): besides
# following, the joins the output's own text vouches for, a match of LONG_MATCH characters or more
# and the token after one the output replaced while following (a rename). Their first proposal has
# no acceptance evidence of its own in the row yet, and the model, asked instead, would draft the
# same text one forward a token.
FIRST = (FOLLOW, (JOIN, "long"), (JOIN, "swap"))
FOLLOW_RUN = 4  # tokens agreed since a join before its drafts count as following
TAIL_TOKENS = 24  # the output's recent tokens whose text is matched against the prediction
LONG_MATCH = 12  # a text match of at least this many characters is a "long" join
MIN_AFTER = 2  # the shortest text match that rejoins at or after the anchor
MIN_BEFORE = 16  # ... and before it (the output went back over text it had passed)
WINDOW = 512  # characters re-tokenised from a join inside one of the prediction's tokens
# A kind of join whose guesses have been rejected more than this estimate allows proposes nothing,
# so that the row's own drafter drafts there (a prediction unrelated to the output would otherwise
# take every step from it with guesses the draft-length rule then cuts to nothing). Each step it
# stays silent forgets a little of the evidence (`GATE_DECAY`), so it is tried again now and then.
GATE = 0.25
GATE_DECAY = 0.95


@dataclass(frozen=True)
class Prediction:
    """A prediction tokenised on its own: `ids` and the character of `text` where each begins.
    `suffixes`: whether tokenising a piece of the text from the middle spells it as it stands
    (False for a tokenizer that prefixes a space to every text: then a join must fall where one
    of `ids` begins)."""

    text: str
    ids: list[int]
    starts: list[int]
    suffixes: bool = True

    @classmethod
    def of(cls, text: str, tokenizer) -> "Prediction":
        if not isinstance(text, str):
            raise InvalidRequestError("prediction must be text", "prediction")
        if tokenizer is None:
            raise InvalidRequestError("a prediction is text: this model has no tokenizer", "prediction")
        if not text:
            return cls("", [], [], False)
        from specdec.tokenizer import check_text

        check_text(text, "prediction", "prediction")
        ids, starts = tokenizer.encode_offsets(text)
        probe = tokenizer.encode_plain("ab")
        suffixes = tokenizer.encode_plain("\nab")[-len(probe):] == probe
        return cls(text, ids, starts, suffixes)


@dataclass(frozen=True)
class PredictionUsage:
    """OpenAI's `completion_tokens_details.accepted_prediction_tokens` / `rejected_prediction_tokens`."""

    accepted: int
    rejected: int


def prediction_usage(prediction_ids: list[int], output_ids: list[int]) -> PredictionUsage:
    """Accepted prediction tokens = the sizes of difflib's matching blocks between the prediction's
    ids (tokenised on its own) and the output's (each prediction token counted at most once, so
    accepted <= both lengths); rejected = the prediction's other tokens."""
    if not prediction_ids or not output_ids:
        return PredictionUsage(0, len(prediction_ids))
    matcher = difflib.SequenceMatcher(None, prediction_ids, output_ids, autojunk=False)
    accepted = sum(block.size for block in matcher.get_matching_blocks())
    return PredictionUsage(accepted, len(prediction_ids) - accepted)


class PredictionDrafter(DrafterBase):
    """Drafts the prediction's next tokens where the output follows it (see the module docstring)."""

    name = "prediction"
    needs = DrafterNeeds(labels_proposals=True)

    def __init__(self, prediction: Prediction, tokenizer):
        self.prediction = prediction
        self.tokenizer = tokenizer
        self.begin([])

    def spawn(self) -> "PredictionDrafter":
        return PredictionDrafter(self.prediction, self.tokenizer)

    def begin(self, prompt_ids: list[int], sampling=None, generator=None) -> None:
        pred = self.prediction
        self._prompt = len(prompt_ids)
        self._seen = 0  # output tokens compared so far
        self._ids, self._starts, self._end = pred.ids, pred.starts, len(pred.text)  # the track
        self._cursor: int | None = 0 if pred.ids else None
        self._anchor = 0  # the prediction's character after the last agreement
        self._run = 0  # tokens agreed since the last join
        self._kind: object = "start"
        self._proposed: object = None  # the kind of join of the last proposal (None: none, or following)
        self._evidence: dict[object, list[float]] = {}  # kind -> [accepted tokens, rejected proposals]
        self._swap: tuple[int, int | None, str] = (-1, None, "swap")  # (output length, char, kind) of a one-token swap

    def propose(self, context: list[int], k: int) -> Proposal:
        check_k(k)
        out = context[self._prompt :]
        self._follow(out)
        if self._cursor is None and out:
            self._rejoin(out)
        c, self._proposed = self._cursor, None
        if c is None or k == 0 or c >= len(self._ids):
            return Proposal([])
        if self._run >= FOLLOW_RUN:
            return Proposal(self._ids[c : c + k], source=FOLLOW)
        evidence = self._evidence.setdefault(self._kind, [0.0, 0.0])
        if (evidence[0] + 1) / (evidence[0] + evidence[1] + 2) < GATE:
            evidence[1] *= GATE_DECAY
            return Proposal([])
        self._proposed = self._kind
        return Proposal(self._ids[c : c + k], source=(JOIN, self._kind))

    def feedback(self, num_accepted: int) -> None:
        """A join's proposal counts as rejected when nothing of it was accepted (also where the
        draft-length rule kept none of it: that kind is not worth drafting now)."""
        if self._proposed is not None:
            evidence = self._evidence[self._proposed]
            evidence[0] += num_accepted
            evidence[1] += num_accepted == 0

    def end(self, output_ids: list[int]) -> None:
        self._ids, self._starts = [], []

    def passed_end(self, context: list[int]) -> bool:
        """Whether the output (in `context`) has followed the prediction to its end (but white
        space, which the output may spell in one token with what follows, as a line end with a
        closing fence)."""
        self._follow(context[self._prompt :])
        text = self.prediction.text
        return bool(text.strip()) and not text[self._anchor :].strip()

    # -- following -------------------------------------------------------------------------------

    def _follow(self, out: list[int]) -> None:
        """Move the cursor over the output's new tokens while they agree with the track."""
        new, c = out[self._seen :], self._cursor
        self._seen = len(out)
        if c is None or not new:
            return
        ids, m = self._ids, 0
        while m < len(new) and c + m < len(ids) and new[m] == ids[c + m]:
            m += 1
        c += m
        if m:
            self._run += m
            self._anchor = self._starts[c] if c < len(ids) else self._end
        if m == len(new) and (c < len(ids) or self._end == len(self.prediction.text)):
            self._cursor = c
        elif m == len(new):  # the end of a re-tokenised window, all agreed: the text goes on from there
            run, self._cursor = self._run, None
            self._track_from(self._end, self._kind)
            self._run = run
        else:
            self._cursor = None
            # A token that replaced the one expected (a renamed name, a changed number): the
            # output may go on from the token after it. "swap" where the output had agreed with
            # the track before it; "first-swap" where it had not (at the start, or just after a
            # join), a weaker guess.
            after = self._starts[c + 1] if c + 1 < len(ids) else None
            self._swap = (len(out) - len(new) + m + 1, after, "swap" if self._run else "first-swap")

    # -- rejoining -------------------------------------------------------------------------------

    def _rejoin(self, out: list[int]) -> None:
        """Find where the output rejoins the prediction (module docstring) and restart the track there."""
        tail = self.tokenizer.decode(out[-TAIL_TOKENS:]).lstrip("\ufffd")
        if not tail or tail.endswith("\ufffd"):
            return  # the output stands inside a character
        text, anchor = self.prediction.text, self._anchor
        length, end = _longest_suffix(text, tail, anchor)
        line_start = text.rfind("\n", 0, anchor) + 1  # of the anchor's line
        if tail.endswith("\n") and not text[line_start:anchor].strip() and anchor < len(text):
            # The output ended a line while the anchor stands at the start of one (or in its
            # indentation): a line inserted there, unless most of the output's line matched
            # text further on (a changed line).
            last_line = tail[tail.rfind("\n", 0, len(tail) - 1) + 1 :]
            if 2 * length <= len(last_line.lstrip()):
                self._track_from(line_start, "line")
                return
        swap_at, swap_char, swap_kind = self._swap
        # (Not where the output spelled the start of the token expected in pieces of its own.)
        if len(out) == swap_at and swap_char is not None and length < LONG_MATCH and not anchor < end < swap_char:
            self._track_from(swap_char, swap_kind)
            return
        if length >= MIN_AFTER:
            self._track_from(end, "long" if length >= LONG_MATCH else "short")
            return
        length, end = _longest_suffix(text, tail, 0)
        if length >= MIN_BEFORE:
            self._track_from(end, "long")

    def _track_from(self, char: int, kind: object) -> None:
        """Restart the track at the prediction's character `char` (see the module docstring)."""
        pred = self.prediction
        self._run, self._kind = 0, kind
        if char >= len(pred.text):
            return
        e = bisect_left(pred.starts, char)
        if e < len(pred.starts) and pred.starts[e] == char:
            self._ids, self._starts, self._end, self._cursor = pred.ids, pred.starts, len(pred.text), e
            return
        if not pred.suffixes:
            return
        window = pred.text[char : char + WINDOW]
        ids, starts = self.tokenizer.encode_offsets(window)
        starts = [char + s for s in starts]
        for p in range(1, len(ids) - 2):
            q = bisect_left(pred.starts, starts[p])
            if (q + 1 < len(pred.ids) and pred.starts[q] == starts[p] and ids[p] == pred.ids[q]
                    and ids[p + 1] == pred.ids[q + 1]):
                self._ids, self._starts = ids[:p] + pred.ids[q:], starts[:p] + pred.starts[q:]
                self._end, self._cursor = len(pred.text), 0
                return
        if char + WINDOW >= len(pred.text):
            self._ids, self._starts, self._end = ids, starts, len(pred.text)
        elif len(ids) > 1:  # the window's last token may be cut short: the track ends before it
            self._ids, self._starts, self._end = ids[:-1], starts[:-1], starts[-1]
        else:
            return
        self._cursor = 0


def _longest_suffix(text: str, tail: str, start: int) -> tuple[int, int]:
    """(length, end) of the longest suffix of `tail` that occurs in `text` ending at or after
    `start`, at its first such occurrence; (0, start) for none. A suffix's own suffixes occur
    wherever it does, so the longest is found by bisection."""
    lo, hi, end = 0, len(tail), start
    while lo < hi:
        mid = (lo + hi + 1) // 2
        at = text.find(tail[-mid:], max(0, start - mid))
        if at >= 0:
            lo, end = mid, at + mid
        else:
            hi = mid - 1
    return lo, end


class PredictionFirst(DrafterBase):
    """The prediction's drafts where it has any, else a lookup drafter's (both free)."""

    needs = DrafterNeeds(labels_proposals=True)

    def __init__(self, prediction: PredictionDrafter, lookup):
        self.prediction, self.lookup = prediction, lookup
        self.name = f"{prediction.name}+{lookup.name}"
        self._last = prediction

    def spawn(self) -> "PredictionFirst":
        return PredictionFirst(self.prediction.spawn(), self.lookup.spawn())

    def begin(self, prompt_ids: list[int], sampling=None, generator=None) -> None:
        self.prediction.begin(prompt_ids, sampling, generator)
        self.lookup.begin(prompt_ids, sampling, generator)

    def propose(self, context: list[int], k: int) -> Proposal:
        proposal = self.prediction.propose(context, k)
        self._last = self.prediction if proposal.tokens else self.lookup
        return proposal if proposal.tokens else self.lookup.propose(context, k)

    def feedback(self, num_accepted: int) -> None:
        self._last.feedback(num_accepted)

    def end(self, output_ids: list[int]) -> None:
        self.prediction.end(output_ids)
        self.lookup.end(output_ids)


# The prompt window of a prediction row's draft model (`PromptReader.begin`): it reads the prompt's
# first tokens and its last DRAFT_WINDOW, not all of it. Its prompt read is its dearest act and comes
# at the first line the output changes; by then the output itself holds the prediction's text up to
# there (the part of an edit's prompt the read would mostly be about), so the middle of the prompt
# tells the draft little. Acceptance only is at stake (BENCHMARKS.md, predicted outputs).
DRAFT_WINDOW = 128


def with_prediction(prediction: PredictionDrafter, drafter):
    """The prediction first, the row's own drafter (or None) where it offers nothing: chains only.
    A learned part that reads the prompt reads it through `DRAFT_WINDOW`."""
    if drafter is None:
        return prediction
    if drafter.needs.fallback:  # a lookup-first combination (`combined.LookupFirstDrafter`)
        return LookupFirstDrafter(PredictionFirst(prediction, drafter.lookup), drafter.learned, drafter.fallback_k,
                                  DRAFT_WINDOW)
    if drafter.needs.model or drafter.needs.observes is not None:
        return LookupFirstDrafter(prediction, drafter, prompt_window=DRAFT_WINDOW)
    return PredictionFirst(prediction, drafter)
