"""Structured output under speculation (BENCHMARKS.md): the Qwen2.5-Coder pair, plain against the draft
model (k = 4 fixed), greedy, with a JSON schema and without, interleaved per prompt.

    OMP_NUM_THREADS=1 python scripts/structured_bench.py 48
"""
import json, sys
from specdec import Engine

N = int(sys.argv[1]) if len(sys.argv) > 1 else 64
engine = Engine.load(target="qwen2.5-coder-1.5b-instruct", drafter="qwen2.5-coder-0.5b-instruct",
                     quantize="int8", num_speculative_tokens=4, draft_length="fixed")
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "language": {"type": "string"},
    "parameters": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"}, "type": {"type": "string"}},
                                               "required": ["name", "type"]}},
    "returns": {"type": "string"}, "description": {"type": "string"}},
    "required": ["name", "language", "parameters", "returns", "description"]}
QUESTIONS = ["Describe a Python function that checks whether a string is a palindrome, as JSON with the keys name, language, parameters, returns, description.",
             "Describe a C function that reverses a singly linked list, as JSON with the keys name, language, parameters, returns, description.",
             "Describe a JavaScript function that debounces another function, as JSON with the keys name, language, parameters, returns, description."]
tok = engine.tokenizer
rows = {}
engine.generate(prompt_ids=tok.encode_chat([{"role": "user", "content": "hi"}]), max_new_tokens=4, structured={"json": SCHEMA})
for q in QUESTIONS:
    ids = tok.encode_chat([{"role": "user", "content": q}])
    for name, spec, structured in [("plain+schema", False, {"json": SCHEMA}), ("draft k=4+schema", True, {"json": SCHEMA}),
                                   ("plain", False, None), ("draft k=4", True, None)]:
        g = engine.generate(prompt_ids=ids, max_new_tokens=N, speculative=spec, structured=structured)
        r = rows.setdefault(name, dict(tokens=0, decode_s=0.0, drafts=0, acc=0, drafted=0, out=[]))
        r["tokens"] += g.stats.new_tokens - 1
        r["decode_s"] += g.stats.wall_s - g.stats.prefill_s
        r["drafts"] += g.stats.drafts; r["acc"] += g.stats.accepted_tokens; r["drafted"] += g.stats.draft_tokens
        r["out"].append(g.token_ids)
        if structured and g.finish_reason == "stop":
            json.loads(g.text)
        print(name, repr(g.text[:100]), g.finish_reason, f"{g.stats.tokens_per_s:.2f} tok/s", flush=True)
base = {k: rows[k]["tokens"] / rows[k]["decode_s"] for k in rows}
print("| config | decode tokens/s | vs plain (same constraint) | mean accepted length | acceptance | identical to plain |")
print("|---|---|---|---|---|---|")
for name, r in rows.items():
    ref = "plain+schema" if "schema" in name else "plain"
    mal = 1 + r["acc"] / r["drafts"] if r["drafts"] else 1.0
    acc = r["acc"] / r["drafted"] if r["drafted"] else 0.0
    same = sum(a == b for a, b in zip(r["out"], rows[ref]["out"]))
    print(f"| {name} | {base[name]:.2f} | {base[name] / base[ref]:.2f}x | {mal:.2f} | {acc:.2f} | {same}/{len(r['out'])} |")
