import pytest
import torch


def make_tiny_hf(tmp_path, family: str, seed: int = 0):
    """Save a tiny random HF model of `family` as a safetensors folder; return (folder, hf_model)."""
    import transformers as T

    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512)
    if family == "gemma3":
        cfg = T.Gemma3TextConfig(**common, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                 layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                              "sliding_attention"])
        cls = T.Gemma3ForCausalLM
    elif family == "llama":
        cfg = T.LlamaConfig(**common, rope_theta=500000.0)
        cls = T.LlamaForCausalLM
    elif family == "mistral":
        cfg = T.MistralConfig(**common, sliding_window=8)
        cls = T.MistralForCausalLM
    elif family == "qwen2":
        cfg = T.Qwen2Config(**common, tie_word_embeddings=True)
        cls = T.Qwen2ForCausalLM
    elif family == "qwen3":
        cfg = T.Qwen3Config(**common, head_dim=16)
        cls = T.Qwen3ForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # random norms so the (1 + w) vs w conventions are really exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    folder = tmp_path / f"tiny-{family}"
    model.save_pretrained(str(folder))
    return folder, model


TINY_VOCAB = 97  # make_tiny_hf's vocabulary


def random_prompts(n: int, length: int = 10, vocab: int = TINY_VOCAB, seed: int = 0) -> list[list[int]]:
    """n reproducible random prompts of token ids in [3, vocab) (0-2 are pad/bos/eos)."""
    return [torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed + s)).tolist()
            for s in range(n)]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """family -> dict(target, folder): tiny random llama and gemma3 (sliding window) models, fp32."""
    from specdec.models import loader

    out = {}
    for family in ("llama", "gemma3"):
        folder, _ = make_tiny_hf(tmp_path_factory.mktemp(family), family, seed=0)
        target, _ = loader.load(folder, torch.float32, "cpu")
        out[family] = dict(target=target, folder=folder)
    return out


@pytest.fixture(scope="session")
def default_engine_fp32():
    from specdec import Engine

    return Engine.load(target="default", drafter="none", dtype="float32", quantize="none")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models are all per-call overhead: on a shared 2-core machine two threads fight each
    other and run ~10x slower than one. Modules of tiny-model tests opt in with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
