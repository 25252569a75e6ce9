"""`train-draft --kind model`: the cut-down draft model is an HF folder that the loader, the
draft-model drafter and transformers all read; greedy identity with it; training lowers the
distillation loss and raises acceptance; resume = uninterrupted; the CLI end to end."""

import json

import pytest
import torch

from specdec import Engine
from specdec.cli import main
from specdec.distill import DistillData
from specdec.drafters import DraftModelDrafter
from specdec.errors import InvalidRequestError, ModelLoadError
from specdec.models import loader
from specdec.models.transformer import RopeSpec
from specdec.train import CHECKPOINT_FILE, DATA_FILE, TrainConfig, pick_layers, \
    train_model

from helpers import TINY_VOCAB as V, make_tiny_hf, random_prompts as prompts, speculative_equals_plain
from test_eagle import peaky_target  # 2 layers, vocabulary 48, structured greedy text

pytestmark = pytest.mark.usefixtures("one_thread")

QUIET = dict(log=lambda *a: None)
TINY = dict(kind="model", num_seeds=24, gen_tokens=40, gen_batch=8, draft_vocab=40, batch_tokens=200, lr=3e-3,
            warmup=5, checkpoint_every=5)


def test_pick_layers():
    assert pick_layers(18, 4, "spread") == [0, 6, 11, 17]
    assert pick_layers(18, 4, "first") == [0, 1, 2, 3]
    assert pick_layers(4, 1, "spread") == [3] and pick_layers(4, 4, "spread") == [0, 1, 2, 3]
    with pytest.raises(InvalidRequestError, match="between 1 and"):
        pick_layers(4, 5, "first")


@pytest.mark.parametrize("family", ["gemma3", "llama", "mistral", "qwen2", "qwen3"])
def test_config_to_hf_round_trip(tmp_path, family):
    folder, _ = make_tiny_hf(tmp_path, family)
    cfg, _ = loader.load_hf_folder(folder)
    assert loader.config_from_hf(loader.config_to_hf(cfg)) == cfg


def test_config_to_hf_refuses_what_it_cannot_write(tiny_models):
    import dataclasses

    cfg = tiny_models["llama"]["target"].config
    mixed = dataclasses.replace(cfg, layer_rope=(RopeSpec(1e4),) * 3 + (RopeSpec(5e5),))
    with pytest.raises(ModelLoadError, match="rope"):
        loader.config_to_hf(mixed)


@pytest.mark.parametrize("family,layers,pick", [("gemma3", 3, "spread"), ("llama", 2, "first")])
def test_untrained_draft_is_the_cut_target_and_drafts(tiny_models, tmp_path, family, layers, pick):
    """--steps 0: no data, the truncated target as an HF folder; loads through the loader (as the
    target's family), through transformers (same logits: HF field and tensor names are right), as
    a draft model with greedy identity, and through Engine.load(drafter=DIR)."""
    m = tiny_models[family]
    target = m["target"]
    out = train_model(target, None, tmp_path / "d", TrainConfig(steps=0, layers=layers, pick=pick, **TINY),
                      **QUIET)
    assert not (out / DATA_FILE).exists()  # nothing generated for a baseline
    picked = json.loads((out / "training.json").read_text())["training"]["layers"]
    assert picked == pick_layers(4, layers, pick)
    draft, _ = loader.load(out, torch.float32, "cpu")
    cfg, tcfg = draft.config, target.config
    assert cfg.family == tcfg.family and cfg.num_layers == layers
    assert cfg.layer_window == tuple(tcfg.layer_window[i] for i in picked)  # gemma3: sliding, global, sliding
    assert cfg.layer_rope == tuple(tcfg.layer_rope[i] for i in picked)
    t_state, d_state = target.state_dict(), draft.state_dict()
    for name in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
        assert torch.equal(d_state[name], t_state[name])
    for new, old in enumerate(picked):
        for key, value in d_state.items():
            if key.startswith(f"layers.{new}."):
                assert torch.equal(value, t_state[f"layers.{old}." + key.split(".", 2)[2]])

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.tensor(prompts(1, 20))  # longer than gemma3's window of 8
    with torch.no_grad():
        ref = hf(ids).logits.log_softmax(-1)
    mine, _ = draft(ids, torch.arange(20)[None], draft.new_cache(1, 20))
    assert (mine.log_softmax(-1) - ref).abs().max() < 1e-3

    # A fixed k: the default cost rule prices a draft token by its measured time, and a cut of a
    # tiny target costs about what the target does, so it would (rightly) stop drafting.
    engine = Engine(target, None, drafter=DraftModelDrafter(draft, V), num_speculative_tokens=3, draft_length="fixed")
    loaded = Engine.load(str(m["folder"]), drafter=str(out), dtype="float32", num_speculative_tokens=3,
                         draft_length="fixed")
    assert isinstance(loaded.drafter, DraftModelDrafter)
    for ids in prompts(2):
        plain = Engine(target, None).generate(prompt_ids=ids, max_new_tokens=24).token_ids
        a = engine.generate(prompt_ids=ids, max_new_tokens=24)
        assert a.token_ids == plain and a.stats.draft_tokens > 0
        assert loaded.generate(prompt_ids=ids, max_new_tokens=24).token_ids == plain


def distill_kl(draft, target, data: DistillData) -> float:
    """Mean KL(p || q) over the data's positions, on the full vocabulary: p is the target's
    next-token distribution (its head on the stored features), q the draft's."""
    total = n = 0.0
    for tokens, feats in zip(data.tokens, data.features):
        logq, _ = draft(tokens[None], torch.arange(len(tokens))[None], draft.new_cache(1, len(tokens)))
        logq = logq[0].log_softmax(-1)
        logp = target.head(feats).log_softmax(-1)
        total += float((logp.exp() * (logp - logq)).sum())
        n += len(tokens)
    return total / n


def acceptance(target, draft, vocab) -> float:
    engine = Engine(target, None, drafter=DraftModelDrafter(draft, vocab), num_speculative_tokens=4,
                    draft_length="fixed")
    drafted, accepted = speculative_equals_plain(engine, Engine(target, None), prompts(4, 6, vocab), 40)
    return accepted / drafted


def test_training_lowers_loss_and_raises_acceptance(tmp_path):
    target = peaky_target()
    untrained = train_model(target, None, tmp_path / "u", TrainConfig(steps=0, layers=1, **TINY), **QUIET)
    trained = train_model(target, None, tmp_path / "t", TrainConfig(steps=30, layers=1, **TINY), **QUIET)
    data = DistillData(**torch.load(trained / DATA_FILE))
    before, _ = loader.load(untrained, torch.float32, "cpu")
    after, _ = loader.load(trained, torch.float32, "cpu")
    assert distill_kl(after, target, data) < 0.5 * distill_kl(before, target, data)
    # The frozen parts stayed the target's.
    assert torch.equal(after.embed_tokens.weight, target.embed_tokens.weight)
    assert torch.equal(after.norm.weight, target.norm.weight)
    a0, a1 = acceptance(target, before, 48), acceptance(target, after, 48)
    assert a1 > a0 + 0.15, (a0, a1)


def test_resume_equals_uninterrupted(tmp_path):
    """Through the loop the head shares (`fit`): a run stopped at step 5 and resumed writes the
    same weights as one run of 10 steps."""
    target = peaky_target(seed=1)
    cfg = dict(TINY, layers=1, steps=10)
    train_model(target, None, tmp_path / "a", TrainConfig(**cfg), **QUIET)
    train_model(target, None, tmp_path / "b", TrainConfig(**cfg, stop_at=5), **QUIET)
    assert torch.load(tmp_path / "b" / CHECKPOINT_FILE)["step"] == 5
    train_model(target, None, tmp_path / "b", TrainConfig(**cfg), resume=True, **QUIET)
    from safetensors.torch import load_file

    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=0, rtol=0)


def tiny_tokenizer(folder):
    """A word-level tokenizer over make_tiny_hf's 97 ids, saved into `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, V)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                            pad_token="<pad>").save_pretrained(str(folder))


def test_text_data_is_the_target_reading_the_local_texts(tiny_models, tmp_path, monkeypatch):
    """`text_data`: paragraphs packed into windows that start with BOS, cut at `positions` in all,
    and every stored feature is the target's own hidden state on exactly those ids."""
    import random

    import specdec.distill
    from specdec.tokenizer import Tokenizer

    target, folder = tiny_models["llama"]["target"], tmp_path / "tok"
    folder.mkdir()
    tiny_tokenizer(folder)
    tok = Tokenizer.from_folder(folder)
    paras = [" ".join(f"w{(i * 5 + j) % 90 + 3}" for j in range(10 + i)) for i in range(30)]
    monkeypatch.setattr(specdec.distill, "local_texts", lambda: ([], paras))
    data = specdec.distill.text_data(target, tok, 100, 32, random.Random(0))
    assert sum(len(t) for t in data.tokens) == 100
    assert all(2 <= len(t) <= 32 and int(t[0]) == 1 for t in data.tokens)
    assert all(len(g) == 0 for g in data.greedy)
    for ids, feats in zip(data.tokens, data.features):
        with torch.inference_mode():
            _, hidden = target(ids[None], torch.arange(len(ids))[None], target.new_cache(1, len(ids)))
        torch.testing.assert_close(feats, hidden[0], atol=0, rtol=0)
    # Every word of the texts that fit is there, in some window, in the shuffled order's packing.
    everything = specdec.distill.text_data(target, tok, 10 ** 6, 10 ** 4, random.Random(0))
    words, separator = sum(10 + i for i in range(30)), [i for i in tok.encode("\n\n") if i != 1]
    assert len(everything.tokens) == 1 and len(everything.tokens[0]) == 1 + words + 29 * len(separator)


def test_text_positions_need_a_tokenizer(tiny_models, tmp_path, capsys):
    """A weights-only target has no text to read: one clear line and exit 2, before any generation."""
    folder = str(tiny_models["llama"]["folder"])
    code = main(["train-draft", "--target", folder, "--out", str(tmp_path / "o"), "--num-seeds", "4",
                 "--gen-tokens", "4", "--text-positions", "50", "--steps", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "--text-positions needs a target with a tokenizer" in err
    assert not (tmp_path / "o" / DATA_FILE).exists()


def test_cli_train_draft_model_then_generate(tiny_models, tmp_path, monkeypatch, capsys):
    """`specdec train-draft --kind model` on a target with a tokenizer, resumed, then
    `specdec generate --drafter OUT --compare`: the tokenizer files travel with the draft."""
    import shutil

    import specdec.distill

    folder = tmp_path / "target"
    shutil.copytree(tiny_models["llama"]["folder"], folder)
    tiny_tokenizer(folder)
    # Seeds from a few words instead of scanning the standard library (seconds of parsing).
    monkeypatch.setattr(specdec.distill, "local_texts",
                        lambda: ([], [" ".join(f"w{(i * 7 + j) % 90 + 3}" for j in range(40)) for i in range(20)]))
    out = tmp_path / "draft"
    base = ["train-draft", "--kind", "model", "--target", str(folder), "--out", str(out), "--layers", "2",
            "--num-seeds", "6", "--gen-tokens", "10", "--gen-batch", "3", "--batch-tokens", "40",
            "--draft-vocab", "50", "--checkpoint-every", "1", "--text-positions", "70", "--text-window", "30"]
    assert main(base + ["--steps", "2"]) == 0
    data = DistillData(**torch.load(out / DATA_FILE))
    read = [len(t) for t, g in zip(data.tokens, data.greedy) if len(g) == 0]
    assert sum(read) == 70 and len(data.tokens) == 6 + len(read)  # 6 generated sequences, then the text
    assert main(base + ["--steps", "3", "--resume"]) == 0
    assert "resuming at step 2" in capsys.readouterr().out
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    assert json.loads((out / "training.json").read_text())["training"]["steps_done"] == 3
    assert main(["generate", "--model", str(folder), "--drafter", str(out), "--prompt", "w5 w9 w11 w40",
                 "--max-tokens", "12", "-k", "3", "--dtype", "float32", "--compare", "--json",
                 "--draft-length", "fixed"]) == 0  # (a tiny draft costs about a target step: the cost rule would not draft)
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["identical"] and result["speculative"]["stats"]["draft_tokens"] > 0
