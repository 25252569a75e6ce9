"""The worker behind `ref@` bench configurations: runs another specdec source tree in its own process.

Started by `bench/runner.py` as `python ref_worker.py SRC` (a script, not `-m`: it must import the
`specdec` package of SRC, never the one this file belongs to, so it imports nothing of its own
package and puts SRC first on the path). It speaks JSON lines: one request a line on stdin, one
reply a line on the stdout it was started with; anything the other tree prints goes to stderr.

It uses only what every specdec version has had: `Engine.load(target, drafter=..., ...)` with
keywords, `engine.generate(prompt_ids=..., max_new_tokens=...)` (greedy by default) and the
`Generation` it returns (`token_ids`, `stats`, `steps`). Every adaptation to an older signature
lives here: a keyword the other `Engine.load` does not take is dropped when its value is None
(the option left at its default) and an error otherwise.

Requests::

    {"op": "load", "target": ..., "load": {Engine.load keywords}, "threads": N, "clock": "wall" | "cpu"}
        -> {"ok": true, "specdec": path of the package imported}
    {"op": "generate", "ids": [...], "max_new": N}
        -> {"ok": true, "token_ids": [...], "wall_s": ..., stats ...}
    {"op": "exit"}

An error is answered {"error": "message"}; the worker stays up for the next request.
"""

import gc
import inspect
import json
import os
import sys
import time


class Worker:
    def __init__(self):
        self.engine = None
        self.clock = time.perf_counter

    def load(self, request):
        import torch

        from specdec.engine import Engine

        torch.set_num_threads(int(request["threads"]))
        # The calling runner's clock: wall time, or the process's CPU time (--clock cpu).
        self.clock = time.process_time if request.get("clock") == "cpu" else time.perf_counter
        accepted = inspect.signature(Engine.load).parameters
        options = {}
        for key, value in request["load"].items():
            if key in accepted:
                options[key] = value
            elif value is not None:
                raise ValueError(f"the reference tree's Engine.load takes no {key!r} (asked {key}={value!r})")
        self.engine = Engine.load(request["target"], **options)
        import specdec

        return {"specdec": os.path.dirname(specdec.__file__)}

    def generate(self, request):
        ids = list(request["ids"])
        gc.collect()  # the previous run's garbage, collected outside this run's time
        start = self.clock()
        gen = self.engine.generate(prompt_ids=ids, max_new_tokens=int(request["max_new"]))
        wall = self.clock() - start
        s = gen.stats
        steps = [st for st in getattr(gen, "steps", []) if getattr(st, "kind", "") != "prefill"]
        tested = sum(len(st.accepted) + (len(st.accepted) < st.drafted) for st in steps)
        return {"token_ids": [int(t) for t in gen.token_ids], "wall_s": wall, "new_tokens": s.new_tokens,
                "prefill_s": s.prefill_s, "target_forwards": s.target_forwards, "drafts": s.drafts,
                "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens, "tested_tokens": tested,
                "accepted_per_position": list(s.accepted_per_position),
                "drafted_per_position": list(s.drafted_per_position)}


def main():
    src = os.path.abspath(sys.argv[1])
    # sys.path[0] is this file's folder (the bench package of the calling tree): drop it, so that
    # nothing of the calling tree can be imported, and put the other tree first.
    sys.path[0] = src
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr  # whatever the other tree prints must not reach the reply stream
    worker = Worker()
    ops = {"load": worker.load, "generate": worker.generate}
    for line in sys.stdin:
        request = json.loads(line)
        op = request.get("op")
        if op == "exit":
            break
        try:
            if op not in ops:
                raise ValueError(f"unknown request {op!r}")
            reply = {"ok": True, **ops[op](request)}
        except Exception as exc:  # noqa: BLE001 - every failure is reported to the caller, in one line
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        replies.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
