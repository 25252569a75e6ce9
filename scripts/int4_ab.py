"""The int4 product of two builds side by side in one process, where a decode step meets it.

    python scripts/int4_ab.py OLD_REV [NEW_REV] [--rows 1,2,3] [--threads N] [--model NAME]

Compiles `cpu_kernels.cpp` as it is at two git revisions (NEW_REV: the working tree when left
out) and, for each row count, checks that both give the same bits and times them called
alternately (the machine's drift falls on both alike), medians of 12 rounds. Without --model: the
products of one token through 28 layers of Qwen2.5 1.5B's shapes on random tables (819 MB, so the
weights come from memory as in a real step), with the bytes read a second. With --model: that
model's forward of a block of that many tokens after 300 (`Engine.load(NAME, drafter="none")`),
30 rounds.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from attention_ab import build  # this folder's: one build of cpu_kernels.cpp at a revision

from specdec.models import cpu_kernels

SHAPES = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]  # (out, in): qkv, o, gate+up, down


def alternate(builds: list, run, rounds: int) -> tuple[float, float]:
    times: list[list[float]] = [[], []]
    for r in range(rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            start = time.perf_counter()
            run(builds[i])
            times[i].append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def products(builds: list, rows: list[int]) -> None:
    from specdec.models.quant import Int4Linear

    torch.manual_seed(0)
    layers = [[Int4Linear(torch.randn(n, k) * 0.05, None) for n, k in SHAPES] for _ in range(28)]
    size = sum(lin._q.numel() for layer in layers for lin in layer)
    for t in rows:
        xs = {k: torch.randn(t, k) for k in (1536, 8960)}
        for lin in layers[0]:
            a, b = (m.int4_linear(xs[lin.in_features], lin._q, lin.bias, lin.out_features) for m in builds)
            assert torch.equal(a, b), "the two builds differ"

        def step(m):
            for layer in layers:
                for lin in layer:
                    m.int4_linear(xs[lin.in_features], lin._q, lin.bias, lin.out_features)

        old, new = alternate(builds, step, 12)
        print(f"{t} rows: old {old * 1e3:.1f} ms ({size / old / 1e9:.1f} GB/s), new {new * 1e3:.1f} ms "
              f"({size / new / 1e9:.1f} GB/s), new / old {new / old:.3f}", flush=True)


def model_steps(builds: list, rows: list[int], name: str) -> None:
    from specdec.engine import Engine

    current = [builds[0]]
    cpu_kernels.load = lambda: current[0]  # what the model's layers call, switched between the builds
    model = Engine.load(name, drafter="none").model
    ids = torch.randint(100, 30000, (1, 300 + max(rows)))
    cache = model.new_cache(1, ids.shape[1] + 8)
    with torch.inference_mode():
        model(ids[:, :300], torch.arange(300)[None], cache, last_n=1, need_hidden=False)
        for t in rows:
            block, positions = ids[:, 300 : 300 + t], torch.arange(300, 300 + t)[None]

            def run(m):
                current[0] = m
                cache.truncate(300)
                return model(block, positions, cache, last_n=None)[0]

            assert torch.equal(run(builds[0]), run(builds[1])), "the two builds differ"
            old, new = alternate(builds, run, 30)
            print(f"{name}, {t} tokens after 300: old {old * 1e3:.1f} ms, new {new * 1e3:.1f} ms, "
                  f"new / old {new / old:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new", nargs="?")
    parser.add_argument("--rows", default="1,2,3")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", help="time this model's forward instead of the bare products")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        builds = [build(args.old, "old", Path(folder), "int4_ab"), build(args.new, "new", Path(folder), "int4_ab")]
    print(f"int4 path: {builds[1].int4_path()}, {args.threads} threads")
    if args.model:
        model_steps(builds, rows, args.model)
    else:
        products(builds, rows)


if __name__ == "__main__":
    main()
