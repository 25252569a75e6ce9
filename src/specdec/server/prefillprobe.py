"""Probe of chunked prefill and prefix caching on the scheduler itself (no HTTP in between).

    python -m specdec.server.prefillprobe --quantize int8 --chunks 0,256,512,1024

`itl`: 4 streams decode plainly; after `--warm` steps a `--long`-token prompt arrives. The loop is
driven here one iteration at a time (`BatchScheduler.run_once`), and each iteration is one step of
the streams (one token each), so an iteration's wall time is the streams' inter-token latency. It
reports that latency before the prompt, while it is prefilled (median and worst), after it, and
the long prompt's own time to first token, for each `--chunks` size (0 = the prompt in one forward).

`ttft`: time to first token of a request whose `--prefix`-token prefix is in the prefix cache
against one whose prefix is not (a fresh prefix of the same length each round), alternating for
`--rounds` rounds.

Prompts are token ids of this project's README (real text, reproducible).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from ..engine import Engine
from ..request import Request
from ..scheduler import BatchScheduler


def _text_ids(tokenizer, n: int, offset: int = 0) -> list[int]:
    readme = Path(__file__).resolve().parents[3] / "README.md"
    ids = tokenizer.encode(readme.read_text())
    while len(ids) < offset + n:
        ids = ids + ids
    return ids[offset : offset + n]


def itl(engine: Engine, chunk: int, long: int, warm: int, after: int) -> dict:
    sched = BatchScheduler(engine.model, engine.tokenizer, max_batch=8, max_model_len=long + 64,
                           prefill_chunk=chunk, prefix_cache_tokens=0)
    # Streams of 40-token prompts that could run `long` tokens; cancelled once measured.
    streams = [sched.submit(Request(_text_ids(engine.tokenizer, 40, 100 * i), long)) for i in range(4)]
    sched.run_once(wait=False)  # the streams' prefills and first step
    phases = {"before": [], "during": [], "after": []}
    for _ in range(warm):
        t = time.perf_counter()
        sched.run_once(wait=False)
        phases["before"].append(time.perf_counter() - t)
    late = sched.submit(Request(_text_ids(engine.tokenizer, long, 5000), 4))
    arrived = time.perf_counter()
    while late._sync.empty():
        t = time.perf_counter()
        sched.run_once(wait=False)
        phases["during"].append(time.perf_counter() - t)
    ttft = time.perf_counter() - arrived
    for _ in range(after):
        t = time.perf_counter()
        sched.run_once(wait=False)
        phases["after"].append(time.perf_counter() - t)
    for h in streams + [late]:
        h.cancel()
    while sched.num_running:
        sched.run_once(wait=False)
    ms = lambda xs: round(1000 * statistics.median(xs), 1)  # noqa: E731
    return {"chunk": chunk, "before_ms": ms(phases["before"]), "during_ms": ms(phases["during"]),
            "during_max_ms": round(1000 * max(phases["during"]), 1), "during_steps": len(phases["during"]),
            "after_ms": ms(phases["after"]), "long_ttft_s": round(ttft, 3)}


def ttft(engine: Engine, prefix: int, rounds: int) -> dict:
    sched = BatchScheduler(engine.model, engine.tokenizer, max_batch=4, max_model_len=prefix + 128,
                           prefix_cache_tokens=4 * (prefix + 64))
    question = _text_ids(engine.tokenizer, 20, 9000)

    def first_token_s(ids: list[int]) -> float:
        handle = sched.submit(Request(ids, 1))
        t = time.perf_counter()
        while not handle.finished:
            sched.run_once(wait=False)
        return time.perf_counter() - t

    shared = _text_ids(engine.tokenizer, prefix, 0)
    first_token_s(shared + question[:5])  # now cached
    cached, fresh = [], []
    for r in range(rounds):
        cached.append(first_token_s(shared + question[r % 5 : r % 5 + 10]))
        # A prefix not seen before: other text, first token changed so nothing matches.
        fresh.append(first_token_s([2] + _text_ids(engine.tokenizer, prefix - 1, 1000 + 37 * r)
                                   + question[:10]))
    stats = sched.prefix_cache.stats
    return {"prefix": prefix, "cached_ttft_s": round(statistics.median(cached), 3),
            "uncached_ttft_s": round(statistics.median(fresh), 3), "rounds": rounds,
            "hit_tokens": stats.hit_tokens, "cached_all": [round(x, 3) for x in cached],
            "uncached_all": [round(x, 3) for x in fresh]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--quantize", default="int8")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--what", default="itl,ttft")
    parser.add_argument("--chunks", default="0,256,512,1024")
    parser.add_argument("--long", type=int, default=2000)
    parser.add_argument("--warm", type=int, default=10)
    parser.add_argument("--after", type=int, default=10)
    parser.add_argument("--prefix", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    engine = Engine.load(args.model, quantize=args.quantize, dtype=args.dtype)
    what = args.what.split(",")
    if "itl" in what:
        itl(engine, 0, 200, 2, 2)  # warm-up: kernels, allocator
        for chunk in [int(c) for c in args.chunks.split(",")]:
            print(itl(engine, chunk, args.long, args.warm, args.after), flush=True)
    if "ttft" in what:
        print(ttft(engine, args.prefix, args.rounds), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
