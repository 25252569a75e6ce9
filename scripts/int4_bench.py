"""The int4 product against its scalar reference on random tables: bit-identical, and how fast.

    PYTHONPATH=src python scripts/int4_bench.py [THREADS]

Shapes of Qwen2.5 1.5B (1536 hidden, 8960 MLP) at 1-64 rows; prints each time and G ops/s.
"""
import time, torch, sys
from specdec.models import cpu_kernels
from specdec.models.quant import Int4Linear
torch.manual_seed(0)
k = cpu_kernels.load()
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
for N, K in [(1536, 1536), (8960, 1536), (1536, 8960), (37, 100)]:
    lin = Int4Linear(torch.randn(N, K) * 0.05, torch.randn(N) if N == 37 else None)
    for T in [1, 2, 3, 5, 7, 64]:
        x = torch.randn(T, K)
        y = k.int4_linear(x, lin._q, lin.bias, lin.out_features)
        r = k.int4_reference(x, lin._q, lin.bias, lin.out_features)
        ones = torch.cat([k.int4_reference(x[i:i+1], lin._q, lin.bias, lin.out_features) for i in range(T)])
        assert torch.equal(y, r) and torch.equal(y, ones), (N, K, T, (y - r).abs().max())
        if N == 37: continue
        reps = 20 if T < 64 else 3
        t0 = time.perf_counter()
        for _ in range(reps): k.int4_linear(x, lin._q, lin.bias, lin.out_features)
        tv = (time.perf_counter() - t0) / reps
        t0 = time.perf_counter()
        for _ in range(max(1, reps // 5)): k.int4_reference(x, lin._q, lin.bias, lin.out_features)
        tr = (time.perf_counter() - t0) / max(1, reps // 5)
        print(f"N={N} K={K} T={T}: vector {tv*1e3:.2f} ms  scalar {tr*1e3:.2f} ms  x{tr/tv:.1f}  {2*N*K*T/tv/1e9:.1f} GOP/s")
print("bit-identical")
