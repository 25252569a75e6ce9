"""Predicted outputs (`drafters/prediction.py`): the drafter follows, rejoins and re-tokenises; the
output with any prediction is the output without one (greedy identity, alone and in a batch beside
rows without predictions; the exact distribution under sampling, which an unverified variant
fails); the usage counts; the CLI's --prediction."""

import json
import subprocess
import sys

import pytest
import torch

from specdec import Engine, SamplingParams
from specdec.drafters import NgramDrafter
from specdec.drafters.combined import lookup_first
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.prediction import (FIRST, FOLLOW, JOIN, Prediction, PredictionDrafter, PredictionFirst,
                                         prediction_usage, with_prediction)
from specdec.errors import InvalidRequestError
from specdec.models import loader
from specdec.tokenizer import Tokenizer
from specdec.verify import TokenTree, TreeVerdict

import test_draft_model as tdm

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "abc abd abe; x = 1; y = 2; "


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    """The tiny Gemma 3 with the character tokenizer (ids 3.. = ASCII 32..125), drafting with ngram."""
    plain = Engine.load(str(tiny_folder), drafter="none", dtype="float32")
    spec = Engine(plain.model, plain.tokenizer, drafter=NgramDrafter())
    return plain, spec


@pytest.fixture(scope="module")
def gemma_tokenizer():
    return Tokenizer.from_folder(loader.resolve("default"))


def stale(text: str) -> str:
    """`text` with a few edits: characters changed, a span deleted, a span inserted."""
    n = len(text)
    chars = list(text)
    for i in (n // 5, n // 2):
        chars[i] = "#" if chars[i] != "#" else "%"
    out = "".join(chars)
    return out[: n // 3] + "INSERTED" + out[n // 3 : 2 * n // 3] + out[2 * n // 3 + 5 :]


def predictions(true: str, prompt: str) -> dict[str, str]:
    return {"true": true, "stale": stale(true), "random": "qwertyuiop asdfghjkl zxcvbnm " * 3, "prompt": prompt,
            "empty": "", "longer": true + true[::-1] + true}


# -- the drafter alone -----------------------------------------------------------------------------


def drafted_after(tok, prediction: str, output: str, k: int = 64) -> list[int]:
    """What a fresh prediction drafter proposes after `output` (tokenised on its own) was emitted."""
    drafter = PredictionDrafter(Prediction.of(prediction, tok), tok)
    prompt = [5, 6]
    drafter.begin(prompt)
    return drafter.propose(prompt + tok.encode_plain(output), k).tokens


def begun(text: str, tok) -> tuple[Prediction, PredictionDrafter]:
    """`text` as a prediction and a drafter of it, begun after the one-token prompt [9]."""
    pred = Prediction.of(text, tok)
    drafter = PredictionDrafter(pred, tok)
    drafter.begin([9])
    return pred, drafter


def test_follows_the_prediction_and_labels_its_evidence(gemma_tokenizer):
    tok = gemma_tokenizer
    pred, drafter = begun("def area(r):\n    return 3.14 * r * r\n\nprint(area(2))\n", tok)
    first = drafter.propose([9], 5)
    assert first.tokens == pred.ids[:5] and first.source == (JOIN, "start")
    follow = drafter.propose([9] + pred.ids[:6], 64)
    assert follow.tokens == pred.ids[6:] and follow.source == FOLLOW
    assert drafter.propose([9] + pred.ids, 8).tokens == []  # the prediction is used up


@pytest.mark.parametrize("edit,output,rest", [
    # a changed line: the output rejoins at the next line
    ("changed", "def f(a):\n    x = compute(a, 2)\n", "    y = x + 1\n    return y\n"),
    # an inserted line: at the line it was inserted before
    ("inserted", "def f(a):\n    print(a)\n", "    x = compute(a)\n    y = x + 1\n    return y\n"),
    # a deleted line: after a few tokens of the line after it
    ("deleted", "def f(a):\n    y = x", " + 1\n    return y\n"),
    # a preamble (a code fence) before the prediction's first line
    ("preamble", "Here it is:\n```python\n", "def f(a):\n    x = compute(a)\n    y = x + 1\n    return y\n"),
])
def test_rejoins_after_a_divergence(gemma_tokenizer, edit, output, rest):
    tok = gemma_tokenizer
    text = "def f(a):\n    x = compute(a)\n    y = x + 1\n    return y\n"
    drafts = drafted_after(tok, text, output)
    assert drafts and tok.decode(drafts) == rest, edit


def test_a_replaced_token_is_a_swap_once_the_output_has_followed(gemma_tokenizer):
    """A token the output put in place of the one expected rejoins at the token after it: a "swap"
    where the output had followed the prediction (a rename: drafted before the row's model,
    `FIRST`), a "first-swap" where it had not (its first token differed), weighed like any join."""
    tok = gemma_tokenizer
    text = "total = price * count\nprint(total)\nreturn total\n"
    pred = Prediction.of(text, tok)
    other = tok.encode_plain("Q")[-1]  # spells nothing of the text
    assert other not in pred.ids
    for out, kind in ((pred.ids[:3] + [other], "swap"), ([other], "first-swap")):
        _, drafter = begun(text, tok)
        proposal = drafter.propose([9] + out, 64)
        assert proposal.source == (JOIN, kind) and proposal.tokens == pred.ids[len(out):], kind
    assert (JOIN, "swap") in FIRST and (JOIN, "first-swap") not in FIRST and (JOIN, "long") in FIRST


def test_passed_end_once_the_output_followed_the_prediction_to_its_end(gemma_tokenizer):
    tok = gemma_tokenizer
    pred, drafter = begun("x = 1\ny = 2\n", tok)
    assert not drafter.passed_end([9] + pred.ids[:-2])
    assert drafter.passed_end([9] + pred.ids)  # the same output, read by passed_end itself
    assert not PredictionDrafter(pred, tok).passed_end([9] + tok.encode_plain("z = 3\n"))


def test_joins_inside_a_token_are_retokenised(gemma_tokenizer):
    """Wherever the output stops in the prediction's text (inside one of its tokens too), the drafts
    spell the text that follows, tokenised from there, and go back to the prediction's own tokens."""
    tok = gemma_tokenizer
    text = "result = transform(values, factor=3)\nprint(result.summary())\nvalidated = check(result)\n"
    pred = Prediction.of(text, tok)
    for cut in range(3, len(text) - 1):
        drafts = drafted_after(tok, text, text[:cut])
        assert drafts, cut
        spelled = tok.decode(tok.encode_plain(text[:cut]) + drafts)
        assert spelled == text, (cut, spelled)
        if cut < text.rfind("\n", 0, -1):  # the rest of the text is its own tokens again
            assert drafts[-3:] == pred.ids[-3:], cut


def test_an_unrelated_prediction_leaves_the_steps_to_the_rows_drafter(gemma_tokenizer):
    """Joins that keep coming to nothing fall silent, so the row's own drafter drafts those steps."""
    tok = gemma_tokenizer
    prediction = "The weather today is mild, with a light breeze from the west and some clouds. " * 4
    output = tok.encode_plain("def total(items):\n    return sum(item.price for item in items if item)\n" * 6)
    drafter = PredictionDrafter(Prediction.of(prediction, tok), tok)
    drafter.begin([7])
    proposed = 0
    for n in range(1, len(output)):
        proposal = drafter.propose([7] + output[:n], 8)
        proposed += bool(proposal.tokens)
        drafter.feedback(0 if output[n : n + 1] != proposal.tokens[:1] else 1)
    assert proposed < 0.3 * len(output), proposed


def test_usage_counts_each_prediction_token_once():
    assert prediction_usage([1, 2, 3, 4], [1, 2, 9, 4, 4, 4]).accepted == 3
    usage = prediction_usage([5, 5, 5], [5])
    assert (usage.accepted, usage.rejected) == (1, 2)
    assert prediction_usage([], [1, 2]).rejected == 0 and prediction_usage([1], []).accepted == 0


def test_composition_keeps_the_rows_drafter(gemma_tokenizer, llama):
    pred = PredictionDrafter(Prediction.of("x = 1\n", gemma_tokenizer), gemma_tokenizer)
    assert with_prediction(pred, None) is pred
    assert isinstance(with_prediction(pred, NgramDrafter()), PredictionFirst)
    model = with_prediction(pred, DraftModelDrafter(llama, 97))
    assert model.needs.fallback and model.lookup is pred and not model.needs.trees
    combined = with_prediction(pred, lookup_first(NgramDrafter(), DraftModelDrafter(llama, 97)))
    assert combined.needs.fallback and combined.lookup.prediction is pred


def test_bad_predictions(tiny):
    plain, _ = tiny
    with pytest.raises(InvalidRequestError, match="prediction"):
        plain.generate(prompt=PROMPT, max_new_tokens=4, prediction=["not", "text"])
    with pytest.raises(InvalidRequestError, match="prediction"):
        plain.generate(prompt=PROMPT, max_new_tokens=4, prediction="bad \ud800 text")
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        Engine(plain.model, None).generate(prompt_ids=[5, 6, 7], max_new_tokens=4, prediction="x")


# -- greedy identity ---------------------------------------------------------------------------------


@pytest.mark.parametrize("drafter", ["none", "ngram", "ngram+draft"])
def test_greedy_output_is_the_same_with_any_prediction(tiny, drafter):
    plain, spec = tiny
    engine = {"none": plain, "ngram": spec,
              "ngram+draft": Engine(plain.model, plain.tokenizer,
                                    drafter=lookup_first(NgramDrafter(), DraftModelDrafter(plain.model, 97)))}[drafter]
    for prompt, n in ((PROMPT, 40), ("hello world, hello", 24)):
        ref = plain.generate(prompt=prompt, max_new_tokens=n)
        for name, prediction in predictions(ref.text, prompt).items():
            out = engine.generate(prompt=prompt, max_new_tokens=n, prediction=prediction)
            assert out.token_ids == ref.token_ids, (drafter, name)
            pred_tokens = len(plain.tokenizer.encode_plain(prediction)) if prediction else 0
            assert out.prediction.accepted + out.prediction.rejected == pred_tokens
            assert out.prediction.accepted <= len(out.token_ids)
            if name == "true":
                assert out.stats.target_forwards < ref.stats.target_forwards / 3, drafter
                assert out.prediction.rejected == 0
    # speculative=False: no drafts at all, the usage still counted
    off = plain.generate(prompt=PROMPT, max_new_tokens=20, prediction=PROMPT, speculative=False)
    assert off.stats.draft_tokens == 0 and off.prediction.accepted + off.prediction.rejected > 0


def test_the_rows_drafter_drafts_where_the_prediction_offers_nothing(tiny):
    plain, spec = tiny
    prompt = "one two three four one two three four one two"
    ref = plain.generate(prompt=prompt, max_new_tokens=30)
    out = spec.generate(prompt=prompt, max_new_tokens=30, prediction="")
    lookup_only = spec.generate(prompt=prompt, max_new_tokens=30)
    assert out.token_ids == ref.token_ids
    assert out.stats.draft_tokens == lookup_only.stats.draft_tokens > 0


def run_batch(engine: Engine, rows: list) -> list[list[int]]:
    """Rows through `Engine.prefill` and `Engine.step` together, as the scheduler runs them: a
    finished row leaves and the last row moves into its cache row."""
    cache = engine.new_cache(len(rows), max(len(r.prompt) + r.out.max_new for r in rows) + 70)
    for r, row in enumerate(rows):
        engine.prefill(row, cache.rows(r + 1, r))
    live = list(rows)
    while live:
        for row in [row for row in live if row.finished]:
            r, last = live.index(row), len(live) - 1
            if r != last:
                cache.move_row(last, r)
                live[r] = live[last]
            live.pop()
            cache.truncate(0, row=last)
        if live:
            report = engine.step(live, cache.rows(len(live)))
            assert all(e.error is None for e in report.emitted)
    return [row.out.ids for row in rows]


def test_batch_of_rows_with_and_without_predictions(tiny):
    plain, spec = tiny
    tok = plain.tokenizer
    cases = []
    for i, prompt in enumerate((PROMPT, "hello world, hello", "a b c a b c", "zz; zz; zz")):
        n = 12 + 7 * i
        ref = plain.generate(prompt=prompt, max_new_tokens=n)
        for name, prediction in predictions(ref.text, prompt).items():
            cases.append((tok.encode(prompt), n, ref.token_ids, prediction if (len(cases) % 3) else None))
    rows = [spec.new_row(ids, max_new_tokens=n, drafter=spec.drafter.spawn(),
                         prediction=None if p is None else Prediction.of(p, tok)) for ids, n, _, p in cases]
    outs = run_batch(spec, rows)
    assert outs == [ref for _, _, ref, _ in cases]
    assert sum(r.stats.accepted_tokens for r, c in zip(rows, cases) if c[3] is not None) > 0


def test_default_model_greedy_identity_with_an_edit(default_engine_fp32):
    engine = default_engine_fp32
    prompt = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    ref = engine.generate(prompt=prompt, max_new_tokens=32)
    for prediction in (ref.text, ref.text.replace("(a, b)", "(x, y)").replace("return", "yield")):
        out = engine.generate(prompt=prompt, max_new_tokens=32, prediction=prediction)
        assert out.token_ids == ref.token_ids
        assert out.stats.accepted_tokens > 0


# -- sampling: the exact distribution -----------------------------------------------------------------


class Letters:
    """A tokenizer of the six-token test vocabulary: id i is the letter 'a' + i."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join("abcdef"[i] for i in ids)

    def encode_plain(self, text):
        return ["abcdef".index(c) if c in "abcdef" else 0 for c in text]

    def encode_offsets(self, text):
        return self.encode_plain(text), list(range(len(text)))


class Unverified(Engine):
    """Keeps every draft without verifying it (the next token sampled after them): must fail."""

    def _verify_tree(self, logits, tree, q, row):
        after = super()._verify_tree(logits[-1:], TokenTree([], []), None, row)
        return TreeVerdict(list(tree.tokens), after.next_token, "bonus", path=list(range(len(tree))))


def sampled_p_value(engine_class) -> float:
    params = SamplingParams(temperature=1.0)
    target = tdm.small_model(0)
    engine = engine_class(target, Letters())
    counts, drafted = {}, 0
    for seed in range(tdm.SAMPLES):
        out = engine.generate(prompt_ids=tdm.PROMPT, max_new_tokens=tdm.N_NEW, prediction="cbdbe",
                              sampling=SamplingParams(temperature=params.temperature, seed=seed))
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
        drafted += out.stats.draft_tokens
    assert drafted > tdm.SAMPLES  # the prediction really drafted
    return tdm.chi_square_p(target, params, counts, strict=engine_class is Engine)


def test_sampling_with_a_prediction_follows_the_exact_distribution():
    assert sampled_p_value(Engine) > 1e-3


def test_unverified_prediction_drafts_are_caught():
    assert sampled_p_value(Unverified) < 1e-6


# -- the CLI ----------------------------------------------------------------------------------------


def run_cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "specdec.cli", "generate", *args], capture_output=True, text=True,
                          timeout=300, input=stdin)


def test_cli_prediction(tiny_folder, tmp_path, tiny):
    plain, _ = tiny
    ref = plain.generate(prompt=PROMPT, max_new_tokens=20)
    res = run_cli("--model", str(tiny_folder), "--prompt", PROMPT, "--max-tokens", "20", "--prediction", "-",
                  "--json", stdin=ref.text)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["token_ids"] == ref.token_ids
    assert out["accepted_prediction_tokens"] + out["rejected_prediction_tokens"] == len(
        plain.tokenizer.encode_plain(ref.text))
    missing = run_cli("--prompt", "hi", "--prediction", str(tmp_path / "nope.txt"))
    (tmp_path / "bad.txt").write_bytes(b"ok \xff\xfe")
    binary = run_cli("--prompt", "hi", "--prediction", str(tmp_path / "bad.txt"))
    for res, needle in ((missing, "cannot read"), (binary, "not UTF-8")):
        assert res.returncode != 0 and "Traceback" not in res.stderr
        assert "--prediction" in res.stderr.strip().splitlines()[-1] and needle in res.stderr


# -- the edit benchmark's tasks ---------------------------------------------------------------------


def test_edit_tasks_and_their_report_helpers():
    from specdec.bench.configs import parse_configs
    from specdec.bench.edits import bin_of, changed_fraction
    from specdec.bench.prompts import DEFAULT_TEMPLATE, parse_tasks, select_prompts

    prompts = select_prompts(["edits"], 0, None, template=DEFAULT_TEMPLATE, chat=True)
    assert len(prompts) >= 24 and len({p.id for p in prompts}) == len(prompts)
    for p in prompts:
        assert 30 <= len(p.prediction.splitlines()) <= 150 and p.chat and p.prediction in p.text
    assert "edits" not in parse_tasks("all") and parse_tasks("edits") == ["edits"]
    code = prompts[0].prediction
    assert changed_fraction("```python\n" + code + "```\n", code) == 0.0 and bin_of(0.0) == "<= 5%"
    lines = code.splitlines(keepends=True)
    edited = "".join(lines[:3] + ["    pass\n"] * 8 + lines[3:])
    assert 0.05 < changed_fraction(edited, code) <= 0.25 and bin_of(0.2) == "15-25%"
    assert parse_configs("ngram:prediction")[0].options["prediction"] is True


def test_the_bench_drafts_a_prompt_from_its_own_or_an_unrelated_prediction():
    from specdec.bench.configs import parse_configs
    from specdec.bench.prompts import DEFAULT_TEMPLATE, select_prompts
    from specdec.bench.runner import predictions_for

    prompts = select_prompts(["edits"], 0, None, template=DEFAULT_TEMPLATE, chat=True)[:3]
    ids = [(i,) for i in range(3)]
    own, other, none = (predictions_for(c, prompts, ids) for c in parse_configs(
        "draft:model=x:prediction,draft:model=x:unrelated-prediction,draft:model=x"))
    assert own == {ids[i]: prompts[i].prediction for i in range(3)} and none == {}
    assert other == {ids[i]: prompts[(i + 1) % 3].prediction for i in range(3)}
    assert all(other[i] != own[i] for i in ids)
    for bad, needle in (("ngram:prediction:unrelated-prediction", "choose one"),
                        ("ref@ngram:prediction", "worker process")):
        with pytest.raises(InvalidRequestError, match=needle):
            parse_configs(bad)
