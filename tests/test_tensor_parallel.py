"""Tensor parallelism over 2 processes (gloo, CPU) on tiny models.

What is asserted, and why. Split over 2 ranks, the o and down projections sum their halves of the
inputs on each rank and the all-reduce adds the halves: a different order of float sums than one
process. So the logits of every prompt position are held within 1e-5 of one process (not bit for
bit) and greedy tokens equal on the test prompts (a near-tie inside that rounding could flip one, and
none does here). Inside one split, speculative greedy output equals plain greedy output exactly
(ngram chains, a token tree, a draft model on rank 0, rows batched by the server's scheduler), and
sampling follows the split target's exact distribution (the chi-square test of test_draft_model).

One process may hold one process group at a time, so the tests share launches in file order
(`split`): a new kind of launch closes the one before.
"""

import functools

import pytest
import torch

from specdec import Engine, SamplingParams
from specdec.drafters import DraftModelDrafter, NgramDrafter, TreeShape
from specdec.errors import InvalidRequestError
from specdec.models import loader
from specdec.models import tensor_parallel as tp
from specdec.models.quant import Int8Linear, cpu_int8_available
from specdec.scheduler import BatchScheduler, Request

import test_draft_model as tdm
from helpers import TINY_VOCAB as V
from helpers import make_tiny_hf, random_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

_live: dict = {}


def split(key, builder, quantize="none") -> tp.ParallelTarget:
    """The 2-rank target made by `builder`, launched once per key (closing another key's first)."""
    if key not in _live:
        for target in _live.values():
            target.close()
        _live.clear()
        _live[key] = tp.launch(tp.Launch(builder, 2, quantize))
    return _live[key]


@pytest.fixture(scope="module", autouse=True)
def close_at_end():
    yield
    for target in _live.values():
        target.close()
    _live.clear()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Gemma 3 target (tied head, q/k norms, sliding windows, 4 heads over 2 kv heads) whole
    in this process, and a noisy copy of it as a draft model (it agrees with the target partly, so
    its drafts are both accepted and rejected)."""
    folder, _ = make_tiny_hf(tmp_path_factory.mktemp("tp"), "gemma3", seed=0)
    whole, _ = loader.load(folder, torch.float32, "cpu")
    return dict(folder=folder, whole=whole, draft=tdm.noisy_copy(whole, 0.5, 3))


def float_split(models) -> tp.ParallelTarget:
    return split("float", functools.partial(tp.load_whole, models["folder"], torch.float32))


def prompts(n):
    # Repetitive prompts, so that lookup drafts find matches and get both accepted and rejected.
    return [p[:6] * 3 for p in random_prompts(n, seed=5)]


def test_logits_within_1e5_of_one_process_and_greedy_tokens_equal(models):
    target, whole = float_split(models), models["whole"]
    # Each rank holds half the heads, half the kv heads (so half the cache) and half the vocabulary.
    assert target.model.layers[0].self_attn.heads == 2 and target.model.layers[0].self_attn.kv_heads == 1
    assert target.lm_head.out_features == (V + 1) // 2
    cache = target.new_cache(1, 64)
    assert cache.local.keys[0].shape[1] == 1
    for ids in random_prompts(4, length=12):
        positions = torch.arange(len(ids))[None]
        one, _ = whole(torch.tensor([ids]), positions, whole.new_cache(1, 64))  # [1, T, V]
        two, _ = target(torch.tensor([ids]), positions, target.new_cache(1, 64))
        assert two.shape == one.shape
        torch.testing.assert_close(two, one, atol=1e-5, rtol=0)
    plain_one, plain_two = Engine(whole, None), Engine(target, None)
    for ids in prompts(3):
        a = plain_one.generate(prompt_ids=ids, max_new_tokens=20, speculative=False).token_ids
        b = plain_two.generate(prompt_ids=ids, max_new_tokens=20, speculative=False).token_ids
        assert a == b


@pytest.mark.parametrize("kind", ["ngram", "ngram-tree", "draft_model"])
def test_speculative_greedy_equals_plain_under_tp(models, kind):
    target = float_split(models)
    plain = Engine(target, None)
    drafter = DraftModelDrafter(models["draft"], V) if kind == "draft_model" else NgramDrafter()
    spec = Engine(target, None, drafter=drafter, num_speculative_tokens=4, draft_length="fixed",
                  draft_tree=TreeShape(3, 2, 6) if kind == "ngram-tree" else None)
    drafted = accepted = 0
    for ids in prompts(3):
        out = spec.generate(prompt_ids=ids, max_new_tokens=20)
        assert out.token_ids == plain.generate(prompt_ids=ids, max_new_tokens=20, speculative=False).token_ids
        drafted += out.stats.draft_tokens
        accepted += out.stats.accepted_tokens
    assert 0 < accepted < drafted  # drafts kept and drafts rolled back, on every rank


def test_batched_rows_under_tp_equal_each_alone(models):
    """The server's scheduler over the split target: rows of mixed drafters joining and leaving
    (cache views, row moves, per-row rollback on every rank) give each row's output alone."""
    target = float_split(models)
    plain = Engine(target, None)
    sched = BatchScheduler(target, None, drafter="ngram",
                           drafters={"none": None, "ngram": NgramDrafter(), "d": DraftModelDrafter(models["draft"], V)},
                           num_speculative_tokens=3, max_batch=4, max_model_len=128, adaptive=False)
    names = ["ngram", "d", "none"]
    requests = [Request(ids, 6 + 3 * (i % 3), drafter=names[i % 3]) for i, ids in enumerate(prompts(7))]
    sched.start()
    outs = [h.result() for h in [sched.submit(r) for r in requests]]
    sched.shutdown()
    for r, o in zip(requests, outs):
        assert o.token_ids == plain.generate(prompt_ids=r.prompt_ids, max_new_tokens=r.max_new_tokens,
                                             speculative=False).token_ids, r.drafter
    assert sched.counters.step_rows / sched.counters.steps > 1.5 and sched.counters.spec.accepted_tokens > 0


@pytest.mark.skipif(not cpu_int8_available(), reason="int8 needs fbgemm")
def test_int8_split_before_quantising(models):
    """Each rank quantises its own float share (the projections inside the all-reduce wrappers are
    int8), and speculative greedy output under the split int8 target equals its plain output."""
    target = split("int8", functools.partial(tp.load_whole, models["folder"], torch.float32), quantize="int8")
    block = target.model.layers[0]
    assert isinstance(block.self_attn.o_proj.inner, Int8Linear) and isinstance(block.mlp.down_proj.inner, Int8Linear)
    assert isinstance(target.lm_head, Int8Linear)
    plain = Engine(target, None)
    spec = Engine(target, None, drafter=NgramDrafter(), num_speculative_tokens=4, draft_length="fixed")
    for ids in prompts(3):
        assert spec.generate(prompt_ids=ids, max_new_tokens=20).token_ids == \
            plain.generate(prompt_ids=ids, max_new_tokens=20, speculative=False).token_ids


def test_sampling_follows_the_split_targets_exact_distribution(monkeypatch):
    """test_draft_model's chi-square test (a 1-layer model over 6 tokens, every 3-token continuation
    enumerated from the split target's own logits) with a draft model on rank 0, the samples run as
    rows of batches (each step is a few round trips between the ranks, so rows share them), and
    fewer samples than there."""
    monkeypatch.setattr(tdm, "SAMPLES", 600)
    target = split("small", functools.partial(tdm.small_model, 0))  # 2 heads over 1 kv head: the kv head on both
    assert target.model.layers[0].self_attn.kv_heads == 1
    params = SamplingParams(temperature=0.7, top_k=3)
    drafter = DraftModelDrafter(tdm.small_model(1), tdm.SMALL_V)
    sched = BatchScheduler(target, None, drafter="d", drafters={"d": drafter}, num_speculative_tokens=2,
                           max_batch=16, max_queue=tdm.SAMPLES, max_model_len=16, adaptive=False).start()
    handles = [sched.submit(Request(tdm.PROMPT, tdm.N_NEW, SamplingParams(temperature=params.temperature,
                                                                           top_k=params.top_k, seed=seed)))
               for seed in range(tdm.SAMPLES)]
    counts = {}
    for h in handles:
        ids = tuple(h.result().token_ids)
        counts[ids] = counts.get(ids, 0) + 1
    sched.shutdown()
    assert sched.counters.spec.draft_tokens > sched.counters.spec.accepted_tokens > 0
    assert tdm.chi_square_p(target, params, counts) > 1e-3


def test_torchrun_starts_the_ranks(models):
    """The documented torchrun launch: every rank runs the same `specdec generate`, rank 0 prints
    the output (the greedy tokens of one process), the other ranks follow and exit with it."""
    import json
    import os
    import subprocess
    import sys

    ids = prompts(1)[0]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "specdec.cli",
           "generate", "--model", str(models["folder"]), "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", "12",
           "--drafter", "ngram", "--dtype", "float32", "--tensor-parallel", "2", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 0 alone prints
    plain = Engine(models["whole"], None).generate(prompt_ids=ids, max_new_tokens=12, speculative=False)
    assert json.loads(lines[0])["token_ids"] == plain.token_ids


# -- bad input: one clear error, before any rank starts ---------------------------------------------------

def test_ranks_must_divide_the_heads(models, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    with pytest.raises(InvalidRequestError, match="does not divide the target's 4 attention heads"):
        Engine.load(str(models["folder"]), drafter="none", dtype="float32", quantize="none", tensor_parallel=3)


def test_more_ranks_than_cores_or_devices(monkeypatch):
    import os

    with pytest.raises(InvalidRequestError, match="more ranks than this machine's"):
        tp.check_world((os.cpu_count() or 1) + 1, "cpu")
    with pytest.raises(InvalidRequestError, match=">= 1"):
        tp.check_world(0, "cpu")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(InvalidRequestError, match="needs 2 CUDA devices, this machine has 1"):
        tp.check_world(2, "cuda")


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_errors_are_one_line(models, capsys, command):
    from specdec.cli import main

    cases = [(["--tensor-parallel", "0"], ">= 1"), (["--tensor-parallel", "64"], "CPU cores"),
             (["--tensor-parallel", "2", "--drafter", "eagle"], "EAGLE")]
    if command == "serve":
        cases.append((["--tensor-parallel", "2", "--replicas", "2"], "--replicas together"))
    for args, needle in cases:
        extra = ["--prompt-ids", "5,6"] if command == "generate" else ["--port", "0"]
        code = main([command, "--model", str(models["folder"]), *extra, *args])  # before any rank starts
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and err[-1].startswith("specdec: error:") and needle in err[-1], err
        assert not any("Traceback" in line for line in err)


def fails_outside_the_main_process():
    """A builder that works on rank 0 and fails on the spawned rank."""
    import multiprocessing

    if multiprocessing.current_process().name != "MainProcess":
        raise MemoryError("no room for this share")
    return tdm.small_model(0)


def test_a_rank_that_cannot_load_is_a_clear_error():
    from specdec.errors import ModelLoadError

    for target in _live.values():
        target.close()
    _live.clear()
    with pytest.raises(ModelLoadError, match="rank 1 could not load its share: MemoryError: no room"):
        tp.launch(tp.Launch(fails_outside_the_main_process, 2))
    assert not torch.distributed.is_initialized()


def test_serve_settings_turn_the_prefix_cache_off_under_tp():
    from specdec.cli import _parser
    from specdec.server.cli import settings_from_args

    def settings(*argv):
        return settings_from_args(_parser().parse_args(["serve", *argv]))

    assert settings().prefix_cache_tokens > 0 and settings().tensor_parallel == 1
    split_settings = settings("--tensor-parallel", "2")
    assert split_settings.tensor_parallel == 2 and split_settings.prefix_cache_tokens == 0
