"""A tiny GGUF written with gguf.GGUFWriter loads and matches the same weights from safetensors."""

import numpy as np
import pytest
import torch

from specdec.models import loader

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
    monkeypatch.setattr(loader, "_GGUF_BLOCK_ROWS", 7)
    blocked = loader.resolve(tmp_path / "tiny.gguf")
    whole = tmp_path / "cache" / "gguf" / blocked.name
    assert (blocked / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
