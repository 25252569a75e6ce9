"""A draft model that sizes its own chains: the price-based chain stop (`policy.ChainStop`), the
ask gate that re-probes a drafter it stopped asking (`policy.AskGate`), the draft's read of its
context (deferred to the first ask, and skipped where the answer's remaining tokens cannot pay it
back: `AskGate.reads`), and the prompt window; the output stays exact (greedy identity; sampled
distribution by a chi-square test)."""

import pytest
import torch

from specdec import Engine, SamplingParams
from specdec.drafters import DraftModelDrafter
from specdec.drafters.combined import LEARNED, lookup_first
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.prediction import FOLLOW, JOIN
from specdec.models import loader
from specdec.policy import AskGate, ChainStop, DraftController, DraftCost, row_rule

from test_draft_model import N_NEW, PROMPT, SAMPLES, SMALL_V, chi_square_p, noisy_copy, small_model

from helpers import TINY_VOCAB as V, random_prompts as prompts


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def peaky(llama):
    """The tiny model with a sharpened head: confident enough (top probabilities ~0.4-0.9) that
    drafting can pay."""
    state = {k: v.clone() for k, v in llama.state_dict().items()}
    state["lm_head.weight"] = state["lm_head.weight"] * 40
    return loader.build_model(llama.config, state, torch.float32, "cpu")


# -- the chain stop -----------------------------------------------------------------------------


def test_a_read_token_is_kept_when_its_chain_probability_beats_its_score_at_the_rows_rate():
    # The forward that read token i is spent; scoring it costs c and gains P_i: kept iff P_i > R c.
    for p, kept in ((0.11, True), (0.09, False)):
        assert ChainStop(verify_cost=0.1, draft_cost=0.2).take(p) is kept
    for p, kept in ((0.16, True), (0.14, False)):  # a row earning 1.5 tokens per plain step
        assert ChainStop(verify_cost=0.1, draft_cost=0.2, rate=1.5).take(p) is kept
    # An overhead c0 is paid once for the whole chain: a chain is sent only where it earns it.
    alone = ChainStop(verify_cost=0.1, verify_overhead=0.5, draft_cost=0.2)
    assert alone.take(0.45) and not alone.worth()  # 0.45 < 0.5 + 0.1
    shared = ChainStop(verify_cost=0.1, verify_overhead=0.5, draft_cost=0.2)
    assert shared.take(0.45) and shared.take(0.95) and shared.worth()  # 0.88 > 0.5 + 0.2


def test_the_next_position_is_read_only_where_the_chain_looks_able_to_pay_its_forward():
    stop = ChainStop(verify_cost=0.1, draft_cost=0.2, rate=1.5)  # a read and a score: 0.45 at R = 1.5
    assert stop.take(0.9) and stop.more()  # 0.81 ahead
    assert stop.take(0.7) and not stop.more()  # 0.63 * 0.7 = 0.44 ahead: not worth a forward
    assert stop.looked == 2 and stop.drafted == 2
    stop.start()
    assert stop.looked == 0 and stop.drafted == 0 and stop.more()


def test_the_rate_makes_a_richer_row_pickier():
    ps = [0.9, 0.8, 0.7, 0.6, 0.5]
    lengths = []
    for rate in (1.0, 1.5, 2.5):
        stop = ChainStop(verify_cost=0.1, draft_cost=0.25, rate=rate)
        kept = 0
        for p in ps:
            if not stop.take(p):
                break
            kept += 1
            if not stop.more():
                break
        lengths.append(kept)
    assert lengths[0] > lengths[1] > lengths[2] >= 1


def test_a_long_chain_of_near_certain_tokens_is_not_cut_at_a_fixed_confidence():
    stop = ChainStop(verify_cost=0.1, draft_cost=0.15, rate=1.5)
    for p in (0.99, 0.98, 0.99, 0.97):
        assert stop.more() and stop.take(p)
    assert stop.drafted == 4


# -- the ask gate -------------------------------------------------------------------------------


def test_the_gate_stops_asking_a_drafter_whose_asks_do_not_pay_and_probes_it_again():
    gate = AskGate()
    asks = 0
    while gate.asks():  # every ask: one draft forward at 0.3, nothing gained
        gate.observe_ask(0.0, 0.3)
        asks += 1
        assert asks < 10
    assert asks >= 2  # one unlucky ask does not end drafting
    skips = 0
    while not gate.asks():
        gate.observe_skip()
        skips += 1
        assert skips < 100
    assert skips >= 5  # it probes now and then, not every step


def test_the_gate_keeps_asking_a_drafter_that_pays():
    gate = AskGate()
    for _ in range(200):
        assert gate.asks()
        gate.observe_ask(2.0, 0.9)


# -- in the engine ------------------------------------------------------------------------------


class FixedPrice(DraftCost):
    """A draft token's price pinned at its prior: the tiny draft models cost about what the target
    does, and a measured price would (rightly) price them out."""

    def per_token(self, source=None):
        return self.prior if source in (None, LEARNED) else 0.0  # a lookup's guesses are free


def _engine(target, drafter, price=None, **kw):
    engine = Engine(target, None, drafter=drafter, num_speculative_tokens=5, verify_cost=0.1, verify_overhead=0.0,
                    **kw)
    if price is not None:
        engine.draft_costs[drafter.name] = FixedPrice(prior=price)
    return engine


@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_a_self_sized_draft_is_exactly_plain_decoding(peaky, noise):
    drafter = DraftModelDrafter(noisy_copy(peaky, noise, 1) if noise else peaky, V)
    engine, plain = _engine(peaky, drafter, price=0.1), Engine(peaky, None)
    lengths = []
    for ids in prompts(3):
        out = engine.generate(prompt_ids=ids, max_new_tokens=24)
        assert out.token_ids == plain.generate(prompt_ids=ids, max_new_tokens=24).token_ids
        lengths += [s.drafted for s in out.steps if s.kind != "prefill"]
    assert len(set(lengths)) >= 3  # chains of several lengths: each ends where its confidence says


def test_a_draft_that_is_never_confident_is_asked_only_now_and_then(llama):
    """A costly draft's tokens never pay: it drafts nothing, and the gate stops asking it (no draft
    forward), probing again every so often rather than never."""
    drafter = DraftModelDrafter(noisy_copy(llama, 0.5, 3), V)
    calls = []
    propose = drafter.propose
    drafter.propose = lambda context, k: calls.append(len(context)) or propose(context, k)
    engine = _engine(llama, drafter, price=2.0)
    ids = prompts(1)[0]
    out = engine.generate(prompt_ids=ids, max_new_tokens=120, sampling=SamplingParams(ignore_eos=True))
    assert out.stats.drafts == 0 and len(out.token_ids) == 120
    asked_at = [n - len(ids) for n in calls]
    assert 2 <= len(asked_at) < 30
    assert max(asked_at) > 60  # asked again late: re-probed after a spell without asks


def test_a_lookup_first_row_keeps_looking_up_while_its_model_is_not_asked(llama):
    drafter = DraftModelDrafter(noisy_copy(llama, 0.5, 3), V)
    combined = lookup_first(NgramDrafter(), drafter)
    engine, plain = _engine(llama, combined, price=2.0), Engine(llama, None)
    ids = [5, 6, 7, 8, 9] * 6
    out = engine.generate(prompt_ids=ids, max_new_tokens=24)
    assert out.token_ids == plain.generate(prompt_ids=ids, max_new_tokens=24).token_ids
    assert out.stats.drafts > 0  # the lookup's drafts (the model's never pay at this price)


def test_a_fixed_length_is_the_k_asked_for(llama):
    drafter = DraftModelDrafter(noisy_copy(llama, 0.5, 1), V)
    out = Engine(llama, None, drafter=drafter, num_speculative_tokens=3, draft_length="fixed").generate(
        prompt_ids=prompts(1)[0], max_new_tokens=16)
    assert {s.drafted for s in out.steps if s.kind != "prefill" and s.drafted} <= {3, 2, 1}
    assert max(s.drafted for s in out.steps) == 3


def test_sampling_with_the_chain_stop_follows_the_target():
    """Seeded sampling under the cost rule: the draft's chains end where its q says, before drawing;
    the output's distribution is still the target's."""
    target, draft = small_model(0), small_model(1)
    drafter = DraftModelDrafter(draft, SMALL_V)
    engine = Engine(target, None, drafter=drafter, num_speculative_tokens=3, verify_cost=0.1, verify_overhead=0.0)
    params = SamplingParams(temperature=1.0)
    counts = {}
    for seed in range(SAMPLES):
        out = engine.generate(prompt_ids=PROMPT, max_new_tokens=N_NEW, sampling=SamplingParams(temperature=1.0,
                                                                                            seed=seed))
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
    assert chi_square_p(target, params, counts) > 1e-3


# -- the prompt window --------------------------------------------------------------------------


def test_a_windowed_draft_reads_the_prompts_start_and_end_and_stays_exact(peaky):
    from specdec.drafters.draft_model import PROMPT_SINK

    drafter = DraftModelDrafter(noisy_copy(peaky, 0.1, 1), V, window=16)
    ids = [(7 * i + 3) % V for i in range(120)]
    drafter.begin(ids)
    assert drafter.cached_tokens == []  # the prompt is read when the core means to ask (`read`)
    drafter.read(ids)
    assert drafter.cached_tokens == (ids[:PROMPT_SINK] + ids[-16:])[:-1]  # the last: by the proposal
    engine, plain = _engine(peaky, drafter, price=0.1), Engine(peaky, None)
    out = engine.generate(prompt_ids=ids, max_new_tokens=24)
    assert out.token_ids == plain.generate(prompt_ids=ids, max_new_tokens=24).token_ids
    assert out.stats.drafts > 0
    short = list(range(PROMPT_SINK + 10))  # within the window: read whole
    drafter.begin(short)
    drafter.read(short)
    assert drafter.cached_tokens == short[:-1]


def test_a_prediction_rows_draft_reads_its_prompt_through_the_prediction_window(llama):
    """A row with a prediction: its draft model (alone, or the learned part of lookup-first) reads
    the prompt's first PROMPT_SINK tokens and its last `prediction.DRAFT_WINDOW`, for that request
    only: the same drafter begun without a prediction reads the prompt whole. The output stays
    plain's."""
    from specdec.drafters.draft_model import PROMPT_SINK
    from specdec.drafters.prediction import DRAFT_WINDOW, Prediction, PredictionDrafter, with_prediction

    ids = prompts(1, length=PROMPT_SINK + DRAFT_WINDOW + 40)[0]
    window = ids[:PROMPT_SINK] + ids[-DRAFT_WINDOW:]
    for own in (DraftModelDrafter(llama, V), lookup_first(NgramDrafter(), DraftModelDrafter(llama, V))):
        model = getattr(own, "learned", own)
        row = with_prediction(PredictionDrafter(Prediction.of(Chars().decode(ids[-30:]), Chars()), Chars()), own)
        row.begin(ids)
        row.read(ids)
        assert model.cached_tokens == window[:-1]  # the last token: read by the proposal
        own.begin(ids)
        own.read(ids)
        assert model.cached_tokens == ids[:-1]
    greedy = SamplingParams(ignore_eos=True)
    plain = Engine(llama, Chars()).generate(prompt_ids=ids, max_new_tokens=30, sampling=greedy)
    engine = Engine(llama, Chars(), drafter=own, num_speculative_tokens=5)
    out = engine.generate(prompt_ids=ids, max_new_tokens=30, sampling=greedy, prediction=Chars().decode(ids[:40]))
    assert out.token_ids == plain.token_ids


# -- the draft's read of its context ------------------------------------------------------------


def test_a_read_is_worth_it_only_where_the_remaining_tokens_can_pay_it_back():
    # A fresh gate's asks are worth 4/3 tokens per plain step: a quarter of each remaining token's
    # plain step saved, 32 plain steps over 128 tokens.
    gate = AskGate()
    assert gate.reads(100, 128, 0.3)  # 30 < 32
    assert not gate.reads(110, 128, 0.3)  # 33 > 32
    assert gate.reads(110, 512, 0.3)  # a longer allowance pays a longer prompt
    assert gate.reads(10_000, 128, 0.0)  # a free read is always worth it
    rich = AskGate()
    for _ in range(20):
        rich.observe_ask(3.0, 1.0)  # asks that earned 3 tokens for 1 plain step each
    assert rich.value() > 1.8 and rich.reads(110, 128, 0.3)  # evidence of pay: a dearer read pays
    poor = AskGate()
    for _ in range(20):
        poor.observe_ask(0.0, 0.5)
    assert poor.value() < 1 and not poor.reads(1, 10_000, 0.0)  # asks that lose never pay a read


def test_the_read_price_is_its_prior_until_a_read_and_a_step_are_measured():
    cost = DraftCost(read_prior=0.07)
    assert cost.per_read_token() == 0.07
    cost.observe_read(100, 0.5)  # 5 ms a token
    assert cost.per_read_token() == 0.07  # no plain step measured yet
    cost.observe_step(0.1, 2.0)  # 50 ms a plain step
    assert cost.per_read_token() == pytest.approx(0.1)


class PricedRead(FixedPrice):
    """FixedPrice with the read's price pinned too (a measured one would depend on timings)."""

    def per_read_token(self):
        return self.read_prior


def _counting(drafter):
    """Record the context length of each `read` and `propose` call on `drafter`."""
    reads, proposals = [], []
    read, propose = drafter.read, drafter.propose
    drafter.read = lambda context: reads.append(len(context)) or read(context)
    drafter.propose = lambda context, k: proposals.append(len(context)) or propose(context, k)
    return reads, proposals


def test_a_prompt_too_long_for_the_allowance_is_never_read_and_the_output_is_plain(peaky):
    ids = prompts(1, length=80)[0]
    drafter = DraftModelDrafter(peaky, V)
    reads, proposals = _counting(drafter)
    engine = _engine(peaky, drafter)
    engine.draft_costs[drafter.name] = PricedRead(prior=0.1, read_prior=0.5)  # the prompt: 40 plain steps
    plain = Engine(peaky, None)
    short = engine.generate(prompt_ids=ids, max_new_tokens=40, sampling=SamplingParams(ignore_eos=True))
    assert short.token_ids == plain.generate(prompt_ids=ids, max_new_tokens=40,
                                             sampling=SamplingParams(ignore_eos=True)).token_ids
    assert reads == [] and proposals == [] and short.stats.drafts == 0  # 0.25 * 39 < 40: never read
    # The same prompt with room for 300 tokens: read once, then drafted from.
    long = engine.generate(prompt_ids=ids, max_new_tokens=300, sampling=SamplingParams(ignore_eos=True))
    assert long.token_ids == plain.generate(prompt_ids=ids, max_new_tokens=300,
                                            sampling=SamplingParams(ignore_eos=True)).token_ids
    assert reads[0] == len(ids) + 1 and long.stats.drafts > 0  # after the first token, before any proposal
    assert proposals and proposals[0] >= reads[0]


def test_a_lookup_first_row_looks_up_without_reading_a_prompt_it_cannot_pay_back(peaky):
    ids = [5, 6, 7, 8, 9] * 16
    drafter = DraftModelDrafter(peaky, V)
    reads, proposals = _counting(drafter)
    combined = lookup_first(NgramDrafter(), drafter)
    engine = _engine(peaky, combined)
    engine.draft_costs[combined.name] = PricedRead(prior=0.1, read_prior=0.5)
    out = engine.generate(prompt_ids=ids, max_new_tokens=24)
    assert out.token_ids == Engine(peaky, None).generate(prompt_ids=ids, max_new_tokens=24).token_ids
    assert reads == [] and proposals == [] and out.stats.drafts > 0  # the lookup's drafts only


def test_the_prompt_is_read_apart_from_the_proposals_and_its_read_is_priced(peaky):
    # A fixed length reads whatever it costs, but before the first proposal and timed as a read.
    ids = prompts(1, length=40)[0]
    drafter = DraftModelDrafter(peaky, V)
    pending = []
    propose = drafter.propose
    drafter.propose = lambda context, k: pending.append(drafter.pending(context)) or propose(context, k)
    engine = Engine(peaky, None, drafter=drafter, num_speculative_tokens=3, draft_length="fixed")
    out = engine.generate(prompt_ids=ids, max_new_tokens=16)
    assert out.stats.drafts > 0 and pending and set(pending) == {0}
    assert engine.draft_costs[drafter.name]._read[1] == len(ids)  # prompt + first token, the last unread


def test_a_seeded_rows_reads_and_drafts_do_not_depend_on_measured_prices(peaky):
    """A seeded sampled row decides its read by the prior price, whatever the drafter's measured
    prices say: the same seed gives the same text and the same reads on any machine."""
    ids = prompts(1, length=60)[0]
    runs = []
    for read_s, draft_s in ((1e-6, 1e-6), (10.0, 10.0)):
        drafter = DraftModelDrafter(noisy_copy(peaky, 0.1, 2), V)
        reads, proposals = _counting(drafter)
        engine = _engine(peaky, drafter)
        measured = engine.draft_costs.setdefault(drafter.name, DraftCost())
        measured.observe_step(0.01, 1.0)
        measured.observe_read(10, read_s)  # measured: reads nearly free, or ruinous
        measured.observe_draft(None, 1, draft_s)
        out = engine.generate(prompt_ids=ids, max_new_tokens=30,
                              sampling=SamplingParams(temperature=0.8, seed=3, ignore_eos=True))
        runs.append((out.token_ids, reads, proposals, [s.drafted for s in out.steps]))
    assert runs[0] == runs[1]
    assert runs[0][1]  # the prior price reads this prompt for 30 tokens (60 * 0.07 < 0.25 * 29)


def test_a_catch_up_after_a_pause_is_read_whatever_its_price(llama):
    """Only the prompt's read is weighed: the gate's re-probe reads what was emitted meanwhile even
    at a read price that the asks' poor value could never pay back."""
    drafter = DraftModelDrafter(noisy_copy(llama, 0.5, 3), V)
    reads, proposals = _counting(drafter)
    engine = _engine(llama, drafter)
    engine.draft_costs[drafter.name] = PricedRead(prior=2.0, read_prior=1.0)  # prompt: 10 plain steps
    ids = prompts(1)[0]
    out = engine.generate(prompt_ids=ids, max_new_tokens=120, sampling=SamplingParams(ignore_eos=True))
    assert out.stats.drafts == 0
    assert reads and reads[0] == len(ids) + 1  # the prompt, before the first proposal
    assert len(reads) >= 2 and max(n - len(ids) for n in reads) > 60  # catch-ups of the re-probes, late too
    assert max(n - len(ids) for n in proposals) > 60


def test_a_followed_prediction_goes_first_however_well_the_model_has_paid(llama):
    """A lookup-first row may ask its model before a lookup guess whose kind has paid less; never
    before a prediction the output has been following or has just rejoined on a long match or
    after a replaced token: those drafts are free and the model, asked instead, drafts the same
    tokens one forward each."""
    drafter = lookup_first(NgramDrafter(), DraftModelDrafter(noisy_copy(llama, 0.0, 1), V))
    cost = DraftCost(prior=0.01)
    rule = row_rule("cost", 5, model=llama, verify_cost=0.1, verify_overhead=0.0, draft_cost=cost, k_max=64)
    control = DraftController(drafter, rule, cost, fixed_k=False)
    ids = prompts(1)[0]
    drafter.begin(ids)
    for _ in range(20):
        rule.gate.observe_ask(gained=8.0, cost=1.0)  # the model's asks have paid well
    assert control.plan(ids, 64, None) > 0 and control.stop is not None  # asked this step
    first = control.learned_first()
    assert first((JOIN, "line")) and first((JOIN, "start"))  # weighed, and here the model goes first
    assert first((JOIN, "short")) and first((JOIN, "first-swap"))
    assert not first(FOLLOW) and not first((JOIN, "long")) and not first((JOIN, "swap"))  # the text vouches


class Chars:
    """A tokenizer of TINY_VOCAB ids, one character each (id i is chr(BASE + i)): predictions as text."""

    BASE = 0x4E00

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(self.BASE + i) for i in ids)

    def encode_plain(self, text):
        return [ord(c) - self.BASE if 0 <= ord(c) - self.BASE < V else 0 for c in text]

    def encode_offsets(self, text):
        return self.encode_plain(text), list(range(len(text)))


def test_a_row_drafting_from_its_prediction_leaves_its_model_unread(llama):
    """A lookup-first row reads its draft model's missing context only in a step its model drafts:
    while the prediction drafts every step, nothing is read (before, each asking step read the
    tokens the prediction had drafted, a draft forward each time), and once the output has passed
    the prediction's end the catch-up is weighed against the few tokens still expected
    (`PREDICTION_TAIL`), here not paid. An unrelated prediction leaves the model reading and drafting."""
    ids = prompts(1, length=60)[0]
    greedy = SamplingParams(ignore_eos=True)
    plain = Engine(llama, Chars()).generate(prompt_ids=ids, max_new_tokens=60, sampling=greedy)
    runs = {}
    for name, prediction in (("own", Chars().decode(plain.token_ids[:50])), ("unrelated", Chars().decode(ids[::-1]))):
        drafter = lookup_first(NgramDrafter(), DraftModelDrafter(llama, V))
        reads, proposals = _counting(drafter.learned)
        engine = Engine(llama, Chars(), drafter=drafter, num_speculative_tokens=5, verify_cost=0.1, verify_overhead=0.0)
        engine.draft_costs[drafter.name] = PricedRead(prior=0.1, read_prior=0.07)
        out = engine.generate(prompt_ids=ids, max_new_tokens=60, sampling=greedy, prediction=prediction)
        assert out.token_ids == plain.token_ids, name
        runs[name] = reads, proposals, out.stats.draft_tokens
    reads, proposals, drafted = runs["own"]
    assert reads == [] and proposals == [] and drafted >= 45  # the prediction drafted; the model never ran
    reads, proposals, _ = runs["unrelated"]
    assert reads and proposals  # the prompt read (60 tokens: 59 * 0.07 < 0.25 * 59), then drafts
