"""A request to the `BatchScheduler` and what comes back: the `Request` a caller submits, the
`RequestHandle` it gets (iterate its deltas, or cancel), each step's `Delta` and the last one's
`Usage`, `Timing` and `Stats`, and the whole `Completion` collected from them.

These are the scheduler's interface, kept apart from the loop that fills them so that its callers
(the server, scripts, tests) read the types without the scheduling.
"""

from __future__ import annotations

import asyncio
import functools
import queue
from dataclasses import dataclass, field
from typing import Callable

from .drafters.prediction import Prediction, PredictionUsage, prediction_usage
from .errors import Fault
from .prefix_cache import SHARED, Partition
from .sampling import SamplingParams
from .engine import Stats
from .step import TokenLogprob

@dataclass(frozen=True)
class Request:
    """One generation request, already tokenised and validated by `BatchScheduler.submit`."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    drafter: str | None = None  # a drafter the scheduler loaded at start, by name; None = its default
    num_speculative_tokens: int | None = None  # None = the scheduler's default k
    logprobs: int | None = None  # None = off; n >= 0: each token's log-prob and n top alternatives
    grammar: object = None  # the request's own `structured.GrammarState` (Engine.compile_structured)
    # Prefix-cache entries are shared only within one partition (the server's: tenant and cache
    # salt, `prefix_cache.py`); None: this request neither reuses nor leaves any.
    cache_partition: Partition | None = SHARED
    tenant: str = ""  # who sent it (the server's metrics and access log); "" for the library
    request_id: str | None = None  # the id its caller knows it by (the server's access line); None: the handle's
    # The output the caller expects, mostly (OpenAI's `prediction`): drafted from first; its
    # accepted and rejected tokens come back in `Usage.prediction`.
    prediction: Prediction | None = None
    token_sources: bool = False  # each delta's text split by where its tokens came from (`Delta.sources`)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens copied from the prefix cache (the request's own partition)
    # With a prediction: (its ids, the output's ids), for `prediction`.
    predicted: tuple[list[int], list[int]] | None = field(default=None, repr=False, compare=False)

    @functools.cached_property
    def prediction(self) -> PredictionUsage | None:
        """The prediction's accepted and rejected tokens, worked out on first use, by whoever reads
        them (difflib over both id lists takes up to a second for the longest predictions: not on
        the scheduler's thread, nor on a server's event loop)."""
        return None if self.predicted is None else prediction_usage(*self.predicted)


@dataclass(frozen=True)
class Timing:
    """Latency of a finished request, for the TTFT / TPOT / end-to-end histograms."""

    queue_s: float  # arrival -> admitted to a batch row
    ttft_s: float  # arrival -> first token
    e2e_s: float  # arrival -> last token
    tpot_s: float | None  # mean time per output token after the first (None for 1 token)


@dataclass(frozen=True)
class Delta:
    """What one scheduler step produced for one request. The last one has `finish_reason` set."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    usage: Usage | None = None  # on the last delta
    stats: Stats | None = None  # on the last delta: this request's speculation statistics
    timing: Timing | None = None  # on the last delta
    error: Fault | None = None  # finish_reason == "error": what this request is told went wrong
    # With `Request.token_sources`: `text` as (text, source) segments, source "draft" | "target" | "bonus".
    sources: list[tuple[str, str]] | None = None


@dataclass(frozen=True)
class Completion:
    """A whole result, collected from the deltas (`RequestHandle.result`)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str
    usage: Usage
    stats: Stats | None
    timing: Timing | None
    error: Fault | None = None  # finish_reason == "error"


class RequestHandle:
    """The caller's side of a submitted request: iterate its deltas, or cancel it.

    Deltas arrive from the scheduler thread. With an event loop (`submit(..., loop=...)`), they go
    into an `asyncio.Queue` through `call_soon_threadsafe` and are read with `async for`; without
    one, into a thread-safe queue read with plain `for` (tests, scripts).
    """

    def __init__(self, request_id: int, request: Request, cancel: Callable[[int], None],
                 loop: asyncio.AbstractEventLoop | None):
        self.id = request_id
        self.request = request
        self._cancel = cancel  # the scheduler's `cancel(request_id)`
        self._loop = loop
        self._async: asyncio.Queue | None = asyncio.Queue() if loop is not None else None
        self._sync: queue.SimpleQueue = queue.SimpleQueue()
        self.finished = False  # the scheduler sent the last delta (scheduler thread)
        self.consumed = False  # the reader has taken the last delta (reader side)

    def _put(self, delta: Delta) -> None:  # scheduler thread
        if self._loop is None:
            self._sync.put(delta)
            return
        try:
            self._loop.call_soon_threadsafe(self._async.put_nowait, delta)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def cancel(self) -> None:
        """Stop generating; the row and its cache are freed before the next step."""
        if not self.finished:
            self._cancel(self.id)

    def __iter__(self):
        if self._loop is not None:
            raise TypeError("this handle was submitted with an event loop: use `async for`")
        while not self.consumed:
            delta = self._sync.get()
            self.consumed = delta.finish_reason is not None
            yield delta

    async def __aiter__(self):
        if self._async is None:
            raise TypeError("this handle was submitted without an event loop: use `for`")
        while not self.consumed:
            delta = await self._async.get()
            self.consumed = delta.finish_reason is not None
            yield delta

    @staticmethod
    def collect(deltas: list[Delta]) -> Completion:
        last = deltas[-1]
        logprobs = None
        if any(d.logprobs is not None for d in deltas):
            logprobs = [lp for d in deltas for lp in (d.logprobs or [])]
        return Completion("".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids], logprobs,
                          last.finish_reason, last.usage, last.stats, last.timing, last.error)

    def result(self) -> Completion:
        """Block until done (no event loop) and return everything."""
        return self.collect(list(self))

