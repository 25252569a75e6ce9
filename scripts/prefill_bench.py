"""Prefill and verify-pass speed of a named model through the model's forward alone (no sampling,
no drafter), for the kernels' figures in BENCHMARKS.md:

    PYTHONPATH=src python scripts/prefill_bench.py 512,2048 [THREADS] [MODEL]

Prefill: random ids of each length in one call (tokens/s by the wall clock and per CPU-second).
Verify: a 12-token block scoring every position after a 300-token prefix, against a 1-token step,
best of 5 each; their ratio is what one long verify pass costs in one-token steps.
"""
import sys
import time

import torch

import specdec
from specdec.engine import Engine

torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
e = Engine.load(sys.argv[3] if len(sys.argv) > 3 else "qwen2.5-coder-1.5b-instruct", drafter="none")
m = e.model
g = torch.Generator().manual_seed(0)
ids = torch.randint(1000, 30000, (1, 2048), generator=g)
def run(n, cache, start=0, last_n=1):
    pos = torch.arange(start, start + n)[None]
    w0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        m(ids[:, start:start + n], pos, cache, last_n=last_n, need_hidden=False)
    return time.perf_counter() - w0, time.process_time() - c0
run(64, m.new_cache(1, 72))  # warm-up
out = [specdec.__file__.split("/src/")[0], f"threads={torch.get_num_threads()}"]
for n in map(int, sys.argv[1].split(",")):
    w, c = run(n, m.new_cache(1, n + 8))
    out.append(f"prefill {n}: {n / w:.1f} tok/s wall, {n / c:.1f} tok/CPU-s")
cache = m.new_cache(1, 400)
run(300, cache)
best = {}
for rep in range(5):
    for t in (1, 12):
        cache.truncate(300)
        w, c = run(t, cache, 300, last_n=None)
        best[t] = min(best.get(t, (1e9, 1e9))[0], w), min(best.get(t, (1e9, 1e9))[1], c)
out.append(f"verify wall: 1-token {best[1][0]*1e3:.1f} ms, 12-token {best[12][0]*1e3:.1f} ms, ratio {best[12][0]/best[1][0]:.2f}")
out.append(f"verify CPU: 1-token {best[1][1]*1e3:.1f} ms, 12-token {best[12][1]*1e3:.1f} ms, ratio {best[12][1]/best[1][1]:.2f}")
print(" | ".join(out), flush=True)
