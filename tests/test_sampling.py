"""sampling.py: each logits processor on hand-made rows, parameter validation, the explicit RNG."""

import pytest
import torch
from scipy.stats import chisquare

from specdec.errors import InvalidRequestError
from specdec.sampling import SamplingParams, make_generator, process_logits, sample

# Probabilities 0.5, 0.3, 0.15, 0.05 written as logits, in a shuffled vocabulary order so that
# "kept set" tests check indices, not positions.
PROBS = torch.tensor([0.15, 0.5, 0.05, 0.3])
LOGITS = PROBS.log() + 2.0  # any shift: softmax is shift-invariant


def kept(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs > 0).flatten().tolist())


def test_temperature_matches_softmax():
    logits = torch.randn(3, 7, 11, generator=torch.Generator().manual_seed(0)) * 3
    for t in (0.3, 1.0, 2.5):
        out = process_logits(logits, SamplingParams(temperature=t))
        assert out.shape == logits.shape and out.dtype == torch.float32
        torch.testing.assert_close(out, torch.softmax(logits / t, -1))
        torch.testing.assert_close(out.sum(-1), torch.ones(3, 7))


def test_tiny_temperature_stays_finite():
    out = process_logits(LOGITS, SamplingParams(temperature=1e-6))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.tensor([0.0, 1.0, 0.0, 0.0]))


@pytest.mark.parametrize("t", [1e-30, 1e-38, 1e-40, 1e-45, 1e-100, 1e-300, 5e-324])
def test_temperature_below_float32_samples_its_limit(t):
    # Valid input (positive and finite) that float32 cannot hold as a divisor: the limit of
    # softmax(l / T) as T -> 0, all the mass on the argmax, shared evenly by exact ties.
    logits = torch.tensor([[0.2, 3.0, 2.9999998, -50.0], [7.0, 1.0, 7.0, 6.5]], dtype=torch.bfloat16).float()
    out = process_logits(logits, SamplingParams(temperature=t, top_k=3, top_p=0.9, min_p=0.1))
    assert torch.isfinite(out).all()
    expected = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.5, 0.0, 0.5, 0.0]])
    if logits[0, 2] == logits[0, 1]:  # bfloat16 rounded the near-tie to a tie
        expected[0] = torch.tensor([0.0, 0.5, 0.5, 0.0])
    assert torch.equal(out, expected)
    # Sampling it draws only the argmax (each tie in turn), never NaN.
    draws = sample(out.expand(200, 2, 4), make_generator(0, "cpu"))
    assert set(draws[:, 0].tolist()) <= {1, 2} and set(draws[:, 1].tolist()) == {0, 2}


def test_speculative_sampling_at_a_tiny_temperature_accepts_the_argmax():
    # The rejection rule compares u * q < p on processed probabilities (no division by T), so
    # one-hot-like p and q at a tiny T accept an argmax draft and replace any other.
    from specdec.verify import verify_sampling

    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 4.0]])
    params = SamplingParams(temperature=5e-324)
    p = process_logits(logits, params)
    q = process_logits(logits[:2] + torch.tensor([0.0, 0.0, 1.5]), params)  # the drafter's argmax differs at 0
    verdict = verify_sampling(p, q, [2, 0], make_generator(1, "cpu"))
    assert (verdict.accepted, verdict.next_token) == ([], 1)
    verdict = verify_sampling(p, None, [1, 0], make_generator(1, "cpu"))
    assert (verdict.accepted, verdict.next_token) == ([1, 0], 2)


def test_greedy_is_one_hot_lowest_index_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, -1.0, 2.0, 5.0]], dtype=torch.bfloat16)
    out = process_logits(logits, SamplingParams())
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_top_k_keeps_exact_set():
    for k, expected in [(1, {1}), (2, {1, 3}), (3, {0, 1, 3}), (4, {0, 1, 2, 3}), (9, {0, 1, 2, 3})]:
        out = process_logits(LOGITS, SamplingParams(temperature=1.0, top_k=k))
        assert kept(out) == expected, k
        # The kept tokens keep their relative odds, renormalised.
        ref = PROBS * torch.tensor([i in expected for i in range(4)])
        torch.testing.assert_close(out, ref / ref.sum())


def test_top_p_keeps_smallest_set_reaching_mass():
    # Sorted masses 0.5 (id 1), 0.3 (id 3), 0.15 (id 0), 0.05 (id 2); cumulative 0.5, 0.8, 0.95, 1.
    for top_p, expected in [(0.3, {1}), (0.7, {1, 3}), (0.9, {0, 1, 3}), (0.99, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})]:
        out = process_logits(LOGITS, SamplingParams(temperature=1.0, top_p=top_p))
        assert kept(out) == expected, top_p
        ref = PROBS * torch.tensor([i in expected for i in range(4)])
        torch.testing.assert_close(out, ref / ref.sum())


@pytest.mark.parametrize("top_p", [1e-9, 1e-50, 5e-324])
def test_top_p_always_keeps_one(top_p):
    # 5e-324 is 0 in float32, where "mass before < top_p" would keep nothing (and divide 0 by 0).
    out = process_logits(LOGITS, SamplingParams(temperature=1.0, top_p=top_p))
    assert kept(out) == {1} and torch.isfinite(out).all()


def test_min_p_drops_below_fraction_of_max():
    # Threshold min_p * 0.5: 0.2 -> 0.1 drops 0.05; 0.4 -> 0.2 drops 0.15 and 0.05; 0.7 -> only 0.5.
    for min_p, expected in [(0.2, {0, 1, 3}), (0.4, {1, 3}), (0.7, {1})]:
        out = process_logits(LOGITS, SamplingParams(temperature=1.0, min_p=min_p))
        assert kept(out) == expected, min_p


def test_order_temperature_topk_topp_minp():
    # T = 0.5 squares the odds: 0.25, 0.09, 0.0225, 0.0025 -> /0.365 = 0.685, 0.247, 0.062, 0.007.
    params = SamplingParams(temperature=0.5, top_p=0.9)  # 0.685 < 0.9 <= 0.932: keeps {1, 3}
    assert kept(process_logits(LOGITS, params)) == {1, 3}
    # top_k=3 first drops id 2; then top_p=0.95 over (0.25, 0.09, 0.0225)/0.3625 -> 0.69, 0.248,
    # 0.062: cumulative before 0.938 < 0.95 keeps all three.
    assert kept(process_logits(LOGITS, SamplingParams(temperature=0.5, top_k=3, top_p=0.95))) == {0, 1, 3}
    # min_p is applied last, relative to the max of what is left.
    out = process_logits(LOGITS, SamplingParams(temperature=0.5, top_k=3, min_p=0.2))  # 0.2 * 0.69 = 0.138
    assert kept(out) == {1, 3}
    torch.testing.assert_close(out.sum(), torch.tensor(1.0))


def test_batched_rows_match_single_rows_and_are_deterministic():
    logits = torch.randn(2, 5, 50, generator=torch.Generator().manual_seed(3)) * 2
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05)
    batched = process_logits(logits, params)
    for b in range(2):
        for t in range(5):
            torch.testing.assert_close(batched[b, t], process_logits(logits[b, t], params))
    assert torch.equal(batched, process_logits(logits, params))
    torch.testing.assert_close(batched.sum(-1), torch.ones(2, 5))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature="1.0"), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_k=True), "top_k"),
        (dict(min_p=1.0), "min_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=float("inf")), "min_p"),
        (dict(seed=1.5), "seed"),
        (dict(seed="7"), "seed"),
    ],
)
def test_invalid_params_raise(kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == field and field in str(info.value)


def test_valid_params_and_greedy_flag():
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=1).greedy
    SamplingParams(temperature=2, top_k=5, top_p=1.0, min_p=0.0, seed=-3)  # edges are valid


def test_seeded_generator_reproducible():
    probs = torch.softmax(torch.randn(4, 30, generator=torch.Generator().manual_seed(0)), -1)
    a = [sample(probs, make_generator(123, "cpu")).tolist() for _ in range(2)]
    assert a[0] == a[1]
    gen = make_generator(123, "cpu")
    run = [sample(probs, gen).tolist() for _ in range(5)]
    gen = make_generator(123, "cpu")
    assert run == [sample(probs, gen).tolist() for _ in range(5)]
    # Unseeded generators come from fresh OS randomness: two of them differ.
    assert make_generator(None, "cpu").initial_seed() != make_generator(None, "cpu").initial_seed()


def test_sample_does_not_touch_global_rng():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    sample(torch.full((3, 10), 0.1), make_generator(1, "cpu"))
    assert torch.equal(before, torch.get_rng_state())


def test_sample_shapes():
    gen = make_generator(0, "cpu")
    assert sample(torch.full((7,), 1 / 7), gen).shape == ()
    out = sample(torch.full((2, 3, 7), 1 / 7), gen)
    assert out.shape == (2, 3) and out.dtype == torch.long


def test_sample_frequencies_match_probs():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
    n = 30000
    ids = sample(probs.expand(n, -1), make_generator(2024, "cpu"))  # [n]
    observed = torch.bincount(ids, minlength=6).double()
    assert chisquare(observed.numpy(), (probs.double() * n).numpy()).pvalue > 1e-3
