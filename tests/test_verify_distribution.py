"""Speculative sampling follows the target's exact distribution: enumeration + chi-square.

A toy target and drafter over a 5-token vocabulary are first-order Markov chains (random logit
tables indexed by the last token), so the exact joint distribution of the first three generated
tokens can be enumerated. Many speculative samples must pass a chi-square goodness-of-fit test,
and a deliberately broken acceptance rule must fail the same test (the test has power).
"""

import itertools

import pytest
import torch

from specdec.sampling import SamplingParams, make_generator, process_logits, sample
from specdec.verify import Verdict, verify_greedy, verify_sampling

from helpers import pooled_chisquare_p

# 5x5 tables: every torch call is per-call overhead, which two threads on a shared machine multiply.
pytestmark = pytest.mark.usefixtures("one_thread")

V, N, SAMPLES = 5, 3, 8000
g = torch.Generator().manual_seed(1234)
TARGET = torch.randn(V, V, generator=g) * 1.5  # [last token, vocab]
DRAFT = TARGET + torch.randn(V, V, generator=g) * 1.2  # related but different


def always_accept(p, q, draft, generator):  # the broken rule for the power check
    return Verdict(list(draft), int(sample(p[len(draft)], generator)), "bonus")


def speculative_sample(params, k, one_hot, rule, generator):
    ctx, out = [0], []
    while len(out) < N:
        draft, qs, last = [], [], ctx[-1]
        for _ in range(k):
            q = process_logits(DRAFT[last], params)
            token = int(q.argmax()) if one_hot else int(sample(q, generator))
            draft.append(token)
            qs.append(q)
            last = token
        p = process_logits(TARGET[[ctx[-1]] + draft], params)  # [k + 1, V]
        verdict = rule(p, None if one_hot else torch.stack(qs), draft, generator)
        out += verdict.tokens
        ctx += verdict.tokens
    return tuple(out[:N])


def exact_joint(params):
    p = process_logits(TARGET, params)  # [V, V]: p[last, next]
    cells = list(itertools.product(range(V), repeat=N))
    probs = []
    for cell in cells:
        prob, last = 1.0, 0
        for t in cell:
            prob *= float(p[last, t])
            last = t
        probs.append(prob)
    return cells, probs


def p_value(params, k, one_hot, rule, seed):
    generator = make_generator(seed, "cpu")
    counts = {}
    for _ in range(SAMPLES):
        key = speculative_sample(params, k, one_hot, rule, generator)
        counts[key] = counts.get(key, 0) + 1
    cells, probs = exact_joint(params)
    # Impossible sequences must never appear.
    assert all(counts.get(c, 0) == 0 for c, pr in zip(cells, probs) if pr == 0) or rule is always_accept
    return pooled_chisquare_p(counts, cells, probs, SAMPLES)


SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.8),
]


# The fast tier (`make test-fast`) holds the first setting: the same one the broken rule fails on.
@pytest.mark.parametrize("params", [pytest.param(SETTINGS[0], marks=pytest.mark.fast), *SETTINGS[1:]])
def test_exact_distribution(params):
    assert p_value(params, k=3, one_hot=False, rule=verify_sampling, seed=11) > 1e-3


def test_exact_distribution_one_hot_drafter():
    assert p_value(SETTINGS[0], k=2, one_hot=True, rule=verify_sampling, seed=12) > 1e-3


@pytest.mark.fast
def test_broken_rule_is_caught():
    assert p_value(SETTINGS[0], k=3, one_hot=False, rule=always_accept, seed=13) < 1e-6


def test_hand_made_cases():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    gen = make_generator(0, "cpu")
    full = verify_sampling(p, None, [1, 2], gen)
    assert full.accepted == [1, 2] and full.kind == "bonus" and full.next_token == 0
    rejected = verify_sampling(p, None, [2, 2], gen)
    assert rejected.accepted == [] and rejected.kind == "recovered" and rejected.next_token == 1
    logits = torch.log(p + 1e-9)
    assert verify_greedy(logits, [1, 0]).tokens == [1, 2]
    assert verify_greedy(logits[:1], []).tokens == [1]
