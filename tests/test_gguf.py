"""A tiny GGUF written with gguf.GGUFWriter loads and matches the same weights from safetensors."""

import numpy as np
import pytest
import torch

from specdec.models import build, gguf_file, loader

HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def write_gemma3_gguf(path, hf, quantise_q8: bool):
    import gguf

    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(1e6)
    w.add_sliding_window(cfg.sliding_window)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":
            continue
        short = name.removeprefix("model.")
        if short == "embed_tokens.weight":
            gname = "token_embd.weight"
        elif short == "norm.weight":
            gname = "output_norm.weight"
        else:
            _, layer, rest = short.split(".", 2)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{HF_TO_GGUF[module]}.{kind}"
        array = t.float().numpy()
        if "norm" in gname:
            array = array + 1.0  # llama.cpp stores Gemma's (1 + w)
        if quantise_q8 and array.ndim == 2 and array.shape[1] % 32 == 0:
            q = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, np.ascontiguousarray(array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("q8", [False, True])
def test_tiny_gguf_matches_safetensors(tmp_path, monkeypatch, q8):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    # The GGUF layout fixes Gemma 3's pattern at 5 local layers then 1 global: build the HF twin so.
    import transformers as T

    cfg = T.Gemma3TextConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                             query_pre_attn_scalar=16, max_position_embeddings=256)
    torch.manual_seed(0)
    hf = T.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    hf.save_pretrained(str(tmp_path / "hf"))
    write_gemma3_gguf(tmp_path / "tiny.gguf", hf, q8)
    from_gguf, _ = loader.load(tmp_path / "tiny.gguf", torch.float32, "cpu")
    from_st, _ = loader.load(tmp_path / "hf", torch.float32, "cpu")
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(3))

    def logits(m):
        return m(ids, torch.arange(24)[None], m.new_cache(1, 24))[0].log_softmax(-1)

    diff = (logits(from_gguf) - logits(from_st)).abs().max()
    assert diff < (5e-2 if q8 else 1e-4), diff
    # The second load reads the conversion cache.
    again, _ = loader.load(tmp_path / "tiny.gguf", torch.float32, "cpu")
    assert torch.equal(logits(again), logits(from_gguf))
    # Large tables are dequantised a block of rows at a time: blocks of 7 rows (the last one short)
    # write the very same file as whole tensors.
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache-blocks"))
    monkeypatch.setattr(build, "_GGUF_BLOCK_ROWS", 7)  # where the GGUF readers live
    blocked = loader.resolve(tmp_path / "tiny.gguf")
    whole = tmp_path / "cache" / "gguf" / blocked.name
    assert (blocked / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()


def test_own_reader_matches_gguf_reader(tmp_path):
    """`read_gguf` gives the scalars, numeric arrays and tensor data gguf's GGUFReader gives, steps
    over string arrays, and honours a non-default alignment."""
    import gguf

    path = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("t.u32", 7)
    w.add_int64("t.i64", -5)
    w.add_float32("t.f32", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "Grüße")
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.strs", ["a", "bc", "", "dé"])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    plain = rng.standard_normal((3, 5)).astype(np.float32)
    half = rng.standard_normal((2, 8)).astype(np.float16)
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("plain", plain)
    w.add_tensor("half", half)
    w.add_tensor("q8", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    ours, theirs = gguf_file.read_gguf(path), gguf.GGUFReader(str(path))
    metadata = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}  # its header as fields
    assert set(ours.fields) == set(metadata)
    for key, field in metadata.items():
        mine = ours.fields[key]
        if key in ("t.strs", "t.nested"):
            assert mine == gguf_file.Skipped({"t.strs": 4, "t.nested": 2}[key])
        elif isinstance(mine, np.ndarray):
            assert mine.tolist() == list(field.contents())
        else:
            assert mine == field.contents(), key
    assert ours.fields["general.alignment"] == 64
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors] == ["plain", "half", "q8"]
    for mine, t in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == t.tensor_type and mine.shape == tuple(t.shape.tolist())
        assert mine.data.dtype == t.data.dtype and np.array_equal(mine.data, t.data)
    assert np.array_equal(ours.tensors[0].data, plain) and np.array_equal(ours.tensors[1].data, half)


def test_own_reader_errors(tmp_path):
    from specdec.errors import ModelLoadError

    cases = {"empty.gguf": b"", "text.gguf": b"not a gguf at all",
             "v1.gguf": b"GGUF" + (1).to_bytes(4, "little") + bytes(16),
             "short.gguf": b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (5).to_bytes(8, "little")}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ModelLoadError, match="GGUF"):
            gguf_file.read_gguf(tmp_path / name)
    # A tensor whose data the file does not hold (cut short after writing).
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "cut.gguf"), "llama")
    w.add_tensor("t", np.ones((64, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = (tmp_path / "cut.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:-100])
    with pytest.raises(ModelLoadError, match="truncated"):
        gguf_file.read_gguf(tmp_path / "cut.gguf")
    # A header cut inside a vocabulary-sized array of strings.
    w = gguf.GGUFWriter(str(tmp_path / "vocab.gguf"), "llama")
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(1000)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    data = (tmp_path / "vocab.gguf").read_bytes()
    (tmp_path / "vocab.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated"):
        gguf_file.read_gguf(tmp_path / "vocab.gguf")
