"""`specdec train-draft`: train a drafter for a target by self-distillation, either an EAGLE-style
draft head (`--kind eagle`, the default) or a stand-alone draft model (`--kind model`).

Recipe (all on the target's own outputs; no data set, no download, nothing from Spec-Bench; steps
1-3 are `distill.py`):

1. Seeds. Short texts built from what this machine already holds: docstrings of the Python
   standard library and the prose (README / METADATA) of installed packages, used as plain text to
   continue and inside `Question: ...\\nAnswer:` prompts (explain, summarise, write a function, small
   arithmetic word problems, a few general topics). A target without a tokenizer gets random ids.
2. Data. The target greedily continues every seed (batched, `--gen-tokens` each). Kept per
   sequence: the token ids and the target's final-normed hidden state at every position (the
   feature the head reads and predicts). The target's next-token distribution at a position is
   its output head applied to that feature, so it is recomputed from the feature when needed.
   With `--text-positions N`, the target also reads N positions of the same local texts
   (teacher-forced windows of `--text-window` tokens, `text_data`): features only, no decoding,
   so more varied contexts per second than generation gives.
3. Sub-vocabulary. `d2t` = the `--draft-vocab` ids the target emits most often in the data
   (counted over every position's greedy choice), EOS always included.
4. Training (eagle). Teacher forcing over each sequence, unrolled `--depth` steps deep the way the
   head drafts (EAGLE-3's "training-time test"): at depth d the head reads its own depth d - 1
   predictions and attends to true-feature entries before them plus its own chain, exactly the
   attention pattern of draft step d. Loss per depth: smooth-L1 between predicted and true
   features (scaled by the features' std) + `--token-weight` x cross-entropy against the target's
   own distribution restricted to the sub-vocabulary.
   Training (model). The draft is the target cut to `--layers` layers (`pick_layers`); its
   embeddings, final norm and output head are the target's, frozen, and only its layers train.
   Teacher forcing over each sequence: the draft's final-normed hidden state at every position
   should be the target's feature there. Loss: the same smooth-L1 on features + `--token-weight` x
   cross-entropy against the target's distribution over the sub-vocabulary (`model_sequence_loss`).
   Both kinds run one loop (`fit`): AdamW, warm-up then cosine decay, batches of whole sequences
   that are a function of the step (so `--resume` continues exactly), checkpoints, a progress bar.
5. Output (eagle): DIR/eagle.json + DIR/eagle.safetensors (load with `--drafter eagle:DIR`).
   Output (model): an HF folder, DIR/config.json (the target's family), DIR/model.safetensors (HF
   tensor names, float32), the target's tokenizer files and DIR/training.json (load with
   `--drafter DIR`, or with transformers). `--steps 0` writes the untrained cut model without
   making data (a baseline). Both: DIR/data.pt (the distillation data, reused by `--resume`) and
   DIR/checkpoint.pt (trainable weights, optimiser, step).

The default head shipped in `specdec/drafters/eagle_default` was made by
`specdec train-draft --target default --out DIR` with the defaults below (see its eagle.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from .distill import DistillData, build_seeds, choose_d2t, generate_data, text_data
from .errors import InvalidRequestError
from .models.kv_cache import KVCache
from .models.transformer import soft_cap

DATA_FILE = "data.pt"
CHECKPOINT_FILE = "checkpoint.pt"
TRAINING_FILE = "training.json"  # --kind model: how the draft was made


@dataclass
class TrainConfig:
    kind: str = "eagle"
    steps: int = 600
    num_seeds: int = 384
    gen_tokens: int = 112
    gen_batch: int = 64
    max_seed_tokens: int = 160
    text_positions: int = 0  # teacher-forced local text (`text_data`), on top of the generated data
    text_window: int = 256
    draft_vocab: int = 8192
    intermediate_size: int = 0  # the head's MLP width; 0 = half the target's
    depth: int = 2  # training-time-test unroll depth
    layers: int = 4  # --kind model: the draft's layers
    pick: str = "first"  # --kind model: which target layers it starts from (see `pick_layers`)
    batch_tokens: int = 1024  # positions per optimiser step (whole sequences, packed greedily)
    lr: float = 1e-3
    warmup: int = 10
    token_weight: float = 0.5
    seed: int = 0
    checkpoint_every: int = 50
    threads: int = 1
    stop_at: int = 0  # stop (with a checkpoint) after this step, to split a run; 0 = run to `steps`


# -- the training loss ---------------------------------------------------------------------------


def unrolled_visibility(t: int, depth: int, device=None) -> Tensor:
    """[T, depth * T] bool: which slots a depth-`depth` query at entry a sees.

    Slots are [depth-1 entries | depth-2 entries | ...], T each. A depth-d chain starting from the
    true-feature entry a - d + 1 is what draft step d sees: true entries 0..a-d+1, then the chain's
    entries at depth d' (2 <= d' <= d) at index a - (d - d').
    """
    a = torch.arange(t, device=device)[:, None]
    b = torch.arange(t, device=device)[None, :]
    parts = [b <= a - depth + 1]
    for d2 in range(2, depth + 1):
        parts.append(b == a - (depth - d2))
    return torch.cat(parts, dim=1)


class _AutogradCache(KVCache):
    """A KV cache whose writes are out of place, so keys written at depth d do not overwrite
    tensors that autograd saved at depth d - 1 (the inference cache writes in place)."""

    def write(self, layer: int, key: Tensor, value: Tensor, slots: Tensor) -> None:
        index = slots[:, None, :, None].expand_as(key)
        self.keys[layer] = self.keys[layer].scatter(2, index, key)
        self.values[layer] = self.values[layer].scatter(2, index, value)


def sequence_loss(model, tokens: Tensor, feats: Tensor, depth: int, feat_scale: float, token_weight: float):
    """Loss of one sequence: tokens [L], feats [L, h] (true features). Returns (loss, stats dict).

    Entry a (0-based, a = 0..L-2) consumes (f_a, x_{a+1}) and predicts f_{a+1}, whose logits
    predict the target's choice after position a + 1.
    """
    t = len(tokens) - 1
    head = model.head
    attn = head.block.self_attn
    cache = _AutogradCache(1, 1, attn.kv_heads, attn.head_dim, depth * t, feats.dtype, feats.device)
    x_in = tokens[1:][None]  # [1, T]
    positions = torch.arange(1, t + 1, device=feats.device)[None]  # [1, T]
    true_next = feats[1:]  # [T, h]
    with torch.no_grad():
        p_target = model.logits(true_next).softmax(-1)  # [T, Vd] target's distribution, renormalised
    inp = feats[:-1][None]  # [1, T, h]
    total, stats = 0.0, {}
    for d in range(1, depth + 1):
        visible = unrolled_visibility(t, d, feats.device)[None, None]  # [1, 1, T, d*T]
        x = head(inp, model.embed(x_in), positions, cache, visible=visible)
        pred = model.target.norm(x)[0]  # [T, h]
        valid = slice(d - 1, t)  # entries with a full chain behind them
        logp = F.log_softmax(model.logits(pred[valid]), -1)
        ce = -(p_target[valid] * logp).sum(-1).mean()
        feat = F.smooth_l1_loss(pred[valid] / feat_scale, true_next[valid] / feat_scale)
        total = total + feat + token_weight * ce
        with torch.no_grad():
            agree = (logp.argmax(-1) == p_target[valid].argmax(-1)).float().mean()
        stats[f"acc{d}"] = float(agree)
        stats[f"ce{d}"] = float(ce.detach())
        # The next depth reads this depth's predictions, shifted: entry a gets the prediction of a - 1.
        inp = torch.cat([pred[:1] * 0, pred[:-1]])[None]
    return total / depth, stats


# -- the draft model (--kind model) ----------------------------------------------------------------


def pick_layers(num_layers: int, n: int, how: str) -> list[int]:
    """Which of the target's `num_layers` layers initialise an `n`-layer draft.

    "first" (the default): layers 0..n-1. "spread": evenly spaced, the first and the last always
    in (Gemma 3 270M, 4 of 18: 0, 6, 11, 17). Cut and untrained, neither agrees with the target
    (the final norm and head expect the residual stream after all 18 layers: 0.6% and 0.0% of the
    target's greedy choices), so what decides is how fast each learns. Quick check on Gemma 3
    270M, 4 layers, the same 40 steps of 512 tokens (lr 1e-3), agreement with the target's greedy
    choices on held-out text (6 prompts, 64 target tokens each): "first" 0.27, "spread" 0.16.
    Why, as we read it: in "first" every layer reads the stream its predecessor in the target
    wrote, so only the step from layer n-1 to the final norm has to be learned; "spread" has a
    foreign junction at every layer. (Gemma 3's first layers all attend through a 512-token
    sliding window, which a draft can afford: it only needs the recent context.)
    """
    if not 1 <= n <= num_layers:
        raise InvalidRequestError(f"--layers must be between 1 and the target's {num_layers} layers", "layers")
    if how == "first":
        return list(range(n))
    if how != "spread":
        raise InvalidRequestError(f"unknown layer pick {how!r}; choose spread or first", "pick")
    if n == 1:
        return [num_layers - 1]
    return [round(i * (num_layers - 1) / (n - 1)) for i in range(n)]


def truncated_model(target, layers: list[int]):
    """A float32 copy of `target` with only `layers` (in order): embeddings, final norm and output
    head copied and frozen, the layers copied and trainable. Gemma 3 layers keep their own type
    (sliding or global attention, and that type's rope)."""
    from .models import loader

    tcfg = target.config
    cfg = dataclasses.replace(tcfg, num_layers=len(layers), layer_rope=tuple(tcfg.layer_rope[i] for i in layers),
                              layer_window=tuple(tcfg.layer_window[i] for i in layers))
    source = target.state_dict()
    state = {k: v for k, v in source.items() if not k.startswith("layers.")}
    for new, old in enumerate(layers):
        prefix = f"layers.{old}."
        state.update({f"layers.{new}.{k[len(prefix):]}": v for k, v in source.items() if k.startswith(prefix)})
    # Copies, not views: training must not write into the target's layers.
    state = {k: v.detach().float().clone() for k, v in state.items()}
    draft = loader.build_model(cfg, state, torch.float32, target.embed_tokens.weight.device)
    draft.requires_grad_(False)
    draft.layers.requires_grad_(True)
    return draft


def _forward_with_grad(model, tokens: Tensor, positions: Tensor, cache: KVCache, last_n: int | None = None):
    """`Transformer.forward` with autograd on. The method is wrapped in `torch.inference_mode`
    (inference is all the runtime does); its undecorated body (`__wrapped__`, which the decorator's
    functools.wraps keeps) is the same code, so the draft trains on exactly the function that will
    draft with it, not on a second copy of the forward pass kept here."""
    forward = type(model).forward
    return getattr(forward, "__wrapped__", forward)(model, tokens, positions, cache, last_n=last_n)


def model_sequence_loss(draft, head_rows: Tensor, softcap: float | None, tokens: Tensor, feats: Tensor,
                        feat_scale: float, token_weight: float):
    """Loss of the draft model on one sequence: tokens [L], feats [L, h] (the target's features).

    Entry i (i = 0..L-2) reads tokens 0..i; its final-normed hidden state should be the target's
    feature f_i, whose logits give the target's distribution of token i + 1. Loss: smooth-L1
    between the two features (scaled by the features' std: a dense signal, and equal features
    mean equal logits) + `token_weight` x cross-entropy against the target's distribution over the
    sub-vocabulary `head_rows` [Vd, h] (its output rows: the full 262k-row head would make a step
    of a 4-layer Gemma 3 270M draft several times slower, and the frozen head maps a matched feature to
    matched logits everywhere).
    """
    t = len(tokens) - 1
    cfg = draft.config
    device = head_rows.device
    cache = _AutogradCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, t, torch.float32, device)
    _, hidden = _forward_with_grad(draft, tokens[None, :t].to(device), torch.arange(t, device=device)[None], cache,
                                   last_n=0)
    pred, true = hidden[0], feats[:t].to(device)  # [T, h] each

    def sub_logits(x: Tensor) -> Tensor:  # [T, h] -> [T, Vd]
        return soft_cap(x @ head_rows.T, softcap)

    with torch.no_grad():
        p_target = sub_logits(true).softmax(-1)
    logp = F.log_softmax(sub_logits(pred), -1)
    ce = -(p_target * logp).sum(-1).mean()
    feat = F.smooth_l1_loss(pred / feat_scale, true / feat_scale)
    with torch.no_grad():
        agree = (logp.argmax(-1) == p_target.argmax(-1)).float().mean()
    return feat + token_weight * ce, {"acc": float(agree), "ce": float(ce.detach()), "feat": float(feat.detach())}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")


def save_draft_model(draft, out: Path, tokenizer_folder: Path | None, info: dict) -> None:
    """Write `draft` as an HF folder: config.json (the target's family, `loader.config_to_hf`),
    model.safetensors (float32, HF tensor names) and the target's tokenizer files, so the loader,
    `--drafter DIR` and transformers all read it as a model of the target's family."""
    import shutil

    from safetensors.torch import save_file

    from .models import loader

    raw = loader.config_to_hf(draft.config)
    tensors = {}
    for name, value in draft.state_dict().items():
        if name == "lm_head.weight":
            if draft.config.tie_embeddings:
                continue
            tensors[name] = value
        else:
            tensors[f"model.{name}"] = value
    save_file({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()},
              str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**raw, "torch_dtype": "float32"}, indent=1) + "\n")
    if tokenizer_folder is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_folder / name).is_file():
                shutil.copyfile(tokenizer_folder / name, out / name)
    (out / TRAINING_FILE).write_text(json.dumps(info, indent=1) + "\n")


def train_model(target, tokenizer, out: Path, cfg: TrainConfig, resume: bool = False, target_name: str = "",
                log=print, tokenizer_folder: Path | None = None) -> Path:
    """Make a `cfg.layers`-layer draft model of the target's architecture and train its layers
    on the distillation data; write it as an HF folder in OUT (see `save_draft_model`).

    `cfg.steps == 0` writes the untrained truncated model without making any data (a baseline).
    target: a loaded `Transformer`; tokenizer: its `Tokenizer` or None; tokenizer_folder: where
    its tokenizer files are (copied into OUT), or None.
    """
    check_config(cfg)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    target.requires_grad_(False)
    started = time.perf_counter()
    ckpt = _checkpoint(out, resume)
    layers = ckpt["layers"] if ckpt is not None else pick_layers(target.config.num_layers, cfg.layers, cfg.pick)
    data = distillation_data(target, tokenizer, out, cfg, resume, log) if cfg.steps > 0 else None
    data_s = time.perf_counter() - started
    if next(target.parameters()).dtype != torch.float32:
        target = target.float()
    draft = truncated_model(target, layers)
    info = {"target": target_name, "layers": layers, "config": dataclasses.asdict(cfg), "steps_done": 0}
    if data is not None:
        tcfg = target.config
        d2t = ckpt["d2t"] if ckpt is not None else choose_d2t(data, tcfg.vocab_size, min(cfg.draft_vocab,
                                                              tcfg.vocab_size), tuple(tcfg.eos_token_ids), tokenizer)
        head_rows = target.lm_head.weight.detach()[d2t.to(target.lm_head.weight.device)]  # [Vd, h]
        feat_scale = float(torch.cat(data.features).std())

        def loss_of(i: int):
            return model_sequence_loss(draft, head_rows, tcfg.final_logit_softcap, data.tokens[i], data.features[i],
                                       feat_scale, cfg.token_weight)

        result = fit(draft.layers, "weights", loss_of, [len(t) for t in data.tokens], cfg, out / CHECKPOINT_FILE,
                     ckpt, {"d2t": d2t, "layers": layers}, log)
        info.update(steps_done=result.steps_done, sequences=len(data.tokens),
                    positions=int(sum(len(t) for t in data.tokens)), data_s=round(data_s),
                    train_s_this_run=round(result.seconds),
                    final_stats={k: round(v, 4) for k, v in result.stats.items()})
    save_draft_model(draft.eval(), out, tokenizer_folder, {"training": info})
    log(f"wrote the {len(layers)}-layer draft model (target layers {layers}) to {out}; "
        f"steps {info['steps_done']}; {info.get('final_stats', {})}")
    return out


# -- the training loop (both kinds) ------------------------------------------------------------------


@dataclass
class FitResult:
    steps_done: int
    stats: dict[str, float]  # running means (0.9 decay) of the loss's stats
    seconds: float  # training time of this run


def fit(module: torch.nn.Module, key: str, loss_of, lengths: list[int], cfg: TrainConfig, ckpt_path: Path,
        ckpt: dict | None, extra: dict, log=print) -> FitResult:
    """The training loop of the head and of the draft model.

    module: what trains (all its parameters that require grad), checkpointed under `key`;
    loss_of(i) -> (loss, stats): sequence i's loss, a mean over its len - 1 entries;
    lengths: the sequences' lengths (whole sequences are packed into batches of `cfg.batch_tokens`
    positions; a step's loss is the entry-weighted mean over its batch);
    ckpt: a checkpoint to continue from, or None; extra: what else each checkpoint holds.
    AdamW, linear warm-up then cosine decay to 5% of `cfg.lr`, gradients clipped at norm 1, a
    checkpoint every `cfg.checkpoint_every` steps and at the end (or at `cfg.stop_at`).
    """
    if key in extra or key in ("optimizer", "step"):
        raise ValueError(f"checkpoint key {key!r} is taken")
    module.train()
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    step = 0
    if ckpt is not None:
        module.load_state_dict(ckpt[key])
        opt.load_state_dict(ckpt["optimizer"])
        step = ckpt["step"]
        log(f"resuming at step {step}")

    def lr_at(s: int) -> float:
        if s < cfg.warmup:
            return cfg.lr * (s + 1) / cfg.warmup
        progress = (s - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    def batches(epoch: int):
        order = list(range(len(lengths)))
        random.Random(cfg.seed * 1000 + epoch).shuffle(order)
        batch, size = [], 0
        for i in order:
            if lengths[i] < 2:
                continue
            batch.append(i)
            size += lengths[i]
            if size >= cfg.batch_tokens:
                yield batch
                batch, size = [], 0
        if batch:
            yield batch

    # Position in the data stream is a function of the step, so a resumed run sees what an
    # uninterrupted one would have.
    plan = []
    epoch = 0
    while len(plan) < cfg.steps:
        plan += list(batches(epoch))
        epoch += 1
        if not plan:
            break
    bar = _bar(cfg.steps, "training", initial=step)
    train_start = time.perf_counter()
    recent: dict[str, float] = {}
    last = min(cfg.steps, cfg.stop_at) if cfg.stop_at > 0 else cfg.steps
    while step < last:
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.zero_grad()
        weight_total = sum(lengths[i] - 1 for i in plan[step])
        for i in plan[step]:
            loss, stats = loss_of(i)
            (loss * (lengths[i] - 1) / weight_total).backward()
            for name, v in stats.items():
                recent[name] = 0.9 * recent.get(name, v) + 0.1 * v
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix({k: f"{v:.2f}" for k, v in sorted(recent.items())})
        if step % cfg.checkpoint_every == 0 or step == last:
            torch.save({key: module.state_dict(), "optimizer": opt.state_dict(), "step": step, **extra}, ckpt_path)
    bar.close()
    module.eval()
    return FitResult(step, recent, time.perf_counter() - train_start)


def _checkpoint(out: Path, resume: bool) -> dict | None:
    path = out / CHECKPOINT_FILE
    return torch.load(path) if resume and path.is_file() else None


def encode_seeds(tcfg, tokenizer, cfg: TrainConfig, rng: random.Random) -> list[list[int]]:
    """`cfg.num_seeds` seeds as the target reads them (`build_seeds`, encoded, BOS first, cut at
    `cfg.max_seed_tokens`; random ids for a target without a tokenizer), shortest first: similar
    lengths share a generation batch, so a batch's cache is smaller."""
    if tokenizer is not None:
        bos = [tcfg.bos_token_id] if tcfg.bos_token_id is not None else []
        encoded = [tokenizer.encode(s) for s in build_seeds(cfg.num_seeds, rng)]
        # The engine feeds `encode`'s ids as they are; add BOS only where encode does not.
        seed_ids = [(e if e[:1] == bos else bos + e)[: cfg.max_seed_tokens] for e in encoded]
    else:  # a weights-only model: random ids, one to max_seed_tokens long
        seed_ids = [[rng.randrange(tcfg.vocab_size) for _ in range(rng.randint(4, min(16, cfg.max_seed_tokens)))]
                    for _ in range(cfg.num_seeds)]
    return sorted((s for s in seed_ids if s), key=len)


def distillation_data(target, tokenizer, out: Path, cfg: TrainConfig, resume: bool, log=print) -> DistillData:
    """OUT/data.pt when resuming and it is there, else the target's continuations of the seeds
    (saved to OUT/data.pt)."""
    tcfg = target.config
    started = time.perf_counter()
    data_path = out / DATA_FILE
    if resume and data_path.is_file():
        data = DistillData(**torch.load(data_path))
        log(f"reusing {len(data.tokens)} sequences from {data_path}")
        return data
    if tokenizer is None and cfg.text_positions > 0:
        raise InvalidRequestError("--text-positions needs a target with a tokenizer: it reads text", "text_positions")
    rng = random.Random(cfg.seed)
    seed_ids = encode_seeds(tcfg, tokenizer, cfg, rng)
    bar = _bar(len(seed_ids), "generating")
    data = generate_data(target, seed_ids, cfg.gen_tokens, cfg.gen_batch,
                         progress=lambda done, total: bar.update(done - bar.n))
    bar.close()
    if cfg.text_positions > 0:
        bar = _bar(cfg.text_positions, "reading text")
        text = text_data(target, tokenizer, cfg.text_positions, cfg.text_window, rng,
                         progress=lambda done, total: bar.update(done - bar.n))
        bar.close()
        data = DistillData(data.tokens + text.tokens, data.features + text.features, data.greedy + text.greedy)
    # Outside inference mode a clone is an ordinary tensor, which autograd may save.
    data = DistillData(*([x.to("cpu").clone() for x in xs] for xs in (data.tokens, data.features, data.greedy)))
    torch.save(dataclasses.asdict(data), data_path)
    n = sum(len(t) for t in data.tokens)
    log(f"data: {len(data.tokens)} sequences, {n} positions, {time.perf_counter() - started:.0f} s")
    return data


# -- the command ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    parser.add_argument("--target", default="default", help="HF folder, .gguf, or default")
    parser.add_argument("--out", required=True, help="output folder (the draft, data, checkpoint)")
    parser.add_argument("--kind", default="eagle", choices=["eagle", "model"],
                        help="eagle: an EAGLE-style draft head (use with --drafter eagle:OUT); model: a "
                             "stand-alone draft model, the target cut to --layers layers and distilled "
                             "(an HF folder: use with --drafter OUT)")
    parser.add_argument("--steps", type=int, default=d.steps, help="optimiser steps (model: 0 = the untrained "
                        "truncated model, no data made)")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt and OUT/data.pt")
    parser.add_argument("--num-seeds", type=int, default=d.num_seeds)
    parser.add_argument("--gen-tokens", type=int, default=d.gen_tokens, help="greedy tokens per seed")
    parser.add_argument("--gen-batch", type=int, default=d.gen_batch)
    parser.add_argument("--text-positions", type=int, default=d.text_positions,
                        help="also teacher-force the target over this many positions of local text (docs and "
                             "docstrings this machine holds; features only, no decoding)")
    parser.add_argument("--text-window", type=int, default=d.text_window, help="tokens per text window")
    parser.add_argument("--draft-vocab", type=int, default=d.draft_vocab,
                        help="sub-vocabulary size (eagle: the head's d2t; model: the ids its token loss covers)")
    parser.add_argument("--intermediate-size", type=int, default=d.intermediate_size,
                        help="eagle: the head's MLP width (0 = half the target's)")
    parser.add_argument("--depth", type=int, default=d.depth, help="eagle: training-time-test unroll depth")
    parser.add_argument("--layers", type=int, default=d.layers, help="model: the draft's number of layers")
    parser.add_argument("--pick", default=d.pick, choices=["first", "spread"],
                        help="model: which target layers it starts from (first: the first N; spread: evenly "
                             "spaced, first and last included)")
    parser.add_argument("--batch-tokens", type=int, default=d.batch_tokens)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--token-weight", type=float, default=d.token_weight)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    parser.add_argument("--stop-at", type=int, default=d.stop_at,
                        help="stop after this step with a checkpoint (continue with --resume); 0 = off")
    parser.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads")
    parser.add_argument("--dtype", default="float32", help="target dtype while making data (float32 | bfloat16)")
    parser.add_argument("--device", default="cpu")


def run(args) -> int:
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
                         if hasattr(args, f.name)})
    train(args.target, Path(args.out), cfg, resume=args.resume, dtype=args.dtype, device=args.device)
    return 0


def _bar(total: int, desc: str, initial: int = 0):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, initial=initial, file=sys.stderr, dynamic_ncols=True, mininterval=2.0)


def train(target_name: str, out: Path, cfg: TrainConfig, resume: bool = False, dtype: str = "float32",
          device: str = "cpu", log=print) -> Path:
    """Load the target, then `train_head` or `train_model` (by `cfg.kind`)."""
    from .builder import resolve_device, resolve_dtype
    from .models import loader
    from .tokenizer import Tokenizer

    check_config(cfg)
    torch.set_num_threads(cfg.threads)
    device = resolve_device(device)
    target, folder = loader.load(target_name, resolve_dtype(dtype, device), device)
    tokenizer = Tokenizer.from_folder(folder)
    if cfg.kind == "model":
        return train_model(target, tokenizer, out, cfg, resume, target_name, log, tokenizer_folder=folder)
    return train_head(target, tokenizer, out, cfg, resume, target_name, log)


def check_config(cfg: TrainConfig) -> None:
    if cfg.kind not in ("eagle", "model"):
        raise InvalidRequestError(f"unknown --kind {cfg.kind!r}; choose eagle (a draft head) or model", "kind")
    if cfg.steps < 0 or cfg.depth < 1 or cfg.draft_vocab < 2 or cfg.num_seeds < 1 or cfg.gen_tokens < 2:
        raise InvalidRequestError("need steps >= 0, depth >= 1, draft-vocab >= 2, num-seeds >= 1, gen-tokens >= 2")
    if cfg.text_positions < 0 or cfg.text_window < 2:
        raise InvalidRequestError("need --text-positions >= 0 and --text-window >= 2", "text_positions")
    if cfg.kind == "model" and cfg.layers < 1:
        raise InvalidRequestError("need --layers >= 1", "layers")


def train_head(target, tokenizer, out: Path, cfg: TrainConfig, resume: bool = False, target_name: str = "",
               log=print) -> Path:
    """Make (or reuse) the distillation data, train the head, write OUT/eagle.{json,safetensors}.

    target: a loaded `Transformer`; tokenizer: its `Tokenizer`, or None (random seed ids).
    """
    from .drafters.eagle import EagleModel, HeadSpec

    check_config(cfg)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    target.requires_grad_(False)
    tcfg = target.config
    started = time.perf_counter()
    data = distillation_data(target, tokenizer, out, cfg, resume, log)
    data_s = time.perf_counter() - started

    # The head trains in float32 whatever the target's dtype was while making data.
    if next(target.parameters()).dtype != torch.float32:
        target = target.float()
    ckpt = _checkpoint(out, resume)
    if ckpt is not None:
        d2t = ckpt["d2t"]
        spec = HeadSpec(**ckpt["spec"])
    else:
        d2t = choose_d2t(data, tcfg.vocab_size, cfg.draft_vocab, tuple(tcfg.eos_token_ids), tokenizer)
        spec = HeadSpec.for_target(tcfg, len(d2t), cfg.intermediate_size or max(1, tcfg.intermediate_size // 2))
    torch.manual_seed(cfg.seed)
    model = EagleModel(spec, target, d2t)
    all_greedy = torch.cat(data.greedy)
    coverage = float(torch.isin(all_greedy, d2t).float().mean())
    feat_scale = float(torch.cat(data.features).std())

    device = target.embed_tokens.weight.device  # the data is kept on the CPU; a sequence moves when used

    def loss_of(i: int):
        return sequence_loss(model, data.tokens[i].to(device), data.features[i].to(device), cfg.depth, feat_scale,
                             cfg.token_weight)

    result = fit(model.head, "head", loss_of, [len(t) for t in data.tokens], cfg, out / CHECKPOINT_FILE, ckpt,
                 {"d2t": d2t, "spec": dataclasses.asdict(spec)}, log)
    info = {"training": {"target": target_name, "config": dataclasses.asdict(cfg), "steps_done": result.steps_done,
                         "sequences": len(data.tokens), "positions": int(sum(len(t) for t in data.tokens)),
                         "sub_vocab_coverage": round(coverage, 4), "data_s": round(data_s),
                         "train_s_this_run": round(result.seconds),
                         "final_stats": {k: round(v, 4) for k, v in result.stats.items()}}}
    model.save(out, info)
    log(f"wrote {out / 'eagle.safetensors'}: coverage of the target's choices by the sub-vocabulary "
        f"{coverage:.3f}; training {result.seconds:.0f} s; {result.stats}")
    return out
