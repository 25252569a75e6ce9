"""A draft model's tokenizer is the target's object where their encoding files are the same bytes
(`Tokenizer.for_encoding`), and that shared object encodes and decodes as a separate read does."""

import json
import shutil

from specdec.tokenizer import Tokenizer, encoding_digest
from tool_models import make_tool_model

TEXTS = ["hi", "def f(x):\n    return x  # é 漢字 🙂", "<|im_start|>user\nhello<|im_end|>", "  spaces\t\ttabs\n\n"]


def test_a_draft_with_the_same_encoding_files_shares_the_targets_tokenizer(tmp_path):
    target_folder, _ = make_tool_model(tmp_path / "target", "qwen", seed=0)
    draft_folder, _ = make_tool_model(tmp_path / "draft", "qwen", seed=1)
    # Another chat template (as the Qwen2.5-Coder 0.5B GGUF's differs from the 1.5B's by one brace
    # pair): it renders no draft's text, so it does not stop the sharing.
    template = draft_folder / "chat_template.jinja"
    if template.exists():
        template.write_text(template.read_text() + "\n")
    target = Tokenizer.from_folder(target_folder)
    shared = Tokenizer.for_encoding(draft_folder, target)
    assert shared is target
    own = Tokenizer.from_folder(draft_folder)  # what the draft read before
    assert own is not target
    for text in TEXTS:
        assert shared.encode(text) == own.encode(text)
        assert shared.encode_plain(text) == own.encode_plain(text)
        ids = own.encode_plain(text)
        assert shared.decode(ids) == own.decode(ids)
        assert shared.decode(ids, skip_special_tokens=False) == own.decode(ids, skip_special_tokens=False)
    assert [shared.decode([i]) for i in range(300)] == [own.decode([i]) for i in range(300)]


def test_different_encoding_files_read_the_drafts_own(tmp_path):
    target_folder, _ = make_tool_model(tmp_path / "target", "qwen", seed=0)
    draft_folder = tmp_path / "draft"
    shutil.copytree(target_folder, draft_folder)
    data = json.loads((draft_folder / "tokenizer.json").read_text())
    data["added_tokens"][-1]["content"] = "<thinking>"  # one added token spelled otherwise
    (draft_folder / "tokenizer.json").write_text(json.dumps(data))
    assert encoding_digest(draft_folder) != encoding_digest(target_folder)
    target = Tokenizer.from_folder(target_folder)
    other = Tokenizer.for_encoding(draft_folder, target)
    assert other is not target
    assert other.encode_plain("<thinking>") != target.encode_plain("<thinking>")
    # A tokenizer not read from a folder is never taken for one.
    assert Tokenizer.for_encoding(target_folder, Tokenizer(rust_tokenizer=other._tok.backend_tokenizer)) is not target
