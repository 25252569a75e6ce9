"""Greedy fidelity of specdec plain decoding against llama.cpp plain on the same GGUF (BENCHMARKS.md,
"Fidelity"). For each quantisation mode: the first token where specdec's greedy text leaves
llama.cpp's, and, teacher-forced, the positions of llama.cpp's continuation where specdec's top
token is llama.cpp's token.

    OMP_NUM_THREADS=1 python scripts/fidelity.py --llama-completion LLAMA_BUILD/bin/llama-completion \
        --model qwen2.5-coder-1.5b-instruct --modes int4,int8,none
"""

import argparse
import gc
import subprocess

import torch

from specdec.engine import Engine
from specdec.models import presets

# Our own chat questions, not Spec-Bench's.
PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a C function that reverses a singly linked list.",
    "What is a race condition? Give a short example.",
    "Write a SQL query that returns the five customers with the highest total order amount.",
    "How do I read a CSV file with pandas and compute the mean of one column?",
]


def first_divergence(tok, ids: list[int], text: str) -> int | None:
    """Index of the first token of `ids` whose decoded text leaves `text` (None: all agree)."""
    for j in range(len(ids)):
        if not text.startswith(tok.decode(ids[: j + 1]).rstrip("\ufffd")):
            return j
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-completion", required=True, help="llama.cpp's llama-completion program")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="a named model (specdec models)")
    ap.add_argument("--modes", default="int4,int8,none", help="specdec --quantize modes to compare")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    gguf = str(presets.path(args.model))
    engine = Engine.load(target=args.model, drafter="none", quantize=args.modes.split(",")[0])
    tok = engine.tokenizer
    chats = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    llama = []
    for ids in chats:  # llama.cpp's greedy continuation of the same rendered chat
        text = tok.decode(ids, skip_special_tokens=False)
        run = subprocess.run([args.llama_completion, "-m", gguf, "-t", str(torch.get_num_threads()), "-n",
                              str(args.tokens), "--temp", "0", "-no-cnv", "--no-display-prompt", "-c", "1024", "-p",
                              text], capture_output=True, text=True, check=True)
        llama.append(run.stdout)
    for mode in args.modes.split(","):
        if engine is None:
            engine = Engine.load(target=args.model, drafter="none", quantize=mode)
        firsts, agree, total = [], 0, 0
        for ids, text in zip(chats, llama):
            out = engine.generate(prompt_ids=ids, max_new_tokens=args.tokens).token_ids
            d = first_divergence(tok, out, text)
            firsts.append("=" if d is None else d)
            forced = tok.encode(text.rstrip())[: args.tokens] if text.strip() else []
            seq = ids + forced
            cache = engine.model.new_cache(1, len(seq) + 1)
            logits, _ = engine.model(torch.tensor([seq]), torch.arange(len(seq))[None], cache)
            top = logits[0, len(ids) - 1 : len(seq) - 1].argmax(-1).tolist()
            agree += sum(a == b for a, b in zip(top, forced))
            total += len(forced)
        print(f"{mode}: first divergence {firsts}; teacher-forced top token = llama.cpp's {agree}/{total}", flush=True)
        engine = None
        gc.collect()


if __name__ == "__main__":
    main()
