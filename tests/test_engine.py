import json
import subprocess
import sys

import pytest
import torch

from specdec import Engine, SamplingParams
from specdec.drafters import NgramDrafter, SuffixDrafter
from specdec.errors import InvalidRequestError
from specdec.models import loader

from helpers import make_tiny_hf

PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Once upon a time, in a small village by the sea,",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder, _ = make_tiny_hf(tmp_path_factory.mktemp("m"), "gemma3")
    model, _ = loader.load(folder, torch.float32, "cpu")
    return model


@pytest.mark.parametrize("make", [NgramDrafter, SuffixDrafter])
@pytest.mark.parametrize("k,length", [(1, "fixed"), (3, "fixed"), (8, "fixed"), (3, "adaptive"), (8, "cost")])
def test_tiny_greedy_identity(tiny, make, k, length):
    plain = Engine(tiny, None)
    spec = Engine(tiny, None, drafter=make(), num_speculative_tokens=k, draft_length=length)
    for seed in range(3):
        ids = torch.randint(0, 20, (12,), generator=torch.Generator().manual_seed(seed)).tolist() * 2
        a = plain.generate(prompt_ids=ids, max_new_tokens=40)
        b = spec.generate(prompt_ids=ids, max_new_tokens=40)
        assert a.token_ids == b.token_ids
        assert b.stats.target_forwards <= a.stats.target_forwards


def test_default_model_greedy_identity(default_engine_fp32):
    spec_engines = [Engine(default_engine_fp32.model, default_engine_fp32.tokenizer, drafter=d(),
                           num_speculative_tokens=5) for d in
                    (NgramDrafter, SuffixDrafter)]
    gained = 0
    for prompt in PROMPTS:
        plain = default_engine_fp32.generate(prompt=prompt, max_new_tokens=48)
        for engine in spec_engines:
            out = engine.generate(prompt=prompt, max_new_tokens=48)
            assert out.token_ids == plain.token_ids, prompt
            gained += plain.stats.target_forwards - out.stats.target_forwards
    assert gained > 0  # lookup drafting saved target passes somewhere


def test_stop_string_ends_output_like_plain(default_engine_fp32):
    prompt = PROMPTS[0]
    full = default_engine_fp32.generate(prompt=prompt, max_new_tokens=40)
    stop = full.text[10:14]
    spec = Engine(default_engine_fp32.model, default_engine_fp32.tokenizer, drafter=NgramDrafter(),
                  num_speculative_tokens=8)
    a = default_engine_fp32.generate(prompt=prompt, max_new_tokens=40, stop=stop)
    b = spec.generate(prompt=prompt, max_new_tokens=40, stop=stop)
    assert a.finish_reason == b.finish_reason == "stop"
    assert a.text == b.text == full.text[: full.text.find(stop)]
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("length", ["fixed", "cost"])
def test_seeded_sampling_reproducible(tiny, length):
    engine = Engine(tiny, None, drafter=NgramDrafter(), num_speculative_tokens=4, draft_length=length)
    sp = SamplingParams(temperature=0.9, top_p=0.9, seed=7)
    ids = list(range(10)) * 2
    a = engine.generate(prompt_ids=ids, max_new_tokens=30, sampling=sp)
    b = engine.generate(prompt_ids=ids, max_new_tokens=30, sampling=sp)
    c = engine.generate(prompt_ids=ids, max_new_tokens=30, sampling=SamplingParams(temperature=0.9, seed=8))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_bad_requests(tiny):
    engine = Engine(tiny, None)
    with pytest.raises(InvalidRequestError):
        engine.generate(prompt_ids=[], max_new_tokens=4)
    with pytest.raises(InvalidRequestError):
        engine.generate(prompt_ids=[1000], max_new_tokens=4)
    with pytest.raises(InvalidRequestError, match="context"):
        engine.generate(prompt_ids=[1] * 500, max_new_tokens=100)
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        engine.generate(prompt="hello", max_new_tokens=4)
    for bad in (dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(min_p=1.0)):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "specdec.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args,needle", [
    (["--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["--prompt", "hi", "--top-p", "1.5"], "top_p"),
    (["--prompt", "hi", "--model", "/no/such/model.gguf"], "not found"),
    (["--prompt", "hi", "--drafter", "nonsense"], "drafter"),
    (["--prompt", "hi", "--max-tokens", "40000"], "context"),
    (["--prompt", "hi", "--draft-length", "cost", "--verify-cost", "-1"], "verify_cost"),
    (["--prompt", "hi", "--verify-overhead", "-1"], "verify_overhead"),
])
def test_cli_errors_are_one_line(args, needle):
    res = run_cli("generate", *args)
    assert res.returncode != 0
    assert "Traceback" not in res.stderr
    assert needle in res.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("kwargs,needle", [
    (dict(drafter="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(drafter="ngram", draft_tree="3x2x4", draft_length="cost"), "fixed shape"),
    (dict(drafter="ngram", draft_length="cost", verify_cost=0), "verify_cost"),
])
def test_engine_load_rejects_bad_speculation_options_before_the_model(kwargs, needle):
    # A target that does not exist: the option's error, not "not found", shows it was checked first.
    with pytest.raises(InvalidRequestError, match=needle):
        Engine.load("/no/such/model.gguf", **kwargs)


def test_quantize_is_checked_against_the_device():
    # What Engine.load and `specdec serve` check before any load (serve before binding its port),
    # in the one settings object.
    from specdec.settings import DecodingSettings

    DecodingSettings(quantize="none", device="cuda")
    with pytest.raises(InvalidRequestError, match="needs the CPU"):
        DecodingSettings(quantize="int8", device="cuda")
    with pytest.raises(InvalidRequestError, match="unknown quantize"):
        DecodingSettings(quantize="int3")
    with pytest.raises(InvalidRequestError, match="unknown draft_quantize"):
        DecodingSettings(draft_quantize="int3")


def test_decoding_settings_are_validated_once_and_frozen(tiny_models):
    import dataclasses

    from specdec.drafters.base import TreeShape
    from specdec.settings import DecodingSettings

    s = DecodingSettings(draft_tree="3x2x6")
    assert s.draft_tree == TreeShape(3, 2, 6) and s.draft_length == "fixed"  # a tree has a fixed shape
    assert DecodingSettings().draft_length == "cost"
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.num_speculative_tokens = 3
    for kwargs, needle in (({"num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1"),
                           ({"draft_length": "greedy"}, "draft_length must be one of"),
                           ({"draft_tree": "3x2x6", "draft_length": "adaptive"}, "a draft tree has a fixed shape"),
                           ({"verify_cost": 0}, "verify_cost must be a number in"),
                           ({"verify_overhead": -1}, "verify_overhead must be a number in"),
                           ({"draft_p_min": 2}, "draft_p_min must be a number in"),
                           ({"draft_vocab": -1}, "draft vocabulary must be")):
        with pytest.raises(InvalidRequestError, match=needle):
            DecodingSettings(**kwargs)
    # The engine keeps the object it was given (Engine.load builds it once, before the load), and
    # validates its keywords through the same object.
    from specdec import Engine

    engine_settings = DecodingSettings(num_speculative_tokens=3)
    engine = Engine(tiny_models["llama"]["target"], None, settings=engine_settings)
    assert engine.settings is engine_settings and engine.k == 3 and engine.draft_length == "cost"
    with pytest.raises(InvalidRequestError, match="num_speculative_tokens must be >= 1"):
        Engine(tiny_models["llama"]["target"], None, num_speculative_tokens=0)


def test_auto_dtype_of_an_int8_cpu_model_is_float32(monkeypatch):
    # On a CPU with native bfloat16 (AVX512-BF16, AMX) "auto" is bfloat16 for a float model, but an
    # int8 model computes in float32 whatever the dtype: bfloat16 would only round its norms.
    from specdec import builder as engine

    monkeypatch.setattr(engine, "_cpu_has_bf16", lambda: True)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    assert engine.resolve_dtype("auto", "cpu") == torch.bfloat16
    assert engine.resolve_dtype("auto", "cpu", "int8") == torch.float32
    assert engine.resolve_dtype("bfloat16", "cpu", "int8") == torch.bfloat16  # asked for by name: kept
    assert engine.resolve_dtype("auto", "cuda", "none") == torch.bfloat16
    monkeypatch.setattr(engine, "_cpu_has_bf16", lambda: False)
    assert engine.resolve_dtype("auto", "cpu") == torch.float32


def test_cli_rejects_max_tokens_before_loading():
    res = run_cli("generate", "--prompt", "hi", "--max-tokens", "0")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "--max-tokens must be >= 1" in res.stderr.strip().splitlines()[-1]
    assert "loading the model" not in res.stderr


def test_cli_json_on_default_model():
    res = run_cli("generate", "--prompt", "The capital of France is", "--max-tokens", "8", "--json",
                  "--drafter", "ngram")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["finish_reason"] in ("stop", "length") and len(out["token_ids"]) <= 8
    assert out["stats"]["new_tokens"] == len(out["token_ids"]) and out["text"]


def test_cli_show_drafts_marks_every_pass():
    res = run_cli("generate", "--prompt", PROMPTS[1], "--max-tokens", "24", "--drafter", "ngram",
                  "--show-drafts", "--dtype", "float32")
    assert res.returncode == 0, res.stderr
    text = res.stdout
    # Every target pass after the prefill ends in a recovered {..} or bonus <..> token; lookup on
    # this repetitive prompt gets some drafts accepted.
    assert "[" in text and ("{" in text or "<" in text)
