"""The drafter contract: `DrafterNeeds`, the `Drafter` protocol and its return value `Proposal`.

(The draft-length rules live in `specdec.policy`.)

A drafter guesses the next few tokens cheaply; the engine verifies them against the target. Drafters
never call `verify` and never touch the target's cache: they see token ids in, token ids out, and
learn how the last guess went through `feedback`.

Lifecycle of one request, as the engine drives it::

    drafter.begin(prompt_ids, sampling, generator)
    loop:
        proposal = drafter.propose(context, k)   # context = prompt + every token emitted so far
        ... verify ...
        drafter.feedback(num_accepted)
    drafter.end(output_ids)                      # output_ids = every generated token

That is the core contract (`Drafter`: begin / propose / feedback / end). What else a drafter can
do is declared once, in its `needs` (`DrafterNeeds`), each flag an optional capability with its
own small protocol (`CAPABILITIES`: trees, batched drafting, observed hidden layers, the prompt
read, self-sizing chains, lookup-first, a model's price); the core calls a capability's methods
only where its flag is set, and never probes a drafter's type or attributes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from specdec.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

    from specdec.models.kv_cache import KVCache
    from specdec.sampling import SamplingParams
    from specdec.verify import TokenTree


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one step.

    `tokens` may be empty: the engine then does a plain decoding step (the graceful fallback when a
    lookup drafter finds nothing). `q` holds the draft distribution each token was sampled from, or
    None for drafters that pick tokens deterministically; verification then treats q as one-hot on
    the proposed token (so acceptance probability is simply p[token]).
    """

    tokens: list[int]  # proposed draft tokens, len <= k
    q: torch.Tensor | None = None  # [len(tokens), vocab] draft probabilities, or None (one-hot)
    # What kind of guess this is, for `CostAwareDraftLength` (lookup drafters: the length of the
    # n-gram the tokens were found after); None = one kind for every proposal.
    source: object = None

    def __post_init__(self) -> None:
        if self.q is not None and (self.q.dim() != 2 or self.q.shape[0] != len(self.tokens)):
            raise ValueError(
                f"Proposal.q must have shape [len(tokens)={len(self.tokens)}, vocab], "
                f"got {tuple(self.q.shape)}"
            )


FINAL_HIDDEN = -1  # `DrafterNeeds.observes`: the target's final-normed hidden state (what its head reads)


@dataclass(frozen=True)
class DrafterNeeds:
    """What a drafter declares, once, about what it can do beyond the core contract (`Drafter`) and
    what it needs from the decoding core. The core reads only these fields (never `isinstance`,
    `hasattr` or attribute probes) and calls a capability's methods (`CAPABILITIES`) only where
    its flag is set:

    observes: the target layers whose hidden states the drafter reads through `observe`
        (`Observer`), one row per token the target's cache commits, in order; None = none. Today
        the core hands over `FINAL_HIDDEN` only (EAGLE-1/2); a head reading several layers
        (EAGLE-3) declares their indices.
    trees: it drafts token trees (`TreeDrafter.propose_tree`).
    batches: rows whose drafters share a `batch_key()` draft in one `propose_batch` call
        (`BatchDrafter`: one model forward per draft position for all of them).
    reads: it must read the context it has not seen before drafting after it (`PromptReader`:
        `pending` / `read`), which the core times apart and may decide not to pay for.
    stops: it sizes its own chains by their price (`SelfSizing.stop_by`, a `policy.ChainStop`):
        the core asks it for the most the rule allows and keeps what it drafts.
    fallback: it is a lookup-first combination (`LookupFirst`): `propose` takes `fallback_k` and
        `learned_first`, and `propose_free` gives its free lookup proposal alone.
    labels_proposals: its proposals carry `Proposal.source` (a lookup's match length), so the
        draft-length rule keeps one acceptance estimate per kind and the core asks for the most
        the rule may keep (looking up is free).
    model: each drafted token costs a forward of a model (a draft model, an EAGLE head): the
        policy prices a draft token by the measured time of `propose` (from its `draft_cost`,
        `Priced`), and never asks for zero tokens when the rule wants some.
    """

    observes: tuple[int, ...] | None = None
    trees: bool = False
    batches: bool = False
    reads: bool = False
    stops: bool = False
    fallback: bool = False
    labels_proposals: bool = False
    model: bool = False


LOOKUP_NEEDS = DrafterNeeds(labels_proposals=True)


@runtime_checkable
class Drafter(Protocol):
    """The core contract: what the engine calls on every drafter. State lives in the drafter
    object, per request; what else it can do is declared in `needs` (`CAPABILITIES`)."""

    name: str
    needs: DrafterNeeds

    def begin(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        """A new request starts: reset per-request state.

        `sampling` and `generator` are the request's. A drafter that samples its tokens from a
        distribution of its own (a draft model) must process its logits with this same `sampling`
        (so its q matches the target's processed p, as verification assumes) and draw only from
        `generator` (reproducible per seed, no global RNG); None means greedy. Lookup drafters,
        which propose deterministically with q = None, ignore both.
        """
        ...

    def propose(self, context: list[int], k: int) -> Proposal:
        """Propose up to `k` tokens that follow `context` (prompt + all tokens emitted so far)."""
        ...

    def feedback(self, num_accepted: int) -> None:
        """How many of the last proposal's tokens the target accepted."""
        ...

    def end(self, output_ids: list[int]) -> None:
        """The request finished with these generated tokens."""
        ...


@runtime_checkable
class Spawner(Protocol):
    """A drafter a server can offer: one `spawn()` per request (`DrafterBase` gives one)."""

    def spawn(self) -> "Drafter":
        """A fresh drafter for another request, sharing whatever is heavy and read-only (a model's
        weights, an EAGLE head): the server runs one per request, side by side."""
        ...


@runtime_checkable
class TreeDrafter(Protocol):
    """`needs.trees`."""

    def propose_tree(self, context: list[int], depth: int, top_k: int, budget: int) -> TokenTree:
        """At most `budget` nodes, `depth` levels and `top_k` children per node; called in place of
        `propose` for a row with a `TreeShape`, and `feedback` then gets the length of the accepted
        root-to-node path. The candidates are deterministic given the context (no q):
        verification treats each as one-hot, which keeps sampling exact (see
        `verify.verify_tree_sampling`). Siblings come in the order the drafter prefers them (tried
        in that order when sampling). An empty tree means nothing to propose: a plain step."""
        ...


@runtime_checkable
class Observer(Protocol):
    """`needs.observes`."""

    def observe(self, hidden: torch.Tensor) -> None:
        """The target's hidden states [T, h] of the tokens its cache just committed, in commit order
        (the prompt's at the prefill, after `begin`)."""
        ...


@runtime_checkable
class BatchDrafter(Protocol):
    """`needs.batches`."""

    def batch_key(self) -> object | None:
        """Rows whose drafters give the same key (not None) propose in one call of
        `propose_batch`; None: this row proposes alone."""
        ...

    def batch_member(self) -> "Drafter":
        """The drafter whose `propose_batch` this row joins: itself, or a lookup-first
        combination's learned part."""
        ...

    def propose_batch(self, drafters: list["Drafter"], contexts: list[list[int]], ks: list[int]) -> list[Proposal]:
        """`drafters[i].propose(contexts[i], ks[i])` for rows of one batch key, together (one model
        forward per draft position for a draft model)."""
        ...

    def reserve(self, rows: int, length: int) -> KVCache | None:
        """A server will run up to `rows` requests of up to `length` tokens side by side, each on
        a `spawn()` of this drafter: it may give them one shared, batched cache, which it returns
        (the server sizes its context by what caches take; drafters sharing a model share it)."""
        ...


@runtime_checkable
class PromptReader(Protocol):
    """`needs.reads`."""

    def begin(self, prompt_ids: list[int], sampling=None, generator=None, *, window: int | None = None) -> None:
        """`Drafter.begin`, and for this request a prompt window: read only the prompt's first few
        tokens and its last `window` (None: as the drafter was made). For a row whose output is
        known to copy most of what it needs (a prediction, `prediction.DRAFT_WINDOW`)."""
        ...

    def pending(self, context: list[int]) -> int:
        """Tokens of `context` the drafter must read (a model forward over them) before it can
        draft after it, beyond the few a proposal reads along with its first position: a draft
        model's whole prompt before its first proposal, or the tokens emitted while it was not
        asked. 0 in steady state."""
        ...

    def read(self, context: list[int]) -> None:
        """Read the `pending` tokens of `context` now, so that the next `propose` only drafts: the
        core times the read apart from the drafts, and decides whether it pays at all
        (`policy.AskGate.reads`)."""
        ...

    def keep_within(self, partition: object) -> None:
        """Requests of this drafter may start from what an earlier request of `partition` left
        read (a common prefix of their contexts), and leave theirs; None: nothing is kept. The
        caller names partitions as the target's prefix cache does (the server's tenant and salt)."""
        ...


@runtime_checkable
class SelfSizing(Protocol):
    """`needs.stops`."""

    def stop_by(self, stop) -> None:
        """The `policy.ChainStop` (or None: draft the k asked for) that ends this row's next
        chains; set by the core before each proposal."""
        ...


@runtime_checkable
class LookupFirst(Protocol):
    """`needs.fallback`: a lookup-first combination (`combined.LookupFirstDrafter`)."""

    def propose(self, context: list[int], k: int, fallback_k: int | None = None, learned_first=None) -> Proposal:
        """Lookup's proposal of up to `k` tokens, else up to `fallback_k` from the learned part."""
        ...

    def propose_free(self, context: list[int], k: int, learned_first=None) -> Proposal | None:
        """The proposal that costs no model forward (a lookup's), or None when there is none, or
        when `learned_first(its source)` prefers the learned part: the row then drafts with
        `batch_member()`, in the batched forward of its batch key with the other drafting rows."""
        ...

    def propose_learned(self, context: list[int], n: int) -> Proposal:
        """The learned part's proposal of up to `n` tokens, alone (where `propose_free` gave none)."""
        ...


@runtime_checkable
class Priced(Protocol):
    """`needs.model`."""

    # A model drafter's price of one draft token in plain target steps, where it measured it when
    # loaded (`DraftModelDrafter.measure_cost`); the policy's online estimate starts from it.
    # None: not measured (the policy's prior).
    draft_cost: float | None


# Each optional capability: its `DrafterNeeds` flag -> the methods a drafter declaring it has.
CAPABILITIES: dict[str, type] = {"observes": Observer, "trees": TreeDrafter, "batches": BatchDrafter,
                                 "reads": PromptReader, "stops": SelfSizing, "fallback": LookupFirst,
                                 "model": Priced}


def declared(needs: DrafterNeeds) -> set[str]:
    """The optional capabilities `needs` declares (keys of `CAPABILITIES`)."""
    return {flag for flag in CAPABILITIES if getattr(needs, flag) not in (None, False)}


def missing_capabilities(drafter) -> list[str]:
    """The capabilities a drafter declares without having their methods (empty: it keeps its word)."""
    return sorted(flag for flag in declared(drafter.needs) if not isinstance(drafter, CAPABILITIES[flag]))


class DrafterBase:
    """The no-op parts of the core contract, for drafters to inherit (nothing learned from
    feedback, no per-request state to drop), and a `spawn` that makes a fresh one of its class.
    The optional capabilities are not here: a drafter that declares one writes its methods."""

    name = "drafter"
    needs = DrafterNeeds()

    def spawn(self):
        return type(self)()

    def begin(self, prompt_ids: list[int], sampling=None, generator=None) -> None:
        pass

    def feedback(self, num_accepted: int) -> None:
        pass

    def end(self, output_ids: list[int]) -> None:
        pass


@dataclass(frozen=True)
class TreeShape:
    """The size of the draft trees an engine asks for: `depth` levels, at most `top_k` children
    per node, at most `budget` nodes in all (one target pass scores budget + 1 tokens).

    Written `DEPTHxTOPKxBUDGET` on the command line, e.g. `5x4x24` (EAGLE-2's shape on a GPU;
    smaller budgets suit a CPU, where every scored token costs).
    """

    depth: int = 5
    top_k: int = 4
    budget: int = 24

    def __post_init__(self) -> None:
        for name in ("depth", "top_k", "budget"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise InvalidRequestError(f"draft tree {name} must be an integer >= 1, got {value!r}",
                                          param="draft_tree")

    @classmethod
    def parse(cls, text: str) -> TreeShape:
        """`DEPTHxTOPKxBUDGET`, e.g. `5x4x24`."""
        parts = text.lower().split("x")
        try:
            if len(parts) != 3:
                raise ValueError
            depth, top_k, budget = (int(x) for x in parts)
        except ValueError:
            raise InvalidRequestError(
                f"draft tree must be written DEPTHxTOPKxBUDGET, e.g. 5x4x24; got {text!r}", param="draft_tree"
            ) from None
        return cls(depth, top_k, budget)

    def __str__(self) -> str:
        return f"{self.depth}x{self.top_k}x{self.budget}"


def draft_chain(choose, advance, logits, k: int, more=None) -> Proposal:
    """Draft a chain of up to `k` tokens from a model that drafts one token per pass.

    choose(logits) -> (token, q): the next draft token and its processed distribution (q = None
    for greedy), or (None, None) to stop (a confidence cut-off); advance(token, i) -> the logits
    after feeding draft token number i (0-based). The last draft is never fed: nothing reads its
    logits yet; nor is one after which `more()` (optional) says not to read the next position
    (`policy.ChainStop.more`). Returns the tokens with q stacked to [len(tokens), vocab] (None when
    greedy).
    """
    import torch

    tokens: list[int] = []
    qs = []
    while True:
        token, q = choose(logits)
        if token is None:
            break
        tokens.append(token)
        if q is not None:
            qs.append(q)
        if len(tokens) == k or (more is not None and not more()):
            break
        logits = advance(token, len(tokens) - 1)
    return Proposal(tokens, torch.stack(qs) if qs else None)


def draft_rows(drafters, logits: dict, ks: list[int], advance, more=None) -> list[Proposal]:
    """`draft_chain` for several rows at once: row i (a key of `logits`, its next-token logits)
    drafts up to ks[i] tokens with `drafters[i]._choose`; `advance({i: token})` feeds each still
    drafting row its last token in one batched call and returns {i: logits after it}. Rows not in
    `logits` propose nothing. The last draft of a row is never fed: nothing reads its logits yet;
    nor is one after which `more(i)` (optional) says not to read row i's next position."""
    import torch

    tokens: dict[int, list[int]] = {i: [] for i in logits}
    qs: dict[int, list] = {i: [] for i in logits}
    active = set(logits)
    while active:
        feed = {}
        for i in sorted(active):
            token, q = drafters[i]._choose(logits[i])
            if token is None:
                active.discard(i)
                continue
            tokens[i].append(token)
            if q is not None:
                qs[i].append(q)
            if len(tokens[i]) == ks[i] or (more is not None and not more(i)):
                active.discard(i)
            else:
                feed[i] = token
        if feed:
            logits = {**logits, **advance(feed)}
    return [Proposal(tokens[i], torch.stack(qs[i]) if qs[i] else None) if i in tokens else Proposal([])
            for i in range(len(drafters))]


def common_prefix_length(seen: list[int], context: Sequence[int]) -> int:
    """Length of the longest common prefix of `seen` and `context`.

    Drafters that index their context incrementally call this to learn where the new tokens begin.
    The usual case (context = seen + new tokens) is one C-speed slice comparison; only a context that
    disagrees with what was seen falls back to the Python loop.
    """
    m = len(seen)
    if len(context) >= m:
        prefix = context[:m]
        if (prefix if isinstance(prefix, list) else list(prefix)) == seen:
            return m
    n = min(m, len(context))
    i = 0
    while i < n and seen[i] == context[i]:
        i += 1
    return i


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_ngram_range(min_ngram: int, max_ngram: int) -> None:
    """Shared constructor validation of the lookup drafters."""
    if not _is_int(min_ngram) or not _is_int(max_ngram) or not 1 <= min_ngram <= max_ngram:
        raise InvalidRequestError(
            f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, "
            f"got min_ngram={min_ngram}, max_ngram={max_ngram}",
            param="min_ngram" if not (_is_int(min_ngram) and min_ngram >= 1) else "max_ngram",
        )


def check_k(k: int) -> None:
    if not _is_int(k) or k < 0:
        raise InvalidRequestError(f"draft length k must be an integer >= 0, got {k!r}", param="k")
