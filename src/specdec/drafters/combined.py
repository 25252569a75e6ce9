"""Prompt lookup where it finds a match, a learned drafter where it does not (`ngram+eagle`).

The two kinds of drafter are good at different text. Lookup is free and often right for many
tokens at once, but only where the text repeats itself (summaries, code edits, retrieved passages);
a learned drafter (the EAGLE head, a draft model) pays a small forward per token but guesses from
the target's own features anywhere. Asking lookup first and the learned drafter only where lookup
has nothing keeps lookup's long free drafts and fills its gaps.

Each proposal says where it came from (`Proposal.source`): the lookup's own label (its match
length) or `LEARNED`, so the engine's cost-aware draft length keeps a separate acceptance estimate
for each and sizes the learned drafts by theirs (`fallback_k`). Verification is the same for both,
so the combination is exactly as lossless as its parts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specdec.drafters.base import DrafterBase, DrafterNeeds, Proposal
from specdec.verify import TokenTree

if TYPE_CHECKING:
    from specdec.models.kv_cache import KVCache

LEARNED = "learned"  # Proposal.source of the learned drafter's guesses


class LookupFirstDrafter(DrafterBase):
    """`lookup` (ngram / suffix) first; `learned` (an EAGLE head or a draft model) when the lookup
    proposes nothing. `fallback_k` caps the learned drafter's chain when the engine gives no
    length of its own for it. Its `needs` are the union of its parts': it labels its proposals
    (lookup's labels, LEARNED for the learned ones), observes what the learned part observes, and
    drafts trees when both parts do."""

    def __init__(self, lookup, learned, fallback_k: int = 4, prompt_window: int | None = None):
        self.lookup = lookup
        self.learned = learned
        self.fallback_k = fallback_k
        # The learned part's prompt window for this row (`PromptReader.begin`; None: its own).
        self.prompt_window = prompt_window if learned.needs.reads else None
        self.name = f"{lookup.name}+{learned.name}"
        self.needs = combine_needs(lookup.needs, learned.needs)
        self._last = lookup

    @property
    def draft_cost(self) -> float | None:
        return self.learned.draft_cost

    def reserve(self, rows: int, length: int) -> KVCache | None:
        return self.learned.reserve(rows, length)

    def spawn(self) -> "LookupFirstDrafter":
        return LookupFirstDrafter(self.lookup.spawn(), self.learned.spawn(), self.fallback_k, self.prompt_window)

    def begin(self, prompt_ids: list[int], sampling=None, generator=None) -> None:
        self.lookup.begin(prompt_ids, sampling, generator)
        if self.prompt_window is None:
            self.learned.begin(prompt_ids, sampling, generator)
        else:
            self.learned.begin(prompt_ids, sampling, generator, window=self.prompt_window)
        self._last = self.lookup

    def observe(self, hidden) -> None:
        # Every committed token's feature goes to the learned drafter, lookup steps included: it
        # rebuilds its state from them the next time it is asked.
        self.learned.observe(hidden)

    def batch_key(self) -> object | None:
        # In a batch, the rows whose lookup found nothing draft with the learned part, in its one
        # batched forward together with the learned drafter's own rows (`propose_free`).
        return self.learned.batch_key()

    def batch_member(self):
        return self.learned

    def propose_batch(self, drafters, contexts, ks):
        # `drafters` are batch members (learned parts, `batch_member`): their own batched call.
        return self.learned.propose_batch(drafters, contexts, ks)

    def pending(self, context: list[int]) -> int:
        return self.learned.pending(context)

    def read(self, context: list[int]) -> None:
        self.learned.read(context)

    def keep_within(self, partition: object) -> None:
        self.learned.keep_within(partition)

    def stop_by(self, stop) -> None:
        # Only the learned part's chains are sized by their price; a lookup's is cut by the rule.
        self.learned.stop_by(stop)

    def propose_free(self, context: list[int], k: int, learned_first=None) -> Proposal | None:
        """Lookup's proposal of up to `k` tokens, or None (the learned part drafts next): where
        lookup finds nothing, or where `learned_first(source)` says the learned drafter is worth
        more than a lookup guess of that kind (a short match's)."""
        proposal = self.lookup.propose(context, k)
        if proposal.tokens and not (learned_first is not None and learned_first(proposal.source)):
            self._last = self.lookup
            return proposal
        self._last = self.learned
        return None

    def propose(self, context: list[int], k: int, fallback_k: int | None = None, learned_first=None) -> Proposal:
        """Lookup's proposal of up to `k` tokens if it has one (and `learned_first` does not prefer
        the learned drafter, see `propose_free`), else up to `fallback_k` (default
        `self.fallback_k`, never more than `k`) from the learned drafter, labelled `LEARNED`."""
        proposal = self.propose_free(context, k, learned_first)
        if proposal is not None:
            return proposal
        return self.propose_learned(context, min(k, self.fallback_k if fallback_k is None else fallback_k))

    def propose_learned(self, context: list[int], n: int) -> Proposal:
        """The learned part's proposal of up to `n` tokens (none for n <= 0), labelled LEARNED: what
        `propose` drafts where `propose_free` gave nothing."""
        if n <= 0:
            return Proposal([])
        learned = self.learned.propose(context, n)
        return Proposal(learned.tokens, learned.q, source=LEARNED)

    def propose_tree(self, context: list[int], depth: int = 5, top_k: int = 4, budget: int = 24) -> TokenTree:
        """With both parts drafting trees (ngram and the EAGLE head): lookup's tree, else the head's."""
        if not self.needs.trees:
            raise NotImplementedError(f"drafter {self.name!r} does not draft trees (needs.trees is False)")
        tree = self.lookup.propose_tree(context, depth, top_k, budget)
        if len(tree):
            self._last = self.lookup
            return tree
        self._last = self.learned
        return self.learned.propose_tree(context, depth, top_k, budget)

    def feedback(self, num_accepted: int) -> None:
        self._last.feedback(num_accepted)

    def end(self, output_ids: list[int]) -> None:
        self.lookup.end(output_ids)
        self.learned.end(output_ids)


def combine_needs(lookup: DrafterNeeds, learned: DrafterNeeds) -> DrafterNeeds:
    """What a combination can do: the learned part's capabilities (observes, batches, reads, stops,
    model), trees where both parts draft them, and its own labels and fallback. Its methods of each
    capability forward to the part that has it; the core calls them only where this declares it."""
    return DrafterNeeds(observes=learned.observes, trees=lookup.trees and learned.trees, batches=learned.batches,
                        reads=learned.reads, stops=learned.stops, fallback=True, labels_proposals=True,
                        model=learned.model)


def lookup_first(lookup, learned, fallback_k: int = 4) -> LookupFirstDrafter:
    """The combination (it drafts trees when both parts can)."""
    return LookupFirstDrafter(lookup, learned, fallback_k)
