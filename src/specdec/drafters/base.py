"""The drafter protocol, its return value, and the two adaptive draft-length rules.

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

A drafter that can offer several candidates per position also has `propose_tree(context, depth,
top_k, budget) -> TokenTree` (see `TreeDrafter`); an engine built with a `TreeShape` calls it in
place of `propose`, and `feedback` then gets the length of the accepted root-to-node path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from specdec.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

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


@runtime_checkable
class Drafter(Protocol):
    """What the engine needs from a drafter. State lives in the drafter object, per request."""

    name: str

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
class TreeDrafter(Drafter, Protocol):
    """A drafter that can also propose a token tree (EAGLE's head, n-gram lookup)."""

    def propose_tree(self, context: list[int], depth: int, top_k: int, budget: int) -> TokenTree:
        """At most `budget` nodes, `depth` levels and `top_k` children per node, following `context`.

        The candidates are deterministic given the context (no q): verification treats each as
        one-hot, which keeps sampling exact (see `verify.verify_tree_sampling`). Siblings come in
        the order the drafter prefers them (tried in that order when sampling). An empty tree
        means nothing to propose: the engine does a plain step.
        """
        ...


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


@dataclass
class AdaptiveDraftLength:
    """The +2 / -1 draft-length heuristic (as in HF transformers' assisted generation).

    Pure per-request state owned by the engine: after a step where every proposed token was
    accepted the drafter is doing well, so ask for two more next time (up to `k_max`); after any
    rejection ask for one fewer (down to 1). A step with nothing proposed (a lookup drafter found no
    match) says nothing about draft quality, so `k` stays as it is.
    """

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


def draft_chain(choose, advance, logits, k: int) -> Proposal:
    """Draft a chain of up to `k` tokens from a model that drafts one token per pass.

    choose(logits) -> (token, q): the next draft token and its processed distribution (q = None
    for greedy), or (None, None) to stop (a confidence cut-off); advance(token, i) -> the logits
    after feeding draft token number i (0-based). The last draft is never fed: nothing reads its
    logits yet. Returns the tokens with q stacked to [len(tokens), vocab] (None when greedy).
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
        if len(tokens) == k:
            break
        logits = advance(token, len(tokens) - 1)
    return Proposal(tokens, torch.stack(qs) if qs else None)


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


@dataclass
class CostAwareDraftLength:
    """Per kind of proposal, the draft length with the best expected speedup (Leviathan et al.).

    A verify step over k >= 1 drafts costs about 1 + c0 + c k plain steps (`verify_overhead` = c0,
    what scoring more than one token costs at all; `verify_cost` = c, the price of each more token;
    the engine's measured defaults per device and quantisation are in `engine.DEFAULT_VERIFY_COSTS`)
    and yields (1 - a^(k+1)) / (1 - a) tokens on average when each draft is accepted with
    probability a once its predecessors were. So the best k maximises

        (1 - a^(k+1)) / ((1 - a) (1 + c0 + c k))      over k = 1 .. k_max,

    When greedy verification screens its rows (`Engine._verify_screened`), a share f
    (`screened_share`) of each token's price, the output head's, is paid only for the rows up
    to the first rejection: a + a^2 + ... + a^k of them on average. The cost is then
    1 + c0 + c ((1 - f) k + f (a + ... + a^k)), which makes a long draft of an uncertain kind cheaper.

    against 1 for k = 0 (no drafting: a plain step), which wins when a is low. The acceptance a is measured per kind of
    proposal (`Proposal.source`): for the lookup drafters the length of the matched n-gram, since
    a guess that follows a one-token match is a far weaker one than a guess after a four-token
    match. Estimate: accepted tokens over accepted tokens + rejections (the maximum-likelihood a of
    that geometric model; a step that accepted all its drafts shows no rejection), started from a
    prior of `prior_accepted` / `prior_rejected` pseudo-counts so that a new kind is tried with a
    short draft. Pure per-request state owned by the engine, like `AdaptiveDraftLength`: it depends
    only on the verdicts, so a seeded request stays reproducible.
    """

    k_max: int
    verify_cost: float
    verify_overhead: float = 0.0
    screened_share: float = 0.0
    prior_accepted: float = 1.5
    prior_rejected: float = 1.0

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

    def acceptance(self, source: object = None) -> float:
        accepted, rejected = self._counts.get(source, (0.0, 0.0))
        return (accepted + self.prior_accepted) / (accepted + rejected + self.prior_accepted + self.prior_rejected)

    def next_k(self, source: object = None) -> int:
        """The k in 0 .. k_max with the highest expected tokens per unit of step cost."""
        a, c, f = self.acceptance(source), self.verify_cost, self.screened_share
        best_k, best, expected = 0, 1.0, 1.0  # k = 0: one token for one plain step
        for k in range(1, self.k_max + 1):
            expected += a**k  # 1 + a + ... + a^k
            value = expected / (1 + self.verify_overhead + c * ((1 - f) * k + f * (expected - 1)))
            if value > best:
                best_k, best = k, value
        return best_k

    def update(self, num_proposed: int, num_accepted: int, source: object = None) -> None:
        if not 0 <= num_accepted <= num_proposed:
            raise ValueError(f"need 0 <= num_accepted <= num_proposed, got {num_accepted}, {num_proposed}")
        if num_proposed == 0:
            return
        counts = self._counts.setdefault(source, [0.0, 0.0])
        counts[0] += num_accepted
        counts[1] += num_accepted < num_proposed
