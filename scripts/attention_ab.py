"""The row attention kernel of two builds side by side in one process.

    python scripts/attention_ab.py OLD_REV [NEW_REV] [--shape H,KV,D] [--threads N]

Compiles `cpu_kernels.cpp` as it is at two git revisions (NEW_REV: the working tree when left
out), checks that both give the same bits, then times one 512-row block at 4,096 slots (a deep
prefill chunk under a causal mask) and a one-row step over the same cache, the two builds called
alternately so that the machine's drift falls on both alike. Prints medians and the ratio.
"""
from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from specdec.models import cpu_kernels

ROOT = Path(__file__).resolve().parent.parent
SOURCE = "src/specdec/models/cpu_kernels.cpp"


def build(rev: str | None, tag: str, folder: Path, name: str = "attention_ab"):
    """`cpu_kernels.cpp` at git revision `rev` (None: the working tree), compiled as module name_tag."""
    text = (ROOT / SOURCE).read_text() if rev is None else subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:{SOURCE}"], check=True, capture_output=True, text=True).stdout
    (folder / tag).mkdir()
    source = folder / tag / f"{name}_{tag}.cpp"
    source.write_text(text)
    return cpp_extension.load(name=f"{name}_{tag}", sources=[str(source)], extra_cflags=cpu_kernels.CFLAGS,
                              extra_ldflags=cpu_kernels.LDFLAGS, build_directory=str(folder / tag), verbose=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new", nargs="?")
    parser.add_argument("--shape", default="12,2,128", help="query heads, key heads, head size (Qwen2.5 1.5B's)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    heads, kv_heads, d = map(int, args.shape.split(","))
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        builds = {"old": build(args.old, "old", Path(folder)), "new": build(args.new, "new", Path(folder))}
    g = torch.Generator().manual_seed(0)
    rows, slots = 512, 4096
    q = torch.randn(1, heads, rows, d, generator=g)
    keys = torch.randn(1, kv_heads, slots + 8, d, generator=g).half()
    values = torch.randn(1, kv_heads, slots + 8, d, generator=g).half()
    visible = (torch.arange(slots)[None, :] <= (slots - rows + torch.arange(rows))[:, None])[None, None]
    block = (q, keys, values, visible, d**-0.5)
    step = (q[:, :, -1:].contiguous(), keys, values, visible[:, :, -1:].contiguous(), d**-0.5)
    same = torch.equal(builds["old"].attention(*block), builds["new"].attention(*block))
    print(f"shape {heads},{kv_heads},{d}, {args.threads} threads; same bits: {same}")
    for name, case, reps in (("512-row block at 4,096 slots", block, 30), ("one-row step at 4,096 slots", step, 300)):
        times: dict[str, list[float]] = {"old": [], "new": []}
        for r in range(reps):
            for tag in ("old", "new") if r % 2 == 0 else ("new", "old"):
                start = time.perf_counter()
                builds[tag].attention(*case)
                times[tag].append(time.perf_counter() - start)
        med = {tag: sorted(t)[len(t) // 2] * 1e3 for tag, t in times.items()}
        print(f"{name}: median old {med['old']:.3f} ms, new {med['new']:.3f} ms (new / old {med['new'] / med['old']:.3f})")


if __name__ == "__main__":
    main()
