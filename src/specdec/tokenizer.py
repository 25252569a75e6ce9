"""Text <-> token ids, and an incremental detokenizer that never splits a UTF-8 character."""

from __future__ import annotations

from pathlib import Path

from .errors import InvalidRequestError


class Tokenizer:
    """Thin wrapper over an HF fast tokenizer saved in a model folder."""

    def __init__(self, hf_tokenizer):
        self._tok = hf_tokenizer

    @classmethod
    def from_folder(cls, folder: Path) -> "Tokenizer | None":
        if not ((folder / "tokenizer.json").exists() or (folder / "tokenizer.model").exists()):
            return None  # a weights-only folder: prompts are token ids
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        tok = AutoTokenizer.from_pretrained(str(folder))
        # transformers 5 keeps the vocabulary and merge list it built the Rust tokenizer from as
        # Python objects, which nothing reads afterwards: the Rust tokenizer has its own copy and
        # does all encoding and decoding. For Gemma's 262k tokens they hold ~145 MB; let them go.
        for leftover in ("_vocab", "_merges"):
            if isinstance(getattr(tok, leftover, None), (dict, list)):
                setattr(tok, leftover, None)
        return cls(tok)

    def encode(self, text: str) -> list[int]:
        if not text:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return list(self._tok(text).input_ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return getattr(self._tok, "chat_template", None) or None

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of `messages` rendered by the model's chat template, ready for the reply."""
        if not self.chat_template:
            raise InvalidRequestError("this model's tokenizer has no chat template: use /v1/completions",
                                      param="messages")
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The template writes any BOS itself: do not add special tokens a second time.
        ids = list(self._tok(text, add_special_tokens=False).input_ids)
        if not ids:
            raise InvalidRequestError("the chat prompt is empty", param="messages")
        return ids


class Detokenizer:
    """Turns a growing list of token ids into text deltas for streaming.

    Decoding token by token breaks multi-byte characters and the tokenizers' space handling, so we
    decode a short window: the text of tokens[prefix:] minus the text of tokens[prefix:read] is
    the new part, held back while it ends in an incomplete character (U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0
        self.text = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        if self.tokenizer is None:
            return ""
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        after = self.tokenizer.decode(self.ids[self.prefix :])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        delta = after[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return delta
