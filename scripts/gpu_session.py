"""What a session with a lent GPU runs, in one call: checks of the CUDA path and the GPU-side work
that a 2-core CPU cannot do in a session. Each part writes its results under OUT as it ends, so a
part that runs out of time loses only itself.

    python scripts/gpu_session.py smoke    --out OUT             every drafter, trees, sampling, and
                                                                 train-draft's two kinds, on tiny random
                                                                 models
    python scripts/gpu_session.py identity --model M --out OUT   greedy identity on CUDA, every drafter
    python scripts/gpu_session.py costs    --model M --out OUT   a verify pass over T tokens / one token
    python scripts/gpu_session.py train    --model M --out OUT   an EAGLE head, data and training sized
                                                                 to time budgets (seconds)

`identity`: for float32 and bfloat16, plain greedy decoding against every drafter (chains and
trees) on our own questions (docs/own-questions.jsonl, never Spec-Bench's), token for token; plus
one seeded sampled run per drafter (it must run; exactness of sampling is the CPU test suite's
chi-square test). `costs`: the time of a target pass over T = 1..10 new tokens after a 300-token
context, CUDA events, median of many, relative to T = 1 (the engine's DEFAULT_VERIFY_COSTS). `train`:
`specdec train-draft`'s recipe (train.py) with the amounts chosen by the clock: seeds are continued in
batches (in a random order of batches, so a cut keeps seeds of every length) until the data budget
is spent, then a few timed optimiser steps size the run to the training budget. What it settled on
(seeds continued, positions, steps) and the command are written into the head's eagle.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from specdec import Engine, SamplingParams  # noqa: E402
from specdec.builder import Made, make_drafter  # noqa: E402
from specdec.models import loader  # noqa: E402
from specdec.tokenizer import Tokenizer  # noqa: E402

TEMPLATE = "Question: {}\nAnswer:"
DRAFTERS = [  # (label, drafter name, k, tree)
    ("ngram k=8", "ngram", 8, None),
    ("suffix k=8", "suffix", 8, None),
    ("eagle k=5", "eagle", 5, None),
    ("ngram+eagle k=8", "ngram+eagle", 8, None),
    ("eagle tree 4x3x12", "eagle", 5, "4x3x12"),
    ("ngram tree 4x3x12", "ngram", 5, "4x3x12"),
]


def own_prompts(n: int) -> list[str]:
    rows = [json.loads(line) for line in (ROOT / "docs" / "own-questions.jsonl").read_text().splitlines() if line]
    return [TEMPLATE.format(r["turns"][0]) for r in rows[:n]]


def save(out: Path, name: str, data) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(data, indent=1) + "\n")


def smoke(args) -> None:
    """Tiny random Llama and Gemma 3 models (the test suite's) on the device, float32 and bfloat16:
    plain greedy against every drafter, chains and trees, a seeded sampled run each, then a few
    steps of the head's data making and training. Needs no model files: the first call can run it."""
    import tempfile

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import make_tiny_hf, random_prompts

    from specdec import train as tr
    from specdec.drafters.combined import lookup_first
    from specdec.drafters.eagle import EagleDrafter, EagleModel, HeadSpec
    from specdec.drafters.ngram import NgramDrafter
    from specdec.drafters.suffix import SuffixDrafter

    tmp = Path(tempfile.mkdtemp())
    results = []
    for family in ("llama", "gemma3"):
        folder, _ = make_tiny_hf(tmp, family)
        for dtype in args.dtypes.split(","):
            target, _ = loader.load(folder, getattr(torch, dtype), args.device)
            g = torch.Generator().manual_seed(0)
            d2t = torch.randperm(target.config.vocab_size, generator=g)[:60].sort().values
            torch.manual_seed(0)
            head = EagleModel(HeadSpec.for_target(target.config, 60, 48), target, d2t.to(args.device)).eval()
            plain = Engine(target, None)
            prompts = random_prompts(3)
            ref = [plain.generate(prompt_ids=p, max_new_tokens=40).token_ids for p in prompts]
            drafters = {"ngram": (NgramDrafter(), None), "suffix": (SuffixDrafter(), None),
                        "eagle": (EagleDrafter(head), None), "ngram+eagle": (lookup_first(NgramDrafter(),
                                                                                          EagleDrafter(head)), None),
                        "eagle tree": (EagleDrafter(head), "3x2x6"), "ngram tree": (NgramDrafter(), "3x2x6")}
            for label, (drafter, tree) in drafters.items():
                engine = Engine(target, None, drafter, 4, draft_length=None if tree else "fixed", draft_tree=tree)
                same = sum(engine.generate(prompt_ids=p, max_new_tokens=40).token_ids == r for p, r in zip(prompts, ref))
                sampled = engine.generate(prompt_ids=prompts[0], max_new_tokens=20,
                                          sampling=SamplingParams(temperature=1.0, top_k=20, seed=3))
                row = {"family": family, "dtype": dtype, "drafter": label, "identical": f"{same}/{len(prompts)}",
                       "sampled_tokens": len(sampled.token_ids)}
                results.append(row)
                print(json.dumps(row), flush=True)
        save(args.out, "smoke.json", results)
    # `specdec train-draft`'s two paths on the device, as the CLI runs them (random seed ids: the
    # tiny models have no tokenizer): data from the target, the sub-vocabulary, optimiser steps, output.
    target, _ = loader.load(folder, torch.float32, args.device)
    small = dict(steps=3, num_seeds=4, gen_tokens=8, gen_batch=2, max_seed_tokens=8, batch_tokens=32, draft_vocab=60,
                 checkpoint_every=10**9)
    tr.train_head(target, None, tmp / "head", tr.TrainConfig(**small), log=print)
    tr.train_model(target, None, tmp / "draft", tr.TrainConfig(kind="model", layers=2, **small), log=print)
    results.append({"train_head": sorted(p.name for p in (tmp / "head").iterdir()),
                    "train_model": sorted(p.name for p in (tmp / "draft").iterdir())})
    save(args.out, "smoke.json", results)
    print("smoke: done", flush=True)


def identity(args) -> None:
    folder = loader.resolve(args.model)
    tokenizer = Tokenizer.from_folder(folder)
    prompts = own_prompts(args.prompts)
    results = []
    for dtype in args.dtypes.split(","):
        model, _ = loader.load(folder, getattr(torch, dtype), args.device)
        plain = Engine(model, tokenizer)
        started = time.perf_counter()
        reference = [plain.generate(prompt=p, max_new_tokens=args.max_tokens).token_ids for p in prompts]
        plain_s = time.perf_counter() - started
        for label, name, k, tree in DRAFTERS:
            engine = Engine(model, tokenizer, drafter=make_drafter(name, Made(model, tokenizer)),
                            num_speculative_tokens=k, draft_length=None if tree else "fixed", draft_tree=tree)
            same, first_diff, accepted, drafts = 0, [], 0, 0
            started = time.perf_counter()
            for p, ref in zip(prompts, reference):
                out = engine.generate(prompt=p, max_new_tokens=args.max_tokens)
                same += out.token_ids == ref
                first_diff.append(next((i for i, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b),
                                       None if len(out.token_ids) == len(ref) else min(len(out.token_ids), len(ref))))
                accepted += out.stats.accepted_tokens
                drafts += out.stats.drafts
            spec_s = time.perf_counter() - started
            sampled = engine.generate(prompt=prompts[0], max_new_tokens=32,
                                      sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=1))
            row = {"dtype": dtype, "drafter": label, "identical": f"{same}/{len(prompts)}",
                   "first_divergence": first_diff, "mean_accepted_length": round(1 + accepted / max(1, drafts), 2),
                   "wall_ratio_plain_over_spec": round(plain_s / spec_s, 2),
                   "sampled_tokens": len(sampled.token_ids)}
            results.append(row)
            print(json.dumps(row), flush=True)
            save(args.out, "identity.json", results)
        del plain, model
        torch.cuda.empty_cache() if args.device.startswith("cuda") else None


@torch.inference_mode()
def costs(args) -> None:
    folder = loader.resolve(args.model)
    results = {}
    for dtype in args.dtypes.split(","):
        model, _ = loader.load(folder, getattr(torch, dtype), args.device)
        device = model.embed_tokens.weight.device
        ctx = 300
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(10, 20000, (1, ctx + 10), generator=gen).to(device)
        cache = model.new_cache(1, ctx + 16)
        model(ids[:, :ctx], torch.arange(ctx, device=device)[None], cache, last_n=1)
        times = {}
        for t in range(1, 11):
            samples = []
            for _ in range(args.repeats):
                cache.truncate(ctx)
                if args.device.startswith("cuda"):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    model(ids[:, ctx:ctx + t], torch.arange(ctx, ctx + t, device=device)[None], cache, last_n=t)
                    end.record()
                    torch.cuda.synchronize()
                    samples.append(start.elapsed_time(end))
                else:
                    s = time.perf_counter()
                    model(ids[:, ctx:ctx + t], torch.arange(ctx, ctx + t, device=device)[None], cache, last_n=t)
                    samples.append((time.perf_counter() - s) * 1000)
            times[t] = statistics.median(samples[len(samples) // 4:])
        results[dtype] = {"ms": {t: round(v, 3) for t, v in times.items()},
                          "relative": {t: round(v / times[1], 3) for t, v in times.items()}}
        print(dtype, json.dumps(results[dtype]), flush=True)
        save(args.out, "costs.json", results)
        del model


def train(args) -> None:
    from specdec import train as tr
    from specdec.drafters.eagle import EagleModel, HeadSpec

    torch.manual_seed(0)
    folder = loader.resolve(args.model)
    tokenizer = Tokenizer.from_folder(folder)
    target, _ = loader.load(folder, torch.float32, args.device)
    target.requires_grad_(False)
    tcfg = target.config
    cfg = tr.TrainConfig(num_seeds=args.max_seeds, gen_tokens=args.gen_tokens, gen_batch=args.gen_batch,
                         depth=args.depth, batch_tokens=args.batch_tokens, lr=args.lr, draft_vocab=args.draft_vocab,
                         checkpoint_every=10**9)
    seeds = tr.encode_seeds(tcfg, tokenizer, cfg, random.Random(cfg.seed))
    batches = [seeds[i:i + cfg.gen_batch] for i in range(0, len(seeds), cfg.gen_batch)]
    random.Random(1).shuffle(batches)  # a budget cut then keeps every length of seed
    data = tr.DistillData([], [], [])
    started = time.perf_counter()
    used = 0
    for batch in batches:
        if time.perf_counter() - started > args.data_seconds:
            break
        part = tr.generate_data(target, batch, cfg.gen_tokens, cfg.gen_batch)
        for xs, ys in zip((data.tokens, data.features, data.greedy), (part.tokens, part.features, part.greedy)):
            xs.extend(y.to("cpu").clone() for y in ys)
        used += len(batch)
        print(f"data: {used} seeds, {sum(map(len, data.tokens))} positions, "
              f"{time.perf_counter() - started:.0f} s", flush=True)
    data_s = time.perf_counter() - started
    positions = sum(map(len, data.tokens))

    d2t = tr.choose_d2t(data, tcfg.vocab_size, cfg.draft_vocab, tuple(tcfg.eos_token_ids), tokenizer)
    spec = HeadSpec.for_target(tcfg, len(d2t), tcfg.intermediate_size // 2)
    # Features move to the GPU once; sequences are read from there.
    feats = [f.to(args.device) for f in data.features]
    toks = [t.to(args.device) for t in data.tokens]
    feat_scale = float(torch.cat(data.features).std())
    lengths = [len(t) for t in data.tokens]

    def fit_for(steps: int, stop_at: int, out: Path):
        torch.manual_seed(cfg.seed)
        model = EagleModel(spec, target, d2t.to(args.device))
        run_cfg = dataclasses.replace(cfg, steps=steps, stop_at=stop_at)
        result = tr.fit(model.head, "head", lambda i: tr.sequence_loss(model, toks[i], feats[i], cfg.depth, feat_scale,
                                                                       cfg.token_weight),
                        lengths, run_cfg, out / "checkpoint.pt", None, {}, log=print)
        return model, result, run_cfg

    import tempfile

    scratch = Path(tempfile.mkdtemp())  # the probes' checkpoints
    fit_for(3, 0, scratch)  # warm-up: kernels, allocator, cuBLAS handles
    t0 = time.perf_counter()
    fit_for(args.probe_steps, 0, scratch)
    per_step = (time.perf_counter() - t0) / args.probe_steps
    steps = max(args.probe_steps, int(args.train_seconds / per_step))
    print(f"probe: {per_step * 1000:.0f} ms a step -> {steps} steps "
          f"({steps * cfg.batch_tokens / positions:.1f} passes over the data)", flush=True)
    head_dir = args.out / "head"
    head_dir.mkdir(parents=True, exist_ok=True)
    model, result, run_cfg = fit_for(steps, 0, head_dir)
    coverage = float(torch.isin(torch.cat(data.greedy), d2t).float().mean())
    recipe = (f"python scripts/gpu_session.py train --model {args.model} --data-seconds {args.data_seconds:g} "
              f"--train-seconds {args.train_seconds:g} --max-seeds {args.max_seeds} --gen-tokens {cfg.gen_tokens} "
              f"--gen-batch {cfg.gen_batch} --depth {cfg.depth} --batch-tokens {cfg.batch_tokens} --lr {cfg.lr:g} "
              f"--draft-vocab {cfg.draft_vocab}: {used} of {len(seeds)} seeds continued, {steps} steps")
    info = {"training": {"target": args.model, "config": dataclasses.asdict(dataclasses.replace(run_cfg, num_seeds=used)),
                         "steps_done": result.steps_done, "sequences": len(data.tokens), "positions": positions,
                         "sub_vocab_coverage": round(coverage, 4), "data_s": round(data_s),
                         "train_s_this_run": round(result.seconds),
                         "final_stats": {k: round(v, 4) for k, v in result.stats.items()},
                         "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
                         "recipe": recipe + f" (data {data_s:.0f} s, training {result.seconds:.0f} s)"}}
    model.save(head_dir, info)
    (head_dir / "checkpoint.pt").unlink(missing_ok=True)
    print(json.dumps(info), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["smoke", "identity", "costs", "train"])
    parser.add_argument("--model", default="default")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--max-seeds", type=int, default=20000)
    parser.add_argument("--gen-tokens", type=int, default=160)
    parser.add_argument("--gen-batch", type=int, default=256)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--data-seconds", type=float, default=90)
    parser.add_argument("--train-seconds", type=float, default=150)
    parser.add_argument("--probe-steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    {"smoke": smoke, "identity": identity, "costs": costs, "train": train}[args.part](args)


if __name__ == "__main__":
    main()
