"""Tool calling against an OpenAI-compatible server (issue 47's must-shows): accuracy of calls
against ground truth, and an agent loop (multi-turn, tool results fed back) timed with speculation
on and off.

    specdec serve qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct ... &
    pip download --no-deps bfcl-eval -d /tmp/bfcl
    python scripts/tool_bench.py --base-url http://127.0.0.1:8000/v1 --bfcl-wheel /tmp/bfcl/*.whl --out tools.json
    llama-server -m target.gguf -md draft.gguf --jinja --port 8081 &
    python scripts/tool_bench.py --base-url http://127.0.0.1:8081/v1 --no-speculative-field

Accuracy: each case (scripts/tool_cases.py: 120 of our own, plus the first 100 of BFCL's
simple_python from bfcl-eval's wheel) asked once with tool_choice "auto" at temperature 0; right when the answer
is exactly one call (as `tool_calls`) that the case's truth accepts. With the `speculative` field
(specdec's extension) each case is asked again with speculation off and the calls compared.

History: a scripted agent conversation replayed turn by turn as an agent framework re-sends it
(`--history TURNS`): the model asked to read a file part by part, each turn adding one read_file
call and its result (~450 tokens of Python's own textwrap.py), so turn 10 carries >= 4k tokens of
history; per turn the prompt tokens, the tokens the prefix cache served and the time to the first
token (a one-token answer's time). A run's first message names the run, so no run reuses another's cache.

Agent loop: each scenario's conversation runs until the model answers without calls (or
--max-turns), every call answered by a fake tool with a fixed result; per turn the time to the
first streamed chunk, the completion tokens and the turn's time; the loop's total with speculation
on and, with the field, off. The server's prefix cache serves both alike: each run sends a
`cache_salt` of its own (specdec's and vLLM's field), so it reuses its own earlier turns, never
another run's (a server without the field, `--no-speculative-field`, is sent none).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import textwrap
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import openai  # noqa: E402

from tool_cases import TOOLS, bfcl_cases, case_right, own_cases  # noqa: E402

SCENARIOS = [
    {"name": "trip", "tools": ["get_weather", "search_flights", "convert_currency"],
     "ask": "I'm going from Paris to Lisbon on 2026-03-14. Check the weather in Lisbon in celsius, find my "
            "flights, and convert 500 EUR to USD for me. Use the tools one at a time, then summarise."},
    {"name": "office", "tools": ["send_email", "create_reminder", "set_alarm"],
     "ask": "Email ana@example.com with the subject \"Quarterly report\", remind me to call mom in 20 minutes, "
            "and set an alarm for 07:30. Use the tools one at a time, then tell me what you did."},
    {"name": "money", "tools": ["get_stock_price", "convert_currency", "compute_tip"],
     "ask": "Get the price of NVDA, convert 120 USD to JPY, and work out a 18% tip on 87.6 dollars. "
            "Use the tools one at a time, then give me the three numbers."},
]


def fake_result(name: str, args: dict) -> str:
    """A fixed tool result for a call (what the agent loop feeds back)."""
    if name == "get_weather":
        return json.dumps({"city": args.get("city"), "temperature": 19, "sky": "clear"})
    if name == "search_flights":
        return json.dumps({"flights": [{"id": "TP431", "departs": "08:10", "price_eur": 142},
                                       {"id": "AF1024", "departs": "13:45", "price_eur": 188}]})
    if name == "convert_currency":
        return json.dumps({"amount": args.get("amount"), "converted": 541.2, "to": args.get("to_currency")})
    if name == "get_stock_price":
        return json.dumps({"symbol": args.get("symbol"), "price": 131.4})
    if name == "compute_tip":
        return json.dumps({"tip": 15.77})
    return json.dumps({"ok": True})


PART_CHARS = 1800  # a read_file result: ~450 tokens of Python source for Qwen2.5's tokenizer
READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read one part (about 60 lines) of a source file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "part": {"type": "integer"}},
                   "required": ["path", "part"]}}}


def history_turns(client, model: str, turns: int, speculative: bool | None) -> list[dict]:
    """The scripted conversation of the module doc, sent once per turn for one token (so the time is
    the time to the first token, whatever the token is): [{turn, prompt_tokens, cached_tokens,
    ttft_s}]."""
    source = inspect.getsource(textwrap)
    parts = [source[i:i + PART_CHARS] for i in range(0, len(source), PART_CHARS)]
    messages = [{"role": "user", "content": f"(run {uuid.uuid4().hex[:8]}) Read textwrap.py part by part with "
                                            "read_file, then tell me what its dedent function does."}]
    out = []
    for n in range(1, turns + 1):
        started = time.perf_counter()
        res = client.chat.completions.create(model=model, messages=messages, tools=[READ_FILE], temperature=0,
                                             max_tokens=1, **_extra(speculative))
        seconds = time.perf_counter() - started
        details = getattr(res.usage, "prompt_tokens_details", None)
        out.append({"turn": n, "prompt_tokens": res.usage.prompt_tokens if res.usage else None,
                    "cached_tokens": getattr(details, "cached_tokens", None), "ttft_s": seconds})
        call_id = f"call_{n}"
        messages.append({"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {
            "name": "read_file", "arguments": json.dumps({"path": "textwrap.py", "part": n})}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": parts[(n - 1) % len(parts)]})
    return out


def _extra(speculative: bool | None, salt: str | None = None) -> dict:
    """specdec's fields (none for a server without them: speculative None)."""
    if speculative is None:
        return {}
    return {"extra_body": {"speculative": speculative, "specdec": {"stats": True}} | ({"cache_salt": salt} if salt else {})}


def ask(client, model: str, case: dict, speculative: bool | None, max_tokens: int):
    res = client.chat.completions.create(model=model, messages=case["messages"], tools=case["tools"],
                                         tool_choice="auto", temperature=0, max_tokens=max_tokens,
                                         **_extra(speculative))
    message = res.choices[0].message
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []], res.choices[0].finish_reason


def accuracy(client, model: str, cases: list[dict], compare: bool, max_tokens: int) -> dict:
    """Right calls over the cases (each set apart), and with `compare` how many are identical off."""
    out: dict = {}
    for case in cases:
        kind = case["id"].split("_")[0]
        row = out.setdefault(kind, {"cases": 0, "right": 0, "as_tool_calls": 0, "identical_off": 0, "errors": [], "per_case": []})
        row["cases"] += 1
        try:
            calls, _ = ask(client, model, case, True if compare else None, max_tokens)
        except openai.APIStatusError as exc:  # a schema the server refuses: a wrong answer, said why
            row["errors"].append({"id": case["id"], "status": exc.status_code, "message": str(exc)[:300]})
            continue
        right = case_right(calls, case["truth"])
        row["right"] += right
        row["as_tool_calls"] += bool(calls)
        row["per_case"].append({"id": case["id"], "right": right, "calls": calls})
        if compare:
            row["identical_off"] += ask(client, model, case, False, max_tokens)[0] == calls
    for row in out.values():
        row["accuracy"] = row["right"] / row["cases"]
    return out


def turn(client, model: str, messages: list, tools: list, speculative: bool | None, max_tokens: int,
         salt: str | None = None) -> dict:
    """One streamed turn: its message (content, calls) and timings."""
    started, first = time.perf_counter(), None
    content, calls, usage, stats = "", {}, None, {}
    stream = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice="auto",
                                            temperature=0, max_tokens=max_tokens, stream=True,
                                            stream_options={"include_usage": True},
                                            **_extra(speculative, salt))
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        stats = (getattr(chunk, "specdec", None) or {}).get("stats") or stats  # the last chunk's, from specdec
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if first is None and (delta.content or delta.tool_calls):
            first = time.perf_counter() - started
        content += delta.content or ""
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"id": part.id, "name": "", "arguments": ""})
            entry["name"] += (part.function.name or "") if part.function else ""
            entry["arguments"] += (part.function.arguments or "") if part.function else ""
    details = usage.prompt_tokens_details if usage else None
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "ttft_s": first,
            "turn_s": time.perf_counter() - started, "tokens": usage.completion_tokens if usage else None,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "cached_tokens": details.cached_tokens if details else None,
            "target_passes": stats.get("target_passes"), "draft_tokens": stats.get("draft_tokens"),
            "accepted_tokens": stats.get("accepted_tokens")}


def agent_loop(client, model: str, scenario: dict, speculative: bool | None, max_turns: int, max_tokens: int) -> dict:
    tools = [TOOLS[n] for n in scenario["tools"]]
    messages = [{"role": "user", "content": scenario["ask"]}]
    turns, started, salt = [], time.perf_counter(), uuid.uuid4().hex
    for _ in range(max_turns):
        t = turn(client, model, messages, tools, speculative, max_tokens, salt)
        turns.append({k: t[k] for k in ("ttft_s", "turn_s", "tokens", "prompt_tokens", "cached_tokens", "target_passes",
                                        "draft_tokens", "accepted_tokens")} | {"calls": [c["name"] for c in t["calls"]]})
        if not t["calls"]:
            break
        messages.append({"role": "assistant", "content": t["content"] or None, "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in t["calls"]]})
        for c in t["calls"]:
            try:
                args = json.loads(c["arguments"])
            except ValueError:
                args = {}
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": fake_result(c["name"], args)})
    return {"scenario": scenario["name"], "total_s": time.perf_counter() - started, "turns": turns}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None, help="the served model's name (default: the server's first)")
    p.add_argument("--cases", default="own,bfcl", help="own, bfcl or both (comma-separated)")
    p.add_argument("--bfcl", type=int, default=100, help="how many BFCL simple_python cases")
    p.add_argument("--bfcl-wheel", default=None, help="bfcl-eval's wheel (pip download --no-deps bfcl-eval); "
                                                      "default: the installed package")
    p.add_argument("--limit", type=int, default=None, help="at most this many cases of each set")
    p.add_argument("--no-speculative-field", action="store_true",
                   help="a server without specdec's `speculative` field (llama-server): no on/off comparison")
    p.add_argument("--loops", type=int, default=1, help="repeats of each agent-loop scenario (0: none)")
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--history", type=int, default=0, metavar="TURNS",
                   help="replay the scripted read_file conversation over this many turns (0: none)")
    p.add_argument("--history-repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--peer-base-url", default=None,
                   help="another server (e.g. llama-server --jinja) whose agent loops and history turns run "
                        "interleaved with these, for a side-by-side ratio")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    client = openai.OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=600)
    model = args.model or client.models.list().data[0].id
    peer = None
    if args.peer_base_url:
        peer_client = openai.OpenAI(base_url=args.peer_base_url, api_key="unused", max_retries=0, timeout=600)
        peer = (peer_client, peer_client.models.list().data[0].id)
    compare = not args.no_speculative_field
    cases = []
    for kind in args.cases.split(","):
        got = own_cases() if kind == "own" else bfcl_cases(args.bfcl, args.bfcl_wheel) if kind == "bfcl" else None
        if got is None:
            p.error(f"--cases: unknown set {kind!r} (own, bfcl)")
        cases += got[: args.limit]
    result = {"model": model, "base_url": args.base_url,
              "accuracy": accuracy(client, model, cases, compare, args.max_tokens), "loops": []}
    for row_kind, row in result["accuracy"].items():
        print(f"{row_kind}: {row['right']}/{row['cases']} right ({row['accuracy']:.0%}), {row['as_tool_calls']} as "
              f"tool_calls, {len(row['errors'])} refused"
              + (f", {row['identical_off']} identical with speculation off" if compare else ""))
    for _ in range(args.history and args.history_repeats):
        turns = history_turns(client, model, args.history, True if compare else None)
        result.setdefault("history", []).append(turns)
        print("history: " + ", ".join(f"turn {t['turn']} {t['prompt_tokens']} tokens ({t['cached_tokens']} cached) "
                                      f"ttft {t['ttft_s']:.2f} s" for t in turns))
        if peer is not None:
            turns = history_turns(*peer, args.history, None)
            result.setdefault("peer_history", []).append(turns)
            print("peer history: " + ", ".join(f"turn {t['turn']} ttft {t['ttft_s']:.2f} s" for t in turns))
    if result.get("history") and args.history >= 2:
        ratio = [h[-1]["ttft_s"] / h[1]["ttft_s"] for h in result["history"]]
        result["history_ttft_last_over_second"] = ratio
        print(f"history: turn {args.history} / turn 2 time to first token: " + ", ".join(f"{r:.2f}x" for r in ratio))
    for _ in range(args.loops):
        for scenario in SCENARIOS:
            runs = [(client, model, s) for s in ((True, False) if compare else (None,))]
            for who, name, speculative in runs + ([(*peer, "peer")] if peer is not None else []):
                loop = agent_loop(who, name, scenario, None if speculative == "peer" else speculative,
                                  args.max_turns, args.max_tokens)
                loop["speculative"] = speculative
                result["loops"].append(loop)
                print(f"loop {scenario['name']} speculative={speculative}: {loop['total_s']:.2f} s, "
                      f"{len(loop['turns'])} turns, ttft " + ", ".join(f"{t['ttft_s'] or 0:.3f}" for t in loop["turns"]))
    if compare and result["loops"]:
        on = sum(x["total_s"] for x in result["loops"] if x["speculative"] is True)
        off = sum(x["total_s"] for x in result["loops"] if x["speculative"] is False)
        result["loop_speedup"] = off / on if on else None
        print(f"agent loops: {off:.2f} s off / {on:.2f} s on = {result['loop_speedup']:.2f}x")
        for mode in (True, False):
            for part, pick in (("first turns", lambda i: i == 0), ("later turns", lambda i: i > 0)):
                turns = [t for x in result["loops"] if x["speculative"] is mode
                         for i, t in enumerate(x["turns"]) if pick(i)]
                total = {k: sum(t[k] or 0 for t in turns) for k in ("turn_s", "ttft_s", "tokens", "prompt_tokens",
                                                                   "cached_tokens", "target_passes")}
                print(f"  speculative={mode}, {part}: {total['turn_s']:.2f} s (to the first token "
                      f"{total['ttft_s']:.2f} s), {total['prompt_tokens']} prompt tokens ({total['cached_tokens']} "
                      f"cached), {total['tokens']} tokens in {total['target_passes']} target passes")
        if peer is not None:
            other = sum(x["total_s"] for x in result["loops"] if x["speculative"] == "peer")
            result["loop_speedup_over_peer"] = other / on if on else None
            print(f"agent loops: {other:.2f} s peer / {on:.2f} s on = {result['loop_speedup_over_peer']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
