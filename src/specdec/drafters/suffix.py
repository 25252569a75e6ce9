"""Suffix cache: n-gram continuation statistics that outlive a request.

The idea (after SuffixDecoding, Oliaro et al. 2024, and llama.cpp's lookup cache): many workloads
repeat themselves across requests, not just within one (agents re-emitting tool calls, templated
answers, the same code edited again). So keep, for every short context n-gram seen anywhere, how
often each next token followed it, and draft by walking the most frequent continuation.

Statistics. `counts[ctx] = {next_token: count}` for every n-gram `ctx` of length min_ngram ..
max_ngram in the token streams seen so far. The streams are every request's prompt + output:
the prompt is counted at `begin`, the tokens emitted so far at each `propose` (so a phrase that
repeats inside the current request is drafted from its second occurrence on), and the tail that no
`propose` saw at `end`. Each transition is counted exactly once: the drafter remembers how much of
the current request's stream it has already counted.

One table, not two. SuffixDecoding keeps a per-request tree and a global tree and scores both;
here current-request and earlier-request counts go into the same table, which is simpler and lets
the current request's statistics count immediately. The cost is that a long-running popular
continuation can outvote a fresh one from the current request; the recency tie-break softens this.

Drafting is greedy: look up the longest suffix of (context + drafted so far) that has counts, take
its most frequent next token (ties -> the one seen most recently), append, repeat up to k times;
stop at the first step with no entry. The choice is deterministic, so `q` is None (one-hot).

Memory is bounded by `max_entries` context n-grams kept in LRU order (an OrderedDict): counting or
drafting from an entry marks it used, and inserting past the bound evicts the least recently used.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from specdec.drafters.base import (
    LOOKUP_NEEDS,
    DrafterBase,
    Proposal,
    _is_int,
    check_k,
    check_ngram_range,
    common_prefix_length,
)
from specdec.errors import InvalidRequestError


class SuffixDrafter(DrafterBase):
    """Frequency-based lookup drafter with statistics shared across requests (see module doc)."""

    name = "suffix"
    needs = LOOKUP_NEEDS  # Proposal.source = the length of the n-gram the draft follows

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_entries: int = 200_000):
        check_ngram_range(min_ngram, max_ngram)
        if not _is_int(max_entries) or max_entries < 1:
            raise InvalidRequestError(
                f"max_entries must be an integer >= 1, got {max_entries!r}", param="max_entries"
            )
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_entries = max_entries
        # context n-gram -> {next token: count}; the inner dict's order is recency (a token is
        # re-inserted on every count), which the tie-break reads. Outer order is LRU, oldest first.
        self._counts: OrderedDict[tuple[int, ...], dict[int, int]] = OrderedDict()
        self._stream: list[int] = []  # the current request's prompt + tokens, all counted
        self._prompt_len = 0  # length of the current request's prompt inside _stream

    def spawn(self) -> "SuffixDrafter":
        # A fresh table: rows that run side by side would interleave their streams in one.
        return SuffixDrafter(self.max_ngram, self.min_ngram, self.max_entries)

    @property
    def num_entries(self) -> int:
        return len(self._counts)

    # -- protocol -------------------------------------------------------------------------------

    def begin(self, prompt_ids: list[int], sampling=None, generator=None) -> None:
        # Deterministic lookup: the request's sampling params and generator are not needed.
        self._stream = []
        self._observe(prompt_ids)
        self._prompt_len = len(self._stream)

    def propose(self, context: list[int], k: int) -> Proposal:
        check_k(k)
        self._observe(context)
        # Only the last max_ngram tokens matter for lookup; drafted tokens extend this tail.
        tail = list(context[-self.max_ngram :])
        drafted: list[int] = []
        source = None  # the length of the suffix the first draft followed (`Proposal.source`)
        while len(drafted) < k:
            token, n = self._most_frequent_next(tail)
            if token is None:
                break
            source = n if source is None else source
            drafted.append(token)
            tail.append(token)
            if len(tail) > self.max_ngram:
                del tail[0]
        return Proposal(drafted, source=source)

    def feedback(self, num_accepted: int) -> None:
        # Statistics come from emitted text only (seen at the next propose / end), never from
        # rejected drafts, so there is nothing to learn here.
        pass

    def end(self, output_ids: list[int]) -> None:
        # The stream the engine emitted is prompt + output; count whatever propose did not see.
        prompt = self._stream[: self._prompt_len]
        self._observe(prompt + list(output_ids))
        self._stream = []
        self._prompt_len = 0

    # -- statistics -----------------------------------------------------------------------------

    def _observe(self, tokens: Sequence[int]) -> None:
        """Count the transitions of `tokens` that are not already counted for this request."""
        # If the stream diverged from what we counted (no begin between requests, or a rollback),
        # count from the point of divergence: counts cannot be taken back, but no transition of
        # the new stream is counted twice.
        start = common_prefix_length(self._stream, tokens)
        del self._stream[start:]
        self._stream.extend(tokens[start:])
        toks = self._stream
        for i in range(max(start, 1), len(toks)):  # toks[i] is the next token after toks[:i]
            nxt = toks[i]
            for n in range(self.min_ngram, min(self.max_ngram, i) + 1):
                self._count(tuple(toks[i - n : i]), nxt)

    def _count(self, ctx: tuple[int, ...], nxt: int) -> None:
        counts = self._counts
        followers = counts.get(ctx)
        if followers is None:
            followers = counts[ctx] = {}
            if len(counts) > self.max_entries:
                counts.popitem(last=False)  # evict the least recently used (never `ctx`: newest)
        else:
            counts.move_to_end(ctx)
        followers[nxt] = followers.pop(nxt, 0) + 1  # re-insert: the most recent is last

    def _most_frequent_next(self, tail: list[int]) -> tuple[int | None, int]:
        """(most frequent follower of the longest suffix of `tail` with counts, that suffix's
        length), or (None, 0)."""
        for n in range(min(self.max_ngram, len(tail)), self.min_ngram - 1, -1):
            ctx = tuple(tail[len(tail) - n :])
            followers = self._counts.get(ctx)
            if not followers:
                continue
            self._counts.move_to_end(ctx)
            best, best_count = None, 0
            for token, c in followers.items():  # oldest to newest: `>=` lets the newest win ties
                if c >= best_count:
                    best, best_count = token, c
            return best, n
        return None, 0
