"""Draft-model options: reduced-vocabulary drafting (FR-Spec; the output stays exact: greedy identity,
and the sampled distribution by a chi-square test) and the price of a draft token in the cost rule."""

import math

import pytest
import torch

from specdec import Engine, SamplingParams
from specdec.drafters import DraftModelDrafter
from specdec.drafters.draft_model import frequent_ids
from specdec.errors import InvalidRequestError
from specdec.models.quant import cpu_int8_available, quantize_model

from test_draft_model import SMALL_V, noisy_copy, p_value, small_model

from helpers import TINY_VOCAB as V, random_prompts as prompts, speculative_equals_plain


pytestmark = pytest.mark.usefixtures("one_thread")


def test_frequent_ids_keep_the_special_ones():
    assert frequent_ids(100, 5, [99, 2]).tolist() == [0, 1, 2, 3, 4, 99]
    assert frequent_ids(4, 10).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("int8", [False, True])
def test_kept_ids_score_as_in_the_full_head_and_the_rest_never(llama, int8):
    if int8 and not cpu_int8_available():
        pytest.skip("no int8 backend")
    model = llama
    if int8:
        model = noisy_copy(llama, 0.0, 0)  # a copy to quantise
        quantize_model(model, "int8")
    full = DraftModelDrafter(model, V)
    reduced = DraftModelDrafter(model, V, vocab=30)
    kept = reduced.vocab_ids
    assert kept.tolist() == list(range(30)) + [i for i in model.config.eos_token_ids if i >= 30]
    ids = prompts(1, 12)[0]
    for d in (full, reduced):
        d.begin(ids)
    a, b = full._target_logits(full._sync(ids)), reduced._target_logits(reduced._sync(ids))
    torch.testing.assert_close(b[kept], a[kept], rtol=1e-5, atol=1e-5)
    rest = torch.ones(V, dtype=torch.bool)
    rest[kept] = False
    assert bool((b[rest] == -math.inf).all())


@pytest.mark.parametrize("draft", ["self", "noisy"])
def test_greedy_identity_with_a_reduced_draft_vocabulary(llama, draft):
    model = llama if draft == "self" else noisy_copy(llama, 0.5, 3)
    drafter = DraftModelDrafter(model, V, vocab=40)
    engine = Engine(llama, None, drafter=drafter, num_speculative_tokens=4, draft_length="fixed")
    plain = Engine(llama, None)
    drafted = accepted = 0
    for ids in prompts(3):
        out = engine.generate(prompt_ids=ids, max_new_tokens=24)
        assert out.token_ids == plain.generate(prompt_ids=ids, max_new_tokens=24).token_ids
        drafted += out.stats.draft_tokens
        accepted += out.stats.accepted_tokens
        for step in out.steps:  # a draft never names an id outside the kept ones
            assert all(t in set(drafter.vocab_ids.tolist()) for t in step.accepted)
    assert drafted > 0
    if draft == "self":  # the target's token is often outside the 40 kept ids: those drafts fail
        assert 0 < accepted < drafted


def test_sampling_with_a_reduced_draft_vocabulary_is_exact():
    # The draft keeps 3 of the 6 ids: the target's other tokens come only from the residual
    # norm(max(0, p - q)); q is the distribution over the kept ids the draft token was drawn from.
    drafter = DraftModelDrafter(small_model(1), SMALL_V, vocab=3)
    assert drafter.vocab_ids.tolist() == [0, 1, 2]
    assert p_value(SamplingParams(temperature=1.0), drafter, k=2) > 1e-3


def test_bad_vocab_is_one_error():
    with pytest.raises(InvalidRequestError, match="draft vocabulary"):
        Engine.load("/no/such/model.gguf", drafter="ngram", draft_vocab=-1)


def test_priced_draft_length_charges_each_draft_token():
    from specdec.policy import CostAwareDraftLength, DraftCost

    free, priced = CostAwareDraftLength(8, 0.16), CostAwareDraftLength(8, 0.16, draft_cost=DraftCost(prior=0.3))
    for rule in (free, priced):
        rule.update(8, 6)  # a high acceptance so far (~0.8)
    assert 1 <= priced.next_k() < free.next_k()  # each draft token costs: shorter drafts pay best
    costly = CostAwareDraftLength(8, 0.16, draft_cost=DraftCost(prior=0.9))
    costly.update(8, 3)
    assert costly.next_k() == 0  # drafting does not pay: a plain step


@pytest.mark.parametrize("cost", [0.3, 2.0])
def test_a_priced_draft_model_drafts_only_where_it_pays(llama, cost):
    drafter = DraftModelDrafter(noisy_copy(llama, 0.5, 3), V)
    drafter.draft_cost = cost  # the measured price: where the policy's online estimate starts
    # The cost-aware draft length (the default), a verify pass priced at 1 + 0.1 k plain steps.
    engine = Engine(llama, None, drafter=drafter, num_speculative_tokens=4, verify_cost=0.1, verify_overhead=0.0)
    plain = Engine(llama, None)
    drafts = steps = 0
    for ids in prompts(2):
        out = engine.generate(prompt_ids=ids, max_new_tokens=32)
        assert out.token_ids == plain.generate(prompt_ids=ids, max_new_tokens=32).token_ids
        drafts, steps = drafts + out.stats.drafts, steps + len(out.steps) - 1
    # The draft is unsure of its tokens (a noisy copy of a flat model): its chains stop where their
    # confidence does not pay the price (`policy.ChainStop`), at most a few tries; dearer than a
    # target step, never a token (tests/test_draft_stop.py has the asks and the re-probing).
    if cost < 1:
        assert drafts < steps / 2
    else:
        assert drafts == 0


def test_measure_cost_times_both_models(llama):
    drafter = DraftModelDrafter(noisy_copy(llama, 0.1, 1), V)
    cost = drafter.measure_cost(llama, context=8, repeats=3)
    assert cost == drafter.draft_cost and 0.05 < cost < 20  # the same architecture: about 1


class _Recorder:
    """A chain stop that keeps every token and remembers the confidences it was told."""

    def __init__(self):
        self.seen = []

    def start(self):
        pass

    def take(self, p):
        self.seen.append(p)
        return True

    def more(self):
        return True


@pytest.mark.parametrize("vocab", [None, 30])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=12, top_p=0.9),
                                    SamplingParams(temperature=1.3, min_p=0.05)])
def test_drafting_over_the_scored_ids_matches_the_full_vocabulary(llama, vocab, params):
    """The draft chooses from its scores over the scored ids only; what it proposes is what the full
    target-vocabulary logits (-inf for the ids it does not score) give: the same greedy token (ties
    to the lowest id), the same confidence, and under sampling the same q, widened with zeros."""
    from specdec.sampling import greedy_tokens, make_generator, process_logits

    drafter = DraftModelDrafter(noisy_copy(llama, 0.3, 2), V, vocab=vocab)
    width = V if vocab is None else len(drafter.vocab_ids)
    for seed, ids in enumerate(prompts(4, 9)):
        drafter.begin(ids, params, make_generator(seed, "cpu"))
        stop = _Recorder()
        drafter.stop_by(stop)
        scores = drafter._sync(ids)
        assert scores.shape == (width,)  # nothing of the full vocabulary's size
        full = drafter._target_logits(scores)  # [V]
        token, q = drafter._choose(scores)
        if vocab is not None:
            assert token in drafter.vocab_ids.tolist()
        if params.greedy:
            assert token == greedy_tokens(full[None])[0] and q is None
            assert stop.seen[0] == pytest.approx(float(full.softmax(-1).max()), rel=1e-6)
        else:
            expected = process_logits(full, params)
            assert q.shape == (V,)
            torch.testing.assert_close(q, expected, rtol=1e-5, atol=1e-7)
            assert stop.seen[0] == pytest.approx(float(expected.max()), rel=1e-5)
            assert q[token] > 0
        drafter.end([])
    if vocab is not None:  # a tie between kept ids goes to the lowest, as argmax over the full row
        drafter.begin(prompts(1)[0])
        tie = torch.full((width,), -5.0)
        tie[[3, 7]] = 2.0
        assert drafter._choose(tie)[0] == int(drafter.vocab_ids[3])


@pytest.mark.parametrize("int4", [False, True])
def test_measure_cost_prices_a_draft_position_with_the_drafting_head(llama, int4):
    """The price is one draft position as a chain pays it: a forward through the head the draft
    drafts with (its reduced / 4-bit copy), never the model's own full head; and timing it leaves
    the drafter as it was."""
    if int4:
        _kernels_or_skip()
    draft = noisy_copy(llama, 0.1, 1)
    if int4:
        quantize_model(draft, "int4")
    drafter = DraftModelDrafter(draft, V, vocab=30)
    calls = {"full head": 0, "drafting head": 0}
    full_head, sub_head = draft.head, drafter._sub_head

    def counting(name, f):
        def call(*args, **kwargs):
            calls[name] += 1
            return f(*args, **kwargs)
        return call

    draft.head = counting("full head", full_head)
    drafter._sub_head = counting("drafting head", sub_head)
    try:
        cost = drafter.measure_cost(llama, context=8, repeats=3)
    finally:
        del draft.head
        drafter._sub_head = sub_head
    assert cost == drafter.draft_cost > 0
    # the twin's read of the prompt reads no head; then a warm-up round and 3 timed ones
    assert calls == {"full head": 0, "drafting head": 1 + 3}
    assert drafter.cache_length == 0 and drafter.cached_tokens == []
    # a draft position timed is a real one: the same token the drafter then proposes
    ids = prompts(1, 8)[0]
    twin = drafter._twin_for_timing(ids)
    assert twin.draft_step_seconds(ids) >= 0 and twin.cached_tokens == ids[:-1]
    drafter.begin(ids)
    assert drafter.propose(ids, 1).tokens == [drafter._target_id(int(drafter._sync(ids).argmax()))]


def _kernels_or_skip():
    from specdec.models import cpu_kernels

    if not cpu_int8_available() or cpu_kernels.load() is None:
        pytest.skip("int4 needs the int8 backend and the compiled kernels")


def test_draft_quantize_auto_follows_the_target(llama):
    from specdec.builder import draft_quantize_for

    _kernels_or_skip()
    assert draft_quantize_for(None, llama) == "none"
    for mode in ("int8", "int4"):
        target = quantize_model(noisy_copy(llama, 0.0, 0), mode)
        assert draft_quantize_for("auto", target) == mode  # an int4 target gets an int4 draft
        assert draft_quantize_for("int8", target) == "int8"  # set on its own


@pytest.mark.parametrize("vocab", [None, 40])
def test_an_int4_draft_scores_with_a_4_bit_head_and_stays_exact(llama, vocab):
    from specdec.models.quant import Int4Linear

    _kernels_or_skip()
    draft = quantize_model(noisy_copy(llama, 0.2, 3), "int4")  # head int8, layers 4-bit
    drafter = DraftModelDrafter(draft, V, vocab=vocab)
    assert isinstance(drafter._sub_head, Int4Linear)  # the draft's own head on 4 bits too
    kept = torch.arange(V) if vocab is None else drafter.vocab_ids
    assert drafter._sub_head.out_features == len(kept)
    # Its scores are the int8 head's rows on a 4-bit grid: close, not equal.
    ids = prompts(1, 12)[0]
    exact = DraftModelDrafter(draft, V, vocab=vocab, int4_head=False)
    for d in (drafter, exact):
        d.begin(ids)
    a, b = drafter._target_logits(drafter._sync(ids)), exact._target_logits(exact._sync(ids))
    torch.testing.assert_close(a[kept], b[kept], rtol=0, atol=0.1 * float(b[kept].abs().max()))
    engine = Engine(llama, None, drafter=drafter, num_speculative_tokens=4, draft_length="fixed")
    drafted, _ = speculative_equals_plain(engine, Engine(llama, None), prompts(3), 24)
    assert drafted > 0


def test_the_cost_rule_prices_verify_passes_by_the_targets_quantisation(llama):
    from specdec.policy import DEFAULT_VERIFY_COSTS, hardware_kind, row_rule

    _kernels_or_skip()
    assert hardware_kind(llama) == "cpu"
    for mode in ("int8", "int4"):
        target = quantize_model(noisy_copy(llama, 0.0, 0), mode)
        assert hardware_kind(target) == f"cpu-{mode}"
        rule = row_rule("cost", 5, model=target)
        assert (rule.verify_overhead, rule.verify_cost) == DEFAULT_VERIFY_COSTS[f"cpu-{mode}"]
