"""The target cache's element type (`kv_dtype`): float16 by default under a float32 model on the
CPU, float32 on request; either way a batched row equals the row alone and greedy speculative
decoding equals plain decoding, and the float16 cache holds the float16 of what a float32 cache
holds."""

import pytest
import torch

from specdec import Engine
from specdec.drafters import NgramDrafter
from specdec.errors import InvalidRequestError
from specdec.models import cpu_kernels, loader
from specdec.models.kv_cache import resolve_kv_dtype
from specdec.scheduler import BatchScheduler, Request
from specdec.settings import DecodingSettings

from helpers import drive, speculative_equals_plain

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_folder):
    model, _ = loader.load(tiny_folder, torch.float32, "cpu")
    return model


def prompts(n):
    # Repetitive prompts so that lookup drafts; mixed lengths.
    return [torch.randint(3, 30, (3 + i % 4,), generator=torch.Generator().manual_seed(i)).tolist() * (2 + i % 3)
            for i in range(n)]


def test_resolve_and_validate():
    assert resolve_kv_dtype("auto", torch.float32, "cpu") == torch.float16
    assert resolve_kv_dtype("auto", torch.bfloat16, "cpu") == torch.bfloat16  # the model's own otherwise
    assert resolve_kv_dtype("auto", torch.float32, "meta") == torch.float32
    assert resolve_kv_dtype("float32", torch.float32, "cpu") == torch.float32
    assert resolve_kv_dtype("float16", torch.bfloat16, "cpu") == torch.float16
    with pytest.raises(InvalidRequestError, match="kv_dtype must be one of") as err:
        DecodingSettings(kv_dtype="int8")
    assert err.value.param == "kv_dtype"


def test_engine_and_scheduler_caches_take_the_setting(target):
    assert Engine(target, None).new_cache(1, 8).keys[0].dtype == torch.float16
    assert Engine(target, None, kv_dtype="float32").new_cache(1, 8).values[-1].dtype == torch.float32
    assert BatchScheduler(target, None, max_batch=2, max_model_len=32).cache.keys[0].dtype == torch.float16
    sched = BatchScheduler(target, None, max_batch=2, max_model_len=32, kv_dtype="float32")
    assert sched.cache.keys[0].dtype == torch.float32 and sched.engine.kv_dtype == torch.float32


def test_float16_cache_holds_the_float16_of_the_float32_cache(target):
    # One prefill and one decode step into each cache type. The layer-0 keys and values depend only
    # on the tokens (not on earlier layers' attention), so the float16 cache's are exactly the
    # float16 of the float32 cache's; the logits then move only slightly, but they do move.
    ids = torch.tensor([prompts(1)[0]])
    n = ids.shape[1]
    out = {}
    for dtype in (torch.float32, torch.float16):
        cache = target.new_cache(1, n + 4, dtype=dtype)
        target(ids, torch.arange(n)[None], cache)
        logits, _ = target(torch.tensor([[5]]), torch.tensor([[n]]), cache)
        out[dtype] = cache, logits
    (c32, l32), (c16, l16) = out[torch.float32], out[torch.float16]
    assert torch.equal(c16.keys[0][:, :, : n + 1], c32.keys[0][:, :, : n + 1].half())
    assert torch.equal(c16.values[0][:, :, : n + 1], c32.values[0][:, :, : n + 1].half())
    torch.testing.assert_close(l16, l32, atol=2e-2, rtol=0)
    assert not torch.equal(l16, l32)


def test_float16_cache_without_the_kernels_computes_the_same(target, monkeypatch):
    # The PyTorch path (no compiled kernels: the cache written by scatter, SDPA over the widened
    # slots) over a float16 cache agrees with the compiled path to rounding.
    ids = torch.tensor([prompts(2)[1]])
    n = ids.shape[1]

    def run():
        cache = target.new_cache(1, n + 2, dtype=torch.float16)
        target(ids, torch.arange(n)[None], cache)
        return target(torch.tensor([[7]]), torch.tensor([[n]]), cache)[0], cache

    compiled, c1 = run()
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    reference, c2 = run()
    torch.testing.assert_close(compiled, reference, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(c1.keys[-1].float(), c2.keys[-1].float(), atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("kv_dtype", ["float16", "float32"])
def test_batched_rows_equal_alone_and_speculative_equals_plain(target, kv_dtype):
    plain = Engine(target, None, kv_dtype=kv_dtype)
    spec = Engine(target, None, drafter=NgramDrafter(), num_speculative_tokens=4, draft_length="fixed",
                  kv_dtype=kv_dtype)
    ps = prompts(6)
    alone = [plain.generate(prompt_ids=p, max_new_tokens=16).token_ids for p in ps]
    drafted = 0
    for p, want in zip(ps, alone):
        out = spec.generate(prompt_ids=p, max_new_tokens=16)
        assert out.token_ids == want
        drafted += out.stats.draft_tokens
    assert drafted > 0
    sched = BatchScheduler(target, None, drafter="ngram", num_speculative_tokens=4, max_batch=6, max_model_len=128,
                           adaptive=False, kv_dtype=kv_dtype)
    # All queued before the loop runs (by hand, no scheduler thread): the 6 rows are admitted together.
    outs = [c.token_ids for c in drive(sched, [sched.submit(Request(p, 16, drafter=("ngram" if i % 2 else "none")))
                                               for i, p in enumerate(ps)])]
    assert outs == alone
    assert sched.counters.step_rows / sched.counters.steps > 2  # the rows really shared steps


def test_a_draft_models_cache_follows_the_setting_where_it_is_quantised(tiny_folder):
    # "auto": float16 for a quantised draft (its rows' keys do not depend on the rows beside them),
    # the model's own float32 for a float one; a setting given is followed by both caches.
    from specdec.models.quant import cpu_int8_available
    from specdec.scheduler import serving_drafters

    if not cpu_int8_available():
        pytest.skip("no int8 backend")
    draft = str(tiny_folder)
    cases = [("int8", "auto", torch.float16), ("int8", "float32", torch.float32),
             ("none", "auto", torch.float32), ("none", "float16", torch.float16)]
    for quantize, kv_dtype, want in cases:
        engine = Engine.load(str(tiny_folder), drafter=draft, quantize=quantize, dtype="float32", kv_dtype=kv_dtype)
        assert engine.drafter.kv_dtype == want, (quantize, kv_dtype)
        engine.drafter.begin([5, 6, 7])
        assert engine.drafter._cache.values[-1].dtype == want
        if quantize == "int8":
            drafters, name = serving_drafters(f"ngram+{draft}", engine.model, engine.tokenizer, kv_dtype=kv_dtype)
            drafters["draft_model"].reserve(2, 16)  # the server's pool of rows
            assert drafters["draft_model"]._pool.cache.keys[0].dtype == want
    # greedy speculative decoding with the quantised draft on float16 equals plain decoding
    spec = Engine.load(str(tiny_folder), drafter=draft, quantize="int8", num_speculative_tokens=4,
                       draft_length="fixed")
    drafted, _ = speculative_equals_plain(spec, Engine(spec.model, spec.tokenizer), prompts(4), 16)
    assert drafted > 0
