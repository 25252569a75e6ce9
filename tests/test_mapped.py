"""The kernel-layout cache (models/mapped.py): a quantised GGUF model loads from its entry to the very
logits the float32 conversion gives, writes no float32 copy, and a stale or cut entry is rebuilt
with one line saying why; `specdec models --cache` lists and prunes entries."""

import gc
import json
import os
import threading

import numpy as np
import pytest
import torch

from helpers import make_tiny_hf
from specdec.errors import ModelLoadError
from specdec.models import cpu_kernels, loader, mapped
from test_gguf import write_gemma3_gguf

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(cpu_kernels.load() is None, reason="the cache lays tables out for the compiled kernels")]

_LLAMA_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
                "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                "mlp.down_proj": "ffn_down"}


def write_llama_like_gguf(path, hf, arch: str):
    """A Q8_0 GGUF of a tiny llama or qwen2 (q/k/v biases, a tied head) HF model."""
    import gguf

    cfg = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", 1e4)))
    for name, t in hf.state_dict().items():
        short = name.removeprefix("model.")
        if short == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            gname = "output.weight"
        elif short == "embed_tokens.weight":
            gname = "token_embd.weight"
        elif short == "norm.weight":
            gname = "output_norm.weight"
        else:
            _, layer, rest = short.split(".", 2)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_LLAMA_NAMES[module]}.{kind}"
        array = np.ascontiguousarray(t.float().numpy())
        if array.ndim == 2 and array.shape[1] % 32 == 0:
            q = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """family -> a tiny Q8_0 GGUF: Gemma 3 (tied head, sandwich norms), Llama (permuted q/k rows,
    its own head), Qwen2 (q/k/v biases, tied head)."""
    import transformers as T

    root = tmp_path_factory.mktemp("ggufs")
    cfg = T.Gemma3TextConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                             query_pre_attn_scalar=16, max_position_embeddings=256)
    torch.manual_seed(0)
    gemma = T.Gemma3ForCausalLM(cfg).eval()
    out = {"gemma3": root / "gemma3.gguf"}
    write_gemma3_gguf(out["gemma3"], gemma, True)
    for family in ("llama", "qwen2"):
        _, hf = make_tiny_hf(root, family, seed=1)
        out[family] = write_llama_like_gguf(root / f"{family}.gguf", hf, family)
    return out


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _logits(model, vocab: int) -> torch.Tensor:
    """A prefill of 20 tokens, then a 3-token block: every row's logits."""
    ids = torch.randint(0, vocab, (1, 23), generator=torch.Generator().manual_seed(5))
    cache = model.new_cache(1, 32)
    first = model(ids[:, :20], torch.arange(20)[None], cache)[0]
    return torch.cat([first, model(ids[:, 20:], torch.arange(20, 23)[None], cache)[0]], dim=1)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
@pytest.mark.parametrize("family", ["gemma3", "llama", "qwen2"])
def test_mapped_entry_loads_the_converted_models_logits_bit_for_bit(ggufs, cache, family, quantize):
    path = ggufs[family]
    model, folder = loader.load(path, torch.float32, "cpu", quantize=quantize)
    assert mapped.is_entry(folder) and folder.parent == cache / "mapped"
    assert not (cache / "gguf").exists()  # no float32 conversion was written
    converted = loader.resolve(path)  # the float32 path, quantised at load as before
    reference = loader.build_model(loader.read_config(converted), loader.read_safetensors_folder(converted),
                                   torch.float32, "cpu", quantize)
    vocab = model.config.vocab_size
    assert torch.equal(_logits(model, vocab), _logits(reference, vocab))
    with open("/proc/self/maps") as maps:  # every table read into memory of its own: no mapping kept
        assert str(folder / mapped.WEIGHTS) not in maps.read()
    again, _ = loader.load(path, torch.float32, "cpu", quantize=quantize)  # the warm load: the file alone
    assert torch.equal(_logits(again, vocab), _logits(reference, vocab))
    assert (folder / "config.json").is_file()


def test_tables_read_in_small_pieces_on_threads_load_the_same_model(ggufs, cache, monkeypatch):
    """`_Reader` splits each table into pieces read by several threads, landing in any order: with
    pieces of 256 bytes the loaded model is the one-piece load's, bit for bit; a piece the file
    cannot fill fails the load with a clear message, raised from its thread, and leaves nothing open."""
    model, folder = loader.load(ggufs["qwen2"], torch.float32, "cpu", quantize="int4")
    reference = _logits(model, model.config.vocab_size)
    monkeypatch.setattr(mapped, "_READ_THREADS", 3)
    monkeypatch.setattr(mapped._Reader, "PIECE", 256)
    pieces = []
    real = os.preadv

    def counted(fd, buffers, offset):
        pieces.append(offset)
        return real(fd, buffers, offset)

    monkeypatch.setattr(mapped.os, "preadv", counted)
    again = mapped.load_entry(folder, torch.float32, "cpu")
    assert len(pieces) > 2 * len(mapped.read_manifest(folder)["modules"])  # tables did split
    assert torch.equal(_logits(again, model.config.vocab_size), reference)
    monkeypatch.setattr(mapped.os, "preadv", lambda fd, buffers, offset: 0 if offset > 4096 else real(fd, buffers, offset))
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ModelLoadError, match=r"weights\.bin ends inside a table \(cut\?\)") as failed:
        mapped.load_entry(folder, torch.float32, "cpu")
    del failed  # its frames hold the mapping (and the mapping's own descriptor)
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before
    assert not [t for t in threading.enumerate() if t.name.startswith("specdec-load")]


def test_stale_and_cut_entries_are_rebuilt_with_a_reason(ggufs, cache, tmp_path, capfd):
    path = tmp_path / "model.gguf"
    path.write_bytes(ggufs["gemma3"].read_bytes())
    model, folder = loader.load(path, torch.float32, "cpu", quantize="int8")
    reference = _logits(model, 96)
    assert "rebuilding" not in capfd.readouterr().err
    weights = folder / mapped.WEIGHTS
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size - 100)
    model, again = loader.load(path, torch.float32, "cpu", quantize="int8")
    said = [line for line in capfd.readouterr().err.splitlines() if "rebuilding" in line]
    assert again == folder and len(said) == 1
    assert said[0] == f"specdec: rebuilding the cached int8 model {folder.name}: {mapped.WEIGHTS} is cut ({size - 100} of {size} bytes)"
    assert weights.stat().st_size == size and torch.equal(_logits(model, 96), reference)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # the source changed
    model, _ = loader.load(path, torch.float32, "cpu", quantize="int8")
    assert "its source changed" in capfd.readouterr().err
    assert torch.equal(_logits(model, 96), reference)
    # The tail of the file rewritten in place (same size): the tail hash tells.
    with open(weights, "r+b") as f:
        f.seek(size - 8)
        f.write(b"\xff" * 8)
    loader.load(path, torch.float32, "cpu", quantize="int8")
    assert "hash differs" in capfd.readouterr().err


def test_models_cache_lists_and_prunes(ggufs, cache, tmp_path, capsys):
    from specdec.cli import main

    path = tmp_path / "gone.gguf"
    path.write_bytes(ggufs["qwen2"].read_bytes())
    loader.load(path, torch.float32, "cpu", quantize="int8")
    loader.load(ggufs["llama"], torch.float32, "cpu", quantize="int4")
    assert main(["models", "--cache", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["entries"]
    assert sorted((r["kind"], r["quantize"], r["status"]) for r in rows) == [("kernel layout", "int4", "ok"),
                                                                           ("kernel layout", "int8", "ok")]
    assert all(r["bytes"] > 0 and r["last_used"] for r in rows)
    path.unlink()  # its source is gone: the entry is stale
    assert main(["models", "--cache"]) == 0
    text = capsys.readouterr().out
    assert "stale: its source file is gone" in text and "int4" in text
    leftover, building = cache / "mapped" / "x-int8-0.tmp-1", cache / "mapped" / "y-int8-0.tmp-2"
    leftover.mkdir()
    building.mkdir()
    os.utime(leftover, (1e9, 1e9))  # a build's folder untouched for years: its process died
    assert main(["models", "--cache", "--prune"]) == 0
    out = capsys.readouterr().out
    assert "removed 2 entries" in out and "x-int8-0.tmp-1" in out
    left = sorted(p.name for p in (cache / "mapped").iterdir() if p.is_dir())
    assert left == sorted([mapped.entry_dir(ggufs["llama"], "int4", mapped.layout_id(cpu_kernels.load())).name,
                           building.name])  # a build under way is left alone
    for argv in (["models", "--prune"], ["models", "--cache", "--unused-days", "3"],
                 ["models", "--cache", "--prune", "--unused-days", "-1"]):
        assert main(argv) == 2  # one line, nonzero
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("specdec: error: --"), argv
    assert main(["models", "--cache", "--prune", "--unused-days", "0"]) == 0  # every entry but a build under way
    assert sorted(p.name for p in (cache / "mapped").iterdir() if p.is_dir()) == [building.name]


def test_engine_loads_a_quantised_gguf_from_its_entry(ggufs, cache):
    from specdec import Engine

    engine = Engine.load(str(ggufs["qwen2"]), drafter="none", quantize="int8")
    assert not (cache / "gguf").exists() and len([p for p in (cache / "mapped").glob("qwen2-int8-*") if p.is_dir()]) == 1
    converted = loader.resolve(ggufs["qwen2"])
    reference = loader.build_model(loader.read_config(converted), loader.read_safetensors_folder(converted),
                                   torch.float32, "cpu", "int8")
    out = engine.generate(prompt_ids=[1, 2, 3], max_new_tokens=6)
    assert out.token_ids == Engine(reference, None).generate(prompt_ids=[1, 2, 3], max_new_tokens=6).token_ids


def test_rows_of_the_default_models_k_quants_read_alone_equal_the_whole_tensor():
    """A build quantises straight from the GGUF, a block of rows at a time: for each ggml type in
    the default model's file (Q4_K, Q6_K, Q5_0, ... which gguf cannot write for a tiny test file),
    rows read alone at odd offsets are the rows of the whole tensor dequantised, as the float32
    conversion writes them."""
    gguf = loader.read_gguf(loader.default_model_path())
    raw = loader._gguf_config(gguf)
    sources = loader.gguf_sources(gguf, raw)
    smallest = {}
    for t in gguf.tensors:
        if len(t.shape) == 2 and (t.tensor_type not in smallest or t.data.size < smallest[t.tensor_type].data.size):
            smallest[t.tensor_type] = t
    assert len(smallest) >= 2
    from gguf.quants import dequantize

    assert {"Q4_K", "Q5_0", "Q6_K", "Q8_0"} <= {k.name for k in smallest}
    for t in smallest.values():
        name = loader._gguf_name(t.name, raw["model_type"])
        whole = torch.from_numpy(dequantize(t.data, t.tensor_type).astype("float32")).view(sources[name].shape)
        for start, n in ((0, 1), (3, 5), (whole.shape[0] - 7, 7)):
            out = torch.empty(n, whole.shape[1])
            sources[name].read_into(start, out)
            assert torch.equal(out, whole[start : start + n]), (t.name, t.tensor_type)


def test_without_the_compiled_kernels_a_quantised_load_takes_the_float32_path(ggufs, cache, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)  # as with SPECDEC_CPU_KERNELS=0 or no compiler
    model, folder = loader.load(ggufs["llama"], torch.float32, "cpu", quantize="int8")
    assert folder.parent == cache / "gguf" and not mapped.is_entry(folder) and not (cache / "mapped").exists()
    assert model.lm_head._q is None  # fbgemm's layout, not the kernels'
