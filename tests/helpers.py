"""Plain helpers the tests share (not fixtures): tiny random models of each family, a
character-level tokenizer with a chat template, and reproducible prompts. Fixtures live in conftest.py; test modules import these by name:
`from helpers import make_tiny_hf`."""

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


def speculative_equals_plain(spec, plain, prompt_ids: list[list[int]], max_new_tokens: int) -> tuple[int, int]:
    """Each prompt through `spec` (an Engine that drafts) and `plain` (one that does not): the
    greedy tokens must be the same; returns (drafted, accepted) tokens over all prompts."""
    drafted = accepted = 0
    for ids in prompt_ids:
        out = spec.generate(prompt_ids=ids, max_new_tokens=max_new_tokens)
        assert out.token_ids == plain.generate(prompt_ids=ids, max_new_tokens=max_new_tokens).token_ids
        drafted += out.stats.draft_tokens
        accepted += out.stats.accepted_tokens
    return drafted, accepted


def random_prompts(n: int, length: int = 10, vocab: int = TINY_VOCAB, seed: int = 0) -> list[list[int]]:
    """n reproducible random prompts of token ids in [3, vocab) (0-2 are pad/bos/eos)."""
    return [torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed + s)).tolist()
            for s in range(n)]


def make_char_tokenizer(folder) -> None:
    """Save a character-level tokenizer (ids 0-2 special, 3..96 = ASCII 32..125) with a chat template."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    for c in range(32, 126):
        vocab[chr(c)] = len(vocab)
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    raw.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    tok.save_pretrained(str(folder))


def pooled_chisquare_p(counts: dict, cells, probs, samples: int) -> float:
    """The chi-square p-value of sampled `counts` (cell -> samples) against exact probabilities
    (`probs[i]` of `cells[i]`): cells expected fewer than 5 times are pooled into one, so the
    chi-square approximation holds; the expected counts are scaled to the observed total."""
    from scipy.stats import chisquare

    observed, expected, rest_obs, rest_exp = [], [], 0, 0.0
    for c, pr in zip(cells, probs):
        if pr * samples >= 5:
            observed.append(counts.get(c, 0))
            expected.append(pr * samples)
        else:
            rest_obs += counts.get(c, 0)
            rest_exp += pr * samples
    if rest_exp > 0:
        observed.append(rest_obs)
        expected.append(rest_exp)
    scale = sum(observed) / sum(expected)
    return chisquare(observed, [e * scale for e in expected]).pvalue


def drive(scheduler, handles) -> list:
    """Run a `BatchScheduler`'s loop by hand on this thread (never `start()`ed) until every handle
    has finished; their completions. Which rows share a step then follows from the order of the
    `submit` calls alone: everything submitted before an iteration is admitted by it (up to
    `max_batch`), never whatever a scheduler thread happened to have picked up by then."""
    while not all(h.finished for h in handles):
        scheduler.run_once(wait=False)
    return [h.result() for h in handles]


def byte_alphabet() -> dict[int, str]:
    # GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest move above 255.
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out
