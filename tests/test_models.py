import pytest
import torch

from specdec.models import loader

from helpers import make_tiny_hf

FAMILIES = ["gemma3", "llama", "mistral", "qwen2", "qwen3"]


def native_logits(model, ids):
    cache = model.new_cache(1, ids.shape[1] + 4)
    logits, _ = model(ids, torch.arange(ids.shape[1])[None], cache)
    return logits


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tmp_path, family):
    folder, hf = make_tiny_hf(tmp_path, family)
    model, _ = loader.load(folder, torch.float32, "cpu")
    ids = torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    diff = (native_logits(model, ids).log_softmax(-1) - ref.log_softmax(-1)).abs().max()
    assert diff < 1e-3, diff


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_cache_decode_and_truncate_across_window(tmp_path, family):
    folder, _ = make_tiny_hf(tmp_path, family)
    model, _ = loader.load(folder, torch.float32, "cpu")
    ids = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(2))
    full = native_logits(model, ids)  # window is 8: positions past it use the mask
    cache = model.new_cache(1, 40)
    model(ids[:, :10], torch.arange(10)[None], cache)
    steps = [model(ids[:, t : t + 1], torch.tensor([[t]]), cache)[0][0, 0] for t in range(10, 30)]
    assert torch.allclose(torch.stack(steps), full[0, 10:30], atol=1e-4)
    # Roll back 12 tokens (wrong ones written), then decode the true ones again.
    cache.truncate(18)
    junk = torch.randint(0, 97, (1, 5))
    model(junk, torch.arange(18, 23)[None], cache)
    cache.truncate(18)
    again, _ = model(ids[:, 18:30], torch.arange(18, 30)[None], cache)
    assert torch.allclose(again[0], full[0, 18:30], atol=1e-4)


@pytest.mark.parametrize("family,quantize,length", [("gemma3", False, 70), ("llama", False, 20), ("gemma3", True, 70)])
def test_prefill_last_layer_for_the_last_rows(tmp_path, family, quantize, length):
    # A prefill's logits come from its last rows computed by themselves in the last layer, with or
    # without every other row's hidden state: the same bits either way, the same cache, and the
    # full forward's values to rounding. (70 tokens: SDPA's long-block path for the other rows.)
    from specdec.models.quant import cpu_int8_available, quantize_model

    if quantize and not cpu_int8_available():
        pytest.skip("needs PyTorch's fbgemm CPU backend")
    folder, _ = make_tiny_hf(tmp_path, family)
    model, _ = loader.load(folder, torch.float32, "cpu")
    if quantize:
        quantize_model(model, "int8")
    ids = torch.randint(0, 97, (1, length), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(length)[None]
    runs = {}
    with torch.inference_mode():
        for name, kwargs in (("all", {}), ("last2", {"last_n": 2}), ("last2_alone", {"last_n": 2, "need_hidden": False})):
            cache = model.new_cache(1, length + 4)
            logits, hidden = model(ids, pos, cache, **kwargs)
            runs[name] = logits, hidden, cache
    full_logits, full_hidden, full_cache = runs["all"]
    logits, hidden, cache = runs["last2"]
    alone_logits, alone_hidden, alone_cache = runs["last2_alone"]
    assert hidden.shape == full_hidden.shape and alone_hidden.shape[1] == 2
    assert torch.equal(logits, alone_logits) and torch.equal(hidden[:, -2:], alone_hidden)
    assert torch.equal(hidden[:, :-2], full_hidden[:, :-2])  # the other rows as a full pass has them
    torch.testing.assert_close(logits, full_logits[:, -2:], atol=1e-4, rtol=1e-4)
    for layer in range(model.config.num_layers):
        assert torch.equal(alone_cache.keys[layer], full_cache.keys[layer])
        assert torch.equal(alone_cache.values[layer], full_cache.values[layer])
        assert torch.equal(cache.keys[layer], full_cache.keys[layer])
        assert torch.equal(cache.values[layer], full_cache.values[layer])
    assert alone_cache.lengths.tolist() == full_cache.lengths.tolist() == [length]


@pytest.mark.parametrize("family,quantize", [("gemma3", True), ("llama", True), ("qwen2", True), ("gemma3", False)])
def test_decoder_layer_kernel_equals_the_modules(tmp_path, monkeypatch, family, quantize):
    # Decode and verify blocks run each decoder layer in one compiled call (`decoder_layer`); it must
    # give the bits of the modules run one by one: logits, hidden states and the cache, for one
    # and five new tokens after a prefill, two sequences at once. Gemma 3 has sandwich and q/k
    # norms and a window, Qwen2 a q/k/v bias; the float case has its projections fused too.
    from specdec.models import cpu_kernels
    from specdec.models.quant import cpu_int8_available, quantize_model
    from specdec.models.transformer import Block

    if cpu_kernels.load() is None or (quantize and not cpu_int8_available()):
        pytest.skip("needs the compiled CPU kernels and PyTorch's fbgemm CPU backend")
    folder, _ = make_tiny_hf(tmp_path, family)
    model, _ = loader.load(folder, torch.float32, "cpu")
    if quantize:
        quantize_model(model, "int8")
    else:
        model.fuse_projections()
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(5))

    def run() -> list[torch.Tensor]:
        out = []
        with torch.inference_mode():
            cache = model.new_cache(2, 40)
            model(ids[:, :20], torch.arange(20).expand(2, -1), cache, last_n=1)
            for t in (1, 5):
                cache.truncate(20)
                logits, hidden = model(ids[:, 20 : 20 + t], torch.arange(20, 20 + t).expand(2, -1), cache)
                out += [logits, hidden] + [c[:, :, : 20 + t].clone() for c in cache.keys + cache.values]
        return out

    fused_calls = []
    monkeypatch.setattr(cpu_kernels.load(), "decoder_layer", _counting(cpu_kernels.load().decoder_layer, fused_calls),
                        raising=False)
    fused = run()
    # Every layer of both blocks and of the 20-token prefill, whose last layer runs twice: all rows
    # for the hidden states, then again for the kept last row (`keep`: every block is compiled).
    assert len(fused_calls) == 3 * model.config.num_layers + 1
    weight = model.layers[1].input_layernorm.weight
    before = weight.detach().clone()
    with torch.no_grad():  # a norm changed in place after the layers remembered their arguments
        weight.add_(0.25)
    fused_after = run()
    monkeypatch.setattr(Block, "_kernel_parts", lambda self, cache_keys: None)
    modules_after = run()
    assert all(torch.equal(a, b) for a, b in zip(fused_after, modules_after))
    with torch.no_grad():
        weight.copy_(before)
    modules = run()
    assert all(torch.equal(a, b) for a, b in zip(fused, modules))
    assert not torch.equal(fused[0], fused_after[0])


def test_decoder_layer_kernel_follows_a_replaced_projection(tmp_path):
    # The layers remember their kernel arguments and trust them while no module has registered
    # another weight or submodule: giving a block a new projection, or a projection a new weight,
    # must reach the next step.
    from specdec.models import cpu_kernels
    from specdec.models.transformer import Block

    if cpu_kernels.load() is None:
        pytest.skip("needs the compiled CPU kernels")
    folder, _ = make_tiny_hf(tmp_path, "gemma3")
    model, _ = loader.load(folder, torch.float32, "cpu")
    model.fuse_projections()
    ids = torch.randint(0, 97, (1, 21), generator=torch.Generator().manual_seed(3))

    def step(use_kernel: bool = True) -> torch.Tensor:
        with torch.inference_mode():
            cache = model.new_cache(1, 30)
            model(ids[:, :20], torch.arange(20)[None], cache, last_n=1)
            if not use_kernel:
                for block in model.layers:
                    block.__dict__["_kernel_memo"] = None
                original = Block._kernel_parts
                Block._kernel_parts = lambda self, cache_keys: None
                try:
                    return model(ids[:, 20:], torch.arange(20, 21)[None], cache)[0]
                finally:
                    Block._kernel_parts = original
            return model(ids[:, 20:], torch.arange(20, 21)[None], cache)[0]

    before = step()
    mlp = model.layers[1].mlp
    old = mlp.down_proj
    new = torch.nn.Linear(old.in_features, old.out_features, bias=False)
    with torch.no_grad():
        new.weight.copy_(old.weight * 1.5)
    mlp.down_proj = new  # a new submodule
    after = step()
    assert not torch.equal(after, before)
    assert torch.equal(after, step(use_kernel=False))
    mlp.down_proj.weight = torch.nn.Parameter(old.weight.detach().clone())  # a new weight: the old values
    assert torch.equal(step(), before)


def _counting(fn, calls: list):
    def wrapped(*args):
        calls.append(1)
        return fn(*args)
    return wrapped


def test_bad_model_paths(tmp_path):
    from specdec.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="not found"):
        loader.resolve(tmp_path / "nope")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match="GGUF"):
        loader.resolve(bad)
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        loader.load(folder, torch.float32, "cpu")


def test_default_model_matches_transformers(default_engine_fp32):
    """The real Gemma 3 270M: native log-probs and 64 greedy tokens equal HF's own implementation."""
    from transformers import AutoModelForCausalLM

    folder = loader.resolve("default")
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tok = default_engine_fp32.tokenizer
    text = ("Speculative decoding lets a small model propose several tokens that a large model then checks in a "
            "single pass, which keeps the output exactly the same while the large model reads its weights less "
            "often per generated token, as long as the drafts are usually right.")
    ids = torch.tensor([tok.encode(text)[:64]])
    with torch.no_grad():
        ref = hf(ids).logits.log_softmax(-1)
    mine = native_logits(default_engine_fp32.model, ids).log_softmax(-1)
    assert (mine - ref).abs().max() < 1e-3
    for prompt in ["The capital of France is", "def quicksort(arr):\n"]:
        prompt_ids = tok.encode(prompt)
        with torch.no_grad():
            hf_out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=64, do_sample=False,
                                 min_new_tokens=64)[0, len(prompt_ids):].tolist()
        ours = default_engine_fp32.generate(prompt_ids=prompt_ids, max_new_tokens=64)
        assert ours.token_ids == hf_out[: len(ours.token_ids)] and len(ours.token_ids) == 64


def test_default_tokenizer_reads_tokenizer_json_directly_and_matches_transformers(default_engine_fp32):
    """The default model's tokenizer is the Rust tokenizer of its tokenizer.json, read without
    transformers (`tokenizer._plain_reading`), and encodes and decodes exactly as a freshly loaded
    transformers tokenizer of the same folder: special tokens written in the text, byte fallback,
    whitespace runs, several scripts, and ids across the whole vocabulary."""
    import random

    from transformers import AutoTokenizer

    ours = default_engine_fp32.tokenizer
    assert ours._rust is not None and ours._tok is None and ours.chat_template is None
    fresh = AutoTokenizer.from_pretrained(str(loader.resolve("default")))
    rnd = random.Random(0)
    alphabet = [chr(c) for c in [*range(32, 127), 0xE9, 0x301, 0x4E2D, 0x1F600, 0x2581, 0xA0, 9, 10]]
    texts = ["Question: What is a hash table?\nAnswer:", "  Übersetze: 東京は大きい 😀\n\n\tdef f(x):",
             "<start_of_turn>user\nhi<end_of_turn>", "<bos>literal<eos> <unused5><pad>", "   ", "ﬁ é é",
             *("".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 60))) for _ in range(200))]
    for text in texts:
        ids = ours.encode(text)
        assert ids == fresh(text).input_ids, text
        for part in (ids, ids[1:], ids[: len(ids) // 2]):
            assert ours.decode(part) == fresh.decode(part, skip_special_tokens=True), text
    spread = [*range(0, 262144, 101), 0, 1, 2, 3, 106, 262143]
    assert ours.decode(spread) == fresh.decode(spread, skip_special_tokens=True)


def test_tokenizer_route_follows_the_folder(tmp_path):
    """tokenizer.json alone, or with a config of inert keys or a chat template (in the config or
    beside it): the Rust tokenizer. A key transformers acts on, or a class of its own:
    transformers, which gives the same ids for what both can read."""
    import json

    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from specdec.tokenizer import Tokenizer

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, 40)}}
    raw = RustTokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<bos>", eos_token="<eos>",
                            pad_token="<pad>").save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())

    def route(extra: dict | None = None, files: dict | None = None) -> Tokenizer:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, **(extra or {})}))
        for name in ("chat_template.jinja",):
            (tmp_path / name).unlink(missing_ok=True)
        for name, text in (files or {}).items():
            (tmp_path / name).write_text(text)
        return Tokenizer.from_folder(tmp_path)

    plain = route()
    assert plain._rust is not None and plain.encode("w3 w4 <eos> x") == [3, 4, 2, 0]
    assert route({"extra_special_tokens": {}, "clean_up_tokenization_spaces": False})._rust is not None
    assert plain.decode([1, 3, 2, 4]) == "w3 w4"
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    for extra, files in (({"chat_template": template}, None), (None, {"chat_template.jinja": template})):
        tok = route(extra, files)
        assert tok._rust is not None and tok.chat_template == template
        assert tok.encode_chat([{"role": "user", "content": "w5"}]) == [5]
    for extra, files in (({"add_bos_token": True}, None), ({"tokenizer_class": "LlamaTokenizer"}, None),
                         ({"clean_up_tokenization_spaces": True}, None),
                         ({"additional_special_tokens": ["w7"]}, None)):
        tok = route(extra, files)
        assert tok._tok is not None and tok._rust is None, (extra, files)
    assert route({"add_bos_token": True, "chat_template": template}).encode_chat(
        [{"role": "user", "content": "w5"}]) == [5]
    (tmp_path / "tokenizer_config.json").unlink()
    assert Tokenizer.from_folder(tmp_path)._rust is not None


def test_unreadable_tokenizer_is_a_load_error(tmp_path):
    """A broken tokenizer.json, or a broken tokenizer_config.json beside a good one, is one
    ModelLoadError naming the folder (the CLI prints it as one line), on either route."""
    from specdec.errors import ModelLoadError
    from specdec.tokenizer import Tokenizer

    (tmp_path / "tokenizer.json").write_text('{"model": {')
    with pytest.raises(ModelLoadError, match="cannot read its tokenizer"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": ')
    with pytest.raises(ModelLoadError, match=str(tmp_path)):
        Tokenizer.from_folder(tmp_path)


def test_default_gguf_tokenizer_is_transformers_config_route(tmp_path):
    """The conversion names the tokenizer type, which spares transformers a second reading of the
    file for its config; the tokenizer saved is the one its config route builds, byte for byte."""
    from transformers import AutoTokenizer

    path = loader.default_model_path()
    loader._gguf_tokenizer(path, tmp_path / "named", "gemma3_text")
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(tmp_path / "config"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "named" / name).read_bytes() == (tmp_path / "config" / name).read_bytes()


def test_blocked_attention_equals_one_sdpa_call():
    """A long block's attention, a block of query rows at a time over only the slots they can see,
    equals one SDPA call over all slots to rounding: causal, sliding-window and batched masks (one
    sequence's rows padded on the left, so they see nothing before their start)."""
    import torch.nn.functional as F

    from specdec.models.transformer import ATTENTION_QUERY_BLOCK, blocked_attention, query_blocks

    g = torch.Generator().manual_seed(0)
    t = 2 * ATTENTION_QUERY_BLOCK + 45
    q = torch.randn(2, 4, t, 16, generator=g)
    k, v = torch.randn(2, 2, t, 16, generator=g), torch.randn(2, 2, t, 16, generator=g)
    i = torch.arange(t)
    causal = i[None, :] <= i[:, None]
    window = causal & (i[None, :] > i[:, None] - 100)
    late_start = causal & (i[None, :] >= 150)  # sequence 2 starts at slot 150
    late_start[:150] = (i[None, :] == i[:, None])[:150]  # its padding rows see themselves only
    for first, second in ((causal, causal), (window, window), (window, causal), (causal, window)):
        visible = torch.stack([first, second & late_start])[:, None]  # the union of what they see counts
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=0.25, enable_gqa=True)
        out = blocked_attention(q, k, v, query_blocks(visible, q.dtype), 0.25, True)
        assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
