"""`specdec bench`: configuration parsing, prompt selection, the bound, summaries, a real end-to-end
run on a tiny model (runner, JSON, Markdown, plot), and one-line CLI errors."""

import json
import random
import sys
import types

import pytest

from specdec.bench import configs as C
from specdec.bench import prompts as P
from specdec.bench import report as R
from specdec.bench.runner import BenchResult, PromptInfo, Run, Settings, compare_outputs, first_divergence
from specdec.cli import main
from specdec.errors import InvalidRequestError

from helpers import make_tiny_hf

# -- configurations ------------------------------------------------------------------------------


def test_parse_configs_fills_defaults_and_keeps_labels():
    got = C.parse_configs("plain, ngram:k=8:adaptive ,suffix:max_ngram=5,draft:k=4,hf-lookup,hf:dtype=bf16",
                          draft_model="/some/draft")
    assert [c.label for c in got] == ["plain", "ngram:k=8:adaptive", "suffix:max_ngram=5", "draft:k=4",
                                      "hf-lookup", "hf:dtype=bf16"]
    plain, ngram, suffix, draft, lookup, hf = got
    assert not plain.speculative and plain.k is None and plain.family == "specdec"
    assert ngram.k == 8 and ngram.adaptive and ngram.speculative and ngram.draft_length == "adaptive"
    assert suffix.draft_length is None and C.parse_config("ngram:k=8:fixed").draft_length == "fixed"
    assert suffix.options == {"k": 5, "max_ngram": 5}
    assert draft.options["model"] == "/some/draft" and draft.k == 4
    assert lookup.options == {"k": 10, "n": 2} and lookup.family == "hf"
    assert hf.options == {"dtype": "bf16"} and not hf.speculative


@pytest.mark.parametrize("text, fragment", [
    ("", "empty"),
    ("plain,,ngram", "empty entry"),
    ("beam", "unknown configuration 'beam'"),
    ("ngram:depth=3", "unknown option 'depth'"),
    ("ngram:k", "needs a value"),
    ("ngram:k=five", "not a valid int"),
    ("ngram:k=0", "k must be >= 1"),
    ("ngram:adaptive=no", "is a flag"),
    ("ngram:adaptive:cost", "one of fixed, adaptive and cost"),
    ("ngram:tree=3x2", "DEPTHxTOPKxBUDGET"),
    ("eagle:tree=3x2x6:adaptive", "fixed shape"),
    ("plain:dtype=float64", "dtype must be one of"),
    ("ngram:quantize=int3", "quantize must be one of"),
    ("ngram:min_ngram=4", "min_ngram <= max_ngram"),
    ("draft:k=4", "needs a draft model"),
    ("draft:p_min=2", "p_min must be in [0, 1]"),
    ("ngram:k=5,ngram:k=5", "listed twice"),
    ("eagle:head=/nonexistent/head", "no EAGLE head"),
])
def test_parse_configs_errors(text, fragment):
    with pytest.raises(InvalidRequestError, match="configs|") as info:
        C.parse_configs(text)
    assert fragment in str(info.value)
    assert info.value.param == "configs"


def test_with_baselines_adds_plain_per_target_and_maps_peers_to_the_default():
    canon = {"auto": "float32", "fp32": "float32", "bf16": "bfloat16"}.get
    configs = C.parse_configs("ngram:k=5,ngram:k=5:quantize=int8,ngram:dtype=fp32,hf,suffix:dtype=bf16")
    full, base = C.with_baselines(configs, "auto", "none", lambda d, q: canon(d, d))
    labels = [c.label for c in full]
    # One plain per target, each placed before its first user; "fp32" is the default target too.
    assert labels == ["plain", "ngram:k=5", "plain:quantize=int8", "ngram:k=5:quantize=int8", "ngram:dtype=fp32",
                      "hf", "plain:dtype=bf16", "suffix:dtype=bf16"]
    assert base["ngram:k=5"] == base["ngram:dtype=fp32"] == base["hf"] == base["plain"] == "plain"
    assert base["ngram:k=5:quantize=int8"] == "plain:quantize=int8"
    assert base["suffix:dtype=bf16"] == "plain:dtype=bf16"
    # A plain the user wrote is kept and used; none is added for peers-free int8-only lists.
    full, base = C.with_baselines(C.parse_configs("ngram:quantize=int8,plain:quantize=int8"), "auto", "none")
    assert [c.label for c in full] == ["ngram:quantize=int8", "plain:quantize=int8"]
    assert base["ngram:quantize=int8"] == "plain:quantize=int8"
    # The runner's own mapping: "auto" is float32 for an int8 target on the CPU (the int8 model
    # computes in float32), so an int8 configuration written with fp32 shares that plain run.
    from specdec.bench.runner import canonical_dtype

    configs = C.parse_configs("ngram:quantize=int8,suffix:quantize=int8:dtype=fp32")
    full, base = C.with_baselines(configs, "auto", "none", canonical_dtype("cpu"))
    assert [c.label for c in full] == ["plain:quantize=int8", "ngram:quantize=int8", "suffix:quantize=int8:dtype=fp32"]
    assert base["suffix:quantize=int8:dtype=fp32"] == "plain:quantize=int8"


# -- prompts -------------------------------------------------------------------------------------


def _fake_spec_bench(path):
    rows = []
    qid = 0
    for cat in P.MT_BENCH_CATEGORIES:
        for _ in range(2):
            qid += 1
            rows.append({"question_id": qid, "category": cat, "turns": [f"{cat} question {qid}", "second turn"]})
    for cat in ("translation", "summarization", "qa", "math_reasoning", "rag"):
        for _ in range(10):
            qid += 1
            rows.append({"question_id": qid, "category": cat, "turns": [f"{cat} question {qid}"]})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_select_prompts_spreads_each_group_and_applies_the_template(tmp_path):
    sb = _fake_spec_bench(tmp_path / "q.jsonl")
    got = P.select_prompts(P.parse_tasks("spec_bench"), 4, sb)
    groups = [p.group for p in got]
    assert groups == [g for g in P.SPEC_BENCH_GROUPS for _ in range(4)]
    qa = [p for p in got if p.group == "qa"]
    # Evenly spread over the group's 10 questions (ids 37..46 in file order): 0, 2, 5, 7.
    assert [p.id for p in qa] == ["qa-37", "qa-39", "qa-42", "qa-44"]
    assert qa[0].text == "Question: qa question 37\nAnswer:"
    mt = [p for p in got if p.group == "mt_bench"]
    assert len({p.text.split()[1] for p in mt}) == 4  # spread over several MT-bench categories
    # The first turn only, wrapped in a custom template; single categories and `code` work as groups.
    got = P.select_prompts(P.parse_tasks("coding,code"), 0, sb, template="{prompt}")
    assert [p.text for p in got[:2]] == ["coding question 9", "coding question 10"]
    assert [p.group for p in got[2:]] == ["code"] * len(P.CODE_PROMPTS) and got[2].text == P.CODE_PROMPTS[0]


def test_prompt_files_and_prompt_errors(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"prompt": "raw text"}\n\n{"turns": ["a question"], "group": "g", "id": "x"}\n'
                 '{"prompt_ids": [5, 6, 7], "category": "ids"}\n')
    got = P.select_prompts(P.parse_tasks("none"), 1, None, [str(f)])
    assert [(p.id, p.group) for p in got] == [("mine-1", "mine"), ("x", "g"), ("mine-4", "ids")]
    assert got[0].text == "raw text" and got[1].text == "Question: a question\nAnswer:" and got[2].ids == (5, 6, 7)

    def error(fn, *a, **kw):
        with pytest.raises(InvalidRequestError) as info:
            fn(*a, **kw)
        return str(info.value)

    assert "unknown task 'chat'" in error(P.parse_tasks, "qa,chat")
    assert "Spec-Bench questions not found" in error(P.select_prompts, ["qa"], 1, tmp_path / "missing.jsonl")
    assert "no prompts selected" in error(P.select_prompts, [], 1, None)
    assert "{prompt}" in error(P.select_prompts, ["code"], 1, None, template="Q: {question}")
    assert "--per-group" in error(P.select_prompts, ["code"], -1, None)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    assert "bad.jsonl:2: not valid JSON" in error(P.load_prompt_file, bad)
    bad.write_text('{"prompt_ids": [1, -2]}\n')
    assert "prompt_ids must be a non-empty list" in error(P.load_prompt_file, bad)
    bad.write_text('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n')
    assert "occurs twice" in error(P.select_prompts, [], 1, None, [str(bad)])
    assert "not found" in error(P.load_prompt_file, tmp_path / "nope.jsonl")


def test_real_spec_bench_file_has_the_six_groups():
    path = P.spec_bench_path()
    if path is None:
        pytest.skip("../shared/spec_bench/question.jsonl is not here")
    got = P.select_prompts(P.parse_tasks("spec_bench"), 3, path)
    assert [p.group for p in got] == [g for g in P.SPEC_BENCH_GROUPS for _ in range(3)]
    assert all(p.text.startswith("Question: ") and p.text.endswith("\nAnswer:") for p in got)


# -- the bound and the summaries -------------------------------------------------------------------


def test_leviathan_bound_formula():
    # Expected tokens per step = sum_{i=0..k} alpha^i (each draft accepted w.p. alpha, + 1 from the target).
    for alpha, k in [(0.0, 4), (0.3, 1), (0.6, 5), (0.9, 8)]:
        assert R.expected_tokens_per_step(alpha, k) == pytest.approx(sum(alpha**i for i in range(k + 1)))
    assert R.expected_tokens_per_step(1.0, 5) == 6.0
    # Leviathan et al.'s closed form, and its limits.
    assert R.leviathan_bound(0.8, 4, 0.05) == pytest.approx((1 - 0.8**5) / ((1 - 0.8) * (4 * 0.05 + 1)))
    assert R.leviathan_bound(0.0, 4, 0.1) == pytest.approx(1 / 1.4)  # nothing accepted: pure cost
    assert R.leviathan_bound(1.0, 4, 0.0) == 5.0
    # Steps without a draft are plain steps: f = 0 gives 1 token per (drafting-cost-inflated) step.
    assert R.leviathan_bound(0.9, 4, 0.0, draft_share=0.0) == 1.0
    assert R.leviathan_bound(0.5, 3, 0.0, draft_share=0.5) == pytest.approx(0.5 * 1.875 + 0.5)
    with pytest.raises(ValueError):
        R.leviathan_bound(1.2, 4, 0.0)


def _run(config, pid, wall, tokens, forwards=None, prefill=0.0, **kw):
    return Run(config, pid, "g", 0, 10, len(tokens), wall, list(tokens), prefill_s=prefill,
               target_forwards=forwards, **kw)


def test_summaries_compute_speedup_alpha_bound_and_identity():
    # Plain: 8 tokens from 8 forwards (the prefill emits the first, then 7 decode steps) in 1 s.
    plain = [_run("plain", "a", 1.0, range(8), forwards=8, prefill=0.3),
             _run("plain", "b", 1.0, range(8), forwards=8, prefill=0.3)]
    # Speculative: prompt a identical; prompt b diverges at token 5. Per run: 4 decode steps, of
    # which 3 drafted (k = 2 each: 6 drafted), 4 accepted; verified = 4 accepted + 2 rejections.
    spec_kw = dict(drafts=3, draft_tokens=6, accepted_tokens=4, tested_tokens=6,
                   accepted_per_position=[3, 1], drafted_per_position=[3, 3], draft_s=0.01)
    spec = [_run("ngram", "a", 0.5, range(8), forwards=5, prefill=0.3, **spec_kw),
            _run("ngram", "b", 0.5, [0, 1, 2, 3, 4, 9, 9, 9], forwards=5, prefill=0.3, **spec_kw)]
    peer = [_run("hf", "a", 2.0, range(8)), _run("hf", "b", 2.0, range(7))]
    configs = C.parse_configs("plain,ngram:k=2,hf")
    configs[1] = C.BenchConfig("ngram", "ngram", {"k": 2})
    baselines = {"plain": "plain", "ngram": "plain", "hf": "plain"}
    runs = plain + spec + peer
    compare_outputs(runs, baselines)
    result = BenchResult(Settings(), configs, baselines, {}, [PromptInfo("a", "g", 10), PromptInfo("b", "g", 10)],
                         runs, {}, "peak RSS", {})
    got = {(s.config, s.group): s for s in R.summarize(result)}
    assert set(got) == {(c, g) for c in ("plain", "ngram", "hf") for g in ("g", "all")}
    s = got[("ngram", "all")]
    assert s.tokens_per_s == pytest.approx(16.0) and s.speedup == pytest.approx(2.0)
    assert s.acceptance_rate == pytest.approx(4 / 6) and s.alpha == pytest.approx(4 / 6)
    assert s.mean_accepted_length == pytest.approx(1 + 4 / 3)
    assert s.acceptance_by_position == [1.0, pytest.approx(1 / 3)]
    assert s.draft_share == pytest.approx(6 / 8) and s.draft_length == 2.0
    assert s.forwards_per_token == pytest.approx(10 / 16)
    assert (s.identical, s.compared, s.first_divergence) == (1, 2, 5)
    # Prefill taken out: 16 tokens in 2 x 0.2 s against 16 in 2 x 0.7 s; prefill 0.6 of 1.0 s.
    assert s.decode_speedup == pytest.approx(3.5) and s.prefill_share == pytest.approx(0.6)
    assert got[("plain", "all")].prefill_share == pytest.approx(0.3)
    # Plain step = 0.7 s / 7 steps = 0.1 s; drafting 0.01 s per 4 steps -> kc = 0.025, c = 0.0125.
    assert s.cost_ratio == pytest.approx(0.0125)
    assert s.step_cost == pytest.approx((0.2 / 4) / 0.1)
    assert s.bound == pytest.approx(R.leviathan_bound(4 / 6, 2.0, 0.0125, 0.75))
    assert s.bound_always_drafting == pytest.approx(R.leviathan_bound(4 / 6, 2.0, 0.0125))
    h = got[("hf", "all")]
    assert h.speedup == pytest.approx((15 / 4) / 8) and h.alpha is None and h.bound is None
    assert (h.identical, h.compared, h.first_divergence) == (1, 2, 7)  # a prefix: diverges at its end
    head = R.headline(result, R.summarize(result))
    assert head["best"] == "ngram" and head["vs_peers"]["hf"] == pytest.approx(16 / (15 / 4))
    assert first_divergence([1, 2, 3], [1, 2, 3, 4]) == 3 and first_divergence([1, 5], [1, 2]) == 1


def test_speedup_interval_is_a_bootstrap_over_prompts():
    # Every prompt twice as fast: any draw of prompts gives 2.0, so the interval is [2, 2].
    plain = [_run("plain", p, 1.0 + i, range(8)) for i, p in enumerate("abcd")]
    fast = [_run("ngram", p, (1.0 + i) / 2, range(8)) for i, p in enumerate("abcd")]
    low, high = R.speedup_interval(fast, plain)
    assert low == pytest.approx(2.0) and high == pytest.approx(2.0)
    # Prompts that gain differently: the interval holds the whole-run speedup and is seeded.
    mixed = [_run("ngram", p, 1.0 / g, range(8)) for p, g in zip("abcd", (1.2, 1.5, 2.5, 3.0))]
    flat = [_run("plain", p, 1.0, range(8)) for p in "abcd"]
    low, high = R.speedup_interval(mixed, flat)
    whole = 32 / sum(r.wall_s for r in mixed) / (32 / 4.0)
    assert 1.2 <= low < whole < high <= 3.0
    assert R.speedup_interval(mixed, flat) == (low, high)
    # A prompt's repeats stay together; one prompt (or none in common) gives no interval.
    assert R.speedup_interval(mixed[:1], flat) is None
    assert R.speedup_interval(mixed, [_run("plain", "z", 1.0, range(8))]) is None


def test_markdown_shows_the_interval_of_the_speedup():
    plain = [_run("plain", p, 1.0, range(8), forwards=8, prefill=0.1) for p in "abc"]
    spec = [_run("ngram", p, 1.0 / g, range(8), forwards=4, prefill=0.1) for p, g in zip("abc", (1.5, 2.0, 2.5))]
    configs = C.parse_configs("plain,ngram")
    baselines = {"plain": "plain", "ngram": "plain"}
    result = BenchResult(Settings(), configs, baselines, {}, [PromptInfo(p, "g", 10) for p in "abc"],
                         plain + spec, {}, "peak RSS", {})
    summaries = R.summarize(result)
    s = next(x for x in summaries if x.config == "ngram" and x.group == "all")
    text = R.to_markdown(result, summaries)
    interval = f"{s.speedup:.2f}x [{s.speedup_interval[0]:.2f}, {s.speedup_interval[1]:.2f}]"
    assert f"| `ngram` | " in text and interval in text  # the table and the headline
    assert text.count(interval) == 2
    # Decode speedup and prefill share are columns of the table.
    assert f"| {s.decode_speedup:.2f}x | {s.prefill_share:.2f} |" in text
    plain_row = next(x for x in summaries if x.config == "plain" and x.group == "all")
    assert plain_row.speedup_interval is None  # the baseline against itself


# -- a real run on a tiny model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    folder, _ = make_tiny_hf(tmp, "llama")
    rnd = random.Random(0)
    lines = []
    for i in range(2):
        motif = [rnd.randrange(1, 97) for _ in range(10)]
        # Repetitive prompts, so the lookup drafters find drafts.
        lines.append(json.dumps({"prompt_ids": motif * 3, "group": f"grp{i % 2}", "id": f"p{i}"}))
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    return tmp, folder, prompts


def test_end_to_end_on_a_tiny_model(tiny, capsys, monkeypatch):
    tmp, folder, prompts = tiny
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as when llama-cpp-python is not installed
    out_json, out_md, out_png = tmp / "r.json", tmp / "r.md", tmp / "r.png"
    configs = "ngram:k=3,suffix:k=3,ngram:tree=3x2x6,hf,hf-lookup:k=3,llama-cpp"
    code = main(["bench", "--model", str(folder), "--configs", configs, "--tasks", "none", "--prompts", str(prompts),
                 "--max-tokens", "12", "--repeats", "2", "--json", str(out_json), "--markdown", str(out_md),
                 "--plot", str(out_png)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    data = json.loads(out_json.read_text())
    labels = ["plain", "ngram:k=3", "suffix:k=3", "ngram:tree=3x2x6", "hf", "hf-lookup:k=3"]  # + plain, - llama-cpp
    assert [c["label"] for c in data["configs"]] == labels
    assert "llama-cpp" in data["skipped"] and "not installed" in data["skipped"]["llama-cpp"]
    # Interleaved: repeat by repeat, prompt by prompt, every configuration in turn.
    order = [(r["repeat"], r["prompt_id"], r["config"]) for r in data["runs"]]
    assert order == [(rep, p, c) for rep in (0, 1) for p in ("p0", "p1") for c in labels]
    for r in data["runs"]:
        assert r["new_tokens"] == len(r["token_ids"]) <= 12 and r["prompt_tokens"] == 30 and r["wall_s"] > 0
        if r["config"] != "plain":
            # Greedy float32: speculation is lossless, and HF runs the same weights.
            assert r["identical"] is True, r
    spec = [r for r in data["runs"] if r["config"] in ("ngram:k=3", "suffix:k=3", "ngram:tree=3x2x6")]
    assert all(r["target_forwards"] <= r["new_tokens"] for r in spec)
    assert sum(r["draft_tokens"] for r in spec) > 0 and all(r["draft_s"] > 0 for r in spec)
    assert all(r["peak_memory"] > 10 * 2**20 for r in data["runs"])
    summary = {(s["config"], s["group"]): s for s in data["summary"]}
    assert set(summary) == {(c, g) for c in labels for g in ("grp0", "grp1", "all")}
    ngram = summary[("ngram:k=3", "all")]
    assert ngram["alpha"] is not None and ngram["bound"] >= 1.0 - 1e-9 and ngram["speedup"] > 0
    assert summary[("plain", "all")]["speedup"] == pytest.approx(1.0)
    assert data["headline"]["best"] in ("plain", "ngram:k=3", "suffix:k=3", "ngram:tree=3x2x6")
    assert set(data["headline"]["vs_peers"]) == {"hf", "hf-lookup:k=3"}
    assert data["command"].startswith("specdec bench --model ") and "--repeats 2" in data["command"]
    # Markdown: on stdout and in the file, one row per configuration; the skip is explained.
    md = out_md.read_text()
    assert captured.out == md
    for label in labels:
        assert f"| `{label}` |" in md
    assert "skipped `llama-cpp`" in md and "4/4" in md  # every speculative output identical to plain
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 10_000
    assert "bench: loading the target" in captured.err


def test_draft_model_configs_share_one_loaded_draft(tiny, capsys):
    """A draft model (here the target itself, so every greedy draft is accepted; a fixed length,
    since the cost-aware one charges this draft's price, about a target step, and would not draft)
    and HF's assistant."""
    tmp, folder, prompts = tiny
    out_json = tmp / "draft.json"
    code = main(["bench", "--model", str(folder), "--configs", "draft:k=3:p_min=0:fixed,draft:k=2:p_min=0:fixed,hf-assist:k=3",
                 "--draft-model", str(folder), "--tasks", "none", "--prompts", str(prompts), "--max-tokens", "10",
                 "--warmup", "0", "--no-progress", "--json", str(out_json)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert err.count("loading the draft model") == 1 and err.count("loading the target") == 1
    summary = {(s["config"], s["group"]): s for s in json.loads(out_json.read_text())["summary"]}
    for label in ("draft:k=3:p_min=0:fixed", "draft:k=2:p_min=0:fixed"):
        s = summary[(label, "all")]
        assert s["alpha"] == 1.0 and s["acceptance_by_position"] == [1.0] * len(s["acceptance_by_position"])
        assert s["identical"] == s["compared"] == 2 and s["cost_ratio"] > 0
    assert summary[("hf-assist:k=3", "all")]["identical"] == 2


def test_ref_configurations_run_another_tree_in_a_worker(tiny, capsys):
    """ref@ pointed at this very tree: the worker must import it (not fail), give the same greedy
    tokens as this tree's configurations, count its drafts, and get the new / reference table."""
    from pathlib import Path

    import specdec

    tmp, folder, prompts = tiny
    src = Path(specdec.__file__).parent.parent
    out_json = tmp / "ref.json"
    code = main(["bench", "--model", str(folder), "--configs", "plain,ngram:k=3,ref@plain,ref@ngram:k=3,this@ngram:k=3",
                 "--ref-src", str(src), "--tasks", "none", "--prompts", str(prompts), "--max-tokens", "12",
                 "--repeats", "2", "--no-progress", "--json", str(out_json), "--clock", "cpu"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    data = json.loads(out_json.read_text())
    labels = ["plain", "ngram:k=3", "ref@plain", "ref@ngram:k=3", "this@ngram:k=3"]
    assert [c["label"] for c in data["configs"]] == labels
    assert {c["label"]: c["family"] for c in data["configs"]}["ref@ngram:k=3"] == "worker"
    assert {c["label"]: c["baseline"] for c in data["configs"]}["ref@ngram:k=3"] == "plain"
    # The worker imported the tree it was given.
    assert {c["label"]: c["runs_on"] for c in data["configs"]}["ref@plain"].startswith(str(src / "specdec"))
    runs = {(r["config"], r["prompt_id"], r["repeat"]): r for r in data["runs"]}
    assert len(runs) == 5 * 2 * 2
    for (label, pid, rep), r in runs.items():
        assert r["token_ids"] == runs[("plain", pid, rep)]["token_ids"] and r["wall_s"] > 0
        if label != "plain":
            assert r["identical"] is True
    ref_ngram = [r for (label, _, _), r in runs.items() if label == "ref@ngram:k=3"]
    assert sum(r["draft_tokens"] for r in ref_ngram) > 0 and all(r["target_forwards"] < 12 for r in ref_ngram)
    versus = {v["ref"]: v for v in data["versus_reference"]}
    assert set(versus) == {"ref@plain", "ref@ngram:k=3"}
    assert versus["ref@plain"]["config"] == "plain"  # no this@plain: the in-process one
    v = versus["ref@ngram:k=3"]  # its this@ twin, measured alike
    assert v["config"] == "this@ngram:k=3" and v["identical"] == v["compared"] == 4 and v["ratio"] > 0
    assert v["interval"][0] <= v["ratio"] <= v["interval"][1]
    assert "| `this@ngram:k=3` | `ref@ngram:k=3` |" in captured.out and "--ref-src" in data["command"]
    assert "--clock cpu" in data["command"] and "CPU time of the process" in captured.out
    # Wall-clock parts are not mixed into CPU-time figures.
    assert all(s["step_cost"] is None and s["bound"] is None for s in data["summary"])
    assert "ref@plain" not in data["headline"]["vs_peers"]


@pytest.mark.parametrize("extra, fragment", [
    (["--configs", "ref@plain"], "need --ref-src"),
    (["--configs", "ref@plain", "--ref-src", "/nonexistent"], "no specdec package there"),
    (["--configs", "ref@hf"], "ref@ takes a specdec configuration"),
    (["--configs", "ref@ngram:max_ngram=3", "--ref-src", "."], "max_ngram cannot be passed"),
])
def test_ref_configuration_errors(extra, fragment, capsys):
    assert main(["bench", "--tasks", "code", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err


def test_lookup_drafters_are_fresh_each_pass(tiny):
    from specdec.bench.runner import SpecdecRunner
    from specdec.engine import Engine

    _, folder, _ = tiny
    engine = Engine.load(str(folder), dtype="float32")
    cfg = C.parse_config("suffix:k=3")
    runner = SpecdecRunner(cfg, engine.model, None, lambda: C.lookup_drafter("suffix", cfg.options), "cpu")
    ids = tuple(range(1, 20)) * 2
    runner.generate(ids, 8)
    learned = runner.drafter.inner
    assert learned.num_entries > 0
    runner.new_pass()
    assert runner.drafter.inner is not learned and runner.drafter.inner.num_entries == 0
    assert runner.engine.model is engine.model  # the target is shared, not reloaded


def test_ctrl_c_keeps_the_complete_prompt_rounds(tiny):
    from specdec.bench.runner import run_bench

    _, folder, prompts = tiny
    measured = []

    def progress(label):
        if not label.startswith("warm-up"):
            measured.append(label)
            if len(measured) == 3:  # p0 by both configurations, then p1 by the first only
                raise KeyboardInterrupt

    result = run_bench(Settings(model=str(folder), max_tokens=6), C.parse_configs("plain,ngram:k=2"),
                       P.load_prompt_file(prompts), progress=progress)
    assert [(r.prompt_id, r.config) for r in result.runs] == [("p0", "plain"), ("p0", "ngram:k=2")]
    assert [p.id for p in result.prompts] == ["p0"] and "1 of 2 prompt rounds" in result.interrupted
    assert "interrupted" in R.to_markdown(result, R.summarize(result))


def test_llama_cpp_runner_passes_ids_greedy_and_stops(tmp_path, monkeypatch):
    """The llama.cpp adapter against a stand-in module (the real package is optional)."""
    from specdec.bench.peers import LlamaCppRunner

    calls = []

    class FakeLlama:
        def __init__(self, **kwargs):
            calls.append(("init", kwargs))

        def token_eos(self):
            return 99

        def reset(self):
            calls.append(("reset",))

        def generate(self, tokens, **kw):
            calls.append(("generate", list(tokens), kw))
            yield from [7, 8, 9, 99, 5, 5]

    class FakeLookup:
        def __init__(self, max_ngram_size, num_pred_tokens):
            self.args = (max_ngram_size, num_pred_tokens)

    fake = types.ModuleType("llama_cpp")
    fake.Llama = FakeLlama
    speculative = types.ModuleType("llama_cpp.llama_speculative")
    speculative.LlamaPromptLookupDecoding = FakeLookup
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", speculative)
    gguf = tmp_path / "m.gguf"
    runner = LlamaCppRunner(C.parse_config("llama-cpp-lookup:k=6:threads=2"), gguf, 2, 128, [1])
    init = calls[0][1]
    assert init["model_path"] == str(gguf) and init["n_threads"] == 2 and init["draft_model"].args == (2, 6)
    run = runner.generate((3, 4, 5), 10)
    assert calls[1] == ("reset",) and calls[2][1] == [3, 4, 5] and calls[2][2]["temp"] == 0.0
    assert run.token_ids == [7, 8, 9, 99] and run.new_tokens == 4  # stops at its EOS, prompt excluded
    assert runner.generate((3,), 2).token_ids == [7, 8]  # and at max tokens


# -- CLI errors: one line, exit 2 ----------------------------------------------------------------


@pytest.mark.parametrize("extra, fragment", [
    (["--configs", "plain,beam"], "unknown configuration 'beam'"),
    (["--configs", "draft"], "needs a draft model"),
    (["--tasks", "chat"], "unknown task 'chat'"),
    (["--tasks", "none", "--prompts", "/nonexistent/p.jsonl"], "prompts file not found"),
    (["--tasks", "code", "--plot", "out.jpg"], "give a .png"),
    (["--tasks", "code", "--json", "/nonexistent/dir/r.json"], "folder does not exist"),
    (["--tasks", "code", "--template", "no placeholder"], "{prompt}"),
])
def test_cli_errors_before_loading(extra, fragment, capsys):
    assert main(["bench", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specdec: error:") and fragment in err


def test_cli_errors_after_loading(tiny, capsys, tmp_path):
    _, folder, prompts = tiny
    # Text prompts need a tokenizer; the tiny model has none.
    assert main(["bench", "--model", str(folder), "--tasks", "code", "--configs", "plain", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("specdec: error: prompt code-1 is text") and "prompt_ids" in err[-1]
    big = tmp_path / "big.jsonl"
    big.write_text('{"prompt_ids": [1, 2, 500]}\n')
    assert main(["bench", "--model", str(folder), "--tasks", "none", "--prompts", str(big), "--configs", "plain",
                 "--no-progress"]) == 2
    assert "token ids must be < the vocabulary size 97" in capsys.readouterr().err
    assert main(["bench", "--model", str(folder), "--tasks", "none", "--prompts", str(prompts), "--configs", "plain",
                 "--max-tokens", "600", "--no-progress"]) == 2
    assert "exceeds the model's context of 512" in capsys.readouterr().err


def test_machine_line_names_the_cpu_generation_and_its_vector_instructions():
    # "AMD EPYC" alone named a Zen 3 (AVX2 only) and a Zen 4 (AVX-512) machine alike; their
    # speed ratios differ, so a benchmark record says which one ran.
    from pathlib import Path

    from specdec.bench.runner import cpu_description, machine_info

    text = cpu_description()
    assert text and machine_info("cpu")["cpu"] == text
    info = Path("/proc/cpuinfo")
    if info.exists():
        flags = set(next((l.split(":", 1)[1].split() for l in info.read_text().splitlines() if l.startswith("flags")), []))
        assert "family" in text
        assert ("AVX2" in text) == ("avx2" in flags)
        assert ("AVX-512" in text) == ("avx512f" in flags)


def test_sampled_runs_are_seeded_per_prompt_and_leave_peers_out(tiny):
    """--temperature > 0: every specdec configuration samples with the prompt's seed (a rerun draws
    the same texts, plain differs from greedy), peers are skipped with the reason, and no output is
    held to plain's (sampled speculative text differs from sampled plain text by design)."""
    from specdec.bench.runner import run_bench

    _, folder, prompts = tiny
    configs = "plain,ngram:k=2,llama-cpp"

    def bench(temperature):
        return run_bench(Settings(model=str(folder), max_tokens=12, warmup=0, temperature=temperature, seed=5),
                         C.parse_configs(configs), P.load_prompt_file(prompts))

    first, again, greedy = bench(1.0), bench(1.0), bench(0.0)
    assert "llama-cpp" in first.skipped and "greedy only" in first.skipped["llama-cpp"]
    assert [r.token_ids for r in first.runs] == [r.token_ids for r in again.runs]
    assert all(r.identical is None for r in first.runs)
    plain = lambda res: [r.token_ids for r in res.runs if r.config == "plain"]
    assert plain(first) != plain(greedy)
    assert "sampled at temperature 1" in R.to_markdown(first, R.summarize(first))
    with pytest.raises(InvalidRequestError, match="temperature"):
        bench(-1.0)


def test_the_spread_across_repeats_is_reported():
    """Three repeats: each repeat's speedup over the baseline's same repeat, and the widest
    distance from their median, in the summary and in the report."""
    plain = [Run("plain", p, "g", i, 10, 8, 1.0, list(range(8)), target_forwards=8) for i in range(3) for p in "ab"]
    # Repeat 0 twice as fast as plain, repeat 1 2.5x, repeat 2 1.6x (the machine drifting).
    gains = (2.0, 2.5, 1.6)
    spec = [Run("ngram", p, "g", i, 10, 8, 1.0 / gains[i], list(range(8)), target_forwards=4)
            for i in range(3) for p in "ab"]
    configs = C.parse_configs("plain,ngram")
    result = BenchResult(Settings(repeats=3), configs, {"plain": "plain", "ngram": "plain"}, {},
                         [PromptInfo(p, "g", 10) for p in "ab"], plain + spec, {}, "peak RSS", {})
    summaries = R.summarize(result)
    s = next(x for x in summaries if x.config == "ngram" and x.group == "all")
    assert s.repeat_speedups == [pytest.approx(g) for g in gains]
    assert s.repeat_tokens_per_s == [pytest.approx(8 * g) for g in gains]
    assert s.repeat_spread == pytest.approx(0.25)  # 2.5 against the median 2.0
    assert next(x for x in summaries if x.config == "plain" and x.group == "all").repeat_spread is None
    text = R.to_markdown(result, summaries)
    assert "| `ngram` | 16.0 / 20.0 / 12.8 | 2.00x / 2.50x / 1.60x | 25.0% |" in text
    one = BenchResult(Settings(), configs, {"plain": "plain", "ngram": "plain"}, {},
                      [PromptInfo(p, "g", 10) for p in "ab"], [r for r in plain + spec if r.repeat == 0], {},
                      "peak RSS", {})
    assert "Spread across repeats" not in R.to_markdown(one, R.summarize(one))


class _BrokenLlamaCpp:
    """An import finder for which `import llama_cpp` fails as llama-cpp-python does where it is
    installed without its shared library (FileNotFoundError)."""

    def find_spec(self, name, path=None, target=None):
        if name == "llama_cpp":
            raise FileNotFoundError("Shared library with base name 'llama' not found")
        return None


def test_a_llama_cpp_without_its_library_is_skipped_and_never_loses_a_run(monkeypatch):
    """The peer is skipped with the reason, and the machine record (written after every run) reads
    the installed versions without importing the peers: an import there had failed after a whole
    run and lost its results."""
    from specdec.bench.peers import _load_llama_cpp
    from specdec.bench.runner import machine_info

    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenLlamaCpp()] + sys.meta_path)
    with pytest.raises(FileNotFoundError):
        import llama_cpp  # noqa: F401
    reason = _load_llama_cpp(None, C.parse_configs("llama-cpp")[0], [], [], {}, {}, print)
    assert reason.startswith("llama-cpp-python cannot load its library")
    assert machine_info("cpu")["cpu"] and "llama_cpp" not in sys.modules


def test_the_bench_times_a_lookup_first_drafters_proposals():
    """The core drafts a lookup-first row through `propose_free` and `propose_learned`, not
    `propose`: the bench's drafting time (its c and bound) must count them."""
    import time

    from specdec.bench.runner import TimedDrafter
    from specdec.drafters.base import DrafterNeeds, Proposal
    from specdec.drafters.combined import LookupFirstDrafter

    class Slow:
        name, needs = "slow", DrafterNeeds()

        def propose(self, context, k):
            time.sleep(0.02)
            return Proposal([1] * k)

    timed = TimedDrafter(LookupFirstDrafter(Slow(), Slow()))
    assert timed.propose_free([1, 2], 3) is not None and timed.take_seconds() >= 0.02
    assert timed.propose_learned([1, 2], 2).tokens == [1, 1] and timed.take_seconds() >= 0.02
