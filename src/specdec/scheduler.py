"""Continuous batching with speculative decoding: many requests share each target forward.

The loop (one background thread, `BatchScheduler._run`) repeats:

1. take cancellations and admit waiting requests into free batch rows (up to `max_batch`);
2. prefill each newly admitted request on its own row (one forward per new prompt) and emit its
   first token;
3. one *decode step* for every running sequence together: each row asks its own drafter for up to
   k_r draft tokens, and the block `[last token] + draft_r` of every row goes through ONE target
   forward of shape `[rows, T]` with `T = max_r (1 + len(draft_r))`;
4. each row verifies its own drafts against its own logits with its own `torch.Generator`, keeps
   the accepted prefix in its cache row (`truncate(row=r)`) and pushes the emitted tokens through
   its own `_Output` (EOS, stop strings, max tokens); finished rows leave the batch.

Why padding is safe. Rows draft different numbers of tokens, so shorter blocks are padded at the
end to T. `Transformer.forward` writes row r's T tokens at slots `[len_r, len_r + T)` at positions
`len_r + j`; under the causal mask a real token j only sees slots before it, never the padding
after it, so its logits are exactly those of the unpadded block. The rollback
`truncate(len_r + 1 + accepted_r, row=r)` then drops the padding with the rejected drafts.

Cache layout. One KV cache of `max_batch` rows x `max_model_len + k_max + 1` slots is allocated
once. Running sequences always occupy the contiguous rows `[0, n)`, and a forward runs on the view
`cache.rows(n)`, so a half-empty batch costs nothing for its empty rows. When a sequence leaves row
i, the sequence in the last row n - 1 is moved into row i (`cache.move_row`, a copy of its filled
slots only), which keeps the running rows contiguous. This trades an occasional copy at a
departure for never gathering or scattering the cache on a step.

Speculation under load (the known failure mode of speculative serving). Verifying draft tokens is
almost free while a forward is bound by reading the weights, which is true for a few tokens per
forward; once the batch alone fills the machine, every drafted token costs as much as a real one
and rejected drafts are pure loss. Two rules cap how many tokens a row may draft per step, and
the smaller cap wins (the request's own k and its remaining token allowance cap it further):

* the budget rule, a hard ceiling: a forward scores at most `spec_token_budget` tokens, so with n
  running sequences each may draft `max(0, spec_token_budget // n - 1)`. With the default budget
  of 32: 5 drafts per row up to n = 5, 3 at n = 8, 1 at n = 16, none from n = 17 on.
* the goodput rule (`GoodputModel`, on by default), which learns from the running server: the time
  of a step as a line in the tokens it scores, t = a + b * n * (k + 1) (least squares over recent
  steps), and the draft acceptance rate alpha. With i.i.d. acceptance a row that drafts k tokens
  emits E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens per step (Leviathan et al.), so the batch
  makes n * E(k) / t(n, k) tokens per second; the rule picks the k in [0, ceiling] that maximises
  that. When the weights dominate (small b/a) drafting pays even at modest alpha; when the batch
  makes steps compute-bound (large b * n) or the drafts are poor, k falls to 0 and the server
  decodes plainly. Evidence fades step by step (exponential weights), so the rule keeps
  exploring: when recent steps all had one width (no slope to fit) it uses the ceiling for a
  while, and an acceptance rate learnt from a few bad drafts drifts back to its prior.

A seeded sampled request keeps its k whatever the load: rejection sampling draws from the
request's generator a number of times that depends on k, so changing k with the load would make
the same seed give different text. Greedy requests are exact at any k, and unseeded ones promise
nothing, so they follow the rules.

Greedy output is the same alone or in a batch: each row's logits depend only on its own tokens
(padding and other rows are masked out), and greedy verification is lossless. In float32 this
holds bit for bit in practice (tested); in bfloat16, matmul shapes change with the batch and a
near-tie may flip.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from .drafters.base import Drafter, Proposal
from .engine import Engine, Stats, _Output, make_drafter
from .errors import InvalidRequestError, SpecdecError
from .models.transformer import Transformer
from .sampling import SamplingParams, make_generator
from .tokenizer import Tokenizer

LOOKUP_DRAFTERS = ("none", "ngram", "suffix")


class QueueFullError(SpecdecError):
    """More requests are waiting than the scheduler accepts (HTTP 429)."""

    http_status = 429
    error_type = "rate_limit_error"


class ShuttingDownError(SpecdecError):
    """The scheduler is draining and takes no new requests (HTTP 503)."""

    http_status = 503
    error_type = "service_unavailable"


@dataclass(frozen=True)
class Request:
    """One generation request, already tokenised and validated by `BatchScheduler.submit`."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    drafter: str | None = None  # none | ngram | suffix; None = the scheduler's default
    num_speculative_tokens: int | None = None  # None = the scheduler's default k
    logprobs: int | None = None  # None = off; n >= 0: each token's log-prob and n top alternatives


@dataclass(frozen=True)
class TokenLogprob:
    """The target's own log-probability (log-softmax of its raw logits) of one emitted token."""

    token: int
    logprob: float
    top: list[tuple[int, float]]  # the `logprobs` most likely tokens at that position, best first


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


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
    error: str | None = None  # finish_reason == "error": what went wrong


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


class RequestHandle:
    """The caller's side of a submitted request: iterate its deltas, or cancel it.

    Deltas arrive from the scheduler thread. With an event loop (`submit(..., loop=...)`), they go
    into an `asyncio.Queue` through `call_soon_threadsafe` and are read with `async for`; without
    one, into a thread-safe queue read with plain `for` (tests, scripts).
    """

    def __init__(self, request_id: int, request: Request, scheduler: "BatchScheduler",
                 loop: asyncio.AbstractEventLoop | None):
        self.id = request_id
        self.request = request
        self._scheduler = scheduler
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
            self._scheduler.cancel(self.id)

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
                          last.finish_reason, last.usage, last.stats, last.timing)

    def result(self) -> Completion:
        """Block until done (no event loop) and return everything."""
        return self.collect(list(self))


@dataclass
class _Sequence:
    """Per-request state inside the loop (scheduler thread only)."""

    handle: RequestHandle
    arrival: float
    generator: torch.Generator
    drafter: Drafter | None
    k: int
    out: _Output
    stats: Stats
    admitted: float = 0.0
    first_token: float | None = None
    sent: int = 0  # characters of the output text already delivered

    @property
    def request(self) -> Request:
        return self.handle.request

    @property
    def context(self) -> list[int]:
        return self.request.prompt_ids + self.out.ids


@dataclass
class SchedulerCounters:
    """Cumulative counters for /metrics (written by the scheduler thread, read anywhere)."""

    spec: Stats = field(default_factory=Stats)  # drafts, draft tokens, accepted, per position
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0  # decode steps (target forwards over the batch)
    step_rows: int = 0  # sum over steps of the rows in the batch
    step_tokens: int = 0  # sum over steps of rows x T (tokens the target scored, padding included)
    finished: dict[str, int] = field(default_factory=dict)  # finish_reason -> requests


@dataclass
class GoodputModel:
    """Online model of step cost and draft acceptance, to choose k (see the module docstring).

    Step time t = a + b * x, x = tokens the forward scored, fitted by exponentially weighted least
    squares (weight `decay` per step, so the fit follows a machine whose load changes).
    """

    decay: float = 0.97
    prior_alpha: float = 0.5  # acceptance assumed before evidence, worth `prior_tokens` drafts
    prior_tokens: float = 4.0
    min_width_var: float = 0.25  # tokens^2: below this the recent steps say nothing about the slope
    sw: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    drafted: float = 0.0
    accepted: float = 0.0

    def observe_step(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self.sw, self.sx, self.sy = d * self.sw + 1, d * self.sx + tokens, d * self.sy + seconds
        self.sxx, self.sxy = d * self.sxx + tokens * tokens, d * self.sxy + tokens * seconds

    def observe_drafts(self, drafted: int, accepted: int) -> None:
        """One step's drafted and accepted tokens over all rows (0, 0 for a step without drafts).

        Called every step, so old evidence fades even while nothing is drafted: the estimate then
        drifts back to the prior, drafting resumes for a while, and a poor early sample cannot
        switch speculation off for good (explore, then exploit).
        """
        self.drafted = self.decay * self.drafted + drafted
        self.accepted = self.decay * self.accepted + accepted

    def line(self) -> tuple[float, float] | None:
        """(a, b) of t = a + b x, or None while recent steps had (nearly) one width only.

        The slope comes only from steps of different widths; once those have faded from the
        weights (the variance of recent widths < `min_width_var`), the slope is stale, and None
        sends the scheduler back to the ceiling for a while, which measures wider steps anew.
        """
        if self.sw < 2:
            return None
        var = (self.sxx * self.sw - self.sx * self.sx) / (self.sw * self.sw)  # weighted variance of x
        if var < self.min_width_var:
            return None
        b = max(0.0, (self.sxy * self.sw - self.sx * self.sy) / (var * self.sw * self.sw))
        a = max(1e-6, (self.sy - b * self.sx) / self.sw)
        return a, b

    @property
    def alpha(self) -> float:
        return (self.accepted + self.prior_alpha * self.prior_tokens) / (self.drafted + self.prior_tokens)

    def best_k(self, rows: int, ceiling: int) -> int:
        """The k in [0, ceiling] with the most expected tokens per second for `rows` sequences."""
        line, alpha = self.line(), self.alpha
        if line is None or ceiling == 0:
            return ceiling
        a, b = line
        alpha = min(alpha, 0.999)

        def goodput(k: int) -> float:
            return rows * (1 - alpha ** (k + 1)) / (1 - alpha) / (a + b * rows * (k + 1))

        return max(range(ceiling + 1), key=goodput)


class BatchScheduler:
    """Continuous batching over one loaded target model (see the module docstring)."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer | None,
        drafter: str = "none",
        num_speculative_tokens: int = 5,
        max_batch: int = 16,
        max_queue: int = 64,
        max_model_len: int | None = None,
        spec_token_budget: int = 32,
        max_speculative_tokens: int = 16,
        adaptive: bool = True,
        on_finish: Callable[[Request, Delta], None] | None = None,
    ):
        if drafter not in LOOKUP_DRAFTERS:
            raise InvalidRequestError(
                f"the server drafts with a lookup drafter: choose one of {', '.join(LOOKUP_DRAFTERS)} "
                f"(got {drafter!r})", "drafter")
        for name, value, low in (("num_speculative_tokens", num_speculative_tokens, 1), ("max_batch", max_batch, 1),
                                 ("max_queue", max_queue, 0), ("spec_token_budget", spec_token_budget, 1),
                                 ("max_speculative_tokens", max_speculative_tokens, num_speculative_tokens)):
            if not isinstance(value, int) or value < low:
                raise InvalidRequestError(f"{name} must be an integer >= {low}, got {value!r}", name)
        cfg = model.config
        self.model = model
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.k = num_speculative_tokens
        self.k_max = max_speculative_tokens  # the largest per-request num_tokens accepted
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.max_model_len = min(max_model_len or cfg.max_position, cfg.max_position)
        self.spec_token_budget = spec_token_budget
        self.goodput = GoodputModel() if adaptive else None
        self.on_finish = on_finish
        self.counters = SchedulerCounters()
        # Room for the longest request plus the widest verify block written past its end.
        self.cache = model.new_cache(max_batch, self.max_model_len + self.k_max + 1)
        self._device = model.embed_tokens.weight.device
        self._lock = threading.Condition()
        self._waiting: deque[_Sequence] = deque()  # guarded by _lock
        self._cancelled: set[int] = set()  # guarded by _lock
        self._running: list[_Sequence] = []  # scheduler thread only; index = cache row
        self._ids = itertools.count(1)
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- the caller's side -----------------------------------------------------------------

    def k_ceiling(self, running: int) -> int:
        """The budget rule: the most tokens each of `running` sequences may draft per step."""
        return max(0, self.spec_token_budget // max(1, running) - 1)

    def k_cap(self, running: int) -> int:
        """How many tokens each of `running` sequences may draft this step (both rules)."""
        ceiling = min(self.k_ceiling(running), self.k_max)
        return ceiling if self.goodput is None else self.goodput.best_k(max(1, running), ceiling)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def validate(self, request: Request) -> None:
        """Raise InvalidRequestError for a request this scheduler cannot run."""
        vocab = self.model.config.vocab_size
        ids = request.prompt_ids
        if not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab for i in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        if not isinstance(request.max_new_tokens, int) or request.max_new_tokens < 1:
            raise InvalidRequestError("max_tokens must be an integer >= 1", "max_tokens")
        if len(ids) + request.max_new_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(ids)} tokens and {request.max_new_tokens} were asked for", "max_tokens")
        if request.drafter is not None and request.drafter not in LOOKUP_DRAFTERS:
            raise InvalidRequestError(f"speculative.drafter must be one of {', '.join(LOOKUP_DRAFTERS)}",
                                      "speculative.drafter")
        k = request.num_speculative_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= self.k_max):
            raise InvalidRequestError(f"speculative.num_tokens must be an integer in [0, {self.k_max}]",
                                      "speculative.num_tokens")
        if request.logprobs is not None and not 0 <= request.logprobs <= 20:
            raise InvalidRequestError("logprobs must be in [0, 20]", "logprobs")

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        """Queue `request`; deltas are delivered on `loop` (async iteration) or to a plain iterator.

        Raises InvalidRequestError (400), QueueFullError (429) or ShuttingDownError (503).
        """
        self.validate(request)
        handle = RequestHandle(next(self._ids), request, self, loop)
        drafter_name = self.drafter if request.drafter is None else request.drafter
        k = self.k if request.num_speculative_tokens is None else request.num_speculative_tokens
        drafter = make_drafter(drafter_name) if k > 0 else None
        seq = _Sequence(handle, time.perf_counter(), make_generator(request.sampling.seed, self._device), drafter, k,
                        _Output(self.tokenizer, self.model.config.eos_token_ids, list(request.stop),
                                request.max_new_tokens),
                        Stats(prompt_tokens=len(request.prompt_ids)))
        with self._lock:
            if self._stopping:
                raise ShuttingDownError("the server is shutting down")
            if len(self._waiting) >= self.max_queue + max(0, self.max_batch - len(self._running)):
                raise QueueFullError(f"too many requests: {len(self._waiting)} are waiting (limit {self.max_queue})")
            self._waiting.append(seq)
            self._lock.notify()
        return handle

    def cancel(self, request_id: int) -> None:
        with self._lock:
            self._cancelled.add(request_id)
            self._lock.notify()

    def start(self) -> "BatchScheduler":
        self._thread = threading.Thread(target=self._run, name="specdec-scheduler", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; with `drain`, finish the queued and running ones first."""
        with self._lock:
            self._stopping = True
            if not drain:
                self._cancelled.update(s.handle.id for s in list(self._waiting) + self._running)
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the loop (scheduler thread) -----------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._waiting and not self._running and not self._cancelled and not self._stopping:
                    self._lock.wait()
                cancelled, self._cancelled = self._cancelled, set()
                kept = deque(s for s in self._waiting if s.handle.id not in cancelled)
                gone = [s for s in self._waiting if s.handle.id in cancelled]
                self._waiting = kept
                admitted = []
                while self._waiting and len(self._running) + len(admitted) < self.max_batch:
                    admitted.append(self._waiting.popleft())
                if self._stopping and not self._waiting and not self._running and not admitted:
                    for seq in gone:
                        self._finish(seq, "cancelled")
                    return
            for seq in gone:
                self._finish(seq, "cancelled")
            for seq in [s for s in self._running if s.handle.id in cancelled]:
                self._leave(seq, "cancelled")
            try:
                with torch.inference_mode():
                    for seq in admitted:
                        self._prefill(seq)
                    if self._running:
                        self._decode_step()
            except Exception as exc:  # a real fault: fail what is in flight, keep serving
                message = f"{type(exc).__name__}: {exc}"
                for seq in admitted:
                    if seq not in self._running and not seq.handle.finished:
                        self._finish(seq, "error", message)
                for seq in list(self._running):
                    self._leave(seq, "error", message)

    def _prefill(self, seq: _Sequence) -> None:
        row = len(self._running)
        self._running.append(seq)
        seq.admitted = time.perf_counter()
        self.cache.truncate(0, row=row)
        ids = seq.request.prompt_ids
        view = self.cache.rows(row + 1, row)
        tokens = torch.tensor([ids], device=self._device)  # [1, P]
        positions = torch.arange(len(ids), device=self._device)[None]  # [1, P]
        logits, _ = self.model(tokens, positions, view, last_n=1, need_hidden=False)  # [1, 1, vocab]
        seq.stats.target_forwards += 1
        self.counters.prompt_tokens += len(ids)
        first = Engine._pick(logits[0], seq.request.sampling, seq.generator)
        seq.stats.prefill_s = time.perf_counter() - seq.admitted
        if seq.drafter is not None:
            seq.drafter.begin(list(ids), seq.request.sampling, seq.generator)
        if self._emit(seq, [first], logits[0]):  # one token asked for, or EOS at once
            self._leave(seq, seq.out.finish_reason)

    def _decode_step(self) -> None:
        rows = self._running
        n = len(rows)
        cap = self.k_cap(n)
        proposals: list[Proposal] = []
        for seq in rows:
            sampling = seq.request.sampling
            fixed = not sampling.greedy and sampling.seed is not None  # reproducible: k ignores load
            # Never draft past the request's token allowance: those tokens could not be emitted.
            k = min(seq.k if fixed else min(seq.k, cap), seq.request.max_new_tokens - len(seq.out.ids))
            proposed = seq.drafter is not None and k > 0
            proposal = seq.drafter.propose(seq.context, k) if proposed else Proposal([])
            proposals.append(Proposal(proposal.tokens[:k], None if proposal.q is None else proposal.q[:k])
                             if proposed else None)
        blocks = [[seq.out.ids[-1]] + (p.tokens if p else []) for seq, p in zip(rows, proposals)]
        width = max(len(b) for b in blocks)
        # Pad every block at its end (after its real tokens, so causally invisible to them).
        tokens = torch.tensor([b + [b[-1]] * (width - len(b)) for b in blocks], device=self._device)  # [n, T]
        view = self.cache.rows(n)
        base = view.lengths.clone()  # [n] each row's filled length = position of its lead token
        positions = base[:, None] + torch.arange(width, device=self._device)  # [n, T]
        # The output head (a large share of a step's work with a big vocabulary) runs only on the
        # real positions, not on the padding: hidden states of the real tokens, row after row.
        started = time.perf_counter()
        _, hidden = self.model(tokens, positions, view, last_n=0)  # hidden: [n, T, hidden]
        lengths = torch.tensor([len(b) for b in blocks], device=self._device)  # [n]
        real = torch.arange(width, device=self._device)[None] < lengths[:, None]  # [n, T] bool
        logits = self.model.head(hidden[real])  # [sum of block lengths, vocab]
        if self.goodput is not None:
            logits[-1, -1].item()  # wait for the forward (asynchronous on a GPU) before timing it
            self.goodput.observe_step(n * width, time.perf_counter() - started)
        self.counters.steps += 1
        self.counters.step_rows += n
        self.counters.step_tokens += n * width
        base = base.tolist()
        done = []
        offset = 0
        step_drafted = step_accepted = 0
        for r, (seq, proposal, block) in enumerate(zip(rows, proposals, blocks)):
            seq.stats.target_forwards += 1
            draft = proposal.tokens if proposal else []
            row_logits = logits[offset : offset + len(block)]  # [1 + len(draft), vocab]
            offset += len(block)
            verdict = Engine._verify(row_logits, proposal or Proposal([]), draft, seq.request.sampling,
                                     seq.generator)
            # Keep the lead token and the accepted drafts; padding and rejected drafts fall away.
            view.truncate(base[r] + 1 + verdict.num_accepted, row=r)
            Engine._count(seq.stats, len(draft), verdict.num_accepted)
            Engine._count(self.counters.spec, len(draft), verdict.num_accepted)
            step_drafted += len(draft)
            step_accepted += verdict.num_accepted
            if proposal is not None:
                seq.drafter.feedback(verdict.num_accepted)
            if self._emit(seq, verdict.tokens, row_logits):
                done.append(seq)
        if self.goodput is not None:
            self.goodput.observe_drafts(step_drafted, step_accepted)
        for seq in done:
            self._leave(seq, seq.out.finish_reason)

    def _emit(self, seq: _Sequence, tokens: list[int], logits: torch.Tensor) -> bool:
        """Push `tokens` through the request's output filter; send one delta. True when finished.

        logits: [len(tokens), vocab] the target's raw logits that predicted each token.
        """
        now = time.perf_counter()
        if seq.first_token is None:
            seq.first_token = now
        kept = []
        for token in tokens:
            seq.out.push(token)
            kept.append(token)
            if seq.out.finish_reason is not None:
                break
        self.counters.generation_tokens += len(kept)
        logprobs = None
        if seq.request.logprobs is not None:
            logp = torch.log_softmax(logits[: len(kept)].float(), dim=-1)  # [len(kept), vocab]
            chosen = logp[torch.arange(len(kept)), torch.tensor(kept)].tolist()
            top = logp.topk(seq.request.logprobs, dim=-1) if seq.request.logprobs else None
            logprobs = [TokenLogprob(t, lp, list(zip(top.indices[i].tolist(), top.values[i].tolist())) if top else [])
                        for i, (t, lp) in enumerate(zip(kept, chosen))]
        if seq.out.finish_reason is None:
            seq.handle._put(Delta(self._safe_text(seq), kept, logprobs))
            return False
        text = seq.out.text[seq.sent:]  # the final text, cut before any stop string
        self._finish(seq, seq.out.finish_reason, text=text, tokens=kept, logprobs=logprobs)
        return True

    @staticmethod
    def _safe_text(seq: _Sequence) -> str:
        """The new text that can be sent: a tail that might begin a stop string is held back.

        A stop string may arrive split over several tokens; text sent to a stream cannot be taken
        back, so a tail that equals a proper prefix of some stop string waits for the next tokens.
        """
        text = seq.out.text
        hold = 0
        for stop in seq.out.stop:
            for n in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:n]):
                    hold = n
                    break
        delta = text[seq.sent : max(seq.sent, len(text) - hold)]
        seq.sent += len(delta)
        return delta

    def _leave(self, seq: _Sequence, reason: str, error: str | None = None) -> None:
        """Take `seq` out of the batch, keeping the running rows contiguous."""
        row = self._running.index(seq)
        last = len(self._running) - 1
        if row != last:
            self.cache.move_row(last, row)
            self._running[row] = self._running[last]
        self._running.pop()
        self.cache.truncate(0, row=last)
        if not seq.handle.finished and reason in ("cancelled", "error"):
            self._finish(seq, reason, error)

    def _finish(self, seq: _Sequence, reason: str, error: str | None = None, text: str = "",
                tokens: list[int] | None = None, logprobs: list[TokenLogprob] | None = None) -> None:
        if seq.handle.finished:
            return
        seq.handle.finished = True
        now = time.perf_counter()
        if seq.drafter is not None and seq.first_token is not None:
            seq.drafter.end(list(seq.out.ids))
        stats = seq.stats
        stats.new_tokens = len(seq.out.ids)
        stats.wall_s = now - (seq.admitted or now)
        decode_s = stats.wall_s - stats.prefill_s
        stats.tokens_per_s = (stats.new_tokens - 1) / decode_s if decode_s > 0 and stats.new_tokens > 1 else 0.0
        timing = None
        if seq.first_token is not None:
            ttft = seq.first_token - seq.arrival
            tpot = (now - seq.first_token) / (stats.new_tokens - 1) if stats.new_tokens > 1 else None
            timing = Timing(seq.admitted - seq.arrival, ttft, now - seq.arrival, tpot)
        delta = Delta(text, tokens or [], logprobs, reason,
                      Usage(len(seq.request.prompt_ids), len(seq.out.ids)), stats, timing, error)
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
        seq.handle._put(delta)
        if self.on_finish is not None:
            self.on_finish(seq.request, delta)
