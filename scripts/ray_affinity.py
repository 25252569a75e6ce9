"""Does session affinity raise the suffix drafter's acceptance on multi-turn conversations?

Two replicas of the default model (dtype auto, suffix drafter, k=5, budget rule so every step drafts),
Ray's consistent-hash router. 8 conversations of 4 turns run at once (turns of one conversation in
order); each turn's prompt is the whole conversation so far. With the X-Session-Id header every
turn of a conversation goes to one replica; without it each turn goes to a replica hashed from its
request id. Fresh replicas for every run (the app is deleted and deployed again), order A B B A.
Acceptance = accepted / drafted tokens, summed over the replicas' /metrics.
Usage: python scripts/ray_affinity.py   (needs the ray extra)"""
import asyncio, os, re, time
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
import httpx
import ray
from ray import serve
from specdec.server.app import ServerSettings
from specdec.server.ray_app import application

PORT = 8767
URL = f"http://127.0.0.1:{PORT}"
TOPICS = ["a hash table", "a linked list", "TCP", "DNS", "a binary heap", "garbage collection", "a mutex",
          "an HTTP cookie"]
ASKS = ["What is {t}? Answer in two sentences.", "Give a short example of {t} in Python.",
        "Repeat your example, but add comments.", "Summarise everything you said about {t} in one sentence."]


def totals():
    text = httpx.get(URL + "/metrics", timeout=30).text
    out = {}
    for name in ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                 "generation_tokens_total"):
        out[name] = sum(float(v) for v in re.findall(rf'specdec:{name}{{replica="[^"]+",model_name="[^"]*"}} (\S+)', text))
    return out


async def conversation(http, c, sticky):
    history = ""
    for turn, ask in enumerate(ASKS):
        history += f"User: {ask.format(t=TOPICS[c])}\nAssistant:"
        headers = {"X-Session-Id": f"conv-{c}"} if sticky else {}
        for attempt in range(3):  # a replica lost to the machine's memory pressure: resend
            res = await http.post(URL + "/v1/completions", headers=headers, json={
                "prompt": history, "max_tokens": 40, "temperature": 0, "stop": ["\nUser:"]})
            if res.status_code == 200:
                break
            print(f"conversation {c} turn {turn}: {res.status_code}, resent", flush=True)
            await asyncio.sleep(5)
        res.raise_for_status()
        history += res.json()["choices"][0]["text"] + "\n"


async def run(sticky):
    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(conversation(http, c, sticky) for c in range(len(TOPICS))))


ray.init(include_dashboard=False, log_to_driver=False)
serve.start(http_options={"host": "127.0.0.1", "port": PORT})
settings = ServerSettings(served_model_name="gemma-3-270m", drafter="suffix", max_batch=8, max_model_len=1024,
                          speculation_control="budget")
results = []
try:
    for sticky in (True, False, False, True):
        serve.run(application(settings, replicas=2, session_affinity=True, log_level="WARNING"), name="specdec",
                  route_prefix="/")
        t0 = time.perf_counter()
        asyncio.run(run(sticky))
        wall = time.perf_counter() - t0
        time.sleep(3)  # every replica's last counters pushed to the hub
        t = totals()
        acc = t["spec_decode_num_accepted_tokens_total"] / max(1, t["spec_decode_num_draft_tokens_total"])
        row = (sticky, t["generation_tokens_total"], t["spec_decode_num_draft_tokens_total"],
               t["spec_decode_num_accepted_tokens_total"], acc, t["generation_tokens_total"] / wall)
        results.append(row)
        print(row, flush=True)
        serve.delete("specdec")
finally:
    serve.shutdown()
    ray.shutdown()
print("| X-Session-Id | generated | drafted | accepted | acceptance | tok/s |")
print("|---|---:|---:|---:|---:|---:|")
for sticky, gen, drafted, accepted, acc, tps in results:
    print(f"| {'yes (affinity)' if sticky else 'no (spread)'} | {gen:.0f} | {drafted:.0f} | {accepted:.0f} | "
          f"{acc:.3f} | {tps:.1f} |")
