"""Load test: total generated tokens/s of the server at several concurrencies, speculative vs plain.

    python -m specdec.server.loadtest --concurrency 1,4,16 --requests 16 --max-tokens 64

starts `specdec serve` (default model, ngram drafter) in a subprocess on a free loopback port, or
measures a running server given `--url`. Both modes run against the same server in one run; the
plain mode sends `speculative: false` per request, the speculative one `speculative: {drafter, k}`,
so they share the weights, the batcher and the warm caches. Each of `--rounds` rounds runs every
level once in each mode (c = 1 spec, c = 1 plain, c = 4 spec, ...), so that drift of a shared
machine hits both modes and every level alike, and the report gives per level the median over the
rounds: tokens/s of each mode, the speculative/plain ratio, and plain tokens/s against the first
level's (the scaling with concurrency), each ratio taken within a round, side by side. Each level
is a closed loop: `c` workers, each sending its next request as soon as its previous one is
answered, until `--requests` requests are done; tokens/s is the completion tokens of all of them
over the wall time of the level. Greedy decoding, so the two modes must return the same text: the
report counts the requests whose outputs differ.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from ..bench.prompts import select_prompts, spec_bench_path
from ..extras import require
from ..settings import DEFAULT_NUM_SPECULATIVE_TOKENS

require("server", "the load test", "httpx")

import httpx  # noqa: E402 (after the check that says what to install)


@dataclass
class LevelResult:
    mode: str
    concurrency: int
    requests: int
    completion_tokens: int
    wall_s: float
    mean_latency_s: float
    texts: dict[int, str]

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s else 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "specdec.cli", "serve", "--model", args.model, "--port", str(port),
           "--drafter", args.drafter, "-k", str(args.k), "--max-batch", str(max(args.levels)),
           "--max-model-len", str(args.max_model_len), "--dtype", args.dtype,
           "--served-model-name", "loadtest"]
    if args.spec_token_budget:
        cmd += ["--spec-token-budget", str(args.spec_token_budget)]
    cmd += ["--speculation-control", args.speculation_control]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise SystemExit("the server did not become ready")
        time.sleep(0.5)


async def run_level(url: str, prompts: list[str], mode: str, concurrency: int, n_requests: int, args) -> LevelResult:
    speculative = False if mode == "plain" else {"drafter": args.drafter, "num_tokens": args.k}
    todo = list(range(n_requests))
    texts: dict[int, str] = {}
    latencies: list[float] = []
    tokens = 0

    async def worker(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while todo:
            i = todo.pop(0)
            body = {"prompt": prompts[i % len(prompts)], "max_tokens": args.max_tokens, "temperature": 0,
                    "speculative": speculative}
            start = time.perf_counter()
            res = await http.post(url + "/v1/completions", json=body)
            if res.status_code != 200:
                raise SystemExit(f"request {i} failed with {res.status_code}: {res.text}")
            out = res.json()
            latencies.append(time.perf_counter() - start)
            tokens += out["usage"]["completion_tokens"]
            texts[i] = out["choices"][0]["text"]

    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as http:
        start = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return LevelResult(mode, concurrency, n_requests, tokens, wall, sum(latencies) / len(latencies), texts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.server.loadtest", description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a running server (default: start one)")
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--drafter", default="ngram", choices=["ngram", "suffix"])
    parser.add_argument("-k", type=int, default=DEFAULT_NUM_SPECULATIVE_TOKENS)
    parser.add_argument("--spec-token-budget", type=int, default=None)
    parser.add_argument("--speculation-control", default="goodput", choices=["goodput", "budget"])
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests", type=int, default=0,
                        help="requests per level and mode (default: the concurrency, at least 4)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of every level in both modes; the report gives medians over them")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--tasks", default="code,summarization,qa", help="bench prompt groups")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    args.levels = [int(x) for x in args.concurrency.split(",")]
    groups = args.tasks.split(",")
    path = spec_bench_path()
    if path is None:
        groups = ["code"]
    most = args.requests or max(4, max(args.levels))
    selected = select_prompts(groups, max(1, -(-most // len(groups))), path)
    prompts = [p.text for p in selected]

    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    try:
        # Warm-up at the widest level, both modes: a server's first wide batches pay one-time costs
        # (allocator growth, buffers sized by the batch) that would otherwise land in whichever level
        # runs first.
        for mode in ("spec", "plain"):
            asyncio.run(run_level(url, prompts, mode, max(args.levels), max(args.levels), args))
        results: dict[tuple[int, int, str], LevelResult] = {}  # (round, concurrency, mode)
        for round_ in range(args.rounds):
            for c in args.levels:
                # Which mode goes first alternates by round, so neither always follows the other.
                for mode in ("spec", "plain") if round_ % 2 == 0 else ("plain", "spec"):
                    n = args.requests or max(4, c)
                    r = results[round_, c, mode] = asyncio.run(run_level(url, prompts, mode, c, n, args))
                    print(f"  round {round_ + 1} c={c:<3} {mode:<5} {r.tokens_per_s:7.1f} tok/s  ({r.completion_tokens} "
                          f"tokens, {r.wall_s:.1f} s, mean latency {r.mean_latency_s:.2f} s)", file=sys.stderr)
        metrics = httpx.get(url + "/metrics").text
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)

    rows = summarize(results, args.levels, args.rounds)
    accepted = {ln.split(" ")[0]: ln.split(" ")[1] for ln in metrics.splitlines()
                if ln.startswith("specdec:spec_decode_num_") and "per_pos" not in ln}
    if args.json:
        print(json.dumps({"rows": rows, "spec_metrics": accepted, "args": vars(args)}))
        return 0
    print(f"model {args.model}, drafter {args.drafter} k={args.k}, speculation control {args.speculation_control}, "
          f"{args.requests or 'max(4, concurrency)'} requests x {args.max_tokens} tokens per level and mode, greedy")
    if args.rounds > 1:
        print(f"medians over {args.rounds} rounds; each ratio taken within a round")
    first = args.levels[0]
    print(f"| concurrency | plain tok/s | plain vs c={first} | speculative tok/s | speculative vs plain | outputs differ |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['plain_tokens_per_s']:.1f} | {r['plain_scaling']:.2f}x | "
              f"{r['spec_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['outputs_differ']} |")
    return 0


def summarize(results: dict[tuple[int, int, str], LevelResult], levels: list[int], rounds: int) -> list[dict]:
    """Per level: the medians over the rounds of each mode's tokens/s, of the speculative/plain ratio
    and of plain tokens/s over the first level's, each ratio from one round's side-by-side runs, and
    the requests whose outputs differ between the modes (any round)."""
    rows = []
    for c in levels:
        spec = [results[r, c, "spec"].tokens_per_s for r in range(rounds)]
        plain = [results[r, c, "plain"].tokens_per_s for r in range(rounds)]
        base = [results[r, levels[0], "plain"].tokens_per_s for r in range(rounds)]
        differ = set()
        for r in range(rounds):
            s_texts, p_texts = results[r, c, "spec"].texts, results[r, c, "plain"].texts
            differ.update(i for i in s_texts if s_texts[i] != p_texts.get(i))
        rows.append({"concurrency": c, "spec_tokens_per_s": statistics.median(spec),
                     "plain_tokens_per_s": statistics.median(plain),
                     "speedup": statistics.median(s / p if p else 0.0 for s, p in zip(spec, plain)),
                     "plain_scaling": statistics.median(p / b if b else 0.0 for p, b in zip(plain, base)),
                     "outputs_differ": len(differ), "spec_rounds": spec, "plain_rounds": plain})
    return rows


if __name__ == "__main__":
    sys.exit(main())
