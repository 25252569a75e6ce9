"""Prompt lookup: propose what followed the last earlier occurrence of the context's tail.

Text that quotes or edits its prompt (summaries, code edits, RAG answers) repeats long spans of it.
If the last n tokens of the context appeared before, the tokens that followed them then are a good
guess for what follows now, and costs no model call at all.

Index. Searching the context from scratch each step is O(len * n) Python per call. Instead the
drafter keeps `index: n-gram tuple -> positions right after each of its occurrences` (oldest
first), and on each call adds only the n-grams that became complete since the last call. An n-gram
is indexed only once at least one token follows it (its end position < len(context)), which does
two things at once: the context's own tail is never in the index, so a lookup of the tail finds
*earlier* occurrences; and every hit has a non-empty continuation. A chain follows the most recent
occurrence (the last position); a tree merges the continuations of several.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdec.drafters.base import DrafterBase, DrafterNeeds, Proposal, check_k, check_ngram_range, common_prefix_length
from specdec.verify import TokenTree


class NgramDrafter(DrafterBase):
    """Prompt-lookup drafter over the current request's context (no cross-request state).

    propose(context, k): for n = max_ngram down to min_ngram, look up the last n tokens of
    `context`; on the first (longest) hit propose up to k tokens that followed that occurrence,
    stopping at the end of the context. No hit: an empty Proposal (the engine does a plain step).

    propose_tree(context, depth, top_k, budget): the distinct continuations of several earlier
    occurrences of the tail, merged into a trie (see `propose_tree`).
    """

    name = "ngram"
    # Proposal.source = the length of the n-gram the draft follows; trees of several occurrences.
    needs = DrafterNeeds(trees=True, labels_proposals=True)

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        check_ngram_range(min_ngram, max_ngram)
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._tokens: list[int] = []  # the context indexed so far
        # tuple of n tokens (all n in [min_ngram, max_ngram] share one dict: tuples of different
        # lengths never compare equal) -> positions right after its indexed occurrences, in order
        self._index: dict[tuple[int, ...], list[int]] = {}
        self._next_end = 0  # n-grams ending before this position (exclusive end) are indexed

    def spawn(self) -> "NgramDrafter":
        return NgramDrafter(self.max_ngram, self.min_ngram)

    def begin(self, prompt_ids: list[int], sampling=None, generator=None) -> None:
        # Deterministic lookup: the request's sampling params and generator are not needed.
        self._reset()
        self._sync(prompt_ids)

    def propose(self, context: list[int], k: int) -> Proposal:
        check_k(k)
        self._sync(context)
        L = len(self._tokens)
        if k == 0:
            return Proposal([])
        for n in range(min(self.max_ngram, L), self.min_ngram - 1, -1):
            ends = self._index.get(tuple(self._tokens[L - n :]))
            if ends is not None:
                start = ends[-1]  # the most recent occurrence
                # start < L by construction of the index; the slice stops at the context's end
                return Proposal(self._tokens[start : min(start + k, L)], source=n)
        return Proposal([])

    def propose_tree(self, context: list[int], depth: int = 5, top_k: int = 4, budget: int = 24) -> TokenTree:
        """A trie of what followed earlier occurrences of the context's tail.

        Continuations are inserted in the order `propose` would prefer them: longest n-gram first,
        and within one n the most recent occurrence first (at most `budget` occurrences per n:
        one that adds no node repeats a preferred one). Each is cut at `depth` tokens, at the
        context's end, at a node that already has `top_k` children, and when the tree holds
        `budget` nodes. Siblings are in insertion order, so the preferred one is tried first. The
        first path is the chain `propose(context, min(depth, budget))` returns.
        """
        check_k(depth)
        self._sync(context)
        toks, L = self._tokens, len(self._tokens)
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[int, dict[int, int]] = {-1: {}}  # node -> {token: child node}; -1 = root
        if depth == 0 or top_k < 1 or budget < 1:
            return TokenTree(tokens, parents)
        for n in range(min(self.max_ngram, L), self.min_ngram - 1, -1):
            for start in reversed(self._index.get(tuple(toks[L - n :]), [])[-budget:]):
                node = -1
                for token in toks[start : min(start + depth, L)]:
                    child = children[node].get(token)
                    if child is None:
                        if len(children[node]) >= top_k or len(tokens) >= budget:
                            break
                        tokens.append(token)
                        parents.append(node)
                        child = len(tokens) - 1
                        children[node][token] = child
                        children[child] = {}
                    node = child
                if len(tokens) >= budget:
                    return TokenTree(tokens, parents)
        return TokenTree(tokens, parents)

    def feedback(self, num_accepted: int) -> None:
        # Lookup has nothing to tune; the engine's AdaptiveDraftLength handles k.
        pass

    def end(self, output_ids: list[int]) -> None:
        # Nothing crosses requests; drop the index now rather than at the next begin.
        self._reset()

    # -- index maintenance ----------------------------------------------------------------------

    def _reset(self) -> None:
        self._tokens = []
        self._index = {}
        self._next_end = 0

    def _sync(self, context: Sequence[int]) -> None:
        """Bring the index up to `context`: add new n-grams, or rebuild if the context diverged."""
        if common_prefix_length(self._tokens, context) < len(self._tokens):
            # Not an extension of what we indexed (a new request without begin, or a rollback):
            # positions stored in the index may point at tokens that no longer exist. Rebuild.
            self._reset()
        self._tokens.extend(context[len(self._tokens) :])
        toks, index = self._tokens, self._index
        L = len(toks)
        # Index every n-gram whose exclusive end `e` satisfies e < L (a token follows it), in
        # increasing e so each list ends with the most recent occurrence.
        for e in range(self._next_end, L):
            for n in range(self.min_ngram, min(self.max_ngram, e) + 1):
                key = tuple(toks[e - n : e])
                ends = index.get(key)
                if ends is None:
                    index[key] = [e]
                else:
                    ends.append(e)
        self._next_end = max(self._next_end, L)
