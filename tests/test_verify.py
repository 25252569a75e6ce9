"""verify.py: hand-made cases, greedy agreement, and the exact-distribution test.

The exact-distribution test: a toy target and drafter over a 5-token vocabulary are first-order
Markov chains (fixed random logit tables indexed by the last token), so the exact joint
distribution of the first N = 3 generated tokens under the target alone can be enumerated
(V**N cells). Many speculative runs (draft k tokens from q, verify, repeat) must pass a
chi-square goodness-of-fit test against it, and deliberately broken rules must fail the same test
(the test has power).
"""

import pytest
import torch
from scipy.stats import chisquare

from specdec.sampling import SamplingParams, make_generator, process_logits, sample
from specdec.verify import Verdict, first_proven_rejection, verify_greedy, verify_greedy_best, verify_greedy_rows, \
    verify_sampling

# ---------------------------------------------------------------- hand-made cases


def test_verdict_properties():
    v = Verdict([3, 1], 4, "recovered")
    assert v.num_accepted == 2 and v.tokens == [3, 1, 4]


def test_screened_rejection_is_certain_and_ties_go_to_the_lowest_id():
    # Columns [2, 5, 7]; draft [5, 7, 2, 5]. Row 0: 5 wins its screen (no proof). Row 1: 5 beats 7.
    ids = torch.tensor([2, 5, 7])
    cols = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert first_proven_rejection(cols, ids, [5, 7, 2, 5]) == 1
    # A tie between 2 and 5 rejects 5 (2 has the lower id) but not 2.
    tie = torch.tensor([[1.0, 1.0, 0.0]])
    assert first_proven_rejection(tie, ids, [5]) == 0
    assert first_proven_rejection(tie, ids, [2]) == 1
    # An unscreened draft token proves nothing: the next screened row decides.
    assert first_proven_rejection(cols[:2], ids, [9, 7]) == 1
    assert first_proven_rejection(cols[:1], ids, [9]) == 1
    assert first_proven_rejection(cols[:0], ids, []) == 0


def test_greedy_on_screened_rows_gives_the_full_verdict():
    # Random logits with many near-ties, drafts that partly follow the argmax, random screens that
    # hold the drafts: verifying rows 0..j only must give verify_greedy's verdict on all rows.
    g = torch.Generator().manual_seed(0)
    vocab = 12
    checked_short = 0
    for trial in range(400):
        k = int(torch.randint(1, 6, (1,), generator=g))
        logits = torch.randint(0, 4, (k + 1, vocab), generator=g).float()  # integers: many ties
        best = logits.argmax(-1).tolist()
        draft = [best[i] if torch.rand(1, generator=g) < 0.7 else int(torch.randint(0, vocab, (1,), generator=g))
                 for i in range(k)]
        screen = set(torch.randperm(vocab, generator=g)[: int(torch.randint(1, vocab, (1,), generator=g))].tolist())
        ids = torch.tensor(sorted(screen.union(draft)))
        j = first_proven_rejection(logits[:, ids], ids, draft)
        assert verify_greedy_rows(logits[: j + 1], draft) == verify_greedy(logits, draft)
        # The same from the rows' argmax alone (what the engine hands over from `head_argmax`).
        assert verify_greedy_best(best[: j + 1], draft) == verify_greedy(logits, draft)
        checked_short += j < k
    assert checked_short > 50  # the screen did cut rows in many trials


def test_greedy_rows_refuses_a_screen_that_was_wrong():
    logits = torch.tensor([[0.0, 1.0], [0.0, 1.0]])  # the target takes token 1 at row 0
    with pytest.raises(RuntimeError, match="screened as rejected"):
        verify_greedy_rows(logits[:1], [1])  # row 0 claimed rejected, but it accepts 1
    with pytest.raises(ValueError):
        verify_greedy_rows(logits, [])
    with pytest.raises(RuntimeError, match="screened as rejected"):
        verify_greedy_best([1], [1])
    with pytest.raises(ValueError):
        verify_greedy_best([1, 1], [])


def test_full_acceptance_gives_bonus():
    # q == p: every draft is accepted (u * q < p holds for every u < 1); the bonus comes from p[k].
    probs = torch.softmax(torch.randn(2, 6, generator=torch.Generator().manual_seed(0)), -1)  # [k=2, V]
    p = torch.cat([probs, torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])])  # [3, V]
    for seed in range(20):
        v = verify_sampling(p, probs, [1, 5], make_generator(seed, "cpu"))
        assert v == Verdict([1, 5], 4, "bonus")


def test_rejection_position_and_residual():
    # Positions 0, 1: p == q, always accepted. Position 2: p(x=2) = 0, always rejected, and the
    # residual max(0, p - q) = [0.5, 0, 0] forces the recovered token to 0.
    same = torch.tensor([[0.2, 0.3, 0.5], [0.6, 0.3, 0.1]])
    p = torch.cat([same, torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])])  # [4, 3]
    q = torch.cat([same, torch.tensor([[0.0, 0.5, 0.5]])])  # [3, 3]
    for seed in range(20):
        v = verify_sampling(p, q, [2, 0, 2], make_generator(seed, "cpu"))
        assert v == Verdict([2, 0], 0, "recovered")


def test_one_hot_drafter_accepts_with_p_and_drops_its_token():
    # q = None: accept x = 1 with prob p(1) = 0.8; else the residual is p without token 1 -> 0.
    p = torch.tensor([[0.2, 0.8, 0.0], [0.0, 0.0, 1.0]])
    gen = make_generator(5, "cpu")
    verdicts = [verify_sampling(p, None, [1], gen) for _ in range(4000)]
    accepted = sum(v.kind == "bonus" for v in verdicts)
    assert 0.77 < accepted / 4000 < 0.83
    assert all(v.tokens == ([1, 2] if v.kind == "bonus" else [0]) for v in verdicts)


def test_none_q_is_the_one_hot_case_of_the_general_rule():
    g = torch.Generator().manual_seed(1)
    for seed in range(50):
        p = torch.softmax(torch.randn(4, 7, generator=g), -1)  # [k + 1 = 4, 7]
        draft = torch.randint(0, 7, (3,), generator=g).tolist()
        one_hot = torch.nn.functional.one_hot(torch.tensor(draft), 7).float()  # [3, 7]
        assert verify_sampling(p, None, draft, make_generator(seed, "cpu")) == verify_sampling(
            p, one_hot, draft, make_generator(seed, "cpu")
        )


def test_empty_residual_falls_back_to_p():
    # Unnormalised q = 2p makes the residual max(0, p - q) empty: the recovered token is then
    # drawn from p, never from a zero vector.
    p = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    q = 2 * p[:1]
    kinds = {verify_sampling(p, q, [1], make_generator(s, "cpu")).tokens[-1] for s in range(40)}
    assert kinds <= {0, 1}  # bonus 0, or recovered 1 from p


def test_empty_draft_returns_bonus_from_first_row():
    p = torch.tensor([[0.0, 0.0, 1.0]])  # [1, 3]
    assert verify_sampling(p, None, [], make_generator(0, "cpu")) == Verdict([], 2, "bonus")
    assert verify_sampling(p, torch.zeros(0, 3), [], make_generator(0, "cpu")) == Verdict([], 2, "bonus")
    assert verify_greedy(torch.tensor([[0.1, 2.0, -1.0]]), []) == Verdict([], 1, "bonus")


def test_verify_greedy_cases():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 1.0, 5.0], [9.0, 0.0, 1.0]])  # argmax 1, 2, 0
    assert verify_greedy(logits, [1, 2]) == Verdict([1, 2], 0, "bonus")
    assert verify_greedy(logits, [1, 0]) == Verdict([1], 2, "recovered")
    assert verify_greedy(logits, [2, 2]) == Verdict([], 1, "recovered")


def test_greedy_params_make_sampling_agree_with_greedy():
    # With temperature 0, p is one-hot at the argmax: acceptance is certain on a match, impossible
    # on a mismatch, and the residual / bonus is the argmax itself.
    g = torch.Generator().manual_seed(7)
    gen = make_generator(7, "cpu")
    greedy = SamplingParams()
    for _ in range(200):
        k = int(torch.randint(0, 5, (1,), generator=g))
        logits = torch.randn(k + 1, 9, generator=g)  # [k + 1, 9]
        draft = logits[:k].argmax(-1).tolist()
        if k:  # break the draft at a random position (or not at all)
            cut = int(torch.randint(0, k + 1, (1,), generator=g))
            if cut < k:
                draft[cut] = (draft[cut] + 1 + int(torch.randint(0, 8, (1,), generator=g))) % 9
        expected = verify_greedy(logits, draft)
        p = process_logits(logits, greedy)
        q_draft = process_logits(torch.randn(k, 9, generator=g), SamplingParams(temperature=1.0))
        # q must give the draft positive mass for the general rule; a greedy drafter is one-hot.
        assert verify_sampling(p, None, draft, gen) == expected
        one_hot_q = torch.nn.functional.one_hot(torch.tensor(draft, dtype=torch.long), 9).float()
        assert verify_sampling(p, one_hot_q, draft, gen) == expected
        assert verify_sampling(p, (q_draft + one_hot_q) / 2, draft, gen) == expected


def test_shape_errors():
    with pytest.raises(ValueError):
        verify_sampling(torch.ones(2, 3) / 3, None, [0, 1], make_generator(0, "cpu"))
    with pytest.raises(ValueError):
        verify_sampling(torch.ones(3, 3) / 3, torch.ones(1, 3) / 3, [0, 1], make_generator(0, "cpu"))
    with pytest.raises(ValueError):
        verify_greedy(torch.ones(1, 3), [0])


# ---------------------------------------------------------------- exact distribution

V, N, SAMPLES = 5, 3, 20000
_g = torch.Generator().manual_seed(1234)
TARGET = torch.randn(V, V, generator=_g) * 1.5  # [last token, vocab] target logits
DRAFT = 0.6 * TARGET + torch.randn(V, V, generator=_g)  # [last token, vocab]: related but different
START = 0  # the context is the single token START


def always_accept(p, q, draft, generator):
    """Broken rule 1: keep every draft, bonus from p."""
    return Verdict(list(draft), int(sample(p[len(draft)], generator)), "bonus")


def recover_from_p(p, q, draft, generator):
    """Broken rule 2: the right acceptance test, but the recovered token drawn from p, not the residual."""
    v = verify_sampling(p, q, draft, generator)
    if v.kind == "recovered":
        return Verdict(v.accepted, int(sample(p[v.num_accepted], generator)), "recovered")
    return v


def speculative_runs(params, k, drafter, rule, seed):
    """SAMPLES independent speculative chains from START; returns the first N tokens of each.

    drafter: "q" (samples from q, reports q), "hidden" (samples from q, reports q=None), or
    "argmax" (deterministic, reports q=None). Drafting is batched over all unfinished chains;
    verification runs one chain at a time, as the engine calls it.
    """
    p_table = process_logits(TARGET, params)  # [V, V]: p[last, next]
    q_table = process_logits(DRAFT, params)  # [V, V]
    gen = make_generator(seed, "cpu")
    outs = [[] for _ in range(SAMPLES)]
    last = torch.full((SAMPLES,), START, dtype=torch.long)  # [SAMPLES]
    active = list(range(SAMPLES))
    while active:
        cur = last[active]  # [A]
        prev, tokens, qs = [cur], [], []
        for _ in range(k):
            q = q_table[cur]  # [A, V]
            cur = q.argmax(-1) if drafter == "argmax" else sample(q, gen)  # [A]
            tokens.append(cur)
            qs.append(q)
            prev.append(cur)
        drafts = torch.stack(tokens, 1).tolist() if k else [[] for _ in active]  # [A][k]
        P = p_table[torch.stack(prev[: k + 1], 1)]  # [A, k + 1, V]
        Q = torch.stack(qs, 1) if k else torch.zeros(len(active), 0, V)  # [A, k, V]
        for a, s in enumerate(active):
            verdict = rule(P[a], Q[a] if drafter == "q" else None, drafts[a], gen)
            outs[s] += verdict.tokens
            last[s] = verdict.tokens[-1]
        active = [s for s in active if len(outs[s]) < N]
    return [tuple(o[:N]) for o in outs]


def exact_joint(params) -> torch.Tensor:
    """[V] * N tensor: P(first N tokens) under the target alone, by enumeration."""
    p = process_logits(TARGET, params).double()  # [V, V]
    joint = p[START]  # [V]
    for _ in range(N - 1):
        # joint[..., a, b] = joint[..., a] * p[a, b]: the chain rule, one token further.
        joint = joint[..., None] * p
    return joint


def p_value(params, k, drafter, rule, seed) -> float:
    runs = speculative_runs(params, k, drafter, rule, seed)
    cells = torch.tensor(runs) @ (V ** torch.arange(N - 1, -1, -1))  # [SAMPLES]: row-major cell index
    counts = torch.bincount(cells, minlength=V**N).double()  # [V**N]
    expected = (exact_joint(params) * SAMPLES).flatten()  # [V**N], same row-major order
    if rule is verify_sampling:  # a correct rule never emits a sequence of probability 0
        assert counts[expected == 0].sum() == 0
    # Chi-square needs expected counts >= 5: pool the rare cells (zero-probability ones included,
    # which is what makes a broken rule that emits impossible sequences fail loudly).
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    wanted = torch.cat([expected[big], expected[~big].sum()[None]])
    if wanted[-1] == 0:
        if observed[-1] > 0:
            return 0.0
        observed, wanted = observed[:-1], wanted[:-1]
    return float(chisquare(observed.numpy(), wanted.numpy() * observed.sum().item() / wanted.sum().item()).pvalue)


def test_exact_joint_is_a_distribution():
    for params in SETTINGS:
        joint = exact_joint(params)
        assert joint.shape == (V,) * N
        torch.testing.assert_close(joint.sum(), torch.tensor(1.0, dtype=torch.float64))
        # Spot-check one cell against the chain rule written out.
        p = process_logits(TARGET, params).double()
        a, b, c = 1, 3, 2
        torch.testing.assert_close(joint[a, b, c], p[START, a] * p[a, b] * p[b, c])


SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.8),
]


@pytest.mark.parametrize("params", SETTINGS, ids=["t1", "t0.7-topk3", "topp0.8"])
def test_exact_distribution(params):
    assert p_value(params, k=3, drafter="q", rule=verify_sampling, seed=11) > 1e-3


@pytest.mark.parametrize("drafter", ["hidden", "argmax"])
def test_exact_distribution_one_hot_drafter(drafter):
    # q = None: the rule treats the proposal as one-hot, which is exact whatever proposed it.
    assert p_value(SETTINGS[0], k=2, drafter=drafter, rule=verify_sampling, seed=12) > 1e-3


def test_exact_distribution_empty_drafts():
    assert p_value(SETTINGS[1], k=0, drafter="q", rule=verify_sampling, seed=13) > 1e-3


@pytest.mark.parametrize("rule", [always_accept, recover_from_p], ids=["always-accept", "recover-from-p"])
def test_broken_rules_are_caught(rule):
    assert p_value(SETTINGS[0], k=3, drafter="q", rule=rule, seed=14) < 1e-6
