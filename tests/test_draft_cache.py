"""What a draft model keeps in its kernel-layout entry (`drafters/draft_cache.py`): its 4-bit
drafting head, equal to the one computed at load, and its measured price, measured again where the
machine signature or thread count differs."""

import json

import pytest
import torch

from specdec.drafters import draft_cache
from specdec.drafters.draft_model import DraftModelDrafter, _rows_of
from specdec.models import cpu_kernels, loader
from test_mapped import cache, ggufs  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(cpu_kernels.load() is None, reason="entries lay tables out for the compiled kernels")]


def _entry_model(ggufs, family="qwen2", quantize="int4"):
    model, folder = loader.load(ggufs[family], torch.float32, "cpu", quantize=quantize)
    assert draft_cache.entry_of(model) is not None
    return model, folder


@pytest.mark.parametrize("vocab", [None, 40])
def test_kept_drafting_head_equals_the_computed_one(ggufs, cache, vocab):
    model, folder = _entry_model(ggufs)
    V = model.config.vocab_size
    first = DraftModelDrafter(model, V, vocab=vocab, int4_head=True, cache_folder=folder)
    kept = list(folder.glob("sub_head-*.pt"))
    assert len(kept) == 1
    again = DraftModelDrafter(model, V, vocab=vocab, int4_head=True, cache_folder=folder)  # read from the file
    computed = _rows_of(model.lm_head, again.vocab_ids, True)  # what every load made before
    for head in (first._sub_head, again._sub_head):
        assert (head.out_features, head.in_features) == (computed.out_features, computed.in_features)
        assert torch.equal(head._q, computed._q)
        assert (head.bias is None) == (computed.bias is None)
        if computed.bias is not None:
            assert torch.equal(head.bias, computed.bias)
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    assert torch.equal(again._sub_head(x), computed(x))
    # Another subset is another file, never the first one's rows.
    other = DraftModelDrafter(model, V, vocab=20, int4_head=True, cache_folder=folder)
    assert len(list(folder.glob("sub_head-*.pt"))) == (2 if vocab != 20 else 1)
    assert torch.equal(other._sub_head._q, _rows_of(model.lm_head, other.vocab_ids, True)._q)


def test_a_cut_kept_head_is_made_again(ggufs, cache):
    model, folder = _entry_model(ggufs)
    V = model.config.vocab_size
    DraftModelDrafter(model, V, vocab=40, int4_head=True, cache_folder=folder)
    file = next(folder.glob("sub_head-*.pt"))
    file.write_bytes(file.read_bytes()[:100])
    d = DraftModelDrafter(model, V, vocab=40, int4_head=True, cache_folder=folder)
    assert torch.equal(d._sub_head._q, _rows_of(model.lm_head, d.vocab_ids, True)._q)


def test_kept_cost_is_read_back_and_measured_again_on_another_machine_or_thread_count(ggufs, cache, monkeypatch):
    target, _ = _entry_model(ggufs, quantize="int8")
    draft, folder = _entry_model(ggufs)
    V = target.config.vocab_size
    measured = []
    real_twin = DraftModelDrafter._twin_for_timing

    def counting_twin(self, prompt):
        measured.append(1)
        return real_twin(self, prompt)

    monkeypatch.setattr(DraftModelDrafter, "_twin_for_timing", counting_twin)
    monkeypatch.setattr(draft_cache, "SAMPLES", 2)
    costs = [DraftModelDrafter(draft, V, vocab=40, cache_folder=folder).measure_cost(target, context=8, repeats=1)
             for _ in range(2)]  # the first SAMPLES loads measure
    assert len(measured) == 2 and (folder / draft_cache.COSTS).is_file()
    kept = DraftModelDrafter(draft, V, vocab=40, cache_folder=folder).measure_cost(target, context=8, repeats=1)
    samples = next(iter(json.loads((folder / draft_cache.COSTS).read_text()).values()))
    assert len(samples) == 2 and samples[0] == costs[0]
    assert len(measured) == 2 and kept == costs[-1] == min(samples)  # read back: the lowest
    # Another drafting head is another price.
    DraftModelDrafter(draft, V, vocab=20, cache_folder=folder).measure_cost(target, context=8, repeats=1)
    assert len(measured) == 3
    # Another thread count measures again.
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        DraftModelDrafter(draft, V, vocab=40, cache_folder=folder).measure_cost(target, context=8, repeats=1)
    finally:
        torch.set_num_threads(threads)
    assert len(measured) == 4
    # Another processor measures again.
    signature = cpu_kernels.cpu_signature
    monkeypatch.setattr(cpu_kernels, "cpu_signature", lambda: "another processor")
    DraftModelDrafter(draft, V, vocab=40, cache_folder=folder).measure_cost(target, context=8, repeats=1)
    assert len(measured) == 5
    monkeypatch.setattr(cpu_kernels, "cpu_signature", signature)
    DraftModelDrafter(draft, V, vocab=40, cache_folder=folder).measure_cost(target, context=8, repeats=1)
    assert len(measured) == 5  # this machine's price is still kept
    # A draft not tied to an entry keeps and reads nothing.
    DraftModelDrafter(draft, V, vocab=40).measure_cost(target, context=8, repeats=1)
    assert len(measured) == 6
