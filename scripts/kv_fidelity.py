"""How closely a float16 KV cache follows the float32 one (BENCHMARKS.md, "Serving under load").

For each of our own prompts: greedy decoding with a float32 cache gives the reference
continuation; then, teacher-forced along it one token a step (the decode path the server runs),
the float16 cache's top token is compared with the reference token at every position. Also the
first token where free-running greedy decoding with float16 leaves the float32 text.

    OMP_NUM_THREADS=1 PYTHONPATH=src python scripts/kv_fidelity.py --model default --tokens 64
"""

import argparse

import fidelity  # this folder's script: run as `python scripts/kv_fidelity.py`, its folder is on the path
import torch

from specdec.engine import Engine
from specdec.errors import InvalidRequestError

# fidelity.py's chat questions (our own, not Spec-Bench's) and two more.
PROMPTS = fidelity.PROMPTS + [
    "Summarise the causes of the French Revolution in a few sentences.",
    "Give three tips for writing clear commit messages.",
]


@torch.inference_mode()
def decode(model, ids: list[int], steps: int, dtype: torch.dtype, forced: list[int] | None = None):
    """Greedy tokens (or, with `forced`, the top token at each forced position) over `steps` steps."""
    cache = model.new_cache(1, len(ids) + steps + 1, dtype=dtype)
    logits, _ = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, last_n=1)
    tops, pos = [], len(ids)
    for i in range(steps):
        top = int(logits[0, -1].argmax())
        tops.append(top)
        nxt = top if forced is None else forced[i]
        logits, _ = model(torch.tensor([[nxt]]), torch.tensor([[pos]]), cache)
        pos += 1
    return tops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--quantize", default="auto")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    engine = Engine.load(target=args.model, drafter="none", quantize=args.quantize)
    tok, model = engine.tokenizer, engine.model
    agree = total = 0
    firsts = []
    for prompt in PROMPTS:
        try:
            ids = tok.encode_chat([{"role": "user", "content": prompt}])
        except InvalidRequestError:  # a base model (the default): the prompt as text
            ids = tok.encode(prompt)
        reference = decode(model, ids, args.tokens, torch.float32)
        forced = decode(model, ids, args.tokens, torch.float16, forced=reference)
        free = decode(model, ids, args.tokens, torch.float16)
        agree += sum(a == b for a, b in zip(forced, reference))
        total += len(reference)
        firsts.append(next((i for i, (a, b) in enumerate(zip(free, reference)) if a != b), None))
    print(f"{args.model} (quantize {args.quantize}): float16 KV top-1 = float32 KV's token at {agree}/{total} "
          f"teacher-forced positions ({100 * agree / total:.1f}%); first greedy difference per prompt: {firsts}")


if __name__ == "__main__":
    main()
