"""The server's rows size their drafts by the rule `specdec generate` uses (issue 43): for the same
settings and prompt, a row alone in the scheduler (its batch cap not binding) drafts the same
lengths, step by step, as `Engine.generate`, under the default (cost-aware) rule.

Prices that come from timings would make the two runs differ by the machine's noise, so the cases
keep them timing-free: prompt lookup (free drafts) with greedy rows, and a draft model with seeded
sampled rows (whose rule prices drafts by its fixed priors, so that a seed reproduces).
"""

import pytest

from specdec import Engine, SamplingParams
from specdec.drafters import DraftModelDrafter, NgramDrafter
from specdec.policy import DraftController
from specdec.scheduler import BatchScheduler, Request

from helpers import TINY_VOCAB as V
from test_batch_core import pair, prompts  # noqa: F401 (the tiny target and its draft model)

pytestmark = pytest.mark.usefixtures("one_thread")


def lengths_by_prompt(monkeypatch, ps):
    """Record each row's draft lengths in order, keyed by its prompt (the context's start)."""
    seen: dict[tuple, list[int]] = {}
    real = DraftController.draft

    def recording(self, context, plan, made):
        tree, q, source = real(self, context, plan, made)
        prompt = next(tuple(p) for p in ps if context[: len(p)] == p)
        seen.setdefault(prompt, []).append(len(tree))
        return tree, q, source

    monkeypatch.setattr(DraftController, "draft", recording)
    return seen


@pytest.mark.parametrize("case", ["ngram-greedy", "draft-model-seeded"])
def test_a_server_row_drafts_what_generate_drafts(pair, monkeypatch, case):  # noqa: F811
    ps = prompts(4)
    if case == "ngram-greedy":
        make, sampling = NgramDrafter, SamplingParams()
    else:
        make, sampling = (lambda: DraftModelDrafter(pair["draft"], V)), SamplingParams(temperature=0.8, seed=11)
    n = 24
    alone = lengths_by_prompt(monkeypatch, ps)
    engine = Engine(pair["target"], None, drafter=make(), num_speculative_tokens=5)
    texts = [engine.generate(prompt_ids=p, max_new_tokens=n, sampling=sampling).token_ids for p in ps]
    monkeypatch.undo()

    served = lengths_by_prompt(monkeypatch, ps)
    sched = BatchScheduler(pair["target"], None, drafter="d", drafters={"d": make()}, num_speculative_tokens=5,
                           max_batch=4, max_model_len=256, spec_token_budget=512, adaptive=False)
    for p, want in zip(ps, texts):  # one row at a time: the batch cap (budget // 1 - 1) never binds
        handle = sched.submit(Request(p, n, sampling))
        while not handle.finished:
            sched.run_once(wait=False)
        assert handle.result().token_ids == want
    monkeypatch.undo()
    assert served == alone
    # ... and that rule is not the fixed k the server drafted before.
    fixed = lengths_by_prompt(monkeypatch, ps)
    engine = Engine(pair["target"], None, drafter=make(), num_speculative_tokens=5, draft_length="fixed")
    for p in ps:
        engine.generate(prompt_ids=p, max_new_tokens=n, sampling=sampling)
    assert fixed != alone
