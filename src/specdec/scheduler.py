"""Continuous batching with speculative decoding: many requests share each target forward.

The scheduler admits, prefills, evicts, cancels and streams; the decoding itself is the engine's
one core (`Engine.prefill`, `Engine.step`), the same that `Engine.generate` runs for one request.
What a caller submits and gets back (`Request`, `RequestHandle`, `Delta`, `Usage`, `Completion`) is
defined in `request.py`.
The loop (one background thread, `BatchScheduler._run`) repeats:

1. take cancellations and admit waiting requests into free batch rows (up to `max_batch`);
2. prefill admitted prompts, one at a time, each in the cache row after the running ones
   (`Engine.prefill`): while rows are running, at most `prefill_chunk` prompt tokens per loop
   iteration (chunked prefill), so a long prompt that arrives delays the running streams by one
   chunk's forward per step rather than by its whole prefill; with nothing running, whole prompts.
   A prompt whose last chunk is in streams its first token and joins the running rows;
3. one `Engine.step` for every running row together: each row drafts with its own drafter (a
   `spawn()` of one loaded at start) and k, the blocks `[last token] + draft_r` of every row go
   through ONE target forward of shape `[rows, T]` with `T = max_r (1 + len(draft_r))`, each row
   verifies with its own sampling and `torch.Generator`, rolls its cache row back and pushes its
   tokens through its own `Output` (EOS, stop strings, max tokens); finished rows leave the batch.

Why padding is safe. Rows draft different numbers of tokens, so shorter blocks are padded at the
end to T. `Transformer.forward` writes row r's T tokens at slots `[len_r, len_r + T)` at positions
`len_r + j`; under the causal mask (or a tree row's own mask) a real token j only sees slots before
it, never the padding after it, so its logits are exactly those of the unpadded block. The
rollback `truncate(len_r + 1 + accepted_r, row=r)` (`compact` for a tree's path) then drops the
padding with the rejected drafts.

Prefix caching (`prefix_cache_tokens` > 0, see `prefix_cache.py`). A prompt, once prefilled, and
a sequence that leaves the batch finished leave their tokens and a copy of their cache slots in a
store bounded by that many cached tokens (least recently used evicted first; the finished
sequence's entry replaces its prompt's); a new prompt starts from the longest
stored prefix of it, copied into its row (`KVCache.import_row`), and its prefill scores the rest.
Only entries of the request's own `cache_partition` (the server's tenant and cache salt) are
looked up or extended, and `usage.cached_tokens` counts what was copied from them.
When that rest is the last token alone and rows are running, there is no prefill: the prompt joins
the running rows at once, and the next step scores its last token as one more row of its batch
and emits its first token (`Engine.step`), instead of a one-row forward that reads every weight.
Slots keep their positions and no layer drops old slots, so the copy is the state that scoring
the prefix would have left, sliding-window layers included. Rows of a learned drafter that reads
the target's hidden states (EAGLE) score their whole prompt: a copy brings no hidden states. A
draft model's own cache row is kept the same way, within the same partition: a request takes the
row an earlier one of its partition left with the longest common prefix (`DraftPool`), and its
prefix rule reads only the rest.

Drafters. The server loads every drafter a request may name at start (`serving_drafters`: none,
ngram, suffix, and a draft model or an EAGLE head with its lookup-first combinations); a request
picks one by name, never by a path. A draft model gets one KV cache of `max_batch` rows
(`reserve`): each request's drafter holds a row of it while it runs, and the rows of a step draft
together, one draft-model forward per draft position (`propose_batch`). Its rows are taken and
handed back per request rather than moved with the target's rows, so a departure moves nothing
there; their rollback is the draft model's prefix rule (see `drafters/draft_model.py`). EAGLE
heads and lookup-first combinations propose row by row.

Cache layout. One KV cache of `max_batch` rows x `max_model_len + room + 1` slots is allocated
once. Running sequences always occupy the contiguous rows `[0, n)`, and a forward runs on the view
`cache.rows(n)`, so a half-empty batch costs nothing for its empty rows. When a sequence leaves row
i, the sequence in the last row n - 1 is moved into row i (`cache.move_row`, a copy of its filled
slots only), which keeps the running rows contiguous. This trades an occasional copy at a
departure for never gathering or scattering the cache on a step. The one prompt being prefilled
sits in row n, just after them (a departure moves it down a row with the last running one), so
when its last chunk is in it joins the running rows where it is.

Speculation under load (the known failure mode of speculative serving). Verifying draft tokens is
almost free while a forward is bound by reading the weights, which is true for a few tokens per
forward; once the batch alone fills the machine, every drafted token costs as much as a real one
and rejected drafts are pure loss. Each row sizes its drafts by the rule `generate` uses (the
cost-aware draft length of its `policy.DraftController`, unless `draft_length` says otherwise),
and two rules cap that per step over the batch, the smaller cap winning (the request's own k and
its remaining token allowance cap it further):

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

A row drafting from a prediction (OpenAI's `prediction`, `drafters/prediction.py`) guesses long runs
where the prediction holds: its chains may grow to `PREDICTION_K_MAX` (or the request's own k)
under the cost rule, and its load cap is the token budget shared among the prediction rows alone,
never less than the batch's (`row_caps`).

A seeded sampled request ignores the load caps: rejection sampling draws from the request's
generator a number of times that depends on k, so changing k with the load would make the same
seed give different text (its rule prices drafts by fixed priors, never by timings, for the same
reason). Greedy requests are exact at any k, and unseeded ones promise
nothing, so they follow the rules.

Greedy output is the same alone or in a batch: each row's logits depend only on its own tokens
(padding and other rows are masked out), and greedy verification is lossless. In float32 this
holds bit for bit in practice (tested); in bfloat16, matmul shapes change with the batch and a
near-tie may flip.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import builder
from .drafters.base import Drafter, TreeShape
from .engine import Emitted, Engine, Row, Stats
from .errors import Fault, InvalidRequestError, SpecdecError
from .models.transformer import Transformer
from .policy import PREDICTION_K_MAX, GoodputModel, LoadCap, budget_ceiling
from .prefix_cache import PrefixCache
from .request import Delta, Request, RequestHandle, Timing, Usage
from .settings import DEFAULT_NUM_SPECULATIVE_TOKENS, DecodingSettings
from .sources import SourceSplitter
from .step import TokenLogprob
from .tokenizer import Tokenizer

LOOKUP_DRAFTERS = ("none", "ngram", "suffix")
# A server's context when none is asked for: the model's own, cut where every row's caches at full
# length would pass this share of the memory free at start (rows commit memory only as they fill,
# `kv_cache.lazy_zeros`, so the share bounds the worst case, every row full); never below FLOOR.
CONTEXT_MEMORY_SHARE = 0.5
CONTEXT_FLOOR = 2048
CONTEXT_STEP = 1024  # a cut context is rounded down to a multiple of this
DEFAULT_PREFILL_CHUNK = 512  # prompt tokens prefilled per step while rows run (0: whole prompts)
DEFAULT_PREFIX_CACHE_TOKENS = 16384  # the server's prefix store, in cached tokens (0: off)
log = logging.getLogger("specdec.scheduler")


def serving_drafters(name: str = "none", target: Transformer | None = None, tokenizer: Tokenizer | None = None,
                     *, draft_p_min: float | None = None, progress=None,
                     draft_vocab: int | None = None, kv_dtype: str = "auto") -> tuple[dict[str, Drafter | None], str]:
    """`builder.serving_drafters` (the drafters a server loads at start, by name, and the default
    one's name) from the server's keyword options."""
    settings = DecodingSettings(draft_p_min=draft_p_min, draft_vocab=draft_vocab, kv_dtype=kv_dtype)
    return builder.serving_drafters(name, builder.Made(target, tokenizer, settings, progress))


class QueueFullError(SpecdecError):
    """More requests are waiting than the scheduler accepts (HTTP 429)."""

    http_status = 429
    error_type = "rate_limit_error"


class ShuttingDownError(SpecdecError):
    """The scheduler is draining and takes no new requests (HTTP 503)."""

    http_status = 503
    error_type = "service_unavailable"


@dataclass
class _Sequence:
    """A request inside the scheduler (scheduler thread only): its caller's handle, its timing,
    and its `Row` of the decoding core."""

    handle: RequestHandle
    arrival: float
    row: Row
    admitted: float = 0.0
    first_token: float | None = None
    looked_up: tuple | None = None  # (its prefix cache lookup,) when done ahead of its prefill
    cached: int = 0  # prompt tokens copied from the prefix cache at admission
    alone: bool = False  # prefilled by itself: a shared prefill with it failed
    splitter: SourceSplitter | None = None  # with `Request.token_sources`

    def sources(self, emitted: Emitted, sent: str) -> list[tuple[str, str]] | None:
        return None if self.splitter is None else self.splitter.split(emitted.pieces, emitted.sources, sent)

    @property
    def request(self) -> Request:
        return self.handle.request

    @property
    def rid(self) -> object:
        """The id its caller knows it by (the server's access line), else the handle's."""
        return self.request.request_id or self.handle.id


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
    prompt_tokens_cached: int = 0  # prompt tokens copied from the prefix cache, not scored
    prefill_forwards: int = 0  # prefill forwards (one per chunk)


def free_memory(device: torch.device | str) -> int | None:
    """Bytes free for caches on `device` now: the system's MemAvailable on the CPU (Linux), the
    device's free memory on CUDA; None where unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def fitting_context(model_max: int, slot_bytes: int, room: int, free: int | None, reserved: int = 0,
                    share: float = CONTEXT_MEMORY_SHARE) -> int:
    """The default context: `model_max`, or less where `share` of `free` bytes, less
    `reserved` (the prefix store), cannot hold every row's slots (`slot_bytes` a slot over all rows,
    `room` slots past the context) at full length; a multiple of CONTEXT_STEP, at least CONTEXT_FLOOR
    (or model_max, if smaller)."""
    floor = min(model_max, CONTEXT_FLOOR)
    if free is None or slot_bytes <= 0:
        return model_max
    fits = int(free * share - reserved) // slot_bytes - room - 1
    if fits >= model_max:
        return model_max
    return max(floor, fits // CONTEXT_STEP * CONTEXT_STEP)


class BatchScheduler:
    """Continuous batching over one loaded target model (see the module docstring).

    `drafters`: the drafters loaded at start, by the names requests choose them with
    (`serving_drafters`; default: none, ngram, suffix); `drafter`: the default one's name;
    `draft_trees`: a tree shape per drafter name, for drafters that draft trees (the rows of that
    drafter then draft trees; the rest chains).
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer | None,
        *,
        drafter: str = "none",
        drafters: dict[str, Drafter | None] | None = None,
        draft_trees: dict[str, TreeShape] | None = None,
        num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS,
        max_batch: int = 16,
        max_queue: int = 64,
        max_model_len: int | None = None,
        spec_token_budget: int = 32,
        max_speculative_tokens: int = 16,
        adaptive: bool = True,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        prefix_cache_tokens: int = 0,
        on_finish: Callable[[Request, Delta], None] | None = None,
        kv_dtype: str = "auto",
        draft_length: str | None = None,
        memory_share: float = CONTEXT_MEMORY_SHARE,
    ):
        drafters = dict(drafters) if drafters is not None else serving_drafters()[0]
        if drafter not in drafters:
            raise InvalidRequestError(
                f"the default drafter must be one of those loaded at start: {', '.join(drafters)} (got {drafter!r})",
                "drafter")
        draft_trees = dict(draft_trees or {})
        for name, shape in draft_trees.items():
            if drafters.get(name) is None or not drafters[name].needs.trees:
                raise InvalidRequestError(f"drafter {name!r} cannot propose draft trees", "draft_tree")
        for name, value, low in (("num_speculative_tokens", num_speculative_tokens, 1), ("max_batch", max_batch, 1),
                                 ("max_queue", max_queue, 0), ("spec_token_budget", spec_token_budget, 1),
                                 ("max_speculative_tokens", max_speculative_tokens, num_speculative_tokens),
                                 ("prefill_chunk", prefill_chunk, 0), ("prefix_cache_tokens", prefix_cache_tokens, 0)):
            if not isinstance(value, int) or value < low:
                raise InvalidRequestError(f"{name} must be an integer >= {low}, got {value!r}", name)
        self.model = model
        self.tokenizer = tokenizer
        # The decoding core. Each row sizes its drafts by the rule `generate` uses (`draft_length`,
        # None: the default, cost-aware), under the batch's load cap (below).
        self.engine = Engine(model, tokenizer, num_speculative_tokens=num_speculative_tokens, draft_length=draft_length,
                             kv_dtype=kv_dtype)
        self.drafters = drafters
        self.draft_trees = draft_trees
        self.drafter = drafter
        self.k = num_speculative_tokens
        self.k_max = max_speculative_tokens  # the largest per-request num_tokens accepted
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.spec_token_budget = spec_token_budget
        self.goodput = GoodputModel() if adaptive else None
        self.load_cap = LoadCap(spec_token_budget, max_speculative_tokens, self.goodput)
        self.on_finish = on_finish
        self.counters = SchedulerCounters()
        self.prefill_chunk = prefill_chunk  # 0: every prompt in one forward
        self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None
        # Room for the longest request plus the widest verify block written past its end.
        # A row drafting from a prediction may grow its chains to PREDICTION_K_MAX (or its own k).
        room = max([self.k_max, PREDICTION_K_MAX] + [shape.budget for shape in draft_trees.values()])
        self.max_model_len = self._make_caches(max_model_len, room, prefix_cache_tokens, memory_share)
        self._lock = threading.Condition()
        self._waiting: deque[_Sequence] = deque()  # guarded by _lock
        self._cancelled: set[int] = set()  # guarded by _lock
        self._running: list[_Sequence] = []  # scheduler thread only; index = cache row
        self._ready: deque[_Sequence] = deque()  # scheduler thread only: admitted, prefill not begun
        self._prefilling: _Sequence | None = None  # scheduler thread only; cache row len(_running)
        self._abort = False  # shutdown without drain: cancel everything held
        self._ids = itertools.count(1)
        self._stopping = False
        self._thread: threading.Thread | None = None

    def _make_caches(self, asked: int | None, room: int, prefix_cache_tokens: int, share: float) -> int:
        """The target's cache and the model drafters' (one for all rows, drafting batched), sized for
        the context `asked` or, if None, the one `share` of the free memory allows (`fitting_context`);
        returns it."""
        batched = [d for d in self.drafters.values() if d is not None and d.needs.batches]
        # What one slot of every row costs, from one-slot caches (drafters sharing a model share one).
        caches = {id(c): c for c in (d.reserve(self.max_batch, 1) for d in batched) if c is not None}
        slot_bytes = self.engine.new_cache(self.max_batch, 1).slot_bytes + sum(c.slot_bytes for c in caches.values())
        model_max = self.model.config.max_position
        fits = fitting_context(model_max, slot_bytes, room, free_memory(self.engine.device),
                               prefix_cache_tokens * (slot_bytes // self.max_batch), share)
        context = fits if asked is None else min(asked, model_max)
        if context > fits:
            log.warning("a context of %d tokens: %d full rows' KV caches would take %.1f GiB, more than %d%% of "
                        "the memory free now; memory runs out if they all fill", context, self.max_batch,
                        context * slot_bytes / 2**30, round(100 * share))
        self.cache = self.engine.new_cache(self.max_batch, context + room + 1)
        for loaded in batched:
            loaded.reserve(self.max_batch, context + room + 1)
        return context

    # -- the caller's side -----------------------------------------------------------------

    def k_ceiling(self, running: int) -> int:
        """The budget rule: the most tokens each of `running` sequences may draft per step."""
        return self.load_cap.ceiling(running)

    def k_cap(self, running: int) -> int:
        """How many tokens each of `running` sequences may draft this step (both rules)."""
        return self.load_cap.cap(running)

    def row_caps(self, running: int) -> int | list[int]:
        """The load cap of every running row: the batch's (`k_cap`), and for rows drafting from a
        prediction, whose guesses are long runs where the prediction holds, the token budget shared
        among those rows alone (never less than the batch's cap). Every row's block is padded to the
        widest, so their long drafts are paid by the whole batch: the budget bounds that."""
        cap = self.k_cap(running)
        predicting = [seq.row.prediction is not None and seq.row.control is not None for seq in self._running]
        if not any(predicting):
            return cap
        own = max(cap, budget_ceiling(self.spec_token_budget, sum(predicting)))
        return [own if p else cap for p in predicting]

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def validate(self, request: Request) -> None:
        """Raise InvalidRequestError for a request this scheduler cannot run."""
        self.engine.check_prompt_ids(request.prompt_ids)
        if isinstance(request.max_new_tokens, bool) or not isinstance(request.max_new_tokens, int) \
                or request.max_new_tokens < 1:
            raise InvalidRequestError("max_tokens must be an integer >= 1", "max_tokens")
        self.engine.check_length(len(request.prompt_ids), request.max_new_tokens, self.max_model_len)
        if request.drafter is not None and request.drafter not in self.drafters:
            raise InvalidRequestError(
                f"speculative.drafter must name a drafter this server loaded at start: {', '.join(self.drafters)} "
                f"(got {request.drafter!r}; a request never names a file)", "speculative.drafter")
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
        handle = RequestHandle(next(self._ids), request, self.cancel, loop)
        name = self.drafter if request.drafter is None else request.drafter
        k = self.k if request.num_speculative_tokens is None else request.num_speculative_tokens
        loaded = self.drafters[name]
        drafter = loaded.spawn() if loaded is not None and k > 0 else None
        if drafter is not None and drafter.needs.reads and self.prefix_cache is not None:
            drafter.keep_within(request.cache_partition)  # its read of a re-sent conversation too
        # A prediction row's chains may grow to PREDICTION_K_MAX (its own acceptance per kind of
        # guess decides), or to the request's own k where it gives one.
        row = self.engine.new_row(request.prompt_ids, max_new_tokens=request.max_new_tokens,
                                  sampling=request.sampling, stop=list(request.stop), drafter=drafter,
                                  num_speculative_tokens=k, draft_tree=self.draft_trees.get(name),
                                  logprobs=request.logprobs, grammar=request.grammar, prediction=request.prediction,
                                  prediction_k_max=request.num_speculative_tokens or PREDICTION_K_MAX)
        seq = _Sequence(handle, time.perf_counter(), row, splitter=SourceSplitter() if request.token_sources else None)
        with self._lock:
            if self._stopping:
                raise ShuttingDownError("the server is shutting down")
            if len(self._waiting) >= self.max_queue + max(0, self.max_batch - self._occupied()):
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
            self._abort = not drain
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the loop (scheduler thread) -----------------------------------------------------------

    def _run(self) -> None:
        while self.run_once():
            pass

    def run_once(self, wait: bool = True) -> bool:
        """One iteration of the loop (the scheduler thread's body; tests drive it by hand, without
        `start`): take cancellations, admit, prefill (a chunk), one step. With `wait`, first wait
        for work. False once stopping with nothing left."""
        with self._lock:
            while wait and not (self._waiting or self._running or self._ready or self._prefilling
                                or self._cancelled or self._stopping):
                self._lock.wait()
            cancelled, self._cancelled = self._cancelled, set()
            if self._abort:  # shutdown(drain=False): everything held is cancelled
                held = list(self._waiting) + list(self._ready) + self._running + [self._prefilling]
                cancelled.update(s.handle.id for s in held if s is not None)
            gone = [s for s in self._waiting if s.handle.id in cancelled]
            self._waiting = deque(s for s in self._waiting if s.handle.id not in cancelled)
            gone += [s for s in self._ready if s.handle.id in cancelled]
            self._ready = deque(s for s in self._ready if s.handle.id not in cancelled)
            while self._waiting and self._occupied() < self.max_batch:
                self._ready.append(self._waiting.popleft())
            waiting = bool(self._waiting)
        for seq in gone:
            self._finish(seq, "cancelled")
        if self._prefilling is not None and self._prefilling.handle.id in cancelled:
            self._drop_prefilling("cancelled")
        for seq in [s for s in self._running if s.handle.id in cancelled]:
            self._leave(seq, "cancelled")
        if self._stopping and not (waiting or self._ready or self._prefilling or self._running):
            return False
        try:
            with torch.inference_mode():
                self._prefill_some()
                if self._running:
                    self._decode_step()
        except Exception as exc:  # noqa: BLE001 (a fault of the loop itself, not of one row: a bug)
            held = ([self._prefilling] if self._prefilling is not None else []) + list(self._running)
            log.error("the scheduler loop failed; failing requests %s",
                      [s.rid for s in held], exc_info=exc)
            if self._prefilling is not None:
                seq = self._prefilling
                self._drop_prefilling("error", Fault.of(RuntimeError(), seq.rid))
            for seq in list(self._running):
                self._leave(seq, "error", Fault.of(RuntimeError(), seq.rid))
        return True

    @staticmethod
    def _fault(seq: _Sequence, exc: BaseException, where: str) -> Fault:
        """What `seq` is told of `exc`, raised by its own work (`errors.Fault`); logged in full,
        under the id its caller knows it by."""
        rid = seq.rid
        fault = Fault.of(exc, rid)
        if fault.status >= 500:
            log.error("request %s failed in %s", rid, where, exc_info=exc)
        else:
            log.info("request %s refused in %s: %s", rid, where, fault.message)
        return fault

    def _occupied(self) -> int:
        """Batch rows taken or promised: running, being prefilled, admitted and waiting for it."""
        return len(self._running) + len(self._ready) + (self._prefilling is not None)

    def _prefill_some(self) -> None:
        """Prefill admitted prompts (step 2 of the loop): with rows running, at most `prefill_chunk`
        prompt tokens this iteration, so they wait for one chunk at most; with none running (or
        chunking off), every admitted prompt whole. One prompt is prefilled at a time, in cache
        row len(_running); when its last chunk is in, it emits its first token and joins the
        running rows where it already sits. Except: admitted prompts that the prefix cache holds
        all but the last token of go in together, one forward for all (`_prefill_cached`)."""
        budget = self.prefill_chunk if self.prefill_chunk and self._running else None
        while self._prefilling is not None or self._ready:
            if self._prefilling is None:
                head = self._ready[0]
                found = head.looked_up[0] if head.looked_up is not None else self._lookup(head)
                head.looked_up = None
                if self._running and not head.alone and self._last_only(head, found):
                    self._join_cached(found)
                    continue
                if len(self._ready) > 1 and not head.alone and self._last_only(head, found):
                    self._prefill_cached(found, budget)
                    if budget is not None:
                        return
                    continue
                self._begin_prefill(self._ready.popleft(), found)
            seq = self._prefilling
            r = len(self._running)
            view = self.cache.rows(r + 1, r)
            done = view.length()
            try:
                emitted = self.engine.prefill(seq.row, view, None if budget is None else done + budget)
            except Exception as exc:  # noqa: BLE001 (this prompt's fault alone: it leaves, the rest go on)
                self._drop_prefilling("error", self._fault(seq, exc, "its prefill"))
                if budget is not None:
                    return
                continue
            self.counters.prefill_forwards += 1
            if emitted is not None:
                if self.prefix_cache is not None:
                    # The prompt is stored as soon as it is in, not only when its request
                    # finishes: requests that arrive together with the same system prompt share
                    # it (the next prompt's prefill begins after this one's).
                    held = min(view.length(), len(seq.row.prompt))
                    self._store(seq, seq.row.prompt[:held], r)
                self._prefilling = None
                self._running.append(seq)
                if self._emit(seq, emitted):  # one token asked for, or EOS at once
                    self._leave(seq, seq.row.out.finish_reason)
            if budget is not None:
                budget -= view.length() - done if emitted is None else len(seq.row.prompt) - done
                if budget <= 0:
                    return

    def _lookup(self, seq: _Sequence):
        """The prefix cache's stored slots for `seq`'s prompt and how many to copy, or None. A
        learned drafter reads the target's hidden state of every prompt token, which a copied prefix
        does not bring: its rows score the whole prompt."""
        drafter = seq.row.drafter
        partition = seq.request.cache_partition
        if self.prefix_cache is not None and partition is not None and (drafter is None or drafter.needs.observes is None):
            return self.prefix_cache.lookup(seq.row.prompt, partition)
        return None

    def _store(self, seq: _Sequence, tokens: list[int], row: int) -> None:
        """Leave `tokens` (cache row `row`'s first slots) in the prefix cache, in `seq`'s partition."""
        if seq.request.cache_partition is not None:
            self.prefix_cache.insert(tokens, self.cache, row, seq.request.cache_partition)

    @staticmethod
    def _last_only(seq: _Sequence, found) -> bool:
        """Whether the prefix cache holds all of `seq`'s prompt but the last token (`found`)."""
        return found is not None and found[1] == len(seq.row.prompt) - 1

    def _begin_prefill(self, seq: _Sequence, found) -> None:
        """`seq` takes the cache row after the running ones; a cached prefix of its prompt
        (`found`, from `_lookup`) is copied in, so that only the rest is scored."""
        r = len(self._running)
        self._prefilling = seq
        self._admit(seq, r, found)

    def _admit(self, seq: _Sequence, r: int, found) -> None:
        seq.admitted = seq.row.started = time.perf_counter()
        self.cache.truncate(0, row=r)
        self.counters.prompt_tokens += len(seq.request.prompt_ids)
        if found is not None:
            self.cache.import_row(found[0], r, found[1])
            self.counters.prompt_tokens_cached += found[1]
            seq.cached = found[1]

    def _prefill_cached(self, found, budget: int | None) -> None:
        """Admitted prompts whose every token but the last is in the prefix cache (the first's
        lookup: `found`), in one forward (`Engine.prefill_last`): requests that arrive together
        share the weights' read as the running rows do. Takes the ready prompts in order while
        they are such hits, up to `budget` of them (None: no limit); they join the running rows."""
        r = len(self._running)
        batch = []
        for seq, seq_found in self._cached_hits(found, budget):
            self._admit(seq, r + len(batch), seq_found)
            batch.append(seq)
        try:
            emitted = self.engine.prefill_last([seq.row for seq in batch], self.cache.rows(r + len(batch), r))
        except Exception:  # noqa: BLE001 (narrowed down: each prompt again by itself, its fault its own)
            for j, seq in enumerate(batch):
                self.cache.truncate(0, row=r + j)
                # Admitted again by itself, and counted there: take back what `_admit` counted here.
                self.counters.prompt_tokens -= len(seq.request.prompt_ids)
                self.counters.prompt_tokens_cached -= seq.cached
                seq.cached, seq.alone = 0, True
            self._ready.extendleft(reversed(batch))
            return
        self.counters.prefill_forwards += 1
        self._running.extend(batch)
        done = [seq for seq, e in zip(batch, emitted) if self._emit(seq, e)]
        for seq in done:
            self._leave(seq, seq.row.out.finish_reason)

    def _join_cached(self, found) -> None:
        """Admitted prompts whose every token but the last is in the prefix cache (the first's
        lookup: `found`), while rows run: each is copied into the row after the running ones and
        joins them at once; the next step scores its last token next to their blocks and emits its
        first token (`Engine.step`), so it costs the step one more row rather than a forward of
        its own. Takes the ready prompts in order while they are such hits."""
        for seq, seq_found in self._cached_hits(found, None):
            self._admit(seq, len(self._running), seq_found)
            self._running.append(seq)

    def _cached_hits(self, found, budget: int | None):
        """Pop the ready prompts in order while each is a hit of every token but its last (the
        first's lookup: `found`), up to `budget` (None: no limit): yields (prompt, its lookup).
        The caller admits each before the next is looked up. A next prompt that is not such a hit
        stays ready and keeps its lookup for its own prefill (a lookup counts in the store's
        statistics and moves its entry to the front)."""
        taken = 0
        while True:
            seq = self._ready.popleft()
            yield seq, found
            taken += 1
            if not self._ready or (budget is not None and taken >= budget):
                return
            nxt = self._ready[0]
            nxt.looked_up = (found := self._lookup(nxt),)
            if not self._last_only(nxt, found):
                return
            nxt.looked_up = None

    def _drop_prefilling(self, reason: str, error: Fault | None = None) -> None:
        seq, self._prefilling = self._prefilling, None
        self.cache.truncate(0, row=len(self._running))
        self._finish(seq, reason, error)

    def _decode_step(self) -> None:
        """One step of the core over every running row (cache rows [0, n))."""
        n = len(self._running)
        report = self.engine.step([seq.row for seq in self._running], self.cache.rows(n), self.row_caps(n))
        if self.goodput is not None:
            self.goodput.observe_step(n * report.width, report.forward_s)
            self.goodput.observe_drafts(report.drafted, report.accepted)
        self.counters.steps += 1
        self.counters.step_rows += n
        self.counters.step_tokens += n * report.width
        done, failed = [], []
        for seq, emitted in zip(self._running, report.emitted):
            if emitted.error is not None:
                failed.append((seq, self._fault(seq, emitted.error, "a decoding step")))
                continue
            self.counters.spec.count(emitted.drafted, emitted.accepted, emitted.depth)
            if self._emit(seq, emitted):
                done.append(seq)
        for seq, fault in failed:
            self._leave(seq, "error", fault)
        for seq in done:
            self._leave(seq, seq.row.out.finish_reason)

    def _emit(self, seq: _Sequence, emitted: Emitted) -> bool:
        """Send what the core pushed through the request's `Output` as one delta. True when finished."""
        if seq.first_token is None:
            seq.first_token = time.perf_counter()
        kept, logprobs = emitted.tokens, emitted.logprobs
        self.counters.generation_tokens += len(kept)
        out = seq.row.out
        text = out.take_text()
        if not out.finished:
            seq.handle._put(Delta(text, kept, logprobs, sources=seq.sources(emitted, text)))
            return False
        self._finish(seq, out.finish_reason, text=text, tokens=kept, logprobs=logprobs,
                     sources=seq.sources(emitted, text))
        return True

    def _leave(self, seq: _Sequence, reason: str, error: Fault | None = None) -> None:
        """Take `seq` out of the batch, keeping the running rows contiguous."""
        row = self._running.index(seq)
        if self.prefix_cache is not None and reason in ("stop", "length"):
            # The committed tokens: the cache may also hold accepted drafts past a stop.
            held = min(self.cache.length(row), len(seq.row.context))
            self._store(seq, seq.row.context[:held], row)
        last = len(self._running) - 1
        if row != last:
            self.cache.move_row(last, row)
            self._running[row] = self._running[last]
        self._running.pop()
        if self._prefilling is not None:  # its row follows the running ones: one row down
            self.cache.move_row(last + 1, last)
            self.cache.truncate(0, row=last + 1)
        else:
            self.cache.truncate(0, row=last)
        if not seq.handle.finished and reason in ("cancelled", "error"):
            self._finish(seq, reason, error)

    def _finish(self, seq: _Sequence, reason: str, error: Fault | None = None, text: str = "",
                tokens: list[int] | None = None, logprobs: list[TokenLogprob] | None = None,
                sources: list[tuple[str, str]] | None = None) -> None:
        if seq.handle.finished:
            return
        seq.handle.finished = True
        now = time.perf_counter()
        row = seq.row
        self.engine.finish(row, now)
        stats = row.stats
        timing = None
        if seq.first_token is not None:
            ttft = seq.first_token - seq.arrival
            tpot = (now - seq.first_token) / (stats.new_tokens - 1) if stats.new_tokens > 1 else None
            timing = Timing(seq.admitted - seq.arrival, ttft, now - seq.arrival, tpot)
        predicted = None if row.prediction is None else (row.prediction.ids, list(row.out.ids))
        delta = Delta(text, tokens or [], logprobs, reason,
                      Usage(len(seq.request.prompt_ids), len(row.out.ids), seq.cached, predicted), stats, timing, error,
                      sources)
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
        seq.handle._put(delta)
        if self.on_finish is not None:
            self.on_finish(seq.request, delta)
