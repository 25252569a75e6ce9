"""The one decoding core over a batch of rows: every drafter, alone and batched with others.

Greedy output of every drafter (a draft model made by `train-draft --kind model --steps 0`, an
EAGLE head, ngram, suffix, their lookup-first combinations, token trees) equals plain decoding,
alone and in a batch of 8 rows with mixed drafters, prompt lengths and token limits, rows joining
mid-way; the sampling rule stays exact for model drafters inside a batch of rows with other seeds
and temperatures (and a broken rule is caught); the server with a draft model serves 16
concurrent greedy streams, each equal to the same request alone, and refuses a drafter path.
"""

import asyncio

import httpx
import openai
import pytest
import torch

from specdec import Engine, SamplingParams
from specdec.drafters import DraftModelDrafter, NgramDrafter, SuffixDrafter, TreeShape
from specdec.drafters.combined import lookup_first
from specdec.drafters.eagle import EagleDrafter
from specdec.models import loader
from specdec.policy import DraftController
from specdec.scheduler import BatchScheduler, Request, serving_drafters
from specdec.train import TrainConfig, train_model

from helpers import TINY_VOCAB, drive, make_char_tokenizer, make_tiny_hf

import test_eagle as te
import test_draft_model as tdm
import test_server as ts
V = TINY_VOCAB

pytestmark = pytest.mark.usefixtures("one_thread")

TREE = TreeShape(3, 2, 6)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny Gemma 3 target (with a character tokenizer, for the server), its 2-layer cut as a
    draft model (`train-draft --kind model --steps 0`) and a random EAGLE head."""
    root = tmp_path_factory.mktemp("pair")
    folder, _ = make_tiny_hf(root, "gemma3")
    make_char_tokenizer(folder)
    target, _ = loader.load(folder, torch.float32, "cpu")
    draft_dir = train_model(target, None, root / "draft", TrainConfig(kind="model", steps=0, layers=2, pick="first"),
                            log=lambda *a: None)
    draft, _ = loader.load(draft_dir, torch.float32, "cpu")
    head = te.random_head(target, 60)
    return dict(folder=folder, target=target, draft_dir=draft_dir, draft=draft, head=head)


def drafters(pair) -> dict:
    """Every drafter kind, by a name, fresh."""
    draft, head = pair["draft"], pair["head"]
    return {
        "draft_model": DraftModelDrafter(draft, V),
        "eagle": EagleDrafter(head),
        "ngram": NgramDrafter(),
        "suffix": SuffixDrafter(),
        "ngram+eagle": lookup_first(NgramDrafter(), EagleDrafter(head)),
        "ngram+draft_model": lookup_first(NgramDrafter(), DraftModelDrafter(draft, V)),
        "ngram-tree": NgramDrafter(),
        "eagle-tree": EagleDrafter(head),
    }


TREES = {"ngram-tree": TREE, "eagle-tree": TREE}


def prompts(n):
    # Repetitive prompts of mixed lengths, so lookup finds matches and rows draft different amounts.
    return [torch.randint(3, 30, (3 + i % 5,), generator=torch.Generator().manual_seed(i)).tolist() * (2 + i % 3)
            for i in range(n)]


@pytest.fixture(scope="module")
def plain(pair):
    engine = Engine(pair["target"], None)
    cache = {}

    def run(ids, n):
        key = (tuple(ids), n)
        if key not in cache:
            cache[key] = engine.generate(prompt_ids=ids, max_new_tokens=n).token_ids
        return cache[key]

    return run


NAMES = ["draft_model", "eagle", "ngram", "suffix", "ngram+eagle", "ngram+draft_model", "ngram-tree", "eagle-tree"]


@pytest.mark.fast
@pytest.mark.parametrize("name", NAMES)
def test_every_drafter_alone_equals_plain(pair, plain, name):
    drafter = drafters(pair)[name]
    engine = Engine(pair["target"], None, drafter=drafter, num_speculative_tokens=4, draft_length="fixed",
                    draft_tree=TREES.get(name))
    drafted = 0
    for ids in prompts(3)[1:]:
        out = engine.generate(prompt_ids=ids, max_new_tokens=20)
        assert out.token_ids == plain(ids, 20)
        drafted += out.stats.draft_tokens
    assert drafted > 0


@pytest.mark.fast
def test_batch_of_mixed_drafters_equals_plain(pair, plain):
    made = drafters(pair)
    names = list(made)
    assert names == NAMES
    sched = BatchScheduler(pair["target"], None, drafter="ngram", drafters={"none": None, **made}, draft_trees=TREES,
                           num_speculative_tokens=4, max_batch=8, max_model_len=256, spec_token_budget=64,
                           adaptive=False, draft_length="fixed")  # every drafter drafts, priced or not
    ps = prompts(18)
    limits = [4 + 3 * (i % 6) for i in range(18)]  # rows stop at different steps
    cycle = names + ["none"]  # each drafter twice, plain rows among them
    requests = [Request(p, n, drafter=cycle[i % len(cycle)]) for i, (p, n) in enumerate(zip(ps, limits))]
    # Driven by hand (no scheduler thread), so the batch is the one set up here: the first 8
    # admitted together and running, then the rest, which join mid-way as rows leave.
    first = [sched.submit(r) for r in requests[:8]]
    sched.run_once(wait=False)
    outs = drive(sched, first + [sched.submit(r) for r in requests[8:]])
    for r, o in zip(requests, outs):
        assert o.token_ids == plain(r.prompt_ids, r.max_new_tokens), r.drafter
        # Some rows stop at EOS before their limit, as they do alone.
        assert o.finish_reason == ("length" if len(o.token_ids) == r.max_new_tokens else "stop")
        assert o.usage.completion_tokens == len(o.token_ids)
    assert any(o.finish_reason == "stop" for o in outs) and any(o.finish_reason == "length" for o in outs)
    c = sched.counters
    assert c.step_rows / c.steps > 3 and c.spec.accepted_tokens > 0  # rows shared steps and drafts were kept
    by_drafter = {}
    for r, o in zip(requests, outs):
        by_drafter[r.drafter] = by_drafter.get(r.drafter, 0) + o.stats.draft_tokens
    assert all(by_drafter[name] > 0 for name in names), by_drafter  # every kind really drafted in the batch
    assert sched.num_running == 0 and int(sched.cache.lengths.sum()) == 0


# -- exact sampling inside a batch ----------------------------------------------------------------------


def batched_p_value(params, drafter, k=2):
    """tdm.p_value's chi-square test, with every sample a row of a batch of 8 beside rows of other
    seeds and temperatures (whose output is not counted)."""
    target = tdm.small_model(0)
    sched = BatchScheduler(target, None, drafter="d", drafters={"d": drafter}, num_speculative_tokens=k,
                           max_batch=8, max_queue=10 * tdm.SAMPLES, max_model_len=16, adaptive=False,
                           draft_length="fixed")
    counted, others = [], []
    for seed in range(tdm.SAMPLES):
        sp = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=seed)
        counted.append(sched.submit(Request(tdm.PROMPT, tdm.N_NEW, sp)))
        if seed % 3 == 0:
            others.append(sched.submit(Request([2, 3, 1][: 1 + seed % 3], 4, SamplingParams(temperature=1.4,
                                                                                          seed=10**6 + seed))))
    counts = {}
    for out in drive(sched, counted + others)[: len(counted)]:  # all queued first: full batches of 8
        ids = tuple(out.token_ids)
        counts[ids] = counts.get(ids, 0) + 1
    assert sched.counters.step_rows / sched.counters.steps > 4  # the samples really ran batched
    return tdm.chi_square_p(target, params, counts, strict=not isinstance(drafter, tdm.BrokenDrafter))


@pytest.mark.parametrize("kind", ["draft_model", "eagle"])
def test_sampling_in_a_batch_follows_the_exact_target_distribution(kind):
    params = SamplingParams(temperature=0.7, top_k=3)
    drafter = DraftModelDrafter(tdm.small_model(1), tdm.SMALL_V) if kind == "draft_model" else te.small_head()
    assert batched_p_value(params, drafter) > 1e-3


def test_broken_rule_in_a_batch_is_caught():
    params = SamplingParams(temperature=0.7, top_k=3)
    assert batched_p_value(params, tdm.BrokenDrafter(tdm.small_model(1), tdm.SMALL_V)) < 1e-6


# -- the server with a draft model ---------------------------------------------------------------------


def test_server_with_a_draft_model(pair):
    engine = Engine(pair["target"], loader_tokenizer(pair["folder"]))
    settings = ts.ServerSettings(model=str(pair["folder"]), served_model_name="tiny", drafter=str(pair["draft_dir"]),
                                 num_speculative_tokens=3, max_batch=16, max_queue=64, max_model_len=256,
                                 dtype="float32", speculation_control="budget", spec_token_budget=64,
                                 draft_length="fixed")  # the tiny draft model is too dear for the cost rule
    srv = ts.ThreadServer(ts.create_app(settings, load=lambda s: (engine.model, engine.tokenizer))).start()
    try:
        texts = [f"{'abcdefgh'[i % 8]}{'xyz'[i % 3]} abc abc {i}" for i in range(16)]
        refs = [engine.generate(prompt=t, max_new_tokens=12 + i % 5).text for i, t in enumerate(texts)]

        async def all_streams():
            client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)

            async def one(i, t):
                stream = await client.completions.create(model="tiny", prompt=t, max_tokens=12 + i % 5, temperature=0,
                                                         stream=True)
                return "".join([c.choices[0].text async for c in stream if c.choices])

            return await asyncio.gather(*(one(i, t) for i, t in enumerate(texts)))

        assert asyncio.run(all_streams()) == refs
        assert ts.metric(srv.url, "spec_decode_num_draft_tokens_total") > 0
        # A request chooses among the drafters loaded at start, by name; a path is refused.
        body = {"model": "tiny", "prompt": "abc", "max_tokens": 4}
        ok = httpx.post(srv.url + "/v1/completions", json={**body, "speculative": {"drafter": "ngram+draft_model"}})
        assert ok.status_code == 200
        bad = httpx.post(srv.url + "/v1/completions", json={**body, "speculative": {"drafter": str(pair["draft_dir"])}})
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "speculative.drafter" and "loaded at start" in bad.json()["error"]["message"]
    finally:
        srv.stop()


def loader_tokenizer(folder):
    from specdec.tokenizer import Tokenizer

    return Tokenizer.from_folder(folder)


def test_serving_drafters_names(pair):
    made, default = serving_drafters(str(pair["draft_dir"]), pair["target"])
    assert default == "draft_model"
    assert set(made) == {"none", "ngram", "suffix", "draft_model", "ngram+draft_model", "suffix+draft_model"}
    made, default = serving_drafters(f"suffix+{pair['draft_dir']}", pair["target"])
    assert default == "suffix+draft_model"
    # Rows get their own drafter state on the one loaded model.
    a, b = made["draft_model"].spawn(), made["draft_model"].spawn()
    assert a is not b and a.model is b.model is made["draft_model"].model


@pytest.mark.parametrize("kind", ["draft_model", "eagle"])
def test_model_drafter_rows_draft_in_one_batched_forward(pair, plain, monkeypatch, kind):
    from specdec.drafters import draft_model, eagle

    module = draft_model if kind == "draft_model" else eagle
    widths = []
    real = module.propose_batch

    def counting(drafters, contexts, ks):
        widths.append(len(drafters))
        return real(drafters, contexts, ks)

    monkeypatch.setattr(module, "propose_batch", counting)
    # Every row's drafts, in order (by its prompt: the context's start), batched, then alone.
    ps = prompts(10)
    drafted: dict[str, dict[tuple, list]] = {"batched": {}, "alone": {}}
    phase = ["batched"]
    real_draft = DraftController.draft

    def recording(self, context, plan, made):
        tree, q, source = real_draft(self, context, plan, made)
        prompt = next(tuple(p) for p in ps if context[: len(p)] == p)
        drafted[phase[0]].setdefault(prompt, []).append(tree.tokens)
        return tree, q, source

    monkeypatch.setattr(DraftController, "draft", recording)
    alone = Engine(pair["target"], None, drafter=drafters(pair)[kind], num_speculative_tokens=3, draft_length="fixed")
    loaded = drafters(pair)[kind]
    sched = BatchScheduler(pair["target"], None, drafter=kind, drafters={kind: loaded}, num_speculative_tokens=3,
                           max_batch=6, max_model_len=256, spec_token_budget=64, adaptive=False,
                           draft_length="fixed")
    limits = [6 + 2 * (i % 4) for i in range(10)]
    # All queued before the loop runs (by hand): the first 6 are admitted together, the rest as rows leave.
    outs = drive(sched, [sched.submit(Request(p, n)) for p, n in zip(ps, limits)])
    assert [o.token_ids for o in outs] == [plain(p, n) for p, n in zip(ps, limits)]
    assert max(widths) > 2  # rows drafted together
    phase[0] = "alone"
    for p, n in zip(ps, limits):  # ... and drafted what each drafts alone
        assert alone.generate(prompt_ids=p, max_new_tokens=n).token_ids == plain(p, n)
        batched = drafted["batched"][tuple(p)]
        assert batched == drafted["alone"][tuple(p)] and any(batched)
    pool = loaded._pool
    assert sorted(pool.free) == list(range(6)) and int(pool.cache.lengths.sum()) == 0  # every row handed back


@pytest.mark.parametrize("kind", ["draft_model", "eagle"])
def test_lookup_first_rows_join_the_batched_forward(pair, plain, monkeypatch, kind):
    """ngram+LEARNED rows whose lookup finds nothing draft with the learned part in the step's one
    batched forward per draft position: in a step where four or more rows draft that way, the
    draft model (EAGLE head) is fed draft tokens at most k - 1 times, each time over all of those
    rows at once (row by row, each row would be fed alone, one row wide). A request's first
    proposal reads its prompt on its own row (a long catch-up), which is not a draft position."""
    from specdec.drafters.combined import LEARNED

    counted = pair["draft"] if kind == "draft_model" else pair["head"].head
    forwards = []  # (rows, tokens) of each forward of the counted module
    real_forward = counted.forward

    def counting_forward(x, *args, **kwargs):
        forwards.append(tuple(x.shape[:2]))
        return real_forward(x, *args, **kwargs)

    monkeypatch.setattr(counted, "forward", counting_forward)
    sources, steps = [], []  # steps: (the step's forwards, rows that drafted with the learned part)
    real_draft, real_step = DraftController.draft, Engine.step

    def recording_draft(self, context, plan, made):
        out = real_draft(self, context, plan, made)
        sources.append(out[2])
        return out

    def recording_step(self, rows, cache, cap=None):
        before = len(forwards)
        sources.clear()
        report = real_step(self, rows, cache, cap)
        steps.append((forwards[before:], sum(s == LEARNED for s in sources)))
        return report

    monkeypatch.setattr(DraftController, "draft", recording_draft)
    monkeypatch.setattr(Engine, "step", recording_step)
    name = f"ngram+{kind}"
    k = 3
    sched = BatchScheduler(pair["target"], None, drafter=name, drafters={name: drafters(pair)[name]},
                           num_speculative_tokens=k, max_batch=6, max_model_len=256, spec_token_budget=64,
                           adaptive=False, draft_length="fixed")
    # Prompts without repeats: lookup finds little, so most rows fall back to the learned part.
    ps = [torch.randint(3, V, (8 + i,), generator=torch.Generator().manual_seed(100 + i)).tolist() for i in range(8)]
    # All queued before the loop runs (by hand, no scheduler thread): the first 6 rows are admitted
    # and step together, whatever the machine's timing.
    outs = drive(sched, [sched.submit(Request(p, 10)) for p in ps])
    monkeypatch.undo()
    assert [o.token_ids for o in outs] == [plain(p, 10) for p in ps]
    crowded = [(f, learned) for f, learned in steps if learned >= 4]
    assert crowded, steps
    for f, learned in crowded:
        # One token a row: the catch-up of the target's last token (one token, since the draft reads
        # the prompt in `begin`), then each draft token but the last: at most k forwards a step.
        feeds = [rows for rows, tokens in f if tokens == 1]
        assert feeds and len(feeds) <= k and all(rows >= learned for rows in feeds), (f, learned)


def test_server_draft_tree(pair, monkeypatch, capsys):
    """`serve --draft-tree`: ngram rows draft token trees in the server's batches, beside chain rows
    (suffix), each greedy output equal to the same request alone; a drafter that cannot draft trees
    or a malformed shape is one error line before anything loads."""
    from specdec.cli import main as cli_main
    from specdec.verify import TokenTree

    engine = Engine(pair["target"], loader_tokenizer(pair["folder"]))
    settings = ts.ServerSettings(model=str(pair["folder"]), served_model_name="tiny", drafter="ngram",
                                 num_speculative_tokens=3, max_batch=8, max_model_len=256, dtype="float32",
                                 speculation_control="budget", spec_token_budget=64, draft_tree="3x2x6")
    trees = []
    real_plan = DraftController.plan

    def recording_plan(self, context, remaining, cap):
        plan = real_plan(self, context, remaining, cap)
        if isinstance(plan, TokenTree) and not plan.is_chain:
            trees.append(len(plan))
        return plan

    monkeypatch.setattr(DraftController, "plan", recording_plan)
    app = ts.create_app(settings, load=lambda s: (engine.model, engine.tokenizer))
    srv = ts.ThreadServer(app).start()
    try:
        texts = [f"{'abcdefgh'[i % 8]}{'xyz'[i % 3]} abc abc {i} abc abc" for i in range(8)]
        refs = [engine.generate(prompt=t, max_new_tokens=12).text for t in texts]

        async def all_streams():
            client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)

            async def one(i, t):
                extra = {"speculative": {"drafter": "suffix"}} if i % 2 else {}
                out = await client.completions.create(model="tiny", prompt=t, max_tokens=12, temperature=0,
                                                      extra_body=extra)
                return out.choices[0].text

            return await asyncio.gather(*(one(i, t) for i, t in enumerate(texts)))

        assert asyncio.run(all_streams()) == refs
        assert app.state.specdec.scheduler.draft_trees == {"ngram": TREE}  # suffix drafts no trees: chains
        assert trees and max(trees) > 3  # real trees (more nodes than the depth) were drafted
    finally:
        srv.stop()
    for argv, fragment in ((["--drafter", "suffix", "--draft-tree", "3x2x6"], "cannot propose draft trees"),
                           (["--draft-tree", "3x2"], "DEPTHxTOPKxBUDGET")):
        capsys.readouterr()
        assert cli_main(["serve", "--model", str(pair["folder"]), *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and fragment in err
