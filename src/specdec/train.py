"""`specdec train-draft`: train an EAGLE-style draft head for a target by self-distillation.

Recipe (all on the target's own outputs; no data set, no download, nothing from Spec-Bench):

1. Seeds. Short texts built from what this machine already holds: docstrings of the Python
   standard library and the prose (README / METADATA) of installed packages, used as plain text to
   continue and inside `Question: ...\\nAnswer:` prompts (explain, summarise, write a function, small
   arithmetic word problems, a few general topics). A target without a tokenizer gets random ids.
2. Data. The target greedily continues every seed (batched, `--gen-tokens` each). Kept per
   sequence: the token ids and the target's final-normed hidden state at every position (the
   feature the head reads and predicts). The target's next-token distribution at a position is
   its output head applied to that feature, so it is recomputed from the feature when needed.
3. Sub-vocabulary. `d2t` = the `--draft-vocab` ids the target emits most often in the data
   (counted over every position's greedy choice), EOS always included.
4. Training. Teacher forcing over each sequence, unrolled `--depth` steps deep the way the head
   drafts (EAGLE-3's "training-time test"): at depth d the head reads its own depth d - 1
   predictions and attends to true-feature entries before them plus its own chain, exactly the
   attention pattern of draft step d. Loss per depth: smooth-L1 between predicted and true
   features (scaled by the features' std) + `--token-weight` x cross-entropy against the target's
   own distribution restricted to the sub-vocabulary. AdamW, warm-up then cosine decay.
5. Output: DIR/eagle.json + DIR/eagle.safetensors (load with `--drafter eagle:DIR`); DIR/data.pt
   (the distillation data, reused by `--resume`) and DIR/checkpoint.pt (head, optimiser, step).

The default head shipped in `specdec/drafters/eagle_default` was made by
`specdec train-draft --target default --out DIR` with the defaults below (see its eagle.json).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import InvalidRequestError
from .models.kv_cache import KVCache

DATA_FILE = "data.pt"
CHECKPOINT_FILE = "checkpoint.pt"


@dataclass
class TrainConfig:
    kind: str = "eagle"
    steps: int = 600
    num_seeds: int = 384
    gen_tokens: int = 112
    gen_batch: int = 64
    max_seed_tokens: int = 160
    draft_vocab: int = 8192
    intermediate_size: int = 0  # the head's MLP width; 0 = half the target's
    depth: int = 2  # training-time-test unroll depth
    batch_tokens: int = 1024  # positions per optimiser step (whole sequences, packed greedily)
    lr: float = 1e-3
    warmup: int = 10
    token_weight: float = 0.5
    seed: int = 0
    checkpoint_every: int = 50
    threads: int = 1
    stop_at: int = 0  # stop (with a checkpoint) after this step, to split a run; 0 = run to `steps`


# -- seeds ---------------------------------------------------------------------------------------

TOPICS = ["the ocean", "volcanoes", "baking bread", "friendship", "the moon", "a rainy day", "bicycles",
          "electric cars", "honey bees", "the printing press", "learning a language", "chess", "coffee",
          "mountains", "a lighthouse", "winter", "recycling", "libraries", "the internet", "trains",
          "gardening", "a lost key", "robots", "music", "the desert", "birds", "old maps", "a city at night",
          "teamwork", "sleep", "running", "clouds", "ancient Rome", "photosynthesis", "magnets", "rivers"]
NAMES = ["Ana", "Ben", "Chloe", "Dev", "Elif", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Luca"]
ITEMS = ["apples", "books", "marbles", "stickers", "pencils", "cookies", "stamps", "coins"]


def local_texts(limit_files: int = 4000) -> tuple[list[tuple[str, str]], list[str]]:
    """(function name, docstring) pairs from the standard library and prose paragraphs from
    installed packages' docs, in a deterministic order."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    funcs: list[tuple[str, str]] = []
    paras: list[str] = []
    files = sorted(p for p in stdlib.rglob("*.py") if "test" not in p.parts and "idlelib" not in p.parts)
    for path in files[:limit_files]:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)):
                doc = ast.get_docstring(node)
                if not doc or len(doc) < 60:
                    continue
                if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                    funcs.append((f"{path.stem}.{node.name}", doc))
                paras += [p.strip() for p in doc.split("\n\n") if _prose(p.strip(), 120)]
    site = Path(sysconfig.get_paths()["purelib"])
    for path in sorted(site.glob("*.dist-info/METADATA"))[:300] + sorted(site.rglob("README*"))[:100]:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for p in text.split("\n\n"):
            if _prose(p.strip(), 200):
                paras.append(p.strip())
    return funcs, paras


def _prose(p: str, min_len: int) -> bool:
    """Long, mostly letters and spaces, not a header block or a code listing."""
    return len(p) >= min_len and ":" not in p[:30] and sum(c.isalpha() or c == " " for c in p) > 0.85 * len(p)


def build_seeds(n: int, rng: random.Random) -> list[str]:
    """`n` seed texts: a mix of plain continuations and Question/Answer prompts."""
    funcs, paras = local_texts()
    if not paras:
        paras = [f"This is a short note about {t}." for t in TOPICS]
    seeds = []
    for i in range(n):
        kind = i % 9
        para = rng.choice(paras)[:700]
        if kind == 0:
            seeds.append(para[: rng.randint(80, 400)])
        elif kind == 1 and funcs:
            name, _ = rng.choice(funcs)
            seeds.append(f"Question: What does the Python function `{name}` do?\nAnswer:")
        elif kind == 2 and funcs:
            _, doc = rng.choice(funcs)
            line = doc.strip().split("\n")[0].rstrip(".")
            seeds.append(f"Question: Write a Python function that does the following: {line}.\nAnswer:")
        elif kind == 3:
            seeds.append(f"Question: Summarize the following text in one or two sentences.\n\n{para}\nAnswer:")
        elif kind == 4:
            seeds.append(f"Question: Explain in simple words what this means: {para.split('. ')[0]}.\nAnswer:")
        elif kind == 5:
            who, what = rng.choice(NAMES), rng.choice(ITEMS)
            a, b, c = rng.randint(3, 60), rng.randint(2, 30), rng.randint(1, 20)
            seeds.append(f"Question: {who} has {a} {what}. {who} buys {b} more and then gives {c} to a friend. "
                         f"How many {what} does {who} have now?\nAnswer:")
        elif kind == 6:
            t1, t2 = rng.sample(TOPICS, 2)
            form = rng.choice(["Write a short story about {a}.", "Give three facts about {a}.",
                               "What is the difference between {a} and {b}?", "Write a poem about {a} and {b}.",
                               "Describe {a} to a child.", "Write an email to a friend about {a}."])
            seeds.append(f"Question: {form.format(a=t1, b=t2)}\nAnswer:")
        elif kind == 7:
            seeds.append(f"{para}\n\nQuestion: What is the main point of the text above?\nAnswer:")
        else:
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            seeds.append(f"Question: What is {a} times {b}? Explain step by step.\nAnswer:")
    return seeds


# -- distillation data ---------------------------------------------------------------------------


@dataclass
class DistillData:
    tokens: list[Tensor]  # per sequence [L] long
    features: list[Tensor]  # per sequence [L, h] float32: target's final-normed hidden states
    greedy: list[Tensor]  # per sequence [L] long: the target's argmax after each position


@torch.inference_mode()
def generate_data(target, seed_ids: list[list[int]], gen_tokens: int, batch: int, progress=None) -> DistillData:
    """Greedy continuations of every seed, with the target's features at every position.

    Each batch prefills its rows one by one (different lengths, batch 1 is the efficient shape for
    a long prefill anyway), copies each row's keys and values into one batched cache, then decodes
    all rows together, each at its own position (the runtime keeps one length per row).
    """
    out = DistillData([], [], [])
    eos = set(target.config.eos_token_ids)
    device = target.embed_tokens.weight.device
    for start in range(0, len(seed_ids), batch):
        rows = seed_ids[start : start + batch]
        b = len(rows)
        cache = target.new_cache(b, max(map(len, rows)) + gen_tokens)
        toks, feats, greedy = [], [], []
        nxt = torch.zeros(b, 1, dtype=torch.long, device=device)
        for r, ids in enumerate(rows):
            one = target.new_cache(1, len(ids))
            logits, hidden = target(torch.tensor([ids], device=device), torch.arange(len(ids), device=device)[None], one)
            n = len(ids)
            for store, src in ((cache.keys, one.keys), (cache.values, one.values)):
                for layer_dst, layer_src in zip(store, src):
                    layer_dst[r, :, :n] = layer_src[0, :, :n]
            cache.positions[r, :n] = one.positions[0, :n]
            cache.lengths[r] = n
            toks.append(list(ids))
            feats.append([hidden[0].cpu()])
            greedy.append(logits[0].argmax(-1).tolist())
            nxt[r, 0] = greedy[r][-1]
        for _ in range(gen_tokens - 1):
            positions = cache.lengths[:, None].clone()
            logits, hidden = target(nxt, positions, cache)
            best = logits[:, -1].argmax(-1)  # [b]
            best_list = best.tolist()
            for r in range(b):
                toks[r].append(int(nxt[r, 0]))
                feats[r].append(hidden[r].cpu())
                greedy[r].append(best_list[r])
            nxt = best[:, None]
        for r in range(b):
            t = torch.tensor(toks[r])
            f = torch.cat(feats[r]).float().clone()
            g = torch.tensor(greedy[r])
            # Cut after the first generated EOS: what follows is not text the target would write.
            hits = [i for i in range(len(rows[r]), len(t)) if int(t[i]) in eos]
            end = hits[0] + 1 if hits else len(t)
            out.tokens.append(t[:end])
            out.features.append(f[:end])
            out.greedy.append(g[:end])
        if progress:
            progress(min(start + batch, len(seed_ids)), len(seed_ids))
    return out


def choose_d2t(data: DistillData, vocab: int, size: int, always: tuple[int, ...], tokenizer=None) -> Tensor:
    """The sub-vocabulary: every id the target chose in the data, most frequent first; the rest
    of the `size` slots go to the ids most frequent in the local texts (greedy text is narrow:
    ~2k distinct ids in 58k positions for Gemma 3 270M, while held-out text needs more)."""
    from .drafters.eagle import frequent_ids

    chosen = torch.zeros(vocab, dtype=torch.float64)
    for g in data.greedy:
        chosen.index_add_(0, g, torch.ones(len(g), dtype=torch.float64))
    text = torch.zeros(vocab, dtype=torch.float64)
    if tokenizer is not None:
        funcs, paras = local_texts()
        for piece in paras + [doc for _, doc in funcs]:
            ids = torch.tensor([i for i in tokenizer.encode(piece) if 0 <= i < vocab], dtype=torch.long)
            text.index_add_(0, ids, torch.ones(len(ids), dtype=torch.float64))
    # Any id the target chose outranks every id seen only in text.
    return frequent_ids(chosen + text / (float(text.max()) + 1.0), size, always)


# -- the training loss ---------------------------------------------------------------------------


def unrolled_visibility(t: int, depth: int) -> Tensor:
    """[T, depth * T] bool: which slots a depth-`depth` query at entry a sees.

    Slots are [depth-1 entries | depth-2 entries | ...], T each. A depth-d chain starting from the
    true-feature entry a - d + 1 is what draft step d sees: true entries 0..a-d+1, then the chain's
    entries at depth d' (2 <= d' <= d) at index a - (d - d').
    """
    a = torch.arange(t)[:, None]
    b = torch.arange(t)[None, :]
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
    positions = torch.arange(1, t + 1)[None]  # [1, T]
    true_next = feats[1:]  # [T, h]
    with torch.no_grad():
        p_target = model.logits(true_next).softmax(-1)  # [T, Vd] target's distribution, renormalised
    inp = feats[:-1][None]  # [1, T, h]
    total, stats = 0.0, {}
    for d in range(1, depth + 1):
        visible = unrolled_visibility(t, d)[None, None]  # [1, 1, T, d*T]
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


# -- the command ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    parser.add_argument("--target", default="default", help="HF folder, .gguf, or default")
    parser.add_argument("--out", required=True, help="output folder (head, data, checkpoint)")
    parser.add_argument("--kind", default="eagle", choices=["eagle"], help="what to train (eagle: draft head)")
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt and OUT/data.pt")
    parser.add_argument("--num-seeds", type=int, default=d.num_seeds)
    parser.add_argument("--gen-tokens", type=int, default=d.gen_tokens, help="greedy tokens per seed")
    parser.add_argument("--gen-batch", type=int, default=d.gen_batch)
    parser.add_argument("--draft-vocab", type=int, default=d.draft_vocab, help="sub-vocabulary size (d2t)")
    parser.add_argument("--intermediate-size", type=int, default=d.intermediate_size,
                        help="the head's MLP width (0 = half the target's)")
    parser.add_argument("--depth", type=int, default=d.depth, help="training-time-test unroll depth")
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
    """Load the target, then `train_head`."""
    from .engine import resolve_device, resolve_dtype
    from .models import loader
    from .tokenizer import Tokenizer

    check_config(cfg)
    torch.set_num_threads(cfg.threads)
    device = resolve_device(device)
    target, folder = loader.load(target_name, resolve_dtype(dtype, device), device)
    return train_head(target, Tokenizer.from_folder(folder), out, cfg, resume, target_name, log)


def check_config(cfg: TrainConfig) -> None:
    if cfg.kind != "eagle":
        raise InvalidRequestError(f"unknown --kind {cfg.kind!r}; this version trains eagle heads", "kind")
    if cfg.steps < 0 or cfg.depth < 1 or cfg.draft_vocab < 2 or cfg.num_seeds < 1 or cfg.gen_tokens < 2:
        raise InvalidRequestError("need steps >= 0, depth >= 1, draft-vocab >= 2, num-seeds >= 1, gen-tokens >= 2")


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

    data_path = out / DATA_FILE
    if resume and data_path.is_file():
        data = DistillData(**torch.load(data_path))
        log(f"reusing {len(data.tokens)} sequences from {data_path}")
    else:
        rng = random.Random(cfg.seed)
        if tokenizer is not None:
            bos = [tcfg.bos_token_id] if tcfg.bos_token_id is not None else []
            encoded = [tokenizer.encode(s) for s in build_seeds(cfg.num_seeds, rng)]
            # The engine feeds `encode`'s ids as they are; add BOS only where encode does not.
            seed_ids = [(e if e[:1] == bos else bos + e)[: cfg.max_seed_tokens] for e in encoded]
        else:  # a weights-only model: random ids, one to max_seed_tokens long
            seed_ids = [[rng.randrange(tcfg.vocab_size) for _ in range(rng.randint(4, min(16, cfg.max_seed_tokens)))]
                        for _ in range(cfg.num_seeds)]
        seed_ids = [s for s in seed_ids if s]
        seed_ids.sort(key=len)  # similar lengths share a batch: less cache per batch
        bar = _bar(len(seed_ids), "generating")
        data = generate_data(target, seed_ids, cfg.gen_tokens, cfg.gen_batch,
                             progress=lambda done, total: bar.update(done - bar.n))
        bar.close()
        # Outside inference mode a clone is an ordinary tensor, which autograd may save.
        data = DistillData(*([x.to("cpu").clone() for x in xs] for xs in (data.tokens, data.features, data.greedy)))
        torch.save(dataclasses.asdict(data), data_path)
        n = sum(len(t) for t in data.tokens)
        log(f"data: {len(data.tokens)} sequences, {n} positions, {time.perf_counter() - started:.0f} s")
    data_s = time.perf_counter() - started

    # The head trains in float32 whatever the target's dtype was while making data.
    if next(target.parameters()).dtype != torch.float32:
        target = target.float()
    ckpt_path = out / CHECKPOINT_FILE
    ckpt = torch.load(ckpt_path) if resume and ckpt_path.is_file() else None
    if ckpt is not None:
        d2t = ckpt["d2t"]
        spec = HeadSpec(**ckpt["spec"])
    else:
        d2t = choose_d2t(data, tcfg.vocab_size, cfg.draft_vocab, tuple(tcfg.eos_token_ids), tokenizer)
        spec = HeadSpec.for_target(tcfg, len(d2t), cfg.intermediate_size or max(1, tcfg.intermediate_size // 2))
    torch.manual_seed(cfg.seed)
    model = EagleModel(spec, target, d2t)
    model.head.train()
    opt = torch.optim.AdamW(model.head.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    step = 0
    if ckpt is not None:
        model.head.load_state_dict(ckpt["head"])
        opt.load_state_dict(ckpt["optimizer"])
        step = ckpt["step"]
        log(f"resuming at step {step}")
    all_greedy = torch.cat(data.greedy)
    coverage = float(torch.isin(all_greedy, d2t).float().mean())
    feat_scale = float(torch.cat(data.features).std())

    def lr_at(s: int) -> float:
        if s < cfg.warmup:
            return cfg.lr * (s + 1) / cfg.warmup
        progress = (s - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    def batches(epoch: int):
        order = list(range(len(data.tokens)))
        random.Random(cfg.seed * 1000 + epoch).shuffle(order)
        batch, size = [], 0
        for i in order:
            if len(data.tokens[i]) < 2:
                continue
            batch.append(i)
            size += len(data.tokens[i])
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
        weight_total = sum(len(data.tokens[i]) - 1 for i in plan[step])
        for i in plan[step]:
            loss, stats = sequence_loss(model, data.tokens[i], data.features[i], cfg.depth, feat_scale,
                                        cfg.token_weight)
            (loss * (len(data.tokens[i]) - 1) / weight_total).backward()
            for key, v in stats.items():
                recent[key] = 0.9 * recent.get(key, v) + 0.1 * v
        torch.nn.utils.clip_grad_norm_(model.head.parameters(), 1.0)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix({k: f"{v:.2f}" for k, v in sorted(recent.items())})
        if step % cfg.checkpoint_every == 0 or step == last:
            torch.save({"head": model.head.state_dict(), "optimizer": opt.state_dict(), "step": step,
                        "d2t": d2t, "spec": dataclasses.asdict(spec)}, ckpt_path)
    bar.close()
    train_s = time.perf_counter() - train_start
    info = {"training": {"target": target_name, "config": dataclasses.asdict(cfg), "steps_done": step,
                         "sequences": len(data.tokens), "positions": int(sum(len(t) for t in data.tokens)),
                         "sub_vocab_coverage": round(coverage, 4), "data_s": round(data_s),
                         "train_s_this_run": round(train_s),
                         "final_stats": {k: round(v, 4) for k, v in recent.items()}}}
    model.head.eval()
    model.save(out, info)
    log(f"wrote {out / 'eagle.safetensors'}: coverage of the target's choices by the sub-vocabulary "
        f"{coverage:.3f}; training {train_s:.0f} s; {recent}")
    return out
