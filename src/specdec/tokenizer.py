"""Text <-> token ids, and an incremental detokenizer that never splits a UTF-8 character."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .errors import InvalidRequestError, ModelLoadError

# tokenizer_config.json keys that change nothing about encoding or decoding once tokenizer.json is
# read (names, lengths, padding, where the folder came from), and keys that change nothing while
# empty or false. A folder whose config sets anything else (add_bos_token, legacy,
# add_prefix_space, a chat template, special tokens of its own, ...) goes through transformers,
# which is what acts on those keys.
_INERT_CONFIG_KEYS = frozenset({
    "backend", "bos_token", "eos_token", "pad_token", "unk_token", "mask_token", "sep_token", "cls_token",
    "is_local", "local_files_only", "model_max_length", "model_input_names", "padding_side", "truncation_side",
    "tokenizer_class",
})
_INERT_WHEN_EMPTY = frozenset({
    "added_tokens_decoder", "additional_special_tokens", "extra_special_tokens", "clean_up_tokenization_spaces",
    "split_special_tokens",
})
# Tokenizer classes whose transformers tokenizer is the Rust one of tokenizer.json as saved (checked
# for Gemma's by tests/test_models.py, text by text against transformers).
_PLAIN_CLASSES = frozenset({"GemmaTokenizer", "GemmaTokenizerFast", "PreTrainedTokenizerFast", "TokenizersBackend"})


def _rust_only(folder: Path) -> bool:
    """Whether the folder's tokenizer.json alone defines its tokenizer (see `Tokenizer`)."""
    if not (folder / "tokenizer.json").is_file():
        return False
    if (folder / "chat_template.jinja").exists() or (folder / "chat_template.json").exists():
        return False
    config_file = folder / "tokenizer_config.json"
    if not config_file.is_file():
        return True
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (isinstance(config, dict)
            and all(key in _INERT_CONFIG_KEYS or (key in _INERT_WHEN_EMPTY and not value) for key, value in config.items())
            and config.get("tokenizer_class", "PreTrainedTokenizerFast") in _PLAIN_CLASSES)


# The files that define a folder's encoding and decoding (everything a tokenizer folder holds but its
# chat template, which only renders messages into text).
_ENCODING_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt")


def encoding_digest(folder: Path) -> str:
    """A hash of the bytes of `folder`'s encoding files (`_ENCODING_FILES`, by name and content):
    two folders with the same digest encode and decode every text and id alike."""
    digest = hashlib.sha256()
    for name in _ENCODING_FILES:
        file = folder / name
        if file.is_file():
            digest.update(f"{name}\0{file.stat().st_size}\0".encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()


def lacks_chat_template(folder: Path) -> bool:
    """Whether the folder certainly has no chat template, known without reading its tokenizer: it
    has no tokenizer files, or tokenizer.json alone defines its tokenizer (`_rust_only`), which
    leaves no place for a template."""
    if not ((folder / "tokenizer.json").exists() or (folder / "tokenizer.model").exists()):
        return True
    return _rust_only(folder)

def check_text(text: str, what: str = "the prompt", param: str | None = "prompt") -> str:
    """`text` if it is valid Unicode text; an InvalidRequestError naming the first lone surrogate
    otherwise.

    A Python str can hold lone surrogates (U+D800..U+DFFF) that no UTF-8 text contains: JSON's
    `"\\ud800"` escapes decode to them, and so do invalid UTF-8 bytes in a command-line argument
    (Python's surrogateescape maps byte 0xNN to U+DCNN). The tokenizers cannot encode them.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = ord(text[exc.start])
        if 0xDC80 <= char <= 0xDCFF:  # surrogateescape: an undecodable byte from the OS
            raise InvalidRequestError(f"{what} is not valid UTF-8 (byte 0x{char - 0xDC00:02x} at character "
                                      f"{exc.start})", param) from None
        raise InvalidRequestError(f"{what} contains a lone surrogate (U+{char:04X} at character {exc.start}), "
                                  "which is not valid Unicode text", param) from None
    return text


class Tokenizer:
    """A model folder's tokenizer.

    Two routes to the same ids. Where tokenizer.json says everything (no chat template, and
    tokenizer_config.json sets nothing that transformers acts on: `_rust_only`), the Rust
    `tokenizers` library reads it directly, as transformers itself would end up doing, in less time
    and memory than through transformers, which also imports many modules of its own first (it
    matters for a large vocabulary such as Gemma's 262k tokens). Any other folder
    (chat templates, slow-only tokenizers, options) goes through transformers' AutoTokenizer.
    """

    def __init__(self, hf_tokenizer=None, rust_tokenizer=None):
        if (hf_tokenizer is None) == (rust_tokenizer is None):
            raise ValueError("give exactly one of hf_tokenizer or rust_tokenizer")
        self._tok = hf_tokenizer
        self._rust = rust_tokenizer
        self.folder: Path | None = None  # the folder it was read from (`from_folder`), if any

    @classmethod
    def from_folder(cls, folder: Path) -> "Tokenizer | None":
        if not ((folder / "tokenizer.json").exists() or (folder / "tokenizer.model").exists()):
            return None  # a weights-only folder: prompts are token ids
        try:
            tokenizer = cls._read(folder)
            tokenizer.folder = folder
            return tokenizer
        except Exception as exc:  # the tokenizers library raises plain Exceptions for a bad file
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelLoadError(f"{folder}: cannot read its tokenizer ({reason})") from exc

    @classmethod
    def for_encoding(cls, folder: Path, known: "Tokenizer | None") -> "Tokenizer | None":
        """A tokenizer that encodes and decodes as `folder`'s does: `known` itself where the folder
        it was read from (`known.folder`) has the same bytes in its encoding files
        (`encoding_digest`), else `folder`'s own. For a draft model, which never renders a chat
        (the target's template does), and whose tokenizer is most often the target's: reading a
        tokenizer through transformers is a large part of a warm load."""
        known_folder = getattr(known, "folder", None)
        if (known_folder is not None and (folder / "tokenizer.json").is_file()
                and encoding_digest(folder) == encoding_digest(known_folder)):
            return known
        return cls.from_folder(folder)

    @classmethod
    def _read(cls, folder: Path) -> "Tokenizer":
        if _rust_only(folder):
            from tokenizers import Tokenizer as RustTokenizer

            return cls(rust_tokenizer=RustTokenizer.from_file(str(folder / "tokenizer.json")))
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
        return cls(hf_tokenizer=tok)

    def backend_json(self) -> str:
        """The Rust tokenizer as tokenizer.json text (what a grammar engine builds its view from)."""
        if self._rust is not None:
            return self._rust.to_str()
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is None:
            raise InvalidRequestError("structured output needs a fast (tokenizer.json) tokenizer", "response_format")
        return backend.to_str()

    def encode(self, text: str) -> list[int]:
        if not text:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        check_text(text)
        if self._rust is not None:
            return self._rust.encode(text).ids  # with the special tokens tokenizer.json adds (BOS)
        return list(self._tok(text).input_ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._rust is not None:
            return self._rust.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode_plain(self, text: str) -> list[int]:
        """Ids of `text` alone: no BOS or other special tokens added."""
        if self._rust is not None:
            return self._rust.encode(text, add_special_tokens=False).ids
        return list(self._tok(text, add_special_tokens=False).input_ids)

    def encode_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """`encode_plain(text)` and the character where each token's text begins in `text`.

        From the tokenizer's own offsets where they partition the text (a token that only finishes
        a character begins where that character does); otherwise found by decoding the tokens one
        at a time (`Detokenizer`), which gives the same starts in more time."""
        if self._rust is not None:
            enc = self._rust.encode(text, add_special_tokens=False)
            ids, offsets = enc.ids, enc.offsets
        else:
            try:
                enc = self._tok(text, add_special_tokens=False, return_offsets_mapping=True)
                ids, offsets = list(enc.input_ids), [tuple(o) for o in enc.offset_mapping]
            except NotImplementedError:  # a slow tokenizer has no offsets
                ids, offsets = self.encode_plain(text), []
        if _partition(offsets, len(text)):
            return list(ids), [a for a, _ in offsets]
        detok, starts = Detokenizer(self), []
        for token in ids:
            starts.append(len(detok.text))
            detok.push(token)
        return list(ids), starts

    @property
    def chat_template(self) -> str | None:
        return None if self._tok is None else getattr(self._tok, "chat_template", None) or None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: list[dict] | None = None) -> list[int]:
        """Token ids of `messages` rendered by the model's chat template.

        By default ready for the reply (`add_generation_prompt`); with `continue_final_message` the
        rendering stops right after the last message's text, so the model continues that message
        (the two exclude each other, as in transformers). `tools`: function tools in OpenAI's
        request shape, for the template to show the model (`tools.ToolSet.template_tools`).
        """
        if not self.chat_template:
            raise InvalidRequestError("this model's tokenizer has no chat template: use /v1/completions",
                                      param="messages")
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError("continue_final_message needs add_generation_prompt = false",
                                      param="continue_final_message")
        for i, message in enumerate(messages):
            for key, value in message.items():
                if isinstance(value, str):
                    check_text(value, f"messages[{i}].{key}", f"messages[{i}].{key}")
        from jinja2 import TemplateError

        try:
            text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message, tools=tools or None)
        except TemplateError as exc:  # the template's own raise_exception(...): roles out of order, ...
            raise InvalidRequestError(f"the chat template rejects these messages: {exc}", "messages") from None
        except ValueError as exc:  # continue_final_message when the template drops the final text
            if not continue_final_message:
                raise
            raise InvalidRequestError(f"cannot continue the final message: {exc}", "continue_final_message") from None
        # The template writes any BOS itself: do not add special tokens a second time.
        ids = list(self._tok(text, add_special_tokens=False).input_ids)
        if not ids:
            raise InvalidRequestError("the chat prompt is empty", param="messages")
        return ids


def _partition(offsets: list[tuple[int, int]], length: int) -> bool:
    """Whether token offsets (start, end) cover [0, length) in order with no gap or overlap (pieces
    of one character repeat its offsets)."""
    if not offsets or offsets[0][0] != 0 or offsets[-1][1] != length:
        return False
    return all(b[0] == a[1] or b == a for a, b in zip(offsets, offsets[1:]))


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
