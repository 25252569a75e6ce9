"""The int4 product against its scalar reference on random tables: bit-identical, and how fast.

    PYTHONPATH=src python scripts/int4_bench.py [THREADS]

Shapes of Qwen2.5 1.5B (1536 hidden, 8960 MLP) at 1-512 rows (a decode step, verify passes, a
prefill's chunks): each product is checked against `int4_reference` on the whole block and against
the vector kernel one row at a time (a row's bits must not depend on the rows beside it), then
timed, best of 5 rounds (the machine is shared), with G multiply-adds/s.
"""
import sys
import time

import torch

from specdec.models import cpu_kernels
from specdec.models.quant import Int4Linear

torch.manual_seed(0)
k = cpu_kernels.load()
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)


def best_time(fn, reps):
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


print(f"int4 path: {k.int4_path()}, threads: {torch.get_num_threads()}")
for N, K in [(1536, 1536), (8960, 1536), (1536, 8960), (37, 100)]:
    lin = Int4Linear(torch.randn(N, K) * 0.05, torch.randn(N) if N == 37 else None)
    for T in [1, 2, 3, 5, 12, 16, 64, 512]:
        x = torch.randn(T, K)
        y = k.int4_linear(x, lin._q, lin.bias, lin.out_features)
        r = k.int4_reference(x, lin._q, lin.bias, lin.out_features)
        ones = torch.cat([k.int4_linear(x[i : i + 1], lin._q, lin.bias, lin.out_features) for i in range(T)])
        assert torch.equal(y, r) and torch.equal(y, ones), (N, K, T, (y - r).abs().max())
        if N == 37:
            continue
        reps = max(1, int(2e8 / (N * K * T)))
        tv = best_time(lambda: k.int4_linear(x, lin._q, lin.bias, lin.out_features), reps)
        line = f"N={N} K={K} T={T}: vector {tv * 1e3:.3f} ms  {N * K * T / tv / 1e9:.1f} G MAC/s"
        if T <= 12:
            tr = best_time(lambda: k.int4_reference(x, lin._q, lin.bias, lin.out_features), 1)
            line += f"  scalar {tr * 1e3:.2f} ms  x{tr / tv:.1f}"
        print(line, flush=True)
print("bit-identical")
