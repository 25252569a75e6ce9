"""Tiny random-weight models that carry the real Qwen2.5 and Llama 3.1 chat templates and their
special tokens (tests/templates), for the tool-calling tests: a byte-level tokenizer of all 256
bytes (no merges) plus each family's added tokens, special or not as the family has them."""

from pathlib import Path

import torch

from helpers import byte_alphabet

TEMPLATES = Path(__file__).parent / "templates"

# (content, special): the family's added tokens as its tokenizer.json declares them.
QWEN_ADDED = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<tool_call>", False),
              ("</tool_call>", False), ("<think>", False), ("</think>", False)]
LLAMA_ADDED = [("<|begin_of_text|>", True), ("<|end_of_text|>", True), ("<|start_header_id|>", True),
               ("<|end_header_id|>", True), ("<|eom_id|>", True), ("<|eot_id|>", True), ("<|python_tag|>", True)]


def make_tool_model(tmp_path, family: str, seed: int = 0):
    """A tiny Qwen2 (family "qwen") or Llama ("llama") folder with that family's template and
    tokens; returns (folder, {token text: id})."""
    import transformers as T
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    alphabet = byte_alphabet()
    vocab = {alphabet[b]: b for b in range(256)}
    raw = RawTokenizer(models.BPE(vocab, []))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    added = QWEN_ADDED if family == "qwen" else LLAMA_ADDED
    raw.add_tokens([AddedToken(text, special=special, normalized=False) for text, special in added])
    ids = {text: raw.token_to_id(text) for text, _ in added}
    if family == "qwen":
        template = (TEMPLATES / "qwen2.5-instruct.jinja").read_text()
        tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>")
        eos = ids["<|im_end|>"]
    else:
        template = (TEMPLATES / "llama3.1-instruct.jinja").read_text()
        tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
        eos = [ids["<|eot_id|>"], ids["<|eom_id|>"]]
    tok.chat_template = template
    common = dict(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=eos)
    torch.manual_seed(seed)
    if family == "qwen":
        model = T.Qwen2ForCausalLM(T.Qwen2Config(**common, tie_word_embeddings=True)).eval()
    else:
        model = T.LlamaForCausalLM(T.LlamaConfig(**common, rope_theta=500000.0)).eval()
    folder = tmp_path / f"tools-{family}"
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder, ids
