"""Text <-> token ids, and an incremental detokenizer that never splits a UTF-8 character."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from .chat_render import render_chat
from .errors import InvalidRequestError, ModelLoadError

# tokenizer_config.json keys that change nothing about encoding or decoding once tokenizer.json is
# read (names, lengths, padding, where the folder came from), and keys that change nothing while
# empty or false. A folder whose config sets anything else (add_bos_token, legacy, a class of its
# own, ...) goes through transformers, which is what acts on those keys. The named special tokens
# are inert where tokenizer.json already holds each as a special added token (`_tokens_agree`),
# and the chat template only renders messages into text (`chat_render`).
_INERT_CONFIG_KEYS = frozenset({
    "backend", "is_local", "local_files_only", "model_max_length", "model_input_names", "padding_side",
    "truncation_side", "tokenizer_class", "chat_template",
})
_INERT_WHEN_EMPTY = frozenset({"clean_up_tokenization_spaces", "split_special_tokens", "add_prefix_space"})
# The named special tokens transformers gives a tokenizer (and a chat template as variables), and the
# keys naming added tokens: inert whatever they hold once `_tokens_agree` finds tokenizer.json says
# the same of each token.
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_ADDED_TOKEN_KEYS = frozenset({"added_tokens_decoder", "additional_special_tokens", "extra_special_tokens"})
# Tokenizer classes whose transformers tokenizer is the Rust one of tokenizer.json as saved (checked
# for Gemma's by tests/test_models.py, text by text against transformers).
_PLAIN_CLASSES = frozenset({"GemmaTokenizer", "GemmaTokenizerFast", "PreTrainedTokenizerFast", "TokenizersBackend"})
# transformers 5's Qwen2Tokenizer rebuilds the Rust tokenizer from tokenizer.json's vocabulary and
# merges with components of its own (`_qwen2_agrees`): the same as the file's where they agree, but
# for an NFC normalizer, which a GGUF's converted tokenizer.json lacks. Its named tokens where the
# config names none:
_QWEN2_DEFAULT_TOKENS = {"unk_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
# The tokenizer class transformers 5's AutoTokenizer gives a folder of these model types (config.json)
# that names none; for qwen2 even where the folder names another (the class names saved beside
# qwen2 weights are not trusted there). A model type not listed here: transformers.
_TYPE_CLASSES = {"qwen2": "Qwen2Tokenizer", "qwen2_moe": "Qwen2Tokenizer", "qwen3": "Qwen2Tokenizer",
                 "qwen3_moe": "Qwen2Tokenizer", "gemma3": "GemmaTokenizer", "gemma3_text": "GemmaTokenizer",
                 "llama": "LlamaTokenizer"}
_QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


@dataclass
class _Plain:
    """What a folder read without transformers needs beside tokenizer.json (`_plain_reading`)."""

    config: dict
    tokenizer_class: str
    templates: str | dict[str, str] | None  # one template, or named ones ("default", "tool_use", ...)
    special_tokens: dict[str, str]  # bos_token, eos_token, ...: their text, where set


def _auto_class(folder: Path, config: dict) -> str | None:
    """The tokenizer class AutoTokenizer picks for the folder, where `_TYPE_CLASSES` knows; None
    where it may pick otherwise."""
    try:
        model = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        model = {}
    except (OSError, ValueError):
        return None
    if not isinstance(model, dict) or model.get("_name_or_path") or model.get("model_name"):
        return None  # transformers also goes by a checkpoint's name
    named = config.get("tokenizer_class") or model.get("tokenizer_class")
    model_type = model.get("model_type")
    if not model_type:
        return named or "PreTrainedTokenizerFast"
    if model_type == "qwen2":
        return "Qwen2Tokenizer"
    return (named or _TYPE_CLASSES[model_type]) if model_type in _TYPE_CLASSES else None


def _plain_reading(folder: Path) -> _Plain | None:
    """What tokenizer_config.json and the template files say, where nothing in them needs
    transformers (tokenizer.json's own contents are checked once read: `_tokens_agree`); None where
    transformers must read the folder."""
    if not (folder / "tokenizer.json").is_file():
        return None
    if any((folder / name).exists() for name in ("chat_template.json", "additional_chat_templates",
                                                 "special_tokens_map.json", "added_tokens.json")):
        return None
    config_file = folder / "tokenizer_config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    tokenizer_class = _auto_class(folder, config)
    qwen2 = tokenizer_class == "Qwen2Tokenizer"
    if tokenizer_class not in _PLAIN_CLASSES and not qwen2:
        return None
    for key, value in config.items():
        inert = (key in _INERT_CONFIG_KEYS or key in _NAMED_TOKENS or key in _ADDED_TOKEN_KEYS
                 or (key in _INERT_WHEN_EMPTY and not value)
                 or (qwen2 and (key == "add_prefix_space" or (key == "errors" and value == "replace"))))
        if not inert:
            return None
    special = {**(_QWEN2_DEFAULT_TOKENS if qwen2 else {}), **{k: config[k] for k in _NAMED_TOKENS if k in config}}
    if not all(value is None or isinstance(value, str) for value in special.values()):
        return None  # an AddedToken written out with flags of its own
    templates = config.get("chat_template")
    if isinstance(templates, list):
        try:
            templates = {entry["name"]: entry["template"] for entry in templates}
        except (TypeError, KeyError):
            return None
    if (folder / "chat_template.jinja").is_file():  # transformers: the file wins over the config's
        templates = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if not (templates is None or isinstance(templates, str)
            or all(isinstance(t, str) for t in templates.values())):
        return None
    return _Plain(config, tokenizer_class, templates or None,
                  {key: value for key, value in special.items() if value is not None})


def _tokens_agree(rust, plain: _Plain) -> bool:
    """Whether transformers would leave the Rust tokenizer's added tokens as tokenizer.json has them:
    each named and extra special token is a special added token there, and the config's
    added_tokens_decoder says of each token what tokenizer.json says."""
    added = rust.get_added_tokens_decoder()
    special = {token.content for token in added.values() if token.special}
    extra = [*(plain.config.get("additional_special_tokens") or []), *(plain.config.get("extra_special_tokens") or [])]
    if not all(isinstance(plain.config.get(key) or [], list) for key in ("additional_special_tokens",
                                                                         "extra_special_tokens")):
        return False  # extra tokens by name (a dict): attributes of their own
    if not all(isinstance(t, str) and t in special for t in [*plain.special_tokens.values(), *extra]):
        return False
    flags = ("content", "special", "lstrip", "rstrip", "normalized", "single_word")
    for key, entry in (plain.config.get("added_tokens_decoder") or {}).items():
        token = added.get(int(key)) if str(key).isdigit() else None
        if not isinstance(entry, dict) or token is None or any(
                entry.get(flag, getattr(token, flag)) != getattr(token, flag) for flag in flags):
            return False
    return True


def _qwen2_agrees(rust, plain: _Plain) -> bool:
    """Whether tokenizer.json's BPE model, pre-tokenizer and decoder are the ones transformers'
    Qwen2Tokenizer builds, and its normalizer none or NFC (the class's)."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    prefix = bool(plain.config.get("add_prefix_space") or False)
    split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False)
    expected_pre = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=False)])
    model = rust.model
    return (type(model).__name__ == "BPE" and model.dropout is None and model.unk_token is None
            and model.continuing_subword_prefix == "" and model.end_of_word_suffix == ""
            and not model.fuse_unk and not model.byte_fallback and not model.ignore_merges
            and rust.pre_tokenizer is not None and rust.decoder is not None and rust.post_processor is not None
            and rust.pre_tokenizer.__getstate__() == expected_pre.__getstate__()
            and rust.decoder.__getstate__() == decoders.ByteLevel().__getstate__()
            and (rust.normalizer is None or rust.normalizer.__getstate__() == normalizers.NFC().__getstate__()))


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
    has no tokenizer files, or its config and files are all `_plain_reading` knows and name no
    template."""
    if not ((folder / "tokenizer.json").exists() or (folder / "tokenizer.model").exists()):
        return True
    plain = _plain_reading(folder)
    return plain is not None and plain.templates is None

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

    Two routes to the same ids and chat text. Where tokenizer.json says everything about encoding
    (tokenizer_config.json sets nothing that transformers acts on but the names of special tokens
    tokenizer.json already holds, and a chat template: `_plain_reading`, `_tokens_agree`), the
    Rust `tokenizers` library reads it directly, as transformers itself would end up doing, and
    `chat_render` renders the template as transformers would: in a fraction of the time, memory
    and imports that transformers takes (a large part of starting a chat model). Any other
    folder (slow-only tokenizers, options, classes of their own) goes through transformers'
    AutoTokenizer; so does every folder with `via_transformers=True`.
    """

    def __init__(self, hf_tokenizer=None, rust_tokenizer=None, chat_templates: str | dict | None = None,
                 special_tokens: dict[str, str] | None = None):
        if (hf_tokenizer is None) == (rust_tokenizer is None):
            raise ValueError("give exactly one of hf_tokenizer or rust_tokenizer")
        self._tok = hf_tokenizer
        self._rust = rust_tokenizer
        self._templates = chat_templates  # the Rust route's (transformers keeps its own)
        self._special_tokens = dict(special_tokens or {})  # named special tokens, for the template
        self.folder: Path | None = None  # the folder it was read from (`from_folder`), if any

    @classmethod
    def from_folder(cls, folder: Path, via_transformers: bool = False) -> "Tokenizer | None":
        if not ((folder / "tokenizer.json").exists() or (folder / "tokenizer.model").exists()):
            return None  # a weights-only folder: prompts are token ids
        try:
            tokenizer = cls._read(folder, via_transformers)
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
    def _read(cls, folder: Path, via_transformers: bool = False) -> "Tokenizer":
        plain = None if via_transformers else _plain_reading(folder)
        if plain is not None:
            from tokenizers import Tokenizer as RustTokenizer
            from tokenizers import normalizers

            rust = RustTokenizer.from_file(str(folder / "tokenizer.json"))
            qwen2 = plain.tokenizer_class == "Qwen2Tokenizer"
            if _tokens_agree(rust, plain) and (not qwen2 or _qwen2_agrees(rust, plain)):
                if qwen2:
                    rust.normalizer = normalizers.NFC()
                return cls(rust_tokenizer=rust, chat_templates=plain.templates, special_tokens=plain.special_tokens)
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

    def _encode_rust(self, text: str, special: bool):
        # encode_batch, not encode: it lets go of the GIL while it works, so a server tokenising a
        # long prompt in a worker thread keeps its event loop answering (encode holds the GIL).
        return self._rust.encode_batch([text], add_special_tokens=special)[0]

    def encode(self, text: str) -> list[int]:
        if not text:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        check_text(text)
        if self._rust is not None:
            return self._encode_rust(text, True).ids  # with the special tokens tokenizer.json adds (BOS)
        return list(self._tok(text).input_ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._rust is not None:
            return self._rust.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode_plain(self, text: str) -> list[int]:
        """Ids of `text` alone: no BOS or other special tokens added."""
        if self._rust is not None:
            return self._encode_rust(text, False).ids
        return list(self._tok(text, add_special_tokens=False).input_ids)

    def encode_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """`encode_plain(text)` and the character where each token's text begins in `text`.

        From the tokenizer's own offsets where they partition the text (a token that only finishes
        a character begins where that character does); otherwise found by decoding the tokens one
        at a time (`Detokenizer`), which gives the same starts in more time."""
        if self._rust is not None:
            enc = self._encode_rust(text, False)
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
    def chat_template(self) -> str | dict[str, str] | None:
        """The chat template; named templates ("default", "tool_use", ...) as a dict where there are several."""
        if self._tok is None:
            return self._templates or None
        return getattr(self._tok, "chat_template", None) or None

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
            if self._rust is not None:
                text = render_chat(self._templates, messages, special_tokens=self._special_tokens, tools=tools or None,
                                   add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message)
            else:
                text = self._tok.apply_chat_template(messages, tokenize=False, continue_final_message=continue_final_message,
                                                     add_generation_prompt=add_generation_prompt, tools=tools or None)
        except TemplateError as exc:  # the template's own raise_exception(...): roles out of order, ...
            raise InvalidRequestError(f"the chat template rejects these messages: {exc}", "messages") from None
        except ValueError as exc:  # continue_final_message when the template drops the final text
            if not continue_final_message:
                raise
            raise InvalidRequestError(f"cannot continue the final message: {exc}", "continue_final_message") from None
        # The template writes any BOS itself: do not add special tokens a second time.
        ids = self.encode_plain(text)
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
