"""The one decoding core: `Engine.step` over a batch of rows, for one request and for many.

A `Row` is one request's whole state: its tokens, output filter (`Output`: EOS, stop strings, max
tokens), sampling parameters and `torch.Generator`, drafter, draft-length rule (`policy`), tree
shape, statistics, and (by its place in the batch) its row of the KV cache. One step over rows
r = 0 .. n - 1, which sit in cache rows 0 .. n - 1:

    for each row: draft length (its rule, capped by the batch's load cap) -> its drafter proposes
                  a chain (a path-shaped `TokenTree`) or a tree
    ONE target forward over the blocks [lead token] + drafts of every row, padded at the end to
                  the widest (padding is causally invisible to the real tokens; a tree row sees
                  only each node's ancestors through its own mask)
    for each row: verify with its own sampling and RNG (greedy, screened greedy, or the rejection
                  rule; chains and trees) -> roll its cache row back to the accepted path
                  (`truncate` / `compact`) -> the drafter hears back (`observe`, `feedback`) ->
                  the emitted tokens go through its `Output`

Plain decoding is the same step with an empty proposal, so the two cannot drift apart; a chain is a
token tree that is a path. `Engine.generate` is a batch of one through this step; the server's
`BatchScheduler` only admits, prefills, evicts and streams, calling the same `prefill` and `step`.
Every emitted token goes through `Output.push`, one token at a time: a stop inside an accepted run
ends the output exactly where plain decoding would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from . import builder, policy
from .drafters.base import Drafter, TreeShape
from .drafters.prediction import Prediction, PredictionDrafter, PredictionUsage, prediction_usage, with_prediction
from .errors import InvalidRequestError, SpecdecError
from .models.kv_cache import KVCache, resolve_kv_dtype
from .models.transformer import Transformer
from .settings import DecodingSettings
from .sampling import SamplingParams, adjust_logits, greedy_tokens, make_generator, process_logits, sample
from .tokenizer import Detokenizer, Tokenizer
from . import step as step_phases
from .step import TARGET, Emitted, Step, StepReport, log_probs
from .verify import TokenTree, TreeVerdict, first_proven_rejection, verify_greedy, verify_sampling, \
    verify_tree_greedy, verify_tree_sampling

@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0
    wall_s: float = 0.0
    prefill_s: float = 0.0
    tokens_per_s: float = 0.0
    drafts: int = 0  # verify steps that had at least one draft token
    draft_tokens: int = 0  # drafted tokens scored by the target (all nodes of a tree)
    accepted_tokens: int = 0
    # Per draft position (depth i + 1 in a tree): steps that accepted a token there, and steps whose
    # draft reached it (with one or more candidates), so their ratio is the acceptance rate at
    # that position given the draft got there, for chains and trees alike.
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """1 + accepted / drafts, as vLLM reports it (tokens per verify step that drafted)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    def count(self, drafted: int, accepted: int, depth: int | None = None) -> None:
        """One verify step: `drafted` tokens scored, reaching `depth` positions (a chain's depth is
        its length, the default; a tree's its deepest level), `accepted` of them on the path."""
        if not drafted:
            return
        depth = drafted if depth is None else depth
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        while len(self.drafted_per_position) < depth:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for i in range(depth):
            self.drafted_per_position[i] += 1
            if i < accepted:
                self.accepted_per_position[i] += 1

    def finish(self, new_tokens: int, wall_s: float) -> None:
        """The request is over: its token count, its time from admission, and tokens/s of the
        decoding phase (the first token comes from the prefill)."""
        self.new_tokens = new_tokens
        self.wall_s = wall_s
        decode_s = wall_s - self.prefill_s
        self.tokens_per_s = (new_tokens - 1) / decode_s if decode_s > 0 and new_tokens > 1 else 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["acceptance_rate"] = self.acceptance_rate
        d["mean_accepted_length"] = self.mean_accepted_length
        return d


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    stats: Stats
    steps: list[Step]
    prediction: PredictionUsage | None = None  # with a prediction: its accepted and rejected tokens


class Output:
    """A request's emitted tokens, applying EOS, stop strings and the token limit one token at a
    time; the one path every token leaves the core by."""

    def __init__(self, tokenizer, eos_ids, stop, max_new_tokens):
        self.detok = Detokenizer(tokenizer)
        self.eos_ids = set(eos_ids)
        self.stop = [s for s in (stop or []) if s]
        self.max_new = max_new_tokens
        self.ids: list[int] = []
        self.finish_reason: str | None = None
        self.text_end: int | None = None  # cut point of the text when a stop string matched
        self.sent = 0  # characters already handed out by `take_text`

    def push(self, token: int) -> str:
        """Add one token; returns the text it adds (cut before a stop string it completes)."""
        self.ids.append(token)
        if token in self.eos_ids:
            self.finish_reason = "stop"
            return ""
        delta = self.detok.push(token)
        if self.stop and delta:
            text = self.detok.text
            window = len(delta) + max(len(s) for s in self.stop)
            hits = [i for s in self.stop if (i := text.find(s, max(0, len(text) - window))) >= 0]
            if hits:
                self.text_end = min(hits)
                self.finish_reason = "stop"
                emitted_before = len(text) - len(delta)
                return text[emitted_before : max(emitted_before, self.text_end)]
        if len(self.ids) >= self.max_new:
            self.finish_reason = "length"
        return delta

    @property
    def text(self) -> str:
        text = self.detok.text
        return text if self.text_end is None else text[: self.text_end]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.max_new - len(self.ids)

    def take_text(self) -> str:
        """The new text a stream can be sent now: everything once finished; before that, a tail
        that might begin a stop string is held back (sent text cannot be taken back, and a stop
        string may arrive split over several tokens)."""
        text = self.text
        hold = 0
        if not self.finished:
            for stop in self.stop:
                for n in range(min(len(stop) - 1, len(text)), hold, -1):
                    if text.endswith(stop[:n]):
                        hold = n
                        break
        delta = text[self.sent : max(self.sent, len(text) - hold)]
        self.sent += len(delta)
        return delta


@dataclass
class Row:
    """One request inside the core (see the module docstring). Made by `Engine.new_row`; its cache
    row is its index in the list of rows a step gets."""

    prompt: list[int]
    out: Output
    sampling: SamplingParams
    generator: torch.Generator | None
    drafter: Drafter | None
    control: policy.DraftController | None  # its drafting decisions (None without a drafter)
    tree: TreeShape | None
    stats: Stats
    screen: bool  # greedy on the raw head: chains screened (`Engine._screen`), tokens by `head_argmax`
    logprobs: int | None  # None: no log-probs; n >= 0: each emitted token's and n top alternatives'
    steps: list[Step] | None  # per-step record (`Generation.steps`), or None
    started: float = 0.0
    begun: bool = False  # prefilled: the drafter has had `begin`
    # A learned drafter's row: the prompt's final hidden states from the prefill's chunks so far.
    prompt_hidden: list[torch.Tensor] = field(default_factory=list)
    grammar: object = None  # a `structured.GrammarState` at the committed tokens, or None
    prediction: Prediction | None = None  # the request's predicted output, or None

    @property
    def prediction_usage(self) -> PredictionUsage | None:
        """The prediction's accepted and rejected tokens (`drafters.prediction.prediction_usage`)."""
        return None if self.prediction is None else prediction_usage(self.prediction.ids, self.out.ids)

    @property
    def context(self) -> list[int]:
        return self.prompt + self.out.ids

    @property
    def finished(self) -> bool:
        return self.out.finished


_DEFAULT = object()


class Engine:
    """Speculative decoding over one loaded target: `generate` for one request, `prefill` and
    `step` for a batch of rows (the server's scheduler).

    A drafter proposes a chain of up to `num_speculative_tokens` tokens per step: `draft_length`
    "cost" (the default for chains) picks, per kind of proposal, the length with the best expected
    speedup for the acceptance measured so far and the price of a step (`policy`: `verify_overhead`,
    `verify_cost`, and the drafter's measured cost per token); "fixed" always asks for k;
    "adaptive" moves k by the +2/-1 rule. Or, with `draft_tree` (a `TreeShape` or its
    `DEPTHxTOPKxBUDGET` string), a token tree from its `propose_tree`: several candidates per
    position, all scored in the same single target pass.
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer | None,
        *,
        drafter: Drafter | None = None,
        settings: DecodingSettings | None = None,
        **options,
    ):
        """`settings` (from `Engine.build`, resolved there), or `options`: `DecodingSettings`'
        decoding keywords (num_speculative_tokens, draft_length, draft_tree, verify_cost,
        verify_overhead, screen_verify, kv_dtype), validated here, once; None = the default."""
        if settings is None:
            settings = DecodingSettings(**{key: value for key, value in options.items() if value is not None})
        elif options:
            raise TypeError(f"Engine: give settings or keywords, not both ({', '.join(options)})")
        tree = settings.draft_tree
        if tree is not None and (drafter is None or not drafter.needs.trees):
            raise builder.no_trees(drafter.name if drafter is not None else "none")
        self.settings = settings
        self.model = model
        self.tokenizer = tokenizer
        # The element type of the target caches this engine's callers make (`new_cache`).
        p = model.embed_tokens.weight
        self.kv_dtype = resolve_kv_dtype(settings.kv_dtype, p.dtype, p.device)
        self.drafter = drafter
        self.k = settings.num_speculative_tokens
        self.draft_length = settings.draft_length
        self.draft_tree: TreeShape | None = tree
        self.verify_cost, self.verify_overhead = settings.verify_cost, settings.verify_overhead
        # Greedy chains on a target whose head can score chosen columns exactly (int8 on the CPU)
        # are verified with the head's full product only up to the first certain rejection.
        self.screen_verify = settings.screen_verify and self._head_columns_exact()
        self.draft_costs: dict[str, policy.DraftCost] = {}  # drafter name -> its measured price
        self._grammar_tokens = None  # the tokenizer as the grammar engine sees it, built on first use

    @classmethod
    def load(
        cls,
        target: str = "default",
        *,
        drafter: str | None = None,
        num_speculative_tokens: int | None = None,
        device: str | None = None,
        dtype: str | None = None,
        draft_length: str | None = None,
        progress=None,
        draft_p_min: float | None = None,
        quantize: str | None = None,
        draft_tree: TreeShape | str | None = None,
        verify_cost: float | None = None,
        verify_overhead: float | None = None,
        screen_verify: bool | None = None,
        draft_quantize: str | None = None,
        draft_vocab: int | None = None,
        tensor_parallel: int | None = None,
        kv_dtype: str | None = None,
    ) -> "Engine":
        """Load a target (and drafter) ready to generate: the keywords are `DecodingSettings`' fields
        (each default and its reason is written there; None = that default), built by
        `Engine.build`. `progress(...)` hears the loads' progress.

        `drafter="auto"` (the default) is prompt lookup, or for a preset target with a paired draft
        model, lookup first and that draft model where lookup finds nothing, with the pair's
        reduced vocabulary unless `draft_vocab` is given (`builder.resolve`). `draft_tree` (e.g.
        "5x4x24") drafts token trees with a drafter that proposes them (eagle, ngram).
        `quantize="auto"` (the default) is, on the CPU for a source that is already quantised,
        int4 where most of its layer weights are 4-bit and int8 otherwise; plain and speculative
        decoding are compared on the same target. `tensor_parallel` N > 1 splits the target over N
        processes (`models/tensor_parallel.py`; not with an EAGLE head, which reads the target's
        internals).
        """
        options = dict(drafter=drafter, num_speculative_tokens=num_speculative_tokens, device=device, dtype=dtype,
                       draft_length=draft_length, draft_p_min=draft_p_min, quantize=quantize, draft_tree=draft_tree,
                       verify_cost=verify_cost, verify_overhead=verify_overhead, screen_verify=screen_verify,
                       draft_quantize=draft_quantize, draft_vocab=draft_vocab, tensor_parallel=tensor_parallel,
                       kv_dtype=kv_dtype)
        # Every option validated once, before the slow target load.
        settings = DecodingSettings(target=target, **{key: v for key, v in options.items() if v is not None})
        return cls.build(settings, progress)

    @classmethod
    def build(cls, settings: DecodingSettings, progress=None) -> "Engine":
        """The engine `settings` describe: resolved and loaded by `builder.build`."""
        built = builder.build(settings, progress)
        return cls(built.model, built.tokenizer, drafter=built.drafter, settings=built.settings)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """A target cache of `batch` rows x `capacity` slots, of this engine's `kv_dtype`."""
        return self.model.new_cache(batch, capacity, dtype=self.kv_dtype)

    # -- one request ------------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | None = None,
        prompt_ids: list[int] | None = None,
        max_new_tokens: int = 64,
        sampling: SamplingParams | None = None,
        stop: str | list[str] | None = None,
        speculative: bool = True,
        on_text=None,
        structured=None,
        prediction: str | None = None,
    ) -> Generation:
        """Generate a continuation: a batch of one row through `prefill` and `step`.
        `on_text(delta)` receives text as it is produced (streaming). `structured`: a
        `StructuredSpec` or a one-key dict ({"json": schema}, {"regex": ...}, {"grammar": ...},
        {"choice": [...]}, {"json_object": True}) the output must match. `prediction`: the text
        the output is expected to be (mostly), drafted from where the output follows it
        (`drafters/prediction.py`); `Generation.prediction` counts its accepted and rejected tokens."""
        ids = self.encode_prompt(prompt, prompt_ids)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InvalidRequestError("max_new_tokens must be >= 1", "max_tokens")
        self.check_length(len(ids), max_new_tokens)
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        emit = on_text or (lambda delta: None)
        start = time.perf_counter()
        grammar = self.compile_structured(structured) if structured is not None else None
        predicted = None if prediction is None else Prediction.of(prediction, self.tokenizer)
        row = self.new_row(ids, max_new_tokens=max_new_tokens, sampling=sampling, stop=stop,
                           drafter=self.drafter if speculative else None, record_steps=True, grammar=grammar,
                           num_speculative_tokens=None if speculative else 0, prediction=predicted)
        row.started = start
        cache = self.new_cache(1, len(ids) + max_new_tokens + self.room(row) + 1)
        emit(self.prefill(row, cache).text)
        while not row.finished:
            emitted = self.step([row], cache).emitted[0]
            if emitted.error is not None:
                self.finish(row)
                raise emitted.error
            emit(emitted.text)
        self.finish(row)
        return Generation(row.out.ids, row.out.text, row.out.finish_reason, row.stats, row.steps,
                          row.prediction_usage)

    # -- rows -------------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | None, prompt_ids: list[int] | None) -> list[int]:
        """Exactly one of a text prompt (encoded) or token ids (checked)."""
        if (prompt is None) == (prompt_ids is None):
            raise InvalidRequestError("give exactly one of prompt or prompt_ids", "prompt")
        if prompt is not None:
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass prompt_ids", "prompt")
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise InvalidRequestError("the prompt is empty", "prompt")
            return ids
        ids = list(prompt_ids)
        self.check_prompt_ids(ids)
        return ids

    def check_prompt_ids(self, ids: list[int]) -> None:
        """Token-id validation, the one place it happens: non-empty, integers in the vocabulary."""
        vocab = self.model.config.vocab_size
        if not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab for i in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", "prompt")

    def check_length(self, prompt_tokens: int, max_new_tokens: int, limit: int | None = None) -> None:
        limit = self.model.config.max_position if limit is None else limit
        if prompt_tokens + max_new_tokens > limit:
            raise InvalidRequestError(
                f"this model's maximum context length is {limit} tokens; the prompt has {prompt_tokens} "
                f"tokens and {max_new_tokens} were asked for", "max_tokens")

    def new_row(
        self,
        prompt_ids: list[int],
        *,
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        stop: list[str] | tuple[str, ...] = (),
        drafter: Drafter | None | object = _DEFAULT,
        num_speculative_tokens: int | None = None,
        draft_tree: TreeShape | None | object = _DEFAULT,
        draft_length: str | None = None,
        logprobs: int | None = None,
        record_steps: bool = False,
        grammar=None,
        prediction: Prediction | None = None,
        prediction_k_max: int = policy.PREDICTION_K_MAX,
    ) -> Row:
        """A row for one request; drafter, k, tree and draft length default to the engine's.

        The drafter object is the row's own (per-request state): a server passes a `spawn()` of a
        drafter loaded at start. k = 0 means no drafting. With a `prediction`, the row drafts from
        it first and with its drafter where it offers nothing (`prediction.with_prediction`), in
        chains of up to `prediction_k_max` tokens under the cost rule.
        """
        sampling = sampling or SamplingParams()
        self.check_sampling(sampling)
        drafter = self.drafter if drafter is _DEFAULT else drafter
        tree = self.draft_tree if draft_tree is _DEFAULT else draft_tree
        k = self.k if num_speculative_tokens is None else num_speculative_tokens
        predicted = None  # the row's PredictionDrafter
        if k == 0:
            drafter = None
        elif prediction is not None and self.tokenizer is not None:
            predicted = PredictionDrafter(prediction, self.tokenizer)
            drafter = with_prediction(predicted, drafter)
        if drafter is None or not drafter.needs.trees:
            tree = None
        fixed_k = not sampling.greedy and sampling.seed is not None
        # Screening judges the raw head's columns: not for logits that are adjusted afterwards.
        screen = (self.screen_verify and sampling.greedy and logprobs is None and not sampling.adjusts_logits
                  and grammar is None)
        control = None
        if drafter is not None:
            cost = None
            read = policy.DEFAULT_READ_COSTS[policy.hardware_kind(self.model)]
            if drafter.needs.model:
                measured = drafter.draft_cost
                cost = self.draft_costs.setdefault(
                    drafter.name, policy.DraftCost(read_prior=read) if measured is None
                    else policy.DraftCost(prior=measured, read_prior=read))
            length = "fixed" if tree is not None else (draft_length or self.draft_length)
            # A seeded sampled row prices its drafts and reads by the priors only: its k must depend
            # on its verdicts alone, or the same seed would give different text on another machine.
            rule_cost = policy.DraftCost(read_prior=read) if cost is not None and fixed_k else cost
            rule = policy.row_rule(length, k, model=self.model, verify_cost=self.verify_cost,
                                   verify_overhead=self.verify_overhead, screened=screen, draft_cost=rule_cost,
                                   k_max=prediction_k_max if prediction is not None else None)
            control = policy.DraftController(drafter, rule, cost, fixed_k=fixed_k, tree=tree, prediction=predicted)
        eos = () if sampling.ignore_eos else self.model.config.eos_token_ids
        return Row(list(prompt_ids), Output(self.tokenizer, eos, list(stop), max_new_tokens),
                   sampling, make_generator(sampling.seed, self.device), drafter, control, tree,
                   Stats(prompt_tokens=len(prompt_ids)), screen, logprobs, [] if record_steps else None,
                   grammar=grammar, prediction=prediction)

    def compile_structured(self, structured):
        """A fresh `structured.GrammarState` for a request's constraint (a spec or its dict form);
        an InvalidRequestError for a bad one, or when the grammar engine is not installed."""
        from . import structured as st

        # A tool call's constraint (`tools.ToolConstraint`) compiles itself on the same tokens.
        spec = structured if hasattr(structured, "compile") else st.StructuredSpec.of(structured)
        try:
            import llguidance  # noqa: F401
        except ImportError:
            raise InvalidRequestError("structured output needs the grammar engine: pip install "
                                      "'specdec[structured]' (llguidance)", spec.param) from None
        if self._grammar_tokens is None:
            if self.tokenizer is None:
                raise InvalidRequestError("structured output needs the model's tokenizer", spec.param)
            try:
                backend = self.tokenizer.backend_json()
            except InvalidRequestError as exc:
                raise InvalidRequestError(str(exc), spec.param) from None
            self._grammar_tokens = st.GrammarTokens(backend, self.model.config.vocab_size,
                                                    self.model.config.eos_token_ids, spec.param)
        if hasattr(spec, "compile"):
            return spec.compile(self._grammar_tokens)
        return st.compile_spec(spec, self._grammar_tokens)

    def check_sampling(self, sampling: SamplingParams) -> None:
        """What `SamplingParams` cannot check alone: the model's vocabulary."""
        vocab = self.model.config.vocab_size
        if any(token >= vocab for token, _ in sampling.logit_bias):
            raise InvalidRequestError(f"logit_bias: token ids must be in [0, {vocab})", "logit_bias")

    @staticmethod
    def room(row: Row) -> int:
        """Cache slots a step may write past the row's committed tokens, lead token excluded."""
        return 0 if row.control is None else row.control.room

    def finish(self, row: Row, now: float | None = None) -> None:
        """The row leaves: its drafter hears the output, its statistics are closed."""
        if row.drafter is not None and row.begun:
            row.drafter.end(list(row.out.ids))
        row.begun = False
        now = now or time.perf_counter()
        row.stats.finish(len(row.out.ids), now - (row.started or now))

    # -- the core: prefill and step -----------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, row: Row, cache: KVCache, upto: int | None = None) -> Emitted | None:
        """Score the row's prompt into `cache` (a one-row cache or view) from where that row's
        length stands up to token `upto` (default: the whole prompt); once the whole prompt is in,
        emit the first token and begin the drafter.

        The row may already hold a prefix of the prompt: the earlier chunks of a chunked prefill,
        or keys and values copied from a prefix cache (`KVCache.import_row`). Slots carry their
        positions, so each part is scored at its own positions, exactly as in one forward. Returns
        None while the prompt is not all in (a chunk scores no output head).
        """
        row.started = row.started or time.perf_counter()
        ids = row.prompt
        start = cache.length()
        end = len(ids) if upto is None else min(upto, len(ids))
        if not start < end:
            raise ValueError(f"nothing to prefill: the row holds {start} of {len(ids)} prompt tokens, upto={upto}")
        drafter = row.drafter
        # Learned drafters (EAGLE-style) read the target's own features: they get the final hidden
        # state of every token the target's cache now holds, in order (`observe`), collected over
        # the chunks. Without one, the prefill's last layer runs for the last token only
        # (`Transformer.forward`).
        observes = drafter is not None and drafter.needs.observes is not None
        tokens = torch.tensor([ids[start:end]], device=self.device)  # [1, end - start]
        positions = torch.arange(start, end, device=self.device)[None]  # [1, end - start]
        final = end == len(ids)
        logits, hidden = self.model(tokens, positions, cache, last_n=1 if final else 0,
                                    need_hidden=observes)  # logits: [1, 1, vocab] when final
        row.stats.target_forwards += 1
        if observes:
            row.prompt_hidden.append(hidden[0])  # [end - start, hidden]
        if not final:
            return None
        return self._first_token(row, logits[0])

    @torch.inference_mode()
    def prefill_last(self, rows: list[Row], cache: KVCache) -> list[Emitted]:
        """`prefill` for rows that each hold all of their prompt but its last token (a prefix cache
        hit on a whole earlier prompt), in one forward: rows[r] lives in cache row r. What one
        `prefill` per row gives, bit for bit: a one-token block scores each row by itself (the
        decode step's batch-invariant products and attention), so rows arriving together share
        each read of the weights instead of a one-row forward each.
        """
        for r, row in enumerate(rows):
            if cache.length(r) != len(row.prompt) - 1 or (row.drafter is not None and row.drafter.needs.observes is not None):
                raise ValueError("prefill_last: every row must hold its prompt but the last token, without a "
                                 "drafter that observes the prompt")
            row.started = row.started or time.perf_counter()
        tokens = torch.tensor([[row.prompt[-1]] for row in rows], device=self.device)  # [n, 1]
        positions = torch.tensor([[len(row.prompt) - 1] for row in rows], device=self.device)  # [n, 1]
        # Rows that pick greedily on the raw head take its argmax only, together (`_head_argmax`).
        _, hidden = self.model(tokens, positions, cache, last_n=0)  # hidden: [n, 1, h]
        argmax_rows = [r for r, row in enumerate(rows) if row.screen]
        picked = dict(zip(argmax_rows, self._head_argmax(hidden[argmax_rows, 0]))) if argmax_rows else {}
        others = [r for r in range(len(rows)) if r not in picked]
        logits = dict(zip(others, self.model.head(hidden[others]))) if others else {}  # r -> [1, vocab]
        emitted = []
        for r, row in enumerate(rows):
            row.stats.target_forwards += 1
            emitted.append(self._first_token(row, logits.get(r), picked.get(r)))
        return emitted

    def _first_token(self, row: Row, logits: torch.Tensor | None, first: int | None = None) -> Emitted:
        """The row's prompt is all in: emit its first token and begin its drafter. logits: [1, vocab],
        or None with `first` already picked (a greedy row on the raw head's argmax)."""
        ids = row.prompt
        drafter = row.drafter
        observes = drafter is not None and drafter.needs.observes is not None
        first = self._pick(logits, row) if first is None else first
        row.stats.prefill_s = time.perf_counter() - row.started
        if row.steps is not None:
            row.steps.append(Step([], first, "prefill", 0))
        if drafter is not None:
            drafter.begin(list(ids), row.sampling, row.generator)
            row.begun = True
            if observes:
                seen = torch.cat(row.prompt_hidden)  # [prompt_len, hidden]
                row.prompt_hidden = []
                if seen.shape[0] != len(ids):
                    raise ValueError(f"{drafter.name} needs the hidden state of every prompt token: its row "
                                     "cannot start from a copied prefix")
                drafter.observe(seen)
        text = row.out.push(first)
        if row.grammar is not None:
            row.grammar.advance([first])
        logprobs = None if row.logprobs is None else log_probs(logits[-1:], [first], row.logprobs)
        return Emitted([first], text, logprobs, pieces=[text], sources=[TARGET])

    @torch.inference_mode()
    def step(self, rows: list[Row], cache: KVCache, cap: int | list[int] | None = None) -> StepReport:
        """One decoding step for every row (unfinished, prefilled): rows[r] lives in cache row r.
        The phases and how a row's fault stays in its row: `step.py`.

        A row may also join here with its prompt all in its cache row but the last token (a prefix
        cache hit) and nothing emitted yet: the step scores that token in its block and emits its
        first token, what `prefill_last` would give, without a forward of its own.

        `cap`: the batch's load cap on each row's draft length (`policy.LoadCap`), or one per row;
        rows with a fixed k (seeded sampling) ignore it.
        """
        return step_phases.run(self, rows, cache, cap)

    # -- verification ---------------------------------------------------------------------------

    def _adjusted(self, row: Row, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """The raw logits of a block's rows as the row's sampling sees them: row j after the
        context and the draft tokens paths[j] (`adjust_logits`), then masked to what the row's
        grammar allows after that prefix. logits: [len(paths), vocab]"""
        if row.sampling.adjusts_logits:
            logits = adjust_logits(logits, row.sampling, row.prompt, row.out.ids, paths,
                                   self.model.config.eos_token_ids)
        if row.grammar is not None:
            allowed = row.grammar.masks(paths).to(logits.device)  # [len(paths), vocab]
            logits = logits.float().masked_fill(~allowed, float("-inf"))
            # A row the grammar ends (EOS only) while min_tokens still masks EOS: the grammar wins,
            # evenly over what it allows, rather than a row without any finite logit.
            dead = torch.isneginf(logits).all(-1)  # [len(paths)]
            if dead.any():
                logits[dead] = torch.zeros_like(logits[dead]).masked_fill(~allowed[dead], float("-inf"))
        return logits

    def _pick(self, logits: torch.Tensor, row: Row) -> int:
        # logits: [1, vocab] (the last position)
        logits = self._adjusted(row, logits[-1:], [[]])
        if row.sampling.greedy:
            return greedy_tokens(logits)[0]
        return int(sample(process_logits(logits[0], row.sampling), row.generator))

    def _head_columns_exact(self) -> bool:
        """Whether the target's head scores chosen columns bit-identically (`head_columns`)."""
        probe = torch.zeros(1, self.model.config.hidden_size, dtype=self.model.embed_tokens.weight.dtype,
                            device=self.device)
        with torch.inference_mode():
            return self.model.head_columns(probe, torch.zeros(1, dtype=torch.long, device=self.device)) is not None

    def _screen(self, hidden: torch.Tensor, draft: list[int], context: list[int]) -> int:
        """How many rows of a greedy chain's verify block may matter: the first draft position that
        is certainly rejected, or len(draft) (`first_proven_rejection`). hidden: [len(draft), hidden
        size], the block's final hidden states before its last row.

        The block's rows are scored on a few hundred columns: every token of the context and of
        the draft (where a greedy target's next token mostly is). A row whose draft token loses
        there is certainly rejected, so no later row is needed; the full head (262k columns for
        Gemma 3, most of a one-token step) then runs on the rows up to it only. Same verdict as
        scoring every row (`verify_greedy_rows`).
        """
        ids = torch.tensor(sorted(set(context).union(draft)), device=hidden.device)
        columns = self.model.head_columns(hidden, ids)
        return len(draft) if columns is None else first_proven_rejection(columns, ids, draft)

    def _head_argmax(self, hidden: torch.Tensor) -> list[int]:
        """The argmax of the raw head's logits for each row of hidden [m, hidden size], ties to
        the lowest id: the head's own exact argmax where it has one, else of its full logits."""
        best = self.model.head_argmax(hidden)
        return best.tolist() if best is not None else greedy_tokens(self.model.head(hidden))

    def _verify_tree(self, logits, tree: TokenTree, q, row: Row) -> TreeVerdict:
        # logits: [len(tree) + 1, vocab]; q: [len(tree), vocab] or None (one-hot). Each block row is
        # adjusted for the draft tokens before it: the verification rules below then compare the
        # drafts against exactly the distributions plain decoding would sample from.
        sampling, generator = row.sampling, row.generator
        logits = self._adjusted(row, logits, tree.paths())
        if tree.is_chain:
            # A path: the chain rules decide exactly as the tree rules would (greedy: the same
            # verdict; sampling: the same distribution), vectorised, and with the random draws
            # chain decoding has always made, so a seed keeps its output.
            if sampling.greedy:
                v = verify_greedy(logits, tree.tokens)
            else:
                v = verify_sampling(process_logits(logits, sampling), q, tree.tokens, generator)
            return TreeVerdict(v.accepted, v.next_token, v.kind, path=list(range(v.num_accepted)))
        if sampling.greedy:
            return verify_tree_greedy(logits, tree)
        return verify_tree_sampling(process_logits(logits, sampling), q, tree, generator)


__all__ = ["Engine", "Generation", "Output", "Row", "Stats", "SpecdecError"]
