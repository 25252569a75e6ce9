"""Continuous batching: joins and leaves between steps, per-row drafts, rollback and RNG."""

import pytest
import torch

from specdec import Engine, SamplingParams
from specdec.errors import InvalidRequestError
from specdec.models import loader
from specdec.policy import GoodputModel
from specdec.scheduler import BatchScheduler, QueueFullError, Request, ShuttingDownError

from helpers import drive, make_tiny_hf

# The schedulers here keep the default goodput rule, which picks k from measured step times, and
# their greedy rows are compared with plain decoding: on one torch thread a row is computed the same
# whatever the shape of its block, so that comparison does not depend on the machine's timing.
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder, _ = make_tiny_hf(tmp_path_factory.mktemp("m"), "gemma3")
    model, _ = loader.load(folder, torch.float32, "cpu")
    return model


def prompts(n):
    # Repetitive prompts so the lookup drafters find matches and rows draft different amounts.
    return [torch.randint(0, 20, (4 + i % 6,), generator=torch.Generator().manual_seed(i)).tolist() * 3
            for i in range(n)]


@pytest.mark.parametrize("drafter,k", [("ngram", 4), ("suffix", 3), ("none", 1)])
def test_batched_greedy_equals_alone(tiny, drafter, k):
    plain = Engine(tiny, None)
    ps = prompts(11)
    lengths = [5 + 4 * (i % 5) for i in range(11)]  # rows finish at different steps
    refs = [plain.generate(prompt_ids=p, max_new_tokens=n).token_ids for p, n in zip(ps, lengths)]
    # 11 requests through 4 rows, all queued before the loop runs (by hand, no scheduler thread):
    # 4 admitted together, the rest join as others leave, and rows get moved.
    sched = BatchScheduler(tiny, None, drafter=drafter, num_speculative_tokens=k, max_batch=4,
                           max_model_len=256)
    # Mixed per-request overrides in the same batch.
    overrides = [(None, None), ("ngram", 2), ("none", 0), (None, 6)]
    outs = drive(sched, [sched.submit(Request(p, n, drafter=overrides[i % 4][0],
                                              num_speculative_tokens=overrides[i % 4][1]))
                         for i, (p, n) in enumerate(zip(ps, lengths))])
    assert [o.token_ids for o in outs] == refs
    assert all(o.finish_reason == "length" and o.usage.completion_tokens == n for o, n in zip(outs, lengths))
    c = sched.counters
    assert c.step_rows / c.steps > 2  # rows really shared steps
    if drafter != "none":
        assert c.spec.accepted_tokens > 0
    assert sched.num_running == 0 and int(sched.cache.lengths.sum()) == 0  # every row released


def test_seeded_sampling_alone_is_reproducible_and_rows_have_own_rngs(tiny):
    sched = BatchScheduler(tiny, None, drafter="ngram", num_speculative_tokens=3, max_batch=4,
                           max_model_len=256)

    def run(*requests):  # queued together, then the loop by hand: they are admitted together
        return [c.token_ids for c in drive(sched, [sched.submit(r) for r in requests])]

    p = prompts(1)[0]
    sp = SamplingParams(temperature=1.0, seed=11)
    [a], [b] = run(Request(p, 30, sp)), run(Request(p, 30, sp))
    # Four copies side by side: one generator each, so all four draw the same stream; at 4 rows
    # the budget rule still allows k = 3 (k_cap(4) = 7), so they draft exactly as when alone.
    together = run(*[Request(p, 30, sp) for _ in range(4)])
    [other] = run(Request(p, 30, SamplingParams(temperature=1.0, seed=12)))
    assert a == b and all(t == a for t in together) and other != a


def test_speculation_fades_under_load(tiny):
    sched = BatchScheduler(tiny, None, drafter="ngram", num_speculative_tokens=5, max_batch=8, max_model_len=256,
                           spec_token_budget=8)
    assert [sched.k_cap(n) for n in (1, 2, 3, 4, 5, 8)] == [7, 3, 1, 1, 0, 0]
    # n rows draft at most budget // n - 1 tokens each, so a step scores at most the budget. All
    # 8 queued before the loop runs (by hand): admitted together, then leaving one by one (their
    # limits differ), so every load from 8 rows down to 1 is stepped.
    drive(sched, [sched.submit(Request(p, 6 + 3 * i)) for i, p in enumerate(prompts(8))])
    c = sched.counters
    assert c.step_rows / c.steps > 2  # the steps were crowded
    assert c.step_tokens <= 8 * c.steps  # no step scored more than the budget


def test_cancel_frees_the_row(tiny):
    # The loop by hand: the cancellation lands after the first step, wherever the machine's timing
    # would have put a scheduler thread by then (it could have finished all 400 tokens).
    sched = BatchScheduler(tiny, None, drafter="ngram", num_speculative_tokens=3, max_batch=2,
                           max_model_len=512)
    long = sched.submit(Request(prompts(1)[0], 400))
    sched.run_once(wait=False)
    assert sched.num_running == 1 and not long.finished
    long.cancel()
    sched.run_once(wait=False)  # the cancellation is taken before anything else
    assert long.finished and sched.num_running == 0
    out = long.result()
    assert out.finish_reason == "cancelled" and 0 < len(out.token_ids) < 400
    assert drive(sched, [sched.submit(Request([1, 2, 3], 3))])[0].usage.completion_tokens == 3
    assert sched.num_running == 0 and sched.counters.finished["cancelled"] == 1


def test_limits(tiny):
    sched = BatchScheduler(tiny, None, drafter="none", num_speculative_tokens=1, max_batch=1, max_queue=1,
                           max_model_len=64)
    with pytest.raises(InvalidRequestError, match="context"):
        sched.submit(Request([1] * 60, 10))
    with pytest.raises(InvalidRequestError):
        sched.submit(Request([], 10))
    with pytest.raises(InvalidRequestError):
        sched.submit(Request([1, 500], 10))
    with pytest.raises(InvalidRequestError):
        sched.submit(Request([1], 4, drafter="/some/draft/model"))
    # Not started: one request fills the free row's place, one the queue, the third is refused.
    sched.submit(Request([1], 4))
    sched.submit(Request([1], 4))
    with pytest.raises(QueueFullError):
        sched.submit(Request([1], 4))
    sched.start()
    sched.shutdown(drain=True)
    with pytest.raises(ShuttingDownError):
        sched.submit(Request([1], 4))
    assert sched.counters.finished == {"length": 2}


def test_goodput_rule_drafts_only_when_it_pays():
    def model(a, b, alpha, widths=(1, 2, 4, 8, 16, 32)):
        m = GoodputModel()
        for x in widths * 5:
            m.observe_step(x, a + b * x)
        m.observe_drafts(1000, int(1000 * alpha))
        return m

    assert GoodputModel().best_k(4, 5) == 5  # no data yet: the ceiling
    line = model(0.1, 0.002, 0.5).line()
    assert line == pytest.approx((0.1, 0.002))
    # Weight-bound steps (extra tokens nearly free) and good drafts: draft up to the ceiling.
    assert model(0.1, 0.0005, 0.8).best_k(1, 5) == 5
    # A batch on a machine where every token costs: fewer drafts, and none for a big batch.
    assert 0 < model(0.1, 0.005, 0.8).best_k(4, 5) < 5
    assert model(0.1, 0.02, 0.5).best_k(16, 5) == 0
    # Poor drafts never pay once tokens cost anything.
    poor = model(0.1, 0.01, 0.05)
    assert poor.best_k(1, 5) == 0
    # ... but evidence fades step by step, so drafting is tried again later.
    for _ in range(400):
        poor.observe_drafts(0, 0)
    assert poor.alpha == pytest.approx(0.5, abs=0.01) and poor.best_k(1, 5) > 0
