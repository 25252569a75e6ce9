"""Every draft-length rule in one place: how many tokens a row drafts this step.

Per row (one request), a rule object owned by the row, fresh per request:

* `FixedDraftLength`: always k.
* `AdaptiveDraftLength`: the +2 / -1 heuristic of HF transformers' assisted generation.
* `CostAwareDraftLength` (the default for chains): per kind of proposal, the k with the best
  expected tokens per unit of step cost, from the measured acceptance and the price of a step.

Over the batch, under load (the server), two caps on every row's k, the smaller winning:

* `budget_ceiling`: a forward scores at most `spec_token_budget` tokens.
* `GoodputModel`: learns the step time as a line in the tokens scored and picks the k with the
  most expected tokens per second for the whole batch.

The price of a step, in plain (one-token) target steps, for a chain of k drafts:

    1 + c0 + c k            verifying: `verify_overhead` c0, `verify_cost` c per scored token
      + d k                 drafting: d = the measured cost of one draft token of this drafter

c0 and c are the target's (DEFAULT_VERIFY_COSTS per device and quantisation, or the user's); d is
the drafter's: ~0 for lookup drafters (a dictionary look-up), and for a drafter that runs a model
per token (`DrafterNeeds.model`: a draft model, an EAGLE head) the time its `propose` takes per
token relative to the time of a target step, measured online (`DraftCost`).

A draft model also reads the context it has not seen (its prompt) before its first draft: once per
request, at `DraftCost.per_read_token` plain steps a token, weighed against what drafting can save
over the answer's remaining tokens (`AskGate.reads`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .drafters.base import Proposal
from .drafters.combined import LEARNED
from .drafters.prediction import FIRST
from .errors import InvalidRequestError
from .verify import TokenTree

DRAFT_LENGTHS = ("fixed", "adaptive", "cost")
# The longest chain a row drafting from a prediction may grow to (`row_rule`'s k_max): where the
# prediction has held, its acceptance estimate climbs and the cost rule wants tens of tokens (at an
# acceptance of 0.99 and int4's verify cost, about 40), which a lookup's cap of a few would forbid.
PREDICTION_K_MAX = 64
# The tokens a row expects to emit once its output has passed its prediction's end (an edit's
# closing fence, the end): what a read by its draft model is weighed against from then on, so a
# catch-up over the hundreds of tokens the prediction drafted is not paid for the last few.
PREDICTION_TAIL = 8
# The cost-aware draft length's step-cost model, 1 + overhead + cost * k for a verify pass over k
# drafts, in plain steps (see `CostAwareDraftLength`), fitted to timings of a pass over T tokens
# against T = 1 (docs/archive/BENCHMARKS-history.md; int4: BENCHMARKS.md, "The cost of scoring T
# tokens in one pass", refitted once its weights moved to huge pages). float32 has an overhead: its matrix products
# leave their one-row fast path at T = 2. int8 with the compiled kernels has none and grows slowly
# in T. int4 has a fit of its own (its one-token pass reads less, and its kernels differ). A GPU
# scores a few tokens for about the price of one: the CUDA row is an estimate, not a fit.
DEFAULT_VERIFY_COSTS = {  # (overhead, cost per draft token)
    "cpu": (0.5, 0.14),
    "cpu-int8": (0.0, 0.16),
    "cpu-int4": (0.0, 0.13),
    "cuda": (0.0, 0.03),
}
# The output head's share of that per-token cost, which greedy screening pays only for rows up to
# the first rejection (`CostAwareDraftLength.screened_share`). For int8 the head is a little under
# half of what each more row costs (docs/archive/BENCHMARKS-history.md).
SCREENED_SHARE = {"cpu-int8": 0.45}
# The price of a model drafter's token, in plain target steps, before any has been measured, and
# for seeded sampled rows (whose k must not depend on timings): optimistic, so the first step
# drafts and measures the real price.
DEFAULT_DRAFT_TOKEN_COST = 0.0
# The price of a draft model's read of one prompt token (its prefill, `Drafter.read`), in plain
# target steps, before a read has been measured, and for seeded sampled rows (timing-free). A
# prefill is priced per token by its arithmetic, not by a pass over the weights, so it is a small
# fraction of a decode step, but a prompt has hundreds of tokens. cpu-int4: the Qwen2.5-Coder
# 0.5B draft reading 500-650-token prompts for the 1.5B int4 target (scripts/draft_tuning_prompts.jsonl,
# 0.07); the other CPU rows are taken to be alike (not fitted); the CUDA row is an estimate.
DEFAULT_READ_COSTS = {"cpu": 0.07, "cpu-int8": 0.07, "cpu-int4": 0.07, "cuda": 0.01}


def hardware_kind(model) -> str:
    """The DEFAULT_VERIFY_COSTS row for a target: cuda, cpu-int4, cpu-int8 or cpu."""
    from .models.quant import quantize_of

    if model.embed_tokens.weight.device.type == "cuda":
        return "cuda"
    mode = quantize_of(model)
    return "cpu" if mode == "none" else f"cpu-{mode}"


def default_draft_length(draft_length: str | None, tree) -> str:
    """None means the best measured: "cost" for chains (prompt lookup on the Spec-Bench mix was
    faster with it than with a fixed k on the int8 target, and even in float32;
    docs/archive/BENCHMARKS-history.md); a tree has a fixed shape."""
    if draft_length is not None:
        return draft_length
    return "fixed" if tree is not None else "cost"


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class DraftCost:
    """The measured price of one draft token of one drafter, in plain target steps.

    Two exponentially weighted means, kept per kind of proposal (`Proposal.source`: a lookup-first
    combination's lookup guesses cost nothing, its learned ones a model forward each): seconds of
    `propose` per drafted token, and seconds of one plain target step (a verify pass's time over
    its modelled cost in plain steps). Their ratio is the price. Before both are measured, `prior`.
    Shared by the rows of one drafter, since the price is the drafter's, not a request's.

    Apart from its drafts, a draft model reads the context it has not seen (`Drafter.read`: the
    prompt, once): the price of one token read, `per_read_token`, is kept the same way (`read_prior`
    before a read and a step are measured).
    """

    prior: float = DEFAULT_DRAFT_TOKEN_COST
    decay: float = 0.9
    read_prior: float = DEFAULT_READ_COSTS["cpu-int4"]
    _draft: dict = field(default_factory=dict)  # source -> [weighted seconds, weighted tokens]
    _step: list = field(default_factory=lambda: [0.0, 0.0])  # [weighted seconds, weighted plain steps]
    _read: list = field(default_factory=lambda: [0.0, 0.0])  # [weighted seconds, weighted tokens read]

    def observe_draft(self, source: object, tokens: int, seconds: float) -> None:
        if tokens <= 0:
            return
        w = self._draft.setdefault(source, [0.0, 0.0])
        w[0], w[1] = self.decay * w[0] + seconds, self.decay * w[1] + tokens

    def observe_step(self, seconds: float, plain_steps: float) -> None:
        self._step[0] = self.decay * self._step[0] + seconds
        self._step[1] = self.decay * self._step[1] + plain_steps

    def per_token(self, source: object = None) -> float:
        w = self._draft.get(source)
        if w is None or not w[1] or not self._step[1] or not self._step[0]:
            return self.prior
        return (w[0] / w[1]) / (self._step[0] / self._step[1])

    def observe_read(self, tokens: int, seconds: float) -> None:
        if tokens <= 0:
            return
        self._read[0] = self.decay * self._read[0] + seconds
        self._read[1] = self.decay * self._read[1] + tokens

    def per_read_token(self) -> float:
        """The price of reading one context token, in plain target steps."""
        if not self._read[1] or not self._step[1] or not self._step[0]:
            return self.read_prior
        return (self._read[0] / self._read[1]) / (self._step[0] / self._step[1])


@dataclass
class FixedDraftLength:
    """Always `k_max` tokens (a tree's fixed shape, `draft_length="fixed"`)."""

    priced = False  # k does not follow the step's price (`CostAwareDraftLength`'s does)

    k_max: int

    def next_k(self, source: object = None) -> int:
        return self.k_max

    def update(self, num_proposed: int, num_accepted: int, source: object = None) -> None:
        pass


@dataclass
class AdaptiveDraftLength:
    """The +2 / -1 draft-length heuristic (as in HF transformers' assisted generation).

    Pure per-request state: after a step where every proposed token was accepted the drafter is
    doing well, so ask for two more next time (up to `k_max`); after any rejection ask for one
    fewer (down to 1). A step with nothing proposed (a lookup drafter found no match) says nothing
    about draft quality, so `k` stays as it is.
    """

    priced = False

    k: int  # the current draft length; starts at the configured k
    k_max: int

    def __post_init__(self) -> None:
        if not _is_int(self.k) or not _is_int(self.k_max) or not 1 <= self.k <= self.k_max:
            raise InvalidRequestError(
                f"draft length must satisfy 1 <= k <= k_max, got k={self.k}, k_max={self.k_max}",
                param="num_speculative_tokens",
            )

    def next_k(self, source: object = None) -> int:
        """The draft length for the next step (`source`: see `CostAwareDraftLength`; unused here)."""
        return self.k

    def update(self, num_proposed: int, num_accepted: int, source: object = None) -> None:
        if not 0 <= num_accepted <= num_proposed:
            raise ValueError(
                f"need 0 <= num_accepted <= num_proposed, got {num_accepted}, {num_proposed}"
            )
        if num_proposed == 0:
            return
        if num_accepted == num_proposed:
            self.k = min(self.k + 2, self.k_max)
        else:
            self.k = max(1, self.k - 1)


@dataclass
class CostAwareDraftLength:
    """Per kind of proposal, the draft length with the best expected speedup (Leviathan et al.).

    A verify step over k >= 1 drafts costs about 1 + c0 + c k plain steps (`verify_overhead` = c0,
    what scoring more than one token costs at all; `verify_cost` = c, the price of each more token;
    measured defaults per device and quantisation in `DEFAULT_VERIFY_COSTS`), plus d k for drafting
    them (`draft_cost`, a `DraftCost`: ~0 for lookup, measured for a model drafter), and yields
    (1 - a^(k+1)) / (1 - a) tokens on average when each draft is accepted with probability a once
    its predecessors were. So the best k maximises

        (1 - a^(k+1)) / ((1 - a) (1 + c0 + c k + d k))      over k = 1 .. k_max,

    against 1 for k = 0 (no drafting: a plain step), which wins when a is low.

    When greedy verification screens its rows (`Engine` with `screen_verify`), a share f
    (`screened_share`) of each token's verify price, the output head's, is paid only for the rows
    up to the first rejection: a + a^2 + ... + a^k of them on average. The verify cost is then
    1 + c0 + c ((1 - f) k + f (a + ... + a^k)), which makes a long draft of an uncertain kind cheaper.

    The acceptance a is measured per kind of proposal (`Proposal.source`): for the lookup
    drafters the length of the matched n-gram, since a guess that follows a one-token match is a
    far weaker one than a guess after a four-token match. Estimate: accepted tokens over accepted
    tokens + rejections (the maximum-likelihood a of that geometric model; a step that accepted all
    its drafts shows no rejection), started from a prior of `prior_accepted` / `prior_rejected`
    pseudo-counts so that a new kind is tried with a short draft. Per-request state: without a
    measured `draft_cost` it depends only on the verdicts, so a seeded request stays reproducible.
    """

    k_max: int
    verify_cost: float
    verify_overhead: float = 0.0
    screened_share: float = 0.0
    prior_accepted: float = 1.5
    prior_rejected: float = 1.0
    draft_cost: DraftCost | None = None  # None: drafting is free (lookup)
    priced = True

    def __post_init__(self) -> None:
        if not _is_int(self.k_max) or self.k_max < 1:
            raise InvalidRequestError(f"k_max must be an integer >= 1, got {self.k_max!r}",
                                      param="num_speculative_tokens")
        if not self.verify_cost > 0:
            raise InvalidRequestError(f"verify_cost must be > 0, got {self.verify_cost!r}", param="verify_cost")
        if not self.verify_overhead >= 0:
            raise InvalidRequestError(f"verify_overhead must be >= 0, got {self.verify_overhead!r}",
                                      param="verify_overhead")
        if not 0 <= self.screened_share < 1:
            raise InvalidRequestError(f"screened_share must be in [0, 1), got {self.screened_share!r}",
                                      param="screened_share")
        self._counts: dict[object, list[float]] = {}  # source -> [accepted tokens, rejections]
        self.gate = AskGate()  # whether a self-sizing drafter is asked this step (`ChainStop`)

    def acceptance(self, source: object = None) -> float:
        accepted, rejected = self._counts.get(source, (0.0, 0.0))
        return (accepted + self.prior_accepted) / (accepted + rejected + self.prior_accepted + self.prior_rejected)

    def step_cost(self, k: int, source: object = None) -> float:
        """The modelled price of a verify step over k drafts, in plain steps (drafting excluded)."""
        if k == 0:
            return 1.0
        a, f = self.acceptance(source), self.screened_share
        reached = sum(a**i for i in range(1, k + 1))
        return 1 + self.verify_overhead + self.verify_cost * ((1 - f) * k + f * reached)

    def next_k(self, source: object = None) -> int:
        """The k in 0 .. k_max with the highest expected tokens per unit of step cost."""
        return self._best(source)[0]

    def value(self, source: object = None) -> float:
        """The expected tokens per plain step of drafting `source`'s kind at its best k (1: a plain step)."""
        return self._best(source)[1]

    def _best(self, source: object) -> tuple[int, float]:
        a, c, f = self.acceptance(source), self.verify_cost, self.screened_share
        d = 0.0 if self.draft_cost is None else self.draft_cost.per_token(source)
        best_k, best, expected = 0, 1.0, 1.0  # k = 0: one token for one plain step
        for k in range(1, self.k_max + 1):
            expected += a**k  # 1 + a + ... + a^k
            value = expected / (1 + self.verify_overhead + c * ((1 - f) * k + f * (expected - 1)) + d * k)
            if value > best:
                best_k, best = k, value
        return best_k, best

    def update(self, num_proposed: int, num_accepted: int, source: object = None) -> None:
        if not 0 <= num_accepted <= num_proposed:
            raise ValueError(f"need 0 <= num_accepted <= num_proposed, got {num_accepted}, {num_proposed}")
        if num_proposed == 0:
            return
        counts = self._counts.setdefault(source, [0.0, 0.0])
        counts[0] += num_accepted
        counts[1] += num_accepted < num_proposed


@dataclass
class ChainStop:
    """Where a drafter that knows its confidence stops its chain (after SpecDec++, Huang et al. 2024).

    A draft model's confidence in its next token (its top probability; of q under sampling) predicts
    the target's acceptance of that token: on the Qwen2.5-Coder pair a token drafted at confidence p
    was accepted about p of the time (scripts/draft_tuning_prompts.jsonl, greedy). So the chance that
    the whole chain up to token i is accepted is about P_i = p_1 p_2 ... p_i: token i adds P_i
    expected tokens to its step. Costs, in plain steps (the cost model of `CostAwareDraftLength`):
    reading one more position's confidence is a draft forward, d; a kept token is scored by the
    target, c (of which a screened row pays the head's share f only for rows reached, P_{i-1} of
    the time); a chain of any length k >= 1 pays the verify overhead c0 once.

    What is to be maximised is the request's tokens per plain step over all its steps, R, not one
    step's ratio: a step's drafts are worth their cost where they gain more than R would buy with
    it (Dinkelbach's view of a ratio). Two decisions follow:

    * keep a token whose confidence was read (its forward is spent) while P_i > R c_i;
    * read the next position only while the chain looks able to pay for that forward too:
      P_i p_i > R (d + c), the next confidence guessed to be like the last (`more`). Without this,
      every chain ends with a forward spent to learn that its next token does not pay: on a draft
      costing a quarter of a target step that forward is most of what drafting loses.

    The chain is sent at all only where P_1 + ... + P_k beats R (c0 + c k) (`worth`). R, `rate`,
    is what the row's asks have earned so far (`AskGate.value`, at least 1). The fixed cut-off
    `draft_p_min` tests each token's p alone: it stops a chain of near-certain tokens at the first
    slightly uncertain one and lets a chain of 0.55s run to a product no draft earns back.

    `verify_cost` c, `verify_overhead` c0, `screened_share` f: the target's, as in
    `CostAwareDraftLength`; `draft_cost` d: the drafter's price per draft forward (for a seeded
    sampled row, the prior, so its drafts depend only on q and its verdicts). One object per row
    and step; `start` before each chain.
    """

    verify_cost: float
    verify_overhead: float = 0.0
    screened_share: float = 0.0
    draft_cost: float = 0.0
    rate: float = 1.0

    def __post_init__(self) -> None:
        self.start()

    def start(self) -> None:
        self.chain, self.last, self.gained, self.spent, self.drafted = 1.0, 1.0, 0.0, self.verify_overhead, 0
        self.looked = 0  # positions whose confidence was read: the draft forwards this chain took

    def _score_cost(self) -> float:
        c, f = self.verify_cost, self.screened_share
        return c * ((1 - f) + f * self.chain)

    def take(self, p: float) -> bool:
        """The next token's confidence p (its position read): keep it (True, counted in the chain) or stop."""
        self.looked += 1
        chain = self.chain * p
        cost = self._score_cost()
        if not chain > self.rate * cost:
            return False
        self.spent += cost
        self.gained += chain
        self.chain, self.last = chain, p
        self.drafted += 1
        return True

    def more(self) -> bool:
        """Whether to read the next position: its chain, guessed at P_i p_i, pays a forward and a score."""
        return self.chain * self.last > self.rate * (self.draft_cost + self._score_cost())

    def worth(self) -> bool:
        """Whether the chain kept gains more than its scoring buys at the row's rate; False: draft nothing."""
        return self.drafted > 0 and self.gained > self.rate * self.spent


@dataclass
class AskGate:
    """Whether to ask a self-sizing drafter (`ChainStop`) at all this step.

    Asking is not free even when nothing comes of it: the draft model reads the new context and
    scores one position before its chain stop can say "not worth a token" (d plain steps). So the
    row keeps two exponentially weighted means over its asks: the tokens an ask gained (accepted
    drafts) and what it cost in plain steps (d per draft forward, c per scored draft, c0 once),
    and asks while the gain is the larger. Both start from an optimistic prior (`prior_gain`,
    `prior_cost`: two asks that gained a token each at half its price), so the first steps ask
    and one unlucky chain does not end drafting. A step that does not ask fades the
    evidence (`decay`) and the prior regains its weight, so a drafter switched off by a poor spell
    is probed again now and then (about every 1 / (1 - decay) steps once the evidence is old):
    a request whose text turns predictable later gets its drafts back. Deterministic given the
    verdicts and the prices, as a seeded sampled row needs (its d is the prior).
    """

    decay: float = 0.97
    prior_gain: float = 2.0
    prior_cost: float = 1.0

    prior_asks: float = 2.0

    def __post_init__(self) -> None:
        self.gain, self.cost, self.count = 0.0, 0.0, 0.0  # weighted sums over the asks

    def asks(self) -> bool:
        return self.gain + self.prior_gain > self.cost + self.prior_cost

    def reads(self, unread: int, remaining: int, read_cost: float) -> bool:
        """Whether to let the drafter read `unread` context tokens (at `read_cost` plain steps each)
        so that it can be asked: a cost paid before any draft, which only the answer's `remaining`
        tokens can pay back. Drafting them at the asks' `value` v (tokens per plain step) takes
        remaining / v plain steps instead of remaining, so the read pays where

            remaining (1 - 1 / v) > unread * read_cost.

        A long prompt with a short allowance is then answered without the draft (in a lookup-first
        combination, lookup alone), where reading it would cost more than its drafts can save even
        at good acceptance. v is the prior's (4/3: a quarter of each plain step saved) until asks
        have been heard; later a gate reopening after a long pause weighs its catch-up the same way.
        Deterministic given the verdicts and the prices, as the gate is.
        """
        v = self.value()
        return v > 1 and remaining * (1 - 1 / v) > unread * read_cost

    def value(self) -> float:
        """Expected tokens per plain step of a step that asks (1: a plain step's)."""
        n = self.count + self.prior_asks
        return (n + self.gain + self.prior_gain) / (n + self.cost + self.prior_cost)

    def observe_ask(self, gained: float, cost: float) -> None:
        self.gain = self.decay * self.gain + gained
        self.cost = self.decay * self.cost + cost
        self.count = self.decay * self.count + 1

    def observe_skip(self) -> None:
        self.gain *= self.decay
        self.cost *= self.decay
        self.count *= self.decay


def row_rule(draft_length: str, k: int, *, model=None, verify_cost: float | None = None,
             verify_overhead: float | None = None, screened: bool = False, draft_cost: DraftCost | None = None,
             k_max: int | None = None):
    """A fresh rule for one request: `fixed`, `adaptive` or `cost` (see the module docstring).

    `model` (the target) picks the default step prices; `screened`: greedy verification screens
    its rows; `draft_cost`: the drafter's price per token (None for lookup drafters); `k_max`:
    the longest chain the cost and adaptive rules may grow to, when longer than k (a row drafting
    from a prediction, `PREDICTION_K_MAX`); a fixed length stays k.
    """
    if draft_length == "adaptive":
        return AdaptiveDraftLength(k, max(k, 16, k_max or 0))
    if draft_length == "cost":
        kind = hardware_kind(model)
        overhead, cost = DEFAULT_VERIFY_COSTS[kind]
        cost = cost if verify_cost is None else verify_cost
        overhead = overhead if verify_overhead is None else verify_overhead
        share = SCREENED_SHARE.get(kind, 0.0) if screened else 0.0
        return CostAwareDraftLength(max(k, k_max or 0), cost, overhead, share, draft_cost=draft_cost)
    return FixedDraftLength(k)


class DraftController:
    """One row's drafting decisions, owned by the row: how many tokens its drafter is asked for
    (its draft-length rule under the batch's cap; a self-sizing drafter's chain stop and ask gate),
    when its drafter reads the context it has not seen, what a draft token costs (`DraftCost`),
    and what each verdict teaches them. The step asks `plan` and `draft` before its forward and
    tells `hear` after verification; nothing outside looks at the rule's kind.
    """

    def __init__(self, drafter, rule, cost: DraftCost | None, *, fixed_k: bool, tree=None, prediction=None):
        self.drafter, self.rule, self.cost, self.fixed_k, self.tree = drafter, rule, cost, fixed_k, tree
        self.prediction = prediction  # the row's `PredictionDrafter`, or None
        # Whether the drafter sizes its own chains by their price (`ChainStop`), under a priced
        # rule; under a fixed or adaptive length it drafts the k asked for.
        self.stops = drafter.needs.stops and rule.priced
        # `Proposal.source` of the drafts its model makes (LEARNED in a lookup-first combination).
        self.model_source = LEARNED if drafter.needs.labels_proposals else None
        self.stop: ChainStop | None = None  # this step's, or None when the drafter is not asked
        self.read = False  # the drafter has read the prompt (`_reads`)
        # A lookup-first row's read, put off until its learned part drafts this step (`catch_up`):
        # the unread tokens, or 0. Where lookup (or a prediction) drafts the step, it is never paid.
        self._deferred = 0

    @property
    def room(self) -> int:
        """Cache slots a step may write past the row's committed tokens, lead token excluded."""
        return self.tree.budget if self.tree is not None else self.rule.k_max

    @property
    def asked(self) -> bool:
        """False for a self-sizing drafter that is not asked this step (the gate said no)."""
        return not (self.stops and self.stop is None)

    def plan(self, context: list[int], remaining: int, cap: int | None) -> int | TokenTree:
        """How many tokens the drafter is asked for this step (0: none), or, for a tree row, its
        proposed tree (tree drafting is not batched). `remaining`: the row's token allowance
        (never drafted past: those tokens could not be emitted); `cap`: the batch's load cap,
        which a seeded sampled row ignores (its draws depend on k)."""
        drafter = self.drafter
        self.stop = None
        self._deferred = 0
        limit = remaining if (cap is None or self.fixed_k) else min(remaining, cap)
        if limit <= 0:
            return 0
        if self.tree is not None:
            shape = self.tree
            budget = min(shape.budget, limit) if cap is not None and not self.fixed_k else shape.budget
            tree = drafter.propose_tree(context, min(shape.depth, limit), shape.top_k, budget)
            if len(tree) > budget:
                raise ValueError(f"{drafter.name} proposed {len(tree)} tree nodes, over the budget of {budget}")
            return tree
        if self.stops:
            # Hand the drafter this step's price and ask for the most the rule allows, if asking
            # has paid so far (`AskGate`; a lookup-first row still looks up when its model is not).
            rule = self.rule
            if rule.gate.asks() and self._reads(context, remaining):
                d = 0.0 if rule.draft_cost is None else rule.draft_cost.per_token(self.model_source)
                self.stop = ChainStop(rule.verify_cost, rule.verify_overhead, rule.screened_share, d,
                                      max(1.0, rule.gate.value()))
            drafter.stop_by(self.stop)
            return min(rule.k_max, limit) if self.stop is not None or drafter.needs.labels_proposals else 0
        if drafter.needs.stops:
            drafter.stop_by(None)  # a fixed or adaptive length: the k asked for
        if drafter.needs.labels_proposals:
            # A lookup's kind is known once it is found, and looking up is free: ask for the most
            # the rule may keep, then keep what it wants for that kind (`draft`).
            k = min(self.rule.k_max, limit)
        else:
            # One kind of guess, known before asking: nothing to propose when the rule wants no
            # draft (a model drafter's forward would be spent for nothing).
            k = min(self.rule.next_k(), limit)
        if k and drafter.needs.reads and (unread := drafter.pending(context)):
            self._read_now_or_later(context, unread)  # a fixed length reads whatever it costs, timed apart
        return k

    def _reads(self, context: list[int], remaining: int) -> bool:
        """For a self-sizing drafter the gate would ask: whether the context it has not read yet
        (the prompt, before the first ask; what was emitted while it was not asked) is worth
        reading for the answer's `remaining` tokens (`AskGate.reads`), and if so read it now.
        False: it is not asked this step (nor, for a prompt too long to pay back, later: the
        allowance only shrinks). Only the prompt's read is weighed: a catch-up after a pause is
        part of the probe the gate chose to make, and weighing it against the stale value that
        the probe is there to refresh would put the probe off. Except past the end of a
        prediction: there every read is weighed, against the few tokens still expected
        (`PREDICTION_TAIL`)."""
        unread = self.drafter.pending(context) if self.drafter.needs.reads else 0
        if not unread:
            self.read = True  # a short prompt: read along with the first proposal
            return True
        rule = self.rule
        price = rule.draft_cost.per_read_token() if rule.draft_cost is not None else 0.0
        weigh = not self.read
        if self.prediction is not None and self.prediction.passed_end(context):
            remaining, weigh = min(remaining, PREDICTION_TAIL), True
        if weigh and not rule.gate.reads(unread, remaining, price):
            return False
        self._read_now_or_later(context, unread)
        return True

    def _read_now_or_later(self, context: list[int], unread: int) -> None:
        """Read now, or for a lookup-first row once its learned part is to draft (`catch_up`): a
        step that lookup or a prediction drafts never reads, so a row following a prediction for
        hundreds of tokens does not keep its draft model's cache in step a few tokens a pass (each
        read a forward of the draft), and when the model is next asked it reads them in one block."""
        if self.drafter.needs.fallback:
            self._deferred = unread
        else:
            self._read(context, unread)

    def catch_up(self, context: list[int]) -> float:
        """Pay the read `plan` put off, if any, before the learned part drafts; its seconds."""
        if not self._deferred:
            return 0.0
        started = time.perf_counter()
        self._read(context, self._deferred)
        self._deferred = 0
        return time.perf_counter() - started

    def _read(self, context: list[int], unread: int) -> None:
        """The drafter reads its pending context, timed as reading (`DraftCost.observe_read`), not
        as drafting: a prompt's read in the first proposal's time would price every draft token
        of the drafter out."""
        started = time.perf_counter()
        self.drafter.read(context)
        self.read = True
        if self.cost is not None and not self.fixed_k:
            self.cost.observe_read(unread, time.perf_counter() - started)

    def learned_first(self):
        """For a lookup-first row whose model sizes its own chains and is asked this step: a test of
        a lookup guess's kind, True where the model's asks have been worth more per plain step
        (`AskGate.value`) than that kind at its best length (`CostAwareDraftLength.value`);
        otherwise None (lookup's guess first, as ever). A prediction the output has been following,
        or has just rejoined on the evidence of its own text (`prediction.FIRST`), always goes
        first: it is the client's own text, free to draft, and the model, asked instead, drafts the
        same tokens one forward each."""
        if not self.stops or self.stop is None:
            return None
        rule = self.rule
        learned = rule.gate.value()
        return lambda source: source not in FIRST and learned > rule.value(source)

    def learned_k(self, plan: int) -> int:
        """The length a lookup-first row's learned part drafts where lookup found nothing."""
        return plan if self.stops else min(plan, max(1, self.rule.next_k(LEARNED)))

    def draft(self, context: list[int], plan: int | TokenTree, made: tuple[Proposal, float] | None):
        """This step's drafts as a tree (a chain is a path), their q ([nodes, vocab] or None) and
        the proposal's `source` (what kind of guess it is). `made`: the row's proposal from a
        batched call, with its share of that call's time. Tree candidates are deterministic given
        the context (`propose_tree`), so a tree carries no q: each node is verified as one-hot."""
        if isinstance(plan, TokenTree):
            return plan, None, None
        k = plan
        if k == 0:
            return TokenTree([], []), None, None
        drafter, rule = self.drafter, self.rule
        if made is not None:
            proposal, seconds = made
        else:
            started, reading = time.perf_counter(), 0.0
            if drafter.needs.fallback:
                # Where lookup finds nothing, the learned drafter reads what it has not (timed as
                # reading) and drafts what the rule wants for its kind (a fixed length: k).
                fallback = (k if self.stop is not None else 0) if self.stops else max(1, rule.next_k(LEARNED))
                proposal = drafter.propose_free(context, k, self.learned_first())
                if proposal is None:
                    reading = self.catch_up(context)
                    proposal = drafter.propose_learned(context, min(k, fallback))
            else:
                proposal = drafter.propose(context, k)
            seconds = time.perf_counter() - started - reading
        if self.cost is not None and not self.fixed_k:
            # A self-sized chain's price is per draft forward (positions its stop read), which is
            # what its stop weighs; per drafted token it would count the forward that found the
            # chain not worth going on, and price itself out.
            forwards = len(proposal.tokens)
            if self.stop is not None and proposal.source == self.model_source:
                forwards = self.stop.looked
            self.cost.observe_draft(proposal.source, forwards, seconds)
        if not (self.stops and proposal.source == self.model_source):
            k = min(k, rule.next_k(proposal.source))
        elif self.stop is not None and not self.stop.worth():
            k = 0  # a self-sized chain keeps what it drafted, if it beats a plain step at all
        q = None if proposal.q is None else proposal.q[:k]
        return TokenTree.chain(proposal.tokens[:k]), q, proposal.source

    def hear(self, drafted: int, accepted: int, source: object, step_seconds: float, batch: int) -> None:
        """What this step's verdict teaches: the ask gate (a self-sizing drafter), the rule's
        acceptance per kind, and, where the pass's modelled cost in plain steps is known (a batch
        of one under the priced rule), the drafter's price relative to a plain step."""
        if self.stops:
            self._hear_ask(drafted, accepted, source)
        if drafted:
            self.rule.update(drafted, accepted, source)
            if self.cost is not None and batch == 1 and self.rule.priced:
                self.cost.observe_step(step_seconds, self.rule.step_cost(drafted, source))

    def _hear_ask(self, drafted: int, accepted: int, source: object) -> None:
        """The ask gate hears what this step's ask gained and cost, or that it was not asked (a
        lookup's proposal in its place says neither)."""
        gate = self.rule.gate
        if self.stop is None:
            gate.observe_skip()
        elif source == self.model_source:
            stop = self.stop
            cost = stop.draft_cost * stop.looked
            if drafted:
                cost += stop.verify_overhead + stop.verify_cost * drafted
            gate.observe_ask(accepted, cost)


# -- under load: the batch's caps ---------------------------------------------------------------


def budget_ceiling(spec_token_budget: int, running: int) -> int:
    """The budget rule: the most tokens each of `running` sequences may draft per step, so that a
    forward scores at most `spec_token_budget` tokens."""
    return max(0, spec_token_budget // max(1, running) - 1)


@dataclass
class GoodputModel:
    """Online model of step cost and draft acceptance, to choose k for a batch (see the scheduler).

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


@dataclass
class LoadCap:
    """The batch's cap on every row's draft length: the budget rule and, when on, the goodput rule;
    the smaller wins, and never more than `k_max`."""

    spec_token_budget: int
    k_max: int
    goodput: GoodputModel | None = None

    def ceiling(self, running: int) -> int:
        return budget_ceiling(self.spec_token_budget, running)

    def cap(self, running: int) -> int:
        ceiling = min(self.ceiling(running), self.k_max)
        return ceiling if self.goodput is None else self.goodput.best_k(max(1, running), ceiling)
