"""Lookup drafters (prompt lookup, suffix cache) and the two adaptive draft-length rules."""

import random

import pytest
import torch

from specdec.drafters import (
    Drafter,
    NgramDrafter,
    Proposal,
    SuffixDrafter,
)
from specdec.errors import InvalidRequestError
from specdec.policy import AdaptiveDraftLength, CostAwareDraftLength


def brute_force_lookup(context, k, max_ngram, min_ngram):
    """Reference prompt lookup: longest n first, then the most recent earlier occurrence."""
    L = len(context)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n > L:
            continue
        suffix = context[L - n :]
        for s in range(L - n - 1, -1, -1):  # earlier than the suffix itself, newest first
            if context[s : s + n] == suffix:
                return context[s + n : s + n + k]
    return []


# -- Proposal / protocol ---------------------------------------------------------------------------


def test_drafters_satisfy_protocol():
    assert isinstance(NgramDrafter(), Drafter)
    assert isinstance(SuffixDrafter(), Drafter)


def test_proposal_checks_q_shape():
    Proposal([1, 2], torch.zeros(2, 10))
    with pytest.raises(ValueError):
        Proposal([1, 2], torch.zeros(3, 10))


# -- NgramDrafter ----------------------------------------------------------------------------------


def test_ngram_finds_continuation_of_repeated_phrase():
    d = NgramDrafter(max_ngram=3)
    prompt = [5, 6, 7, 8, 9, 10, 11, 1, 2, 5, 6, 7]
    d.begin(prompt)
    assert d.propose(prompt, 4).tokens == [8, 9, 10, 11]


def test_ngram_prefers_longer_ngram_over_more_recent_shorter():
    # "3" alone last appeared before 40, but "2 3" appeared before 30: the 2-gram wins.
    ctx = [2, 3, 30, 31, 9, 3, 40, 41, 2, 3]
    d = NgramDrafter(max_ngram=2)
    assert d.propose(ctx, 2).tokens == [30, 31]
    # With only unigrams, the most recent "3" wins.
    assert NgramDrafter(max_ngram=1).propose(ctx, 2).tokens == [40, 41]


def test_ngram_prefers_most_recent_match():
    ctx = [1, 2, 10, 1, 2, 20, 1, 2, 30, 9, 1, 2]
    assert NgramDrafter(max_ngram=2).propose(ctx, 1).tokens == [30]


def test_ngram_returns_empty_without_match():
    d = NgramDrafter(max_ngram=3, min_ngram=2)
    assert d.propose([1, 2, 3, 4, 5], 4) == Proposal([])
    assert d.propose([], 4).tokens == []
    assert NgramDrafter().propose([7], 3).tokens == []


def test_ngram_respects_k_and_context_end():
    ctx = [1, 2, 3, 4, 5, 6, 1, 2]
    d = NgramDrafter(max_ngram=2)
    assert d.propose(ctx, 2).tokens == [3, 4]
    assert d.propose(ctx, 0).tokens == []
    # The match's continuation runs into the suffix itself and stops at the end of context.
    ctx = [7, 7, 7, 7]
    assert NgramDrafter(max_ngram=2).propose(ctx, 5).tokens == [7]
    ctx = [1, 2, 3, 1, 2]
    assert NgramDrafter(max_ngram=2).propose(ctx, 10).tokens == [3, 1, 2]


def test_ngram_incremental_index_matches_brute_force():
    rng = random.Random(1234)
    for trial in range(60):
        max_ngram = rng.randint(1, 4)
        min_ngram = rng.randint(1, max_ngram)
        vocab = rng.randint(2, 6)
        d = NgramDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 10))]
        d.begin(prompt)
        ctx = list(prompt)
        for _ in range(80):
            # grow by 1..3 tokens between calls, like an engine accepting drafts
            ctx.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 3)))
            k = rng.randint(1, 6)
            got = d.propose(ctx, k).tokens
            assert got == brute_force_lookup(ctx, k, max_ngram, min_ngram), (trial, ctx, k)
            assert len(got) <= k
        d.end(ctx[len(prompt) :])


def test_ngram_tree_merges_continuations():
    d = NgramDrafter(max_ngram=2)
    context = [1, 2, 3, 4, 9, 1, 2, 5, 6, 8, 2, 7, 1, 2]
    d.begin(context)
    tree = d.propose_tree(context, depth=3, top_k=3, budget=20)
    # "1 2" -> [5, 6, 8] (most recent first), [3, 4, 9]; then "2" -> [7, 1, 2] (5 and 3 known).
    assert tree.tokens[:3] == [5, 6, 8] and tree.children(-1) == [0, 3, 6]
    assert [tree.tokens[c] for c in tree.children(-1)] == [5, 3, 7]
    assert tree.tokens[:3] == d.propose(context, 3).tokens  # the first path is the chain
    assert len(d.propose_tree(context, depth=3, top_k=2, budget=20).children(-1)) == 2
    small = d.propose_tree(context, depth=3, top_k=3, budget=4)
    assert len(small) == 4 and small.tokens == [5, 6, 8, 3]
    assert len(d.propose_tree([42, 43], depth=3, top_k=3, budget=4)) == 0  # no match: a plain step


def test_ngram_begin_resets_and_divergent_context_rebuilds():
    d = NgramDrafter(max_ngram=2)
    d.begin([1, 2, 3, 1, 2])
    assert d.propose([1, 2, 3, 1, 2], 3).tokens == [3, 1, 2]
    # New request: nothing of the old one may leak.
    d.begin([1, 2, 9])
    assert d.propose([1, 2, 9], 3).tokens == []
    # A context that does not extend the indexed one (no begin) is handled by rebuilding.
    ctx = [4, 5, 6, 4, 5]
    assert d.propose(ctx, 3).tokens == brute_force_lookup(ctx, 3, 2, 1)


class CountingIndex(dict):
    """The n-gram index with a count of its look-ups (`get`, the only way `NgramDrafter` reads it)."""

    gets = 0

    def get(self, key, default=None):
        self.gets += 1
        return super().get(key, default)


def test_ngram_indexes_a_growing_context_incrementally():
    # 3000 calls on contexts growing from 500 to 3500 tokens. Incremental indexing does a bounded
    # amount of work per new token (one look-up per n-gram size to index it, at most one per size
    # to propose); a search or a rebuild from scratch per call would do work growing with the
    # context, ~10^7 look-ups here. The proposals stay those of the reference lookup.
    rng = random.Random(0)
    max_ngram = 3
    d = NgramDrafter(max_ngram=max_ngram)
    ctx = [rng.randrange(50) for _ in range(500)]
    d.begin(ctx)
    counted = CountingIndex(d._index)
    d._index = counted
    calls = 3000
    for i in range(calls):
        ctx.append(rng.randrange(50))
        proposal = d.propose(ctx, 5)
        if i % 500 == 0:
            assert proposal.tokens == brute_force_lookup(ctx, 5, max_ngram, 1)
    assert d._index is counted, "the index was rebuilt instead of extended"
    assert counted.gets <= 2 * max_ngram * calls


def test_ngram_invalid_params():
    with pytest.raises(InvalidRequestError):
        NgramDrafter(max_ngram=2, min_ngram=3)
    with pytest.raises(InvalidRequestError):
        NgramDrafter(max_ngram=3, min_ngram=0)
    with pytest.raises(InvalidRequestError):
        NgramDrafter(max_ngram=0, min_ngram=0)
    with pytest.raises(InvalidRequestError):
        NgramDrafter().propose([1, 2], -1)


# -- SuffixDrafter ---------------------------------------------------------------------------------


def test_suffix_learns_from_earlier_request():
    d = SuffixDrafter(max_ngram=3)
    d.begin([100, 101])
    d.end([10, 11, 12, 13, 14])
    # A new request whose tail matches the earlier output gets its continuation drafted.
    prompt = [200, 10, 11]
    d.begin(prompt)
    assert d.propose(prompt, 3).tokens == [12, 13, 14]


def test_suffix_counts_current_request_immediately():
    d = SuffixDrafter(max_ngram=2)
    prompt = [1, 2, 3, 4, 9]
    d.begin(prompt)
    ctx = prompt + [1, 2]
    assert d.propose(ctx, 2).tokens == [3, 4]


def test_suffix_picks_most_frequent_continuation():
    d = SuffixDrafter(max_ngram=2)
    for out in ([5, 6, 1], [5, 6, 1], [5, 6, 2]):
        d.begin([])
        d.end(out)
    d.begin([9])
    assert d.propose([9, 5, 6], 1).tokens == [1]
    # Greedy token by token: after "5 6" comes 1 (count 2), and nothing follows "6 1".
    assert d.propose([9, 5], 4).tokens == [6, 1]


def test_suffix_ties_go_to_most_recent():
    d = SuffixDrafter(max_ngram=1)
    d.end([3, 7])
    d.end([3, 8])
    assert d.propose([3], 1).tokens == [8]
    d.end([3, 7])  # now 7 has count 2
    assert d.propose([3], 1).tokens == [7]


def test_suffix_no_entry_gives_empty_and_respects_k():
    d = SuffixDrafter()
    assert d.propose([1, 2, 3], 4).tokens == []
    d.end(list(range(20)))
    assert d.propose([0], 5).tokens == [1, 2, 3, 4, 5]
    assert d.propose([0], 0).tokens == []
    assert d.propose([19], 5).tokens == []


def test_suffix_does_not_double_count_emitted_tokens():
    d = SuffixDrafter(max_ngram=1)
    prompt = [1, 2]
    d.begin(prompt)
    d.propose(prompt + [1, 3], 2)
    d.propose(prompt + [1, 3, 1], 2)
    d.end([1, 3, 1, 3])
    # The stream was 1 2 1 3 1 3: "1" was followed by 2 once and by 3 twice.
    assert d._counts[(1,)] == {2: 1, 3: 2}


def test_suffix_eviction_bounds_entries():
    rng = random.Random(7)
    d = SuffixDrafter(max_ngram=3, max_entries=50)
    for _ in range(20):
        d.begin([rng.randrange(30) for _ in range(20)])
        assert d.num_entries <= 50
        d.end([rng.randrange(30) for _ in range(20)])
        assert d.num_entries <= 50
    assert d.num_entries == 50
    # The most recent request's statistics survive eviction.
    d.begin([])
    d.end([900, 901, 902])
    assert d.propose([900], 2).tokens == [901, 902]


def test_suffix_invalid_params():
    with pytest.raises(InvalidRequestError):
        SuffixDrafter(max_ngram=1, min_ngram=2)
    with pytest.raises(InvalidRequestError):
        SuffixDrafter(max_entries=0)
    with pytest.raises(InvalidRequestError):
        SuffixDrafter().propose([1], -2)


# -- AdaptiveDraftLength ---------------------------------------------------------------------------


def test_adaptive_draft_length_trajectory():
    a = AdaptiveDraftLength(k=4, k_max=9)
    trajectory = [a.next_k()]
    for accepted_all in (True, True, True, False, False, True):
        k = a.next_k()
        a.update(k, k if accepted_all else k // 2)
        trajectory.append(a.next_k())
    assert trajectory == [4, 6, 8, 9, 8, 7, 9]
    for _ in range(20):
        a.update(a.next_k(), 0)
    assert a.next_k() == 1
    a.update(0, 0)  # nothing proposed: no information, k unchanged
    assert a.next_k() == 1


def test_adaptive_draft_length_invalid():
    with pytest.raises(InvalidRequestError):
        AdaptiveDraftLength(k=0, k_max=4)
    with pytest.raises(InvalidRequestError):
        AdaptiveDraftLength(k=5, k_max=4)
    with pytest.raises(ValueError):
        AdaptiveDraftLength(k=2, k_max=4).update(2, 3)


# -- CostAwareDraftLength --------------------------------------------------------------------------


def expected_speedup(a: float, k: int, c: float, c0: float, f: float = 0.0) -> float:
    """Leviathan et al.'s expected tokens per unit of cost, written out as sums; a share f of each
    token's cost is paid only for the rows reached by acceptance (a^1 .. a^k of them)."""
    rows_reached = sum(a**i for i in range(1, k + 1))
    return sum(a**i for i in range(k + 1)) / (1 + (c0 + c * ((1 - f) * k + f * rows_reached) if k else 0))


@pytest.mark.parametrize("c,c0,f", [(0.03, 0.0, 0.0), (0.2, 0.0, 0.0), (0.5, 0.0, 0.0), (0.14, 0.5, 0.0),
                                    (0.16, 0.0, 0.45), (0.5, 0.2, 0.9)])
def test_cost_aware_length_maximises_the_expected_speedup(c, c0, f):
    rule = CostAwareDraftLength(k_max=12, verify_cost=c, verify_overhead=c0, screened_share=f)
    rng = random.Random(0)
    for _ in range(200):
        proposed = rng.randint(1, 12)
        rule.update(proposed, rng.randint(0, proposed), source=rng.choice([1, 2, 3]))
    for source in (1, 2, 3, "never seen"):
        a = rule.acceptance(source)
        best = max(range(13), key=lambda k: (expected_speedup(a, k, c, c0, f), -k))
        assert rule.next_k(source) == best


def test_cost_aware_length_follows_each_kind():
    rule = CostAwareDraftLength(k_max=8, verify_cost=0.2)
    first = rule.next_k(4)
    assert 1 <= first < 8  # a new kind starts from the prior: a short draft
    for _ in range(20):
        rule.update(8, 8, source=4)  # long matches: everything accepted
        rule.update(5, 0, source=1)  # one-token matches: nothing accepted
    assert rule.next_k(4) == 8
    assert rule.next_k(1) == 0  # acceptance below the cost of a token: do a plain step
    assert rule.acceptance(1) < 0.2 < 0.9 < rule.acceptance(4)
    rule.update(0, 0, source=2)  # nothing proposed: no information
    assert rule.next_k(2) == rule.next_k("unseen")


def test_cost_aware_length_invalid():
    with pytest.raises(InvalidRequestError):
        CostAwareDraftLength(k_max=0, verify_cost=0.2)
    with pytest.raises(InvalidRequestError):
        CostAwareDraftLength(k_max=4, verify_cost=0)
    with pytest.raises(InvalidRequestError):
        CostAwareDraftLength(k_max=4, verify_cost=0.2, verify_overhead=-1)
    with pytest.raises(InvalidRequestError, match="screened_share"):
        CostAwareDraftLength(k_max=4, verify_cost=0.2, screened_share=1.0)
    with pytest.raises(ValueError):
        CostAwareDraftLength(k_max=4, verify_cost=0.2).update(2, 3)


def test_lookup_proposals_name_their_match_length():
    context = [5, 6, 7, 8, 1, 2, 9, 5, 6, 7]
    assert NgramDrafter(max_ngram=3).propose(context, 4) == Proposal([8, 1, 2, 9], source=3)
    assert NgramDrafter(max_ngram=3).propose([1, 2, 3, 1], 2).source == 1
    suffix = SuffixDrafter(max_ngram=3)
    suffix.begin(context)
    assert suffix.propose(context, 2).source == 3
