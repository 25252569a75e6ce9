"""Loading without holding the weights twice: streamed safetensors, and int8 straight from disk."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.errors import ModelLoadError
from specdec.models import build, loader
from specdec.models.quant import Int8Linear, cpu_int8_available, quantize_model

from helpers import make_tiny_hf


def test_streamed_writer_and_row_reader_round_trip(tmp_path):
    g = torch.Generator().manual_seed(0)
    table = torch.randn(10, 6, generator=g)
    norm = torch.randn(6, generator=g).bfloat16()
    specs = [("model.embed_tokens.weight", torch.float32, (10, 6)), ("model.norm.weight", torch.bfloat16, (6,))]
    # The table comes in three blocks of rows; the reader of the safetensors library must see one tensor.
    loader.write_safetensors(tmp_path / "m.safetensors", specs, [table[:4], table[4:7], table[7:], norm])
    back = load_file(str(tmp_path / "m.safetensors"))
    assert torch.equal(back["model.embed_tokens.weight"], table) and torch.equal(back["model.norm.weight"], norm)

    stored = loader.read_safetensors_folder(tmp_path)
    assert set(stored) == {"embed_tokens.weight", "norm.weight"}  # HF's "model." prefix dropped
    rows = torch.empty(3, 6)
    stored["embed_tokens.weight"].read_into(5, rows)
    assert torch.equal(rows, table[5:8])
    as_float = torch.empty(6)
    stored["norm.weight"].read_into(0, as_float)  # bfloat16 on disk, converted on the way
    assert torch.equal(as_float, norm.float()) and torch.equal(stored["norm.weight"].load(), norm)

    with pytest.raises(ValueError, match="model.norm.weight"):  # a block of the wrong shape
        loader.write_safetensors(tmp_path / "bad.safetensors", specs, [table, norm[:5]])
    with pytest.raises(ValueError, match="more tensors"):
        loader.write_safetensors(tmp_path / "bad.safetensors", specs, [table, norm, norm])


def test_converting_load_reads_in_blocks_and_equals_to(tmp_path, monkeypatch):
    # A load in another dtype converts a block of rows at a time (so a float32 table is never whole
    # beside its bfloat16 copy); the values are .to(dtype)'s, bit for bit, whatever the block.
    g = torch.Generator().manual_seed(1)
    tensors = {"model.embed_tokens.weight": torch.randn(37, 5, generator=g) * 1e3,
               "model.norm.weight": torch.randn(11, generator=g), "model.scale": torch.tensor(2.5)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    stored = loader.read_safetensors_folder(tmp_path)
    reads = []
    real_read_into = loader.StoredTensor.read_into
    monkeypatch.setattr(loader.StoredTensor, "read_into",
                        lambda self, start, out: (reads.append(out.shape[0] if out.dim() else 0), real_read_into(self, start, out)))
    monkeypatch.setattr(build, "_CONVERT_BLOCK_BYTES", 4 * 5 * 8)  # 8 rows of the table a read (build.py reads)
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        for name, tensor in tensors.items():
            reads.clear()
            got = stored[name.removeprefix("model.")].load(dtype)
            assert got.dtype == dtype and torch.equal(got, tensor.to(dtype)), (name, dtype)
            if name == "model.embed_tokens.weight":
                assert reads == [8, 8, 8, 8, 5]  # 37 rows: four full blocks and a partial one
    reads.clear()
    assert torch.equal(stored["embed_tokens.weight"].load(), tensors["model.embed_tokens.weight"]) and reads == [37]


def test_unreadable_safetensors_are_clear_errors(tmp_path):
    save_file({"model.norm.weight": torch.ones(1000)}, str(tmp_path / "m.safetensors"))
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "m.safetensors").write_bytes(data[:-100])
    stored = loader.read_safetensors_folder(tmp_path)["norm.weight"]
    with pytest.raises(ModelLoadError, match="truncated"):
        stored.load()
    (tmp_path / "m.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        loader.read_safetensors_folder(tmp_path)


@pytest.mark.skipif(not cpu_int8_available(), reason="needs PyTorch's fbgemm CPU backend")
@pytest.mark.parametrize("family", ["gemma3", "llama", "qwen2"])  # tied; untied; tied with q/k/v biases
def test_int8_load_from_disk_is_the_in_memory_quantisation(tmp_path, family):
    """`load(..., quantize="int8")` reads the float weights a block at a time and keeps only int8;
    it must give exactly the model that quantising a loaded float model gives."""
    folder, _ = make_tiny_hf(tmp_path, family)
    direct, _ = loader.load(folder, torch.float32, "cpu", quantize="int8")
    reference, _ = loader.load(folder, torch.float32, "cpu")
    quantize_model(reference, "int8")
    layers = {n: m for n, m in direct.named_modules() if isinstance(m, Int8Linear)}
    assert layers.keys() == {n for n, m in reference.named_modules() if isinstance(m, Int8Linear)}
    assert "layers.0.self_attn.qkv_proj" in layers and "layers.0.mlp.gate_up_proj" in layers  # fused
    for name, layer in layers.items():
        other = reference.get_submodule(name)
        assert torch.equal(layer.int8_weight(), other.int8_weight()), name
        assert torch.equal(layer.weight_scale, other.weight_scale), name
        assert (layer.bias is None) == (other.bias is None)
        assert layer.bias is None or torch.equal(layer.bias, other.bias)
    assert not any(p.is_meta for p in direct.parameters()) and not any(b.is_meta for b in direct.buffers())
    if direct.config.tie_embeddings:  # the table reads the head's int8 rows as the head stores them: one copy
        head = direct.lm_head
        stored = head._q if head._q is not None else head.int8_weight()
        assert direct.embed_tokens.q.data_ptr() == stored.data_ptr()
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(20)[None]
    a, _ = direct(ids, pos, direct.new_cache(1, 32))
    b, _ = reference(ids, pos, reference.new_cache(1, 32))
    assert torch.equal(a, b)


def test_missing_and_misshapen_tensors_fail_before_reading(tmp_path):
    folder, _ = make_tiny_hf(tmp_path, "llama")
    state = load_file(str(next(folder.glob("*.safetensors"))))
    bad = dict(state)
    bad["model.norm.weight"] = torch.ones(3)
    save_file(bad, str(next(folder.glob("*.safetensors"))))
    with pytest.raises(ModelLoadError, match="norm.weight has shape"):
        loader.load(folder, torch.float32, "cpu", quantize="int8")
    del bad["model.norm.weight"]
    save_file(bad, str(next(folder.glob("*.safetensors"))))
    with pytest.raises(ModelLoadError, match="lack 1 tensors"):
        loader.load(folder, torch.float32, "cpu")
