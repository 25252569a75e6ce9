"""Two servers side by side: the load test's levels against `specdec serve` from two source trees.

    OMP_NUM_THREADS=1 taskset -c 1 python scripts/serve_ab.py OLD/src NEW/src --concurrency 1,4,16 --rounds 2

starts one server from each tree (default model, ngram drafter k = 5, goodput control; each
process imports its own tree), then runs every level in both modes against both servers, round
after round, the server and mode order alternating, so drift of a shared machine hits both trees
alike. Reports per tree and level the medians over the rounds of plain and speculative tokens/s,
plain against the first level, and speculative against plain (each ratio within a round), and
how many outputs differ between the modes and between the trees (greedy: none should).
"""

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
import types

import httpx

from specdec.bench.prompts import select_prompts, spec_bench_path
from specdec.server.loadtest import _free_port, run_level


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("a", help="the first tree's src folder")
    parser.add_argument("b", help="the second tree's src folder")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    opts = parser.parse_args()
    levels = [int(x) for x in opts.concurrency.split(",")]
    args = types.SimpleNamespace(drafter="ngram", k=5, max_tokens=opts.max_tokens)
    groups = ["code", "summarization", "qa"] if spec_bench_path() else ["code"]
    prompts = [p.text for p in select_prompts(groups, -(-opts.requests // len(groups)), spec_bench_path())]
    procs, urls = {}, {}
    for name, src in (("A", opts.a), ("B", opts.b)):
        port = _free_port()
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "specdec.cli", "serve", "--model", "default", "--port", str(port), "--drafter", "ngram",
             "-k", "5", "--max-batch", str(max(levels)), "--max-model-len", "4096", "--served-model-name", "loadtest",
             "--speculation-control", "goodput"],
            env=dict(os.environ, PYTHONPATH=os.path.abspath(src)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        urls[name] = f"http://127.0.0.1:{port}"
    try:
        for url in urls.values():
            while True:
                try:
                    if httpx.get(url + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            for mode in ("spec", "plain"):  # warm-up at the widest level
                asyncio.run(run_level(url, prompts, mode, max(levels), max(levels), args))
        res = {}
        for r in range(opts.rounds):
            for c in levels:
                for name in ("A", "B") if (r + levels.index(c)) % 2 == 0 else ("B", "A"):
                    for mode in ("plain", "spec") if r % 2 == 0 else ("spec", "plain"):
                        x = res[name, r, c, mode] = asyncio.run(run_level(urls[name], prompts, mode, c, opts.requests, args))
                        print(f"round {r + 1} c={c} {name} {mode}: {x.tokens_per_s:.1f} tok/s", flush=True)
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(60)
    rounds = range(opts.rounds)
    for name, src in (("A", opts.a), ("B", opts.b)):
        for c in levels:
            plain = [res[name, r, c, "plain"].tokens_per_s for r in rounds]
            spec = [res[name, r, c, "spec"].tokens_per_s for r in rounds]
            scale = [res[name, r, c, "plain"].tokens_per_s / res[name, r, levels[0], "plain"].tokens_per_s for r in rounds]
            differ = sum(res[name, r, c, "spec"].texts[i] != t for r in rounds for i, t in res[name, r, c, "plain"].texts.items())
            print(f"{name} ({src}) c={c}: plain {statistics.median(plain):.1f} {[round(v, 1) for v in plain]}, "
                  f"vs c={levels[0]} {statistics.median(scale):.2f}x {[round(v, 2) for v in scale]}; "
                  f"spec {statistics.median(spec):.1f} ({statistics.median(s / p for s, p in zip(spec, plain)):.2f}x "
                  f"{[round(s / p, 2) for s, p in zip(spec, plain)]}); outputs differ {differ}")
    across = sum(res["A", r, c, m].texts[i] != t for r in rounds for c in levels for m in ("plain", "spec")
                 for i, t in res["B", r, c, m].texts.items())
    print(f"outputs differing between the trees: {across}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
