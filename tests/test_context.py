"""A server's context: the model's own unless asked otherwise, cut only where every row's caches at
full length would not fit in memory, and the caches take memory only as rows fill them."""

import logging

import pytest
import torch

from specdec import scheduler as S
from specdec.drafters import DraftModelDrafter, NgramDrafter
from specdec.drafters.combined import lookup_first
from specdec.models.kv_cache import LAZY_BYTES, KVCache, lazy_zeros
from specdec.models.transformer import ModelConfig, RopeSpec, Transformer
from specdec.scheduler import BatchScheduler, fitting_context


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) * 1024


def model(max_position: int, seed: int = 0) -> Transformer:
    cfg = ModelConfig(family="llama", vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=16, rms_eps=1e-6, max_position=max_position,
                      layer_rope=(RopeSpec(1e4),) * 2, layer_window=(None, None))
    torch.manual_seed(seed)
    return Transformer(cfg).eval()


def test_a_big_cache_takes_memory_only_where_it_is_written():
    before = rss_bytes()
    cache = KVCache(8, 4, 2, 64, 1 << 16, torch.float16, "cpu")  # 1 GiB of keys and values
    tables = cache.keys + cache.values
    assert sum(t.numel() * t.element_size() for t in tables) == 1 << 30
    assert rss_bytes() - before < 64 << 20
    assert cache.slot_bytes == 8 * 2 * 4 * 2 * 64 * 2 + 4 * 8  # keys and values of every row, and positions
    block = torch.randn(4, 2, 3, 64)
    cache.write(5, block, block, torch.tensor([[7, 8, 9]] * 4))
    assert rss_bytes() - before < 64 << 20
    assert torch.equal(cache.keys[5][:, :, 7:10], block.half()) and not cache.keys[5][:, :, :7].any()
    assert not cache.values[0][3, :, -100:].any() and not cache.positions.any()  # zero where unwritten
    small = lazy_zeros((LAZY_BYTES // 8,), torch.float32, "cpu")  # below the threshold: plain zeros
    assert small.abs().sum() == 0 and small.dtype == torch.float32


def test_fitting_context():
    # 100 bytes a slot over all rows, 9 slots of room: half of 1,000,000 bytes holds 5,000 slots.
    assert fitting_context(4096, 100, 9, 10**6) == 4096  # the model's own fits
    assert fitting_context(32768, 100, 9, 10**7) == 32768
    assert fitting_context(32768, 100, 9, 2 * 10**6) == 9 * 1024  # 10,000 - 10 slots, down to a step
    assert fitting_context(32768, 100, 9, 2 * 10**6, reserved=10**5) == 8 * 1024  # the prefix store counts
    assert fitting_context(32768, 100, 9, 10**5) == S.CONTEXT_FLOOR  # never below the floor
    assert fitting_context(1000, 100, 9, 10**5) == 1000  # nor above the model's own
    assert fitting_context(32768, 100, 9, None) == 32768  # free memory unknown
    assert fitting_context(32768, 100, 9, 4 * 10**6, share=0.25) == 9 * 1024  # one of two replicas


def test_a_scheduler_sizes_its_context_from_the_model_and_the_memory(monkeypatch, caplog):
    target, draft = model(8192), model(8192, seed=1)
    learned = DraftModelDrafter(draft, 50)
    drafters = {"none": None, "draft": learned, "ngram+draft": lookup_first(NgramDrafter(), learned)}  # one cache
    asked = BatchScheduler(target, None, drafters=drafters, drafter="draft", max_batch=4, max_model_len=300,
                           adaptive=False)
    assert asked.max_model_len == 300
    own = BatchScheduler(target, None, drafters=drafters, drafter="draft", max_batch=4, adaptive=False)
    assert own.max_model_len == 8192  # plenty of memory for these caches
    slots = own.cache.capacity
    assert slots >= 8192 and drafters["draft"]._pool.cache.capacity == slots
    # What every row's slot costs, the target's and the draft's (once, though two drafters use it):
    # with memory for 5,000 such slots (and none held back for the prefix store) the context is 4,096.
    slot_bytes = own.cache.slot_bytes + drafters["draft"]._pool.cache.slot_bytes
    monkeypatch.setattr(S, "free_memory", lambda device: int(5000 * slot_bytes / S.CONTEXT_MEMORY_SHARE))
    cut = BatchScheduler(target, None, drafters=drafters, drafter="draft", max_batch=4, adaptive=False)
    assert cut.max_model_len == 4096 and cut.cache.capacity == slots - 8192 + 4096
    with pytest.raises(Exception, match="maximum context length is 4096"):
        cut.engine.check_length(4000, 97, cut.max_model_len)
    with caplog.at_level(logging.WARNING, logger="specdec.scheduler"):  # asked for more than fits: said
        assert BatchScheduler(target, None, drafters=drafters, max_batch=4, max_model_len=8192).max_model_len == 8192
    assert any("memory runs out if they all fill" in r.getMessage() for r in caplog.records)
