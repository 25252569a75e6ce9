"""A chat model's tokenizer read without transformers (tokenizer.json by the Rust library, the chat
template by `chat_render`) gives the same text and ids as transformers' AutoTokenizer of the same
folder, and a folder it cannot vouch for still goes through transformers."""

import json
import shutil
import unicodedata
from pathlib import Path

import pytest
from jinja2 import TemplateError

from specdec.chat_render import render_chat
from specdec.errors import InvalidRequestError
from specdec.tokenizer import Tokenizer
from tool_models import make_tool_model

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file — «UTF-8»", "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "description": "where <it> is"}},
        "required": ["path"]}}},
    {"type": "function", "function": {"name": "now", "description": "The time", "parameters": {"type": "object"}}}]
CALL = {"type": "function", "function": {"name": "read_file", "arguments": {"path": "src/é.py"}}}

# (messages, tools, add_generation_prompt, continue_final_message)
CASES = [
    ([{"role": "user", "content": "hi"}], None, True, False),
    ([{"role": "user", "content": "hi"}], None, False, False),
    ([{"role": "system", "content": "Be brief. 日本語で。"}, {"role": "user", "content": "e\u0301 café 🙂\n\n  x"},
      {"role": "assistant", "content": "はい"}, {"role": "user", "content": "<|im_start|> & <b>"}], None, True, False),
    ([{"role": "user", "content": "read it"}], TOOLS, True, False),
    ([{"role": "system", "content": "You code."}, {"role": "user", "content": "read it"}], TOOLS, True, False),
    ([{"role": "user", "content": "read src/é.py"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
      {"role": "tool", "content": "print('hé')"}, {"role": "tool", "content": "second"}], TOOLS, True, False),
    ([{"role": "user", "content": "read"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
      {"role": "tool", "name": "read_file", "content": "{\"ok\": 1}"}], TOOLS, False, False),
    ([{"role": "user", "content": "say a poem"}, {"role": "assistant", "content": "Roses are"}], None, False, True),
    ([{"role": "user", "content": "say"}, {"role": "assistant", "content": "Sure, "}], None, False, True),
    ([{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}]}],
     None, True, False),
    ([{"role": "user", "content": "go"}, {"role": "assistant", "content": [{"type": "text", "text": "Step"}]}],
     None, False, True),
]


def _both(folder: Path) -> tuple[Tokenizer, Tokenizer]:
    plain, hf = Tokenizer.from_folder(folder), Tokenizer.from_folder(folder, via_transformers=True)
    assert plain._rust is not None and plain._tok is None and hf._tok is not None
    assert json.loads(plain.backend_json()) == json.loads(hf.backend_json())
    assert plain._special_tokens == hf._tok.special_tokens_map
    assert plain.chat_template == hf.chat_template
    return plain, hf


def _outcome(call):
    """What `call` returns, or the kind of error it raises and the start of its message where the
    message is the template's or ours (not where transformers words it)."""
    try:
        return call()
    except (InvalidRequestError, TemplateError) as exc:
        return type(exc).__name__, str(exc).split(":")[0]
    except (ValueError, TypeError) as exc:
        return (type(exc).__name__,)


def _assert_same_chats(plain: Tokenizer, hf: Tokenizer, cases=CASES) -> int:
    """Each case rendered and encoded alike by both routes (or failing alike, as Qwen2.5's template
    does on content given as a list of parts); returns how many rendered."""
    rendered = 0
    for messages, tools, gen, cont in cases:
        text = _outcome(lambda: render_chat(plain.chat_template, messages, special_tokens=plain._special_tokens,
                                            tools=tools, add_generation_prompt=gen, continue_final_message=cont))
        assert text == _outcome(lambda: hf._tok.apply_chat_template(
            messages, tokenize=False, tools=tools, add_generation_prompt=gen, continue_final_message=cont)), messages
        ids = _outcome(lambda: plain.encode_chat(messages, gen, cont, tools))
        assert ids == _outcome(lambda: hf.encode_chat(messages, gen, cont, tools))
        if isinstance(text, str):
            rendered += 1
            decoded = plain.decode(ids, skip_special_tokens=False)
            assert decoded == hf.decode(ids, skip_special_tokens=False)
            assert decoded in (text, unicodedata.normalize("NFC", text))  # Qwen2Tokenizer's normalizer
    return rendered


def _tokenizer_only(folder: Path, to: Path) -> Path:
    """The tokenizer files of a model folder, without config.json (so no model type picks the class)."""
    to.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(folder / name, to / name)
    return to


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: make_tool_model(root, family)[0] for family in ("qwen", "llama")}


@pytest.mark.parametrize("family", ["qwen", "llama"])
def test_real_templates_render_and_encode_as_transformers(families, tmp_path, family):
    """Qwen2.5's and Llama 3.1's templates: plain turns, tools, tool calls and results, with and
    without the generation prompt, continuing the final message, text parts, non-ASCII text."""
    folder = families[family] if family == "llama" else _tokenizer_only(families[family], tmp_path / "tok")
    assert _assert_same_chats(*_both(folder)) >= len(CASES) - 2


def test_template_errors_are_the_same(families):
    """Llama 3.1's raise_exception (two tool calls at once; tools but no user message) is a 400 on
    both routes, as is a final message the template does not end with."""
    plain, hf = _both(families["llama"])
    two_calls = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [CALL, CALL]}]
    cases = [(two_calls, TOOLS, False), ([{"role": "system", "content": "s"}], TOOLS, False),
             ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "zq", "tool_calls": [CALL]}],
              TOOLS, True),
             ([], None, False)]
    for messages, tools, cont in cases:
        ours = _outcome(lambda: plain.encode_chat(messages, not cont, cont, tools))
        assert ours == _outcome(lambda: hf.encode_chat(messages, not cont, cont, tools))
        assert ours[0] == "InvalidRequestError" if messages else ours == ("ValueError",), ours


def test_role_checking_and_named_templates(families, tmp_path):
    """A template that checks the roles' order raises alike; a config with named templates renders
    "tool_use" when tools are given and "default" otherwise, on both routes."""
    folder = _tokenizer_only(families["qwen"], tmp_path / "tok")
    (folder / "chat_template.jinja").unlink()
    strict = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
              "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
              "{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['content'] is string %}{{ m['content'] | trim }}"
              "{% else %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}"
              "{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    tool_use = ("{{ bos_token }}{% for t in tools %}{{ t | tojson(indent=2) }}{% endfor %}{% for m in messages %}"
                "{% set ns = namespace(n=loop.index) %}{{ m['content'] ~ ns.n }}{% endfor %}{{ strftime_now('%Y')[:0] }}")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(bos_token="<|endoftext|>", chat_template=[{"name": "default", "template": strict},
                                                            {"name": "tool_use", "template": tool_use}])
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    plain, hf = _both(folder)
    assert isinstance(plain.chat_template, dict)
    assert _assert_same_chats(plain, hf) == len(CASES) - 1  # the one beginning with a system turn fails the check
    out_of_order = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    ours = _outcome(lambda: plain.encode_chat(out_of_order))
    assert ours == _outcome(lambda: hf.encode_chat(out_of_order))
    assert ours == ("InvalidRequestError", "the chat template rejects these messages")


def test_qwen2_tokenizer_class_gets_its_nfc_normalizer(families, tmp_path):
    """A qwen2 folder's tokenizer.json with Qwen2Tokenizer's own pre-tokenizer but no normalizer
    (as a GGUF's converted one): transformers adds NFC, and so does the Rust route."""
    from tokenizers import Regex, decoders, pre_tokenizers

    from specdec.tokenizer import _QWEN2_SPLIT

    folder = tmp_path / "qwen2"
    shutil.copytree(families["qwen"], folder)
    data = json.loads((folder / "tokenizer.json").read_text())
    split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT), "isolated")
    data["pre_tokenizer"] = json.loads(pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]).__getstate__())
    data["decoder"] = json.loads(decoders.ByteLevel().__getstate__())
    data["model"].update(continuing_subword_prefix="", end_of_word_suffix="")
    (folder / "tokenizer.json").write_text(json.dumps(data))
    plain, hf = _both(folder)
    assert plain.encode_plain("e\u0301") == hf.encode_plain("e\u0301") == plain.encode_plain("\u00e9")
    _assert_same_chats(plain, hf)


def test_folders_it_cannot_vouch_for_go_through_transformers(families, tmp_path):
    """A key transformers acts on, a special token tokenizer.json lacks, a tokenizer.json unlike
    Qwen2Tokenizer's for a qwen2 model, or a model type it does not know: transformers."""
    base = _tokenizer_only(families["qwen"], tmp_path / "base")
    config = json.loads((base / "tokenizer_config.json").read_text())
    variants = [({"add_bos_token": True}, None), ({"bos_token": "<s>"}, None), ({"errors": "strict"}, None),
                ({"additional_special_tokens": ["<tool_call>"]}, None), ({"add_prefix_space": True}, None),
                ({}, {"model_type": "qwen2"}), ({}, {"model_type": "phi3"})]
    for i, (extra, model_config) in enumerate(variants):
        folder = tmp_path / str(i)
        shutil.copytree(base, folder)
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, **extra}))
        if model_config:
            (folder / "config.json").write_text(json.dumps(model_config))
        tok = Tokenizer.from_folder(folder)
        assert tok._tok is not None and tok._rust is None, (extra, model_config)
        assert tok.encode_chat([{"role": "user", "content": "hi"}])
    assert Tokenizer.from_folder(base)._rust is not None


REAL = sorted((Path.home() / ".cache/specdec/gguf").glob("qwen2.5-coder-*-instruct-*/tokenizer.json"))


@pytest.mark.skipif(not REAL, reason="no Qwen2.5-Coder folder in ~/.cache/specdec (CI has none)")
def test_real_qwen_coder_folder():
    plain, hf = _both(REAL[0].parent)
    _assert_same_chats(plain, hf)
