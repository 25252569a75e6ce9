"""Tenants, cache partitions and bounded work (issue 44, items 2-5; issue 45, item 5).

The attacks of issue 44 rerun as tests: a 6-digit PIN in another client's prompt recovered digit by
digit through the prefix cache (the hit tokens /metrics and `usage` report, and the time to first
token), a 50 MB body, keys that do not reach /metrics and the docs. Each one succeeds where it must
(within one tenant and salt: the test shows the channel is real) and fails across tenants and salts.

The tiny random Gemma 3 with the character tokenizer of test_server.py serves them in a thread of
the test process; the timing attack drives the scheduler in-process with the partitions the app
gives requests (`tenants.cache_partition`); one subprocess runs `specdec serve` for its log lines
and SIGHUP.
"""

import asyncio
import json
import logging
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdec.prefix_cache import PrefixCache
from specdec.sampling import SamplingParams
from specdec.scheduler import BatchScheduler, Request
from specdec.server.app import ServerSettings, create_app
from specdec.server.tenants import (DEFAULT_TENANT, KeyRing, Tenant, TenantBusyError, TenantGate, cache_partition,
                                    parse_keys)
from specdec.server.wire import http_protocol
from test_server import HOST, SETTINGS, ThreadServer, free_port

pytestmark = pytest.mark.usefixtures("one_thread")
C = "/v1/completions"
ALICE, BOB, CAROL, OPS = "sk-alice-0123456789", "sk-bob-0123456789", "sk-carol-0123456789", "metrics-0123456789"
PIN = "481527"
SECRET = "Internal note for the ACME account team. Customer record 77, door PIN " + PIN + ". Keep it."
PREFIX = SECRET[: SECRET.index(PIN)]


def auth(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


def keys_text(alice_limits: str = "") -> str:
    return f"# tenant key limits\nalice {ALICE} {alice_limits}\n\nbob {BOB}\n"


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(keys_text("concurrency=1 queue=1"))
    return path


@pytest.fixture(scope="module")
def served(tiny_folder, engine, keys_file):
    """Two tenants (alice: one place and one queue place; bob: the defaults), a metrics key."""
    settings = ServerSettings(model=str(tiny_folder), **SETTINGS, api_keys_file=str(keys_file), metrics_key=OPS)
    app = create_app(settings, load=lambda s: (engine.model, engine.tokenizer))
    srv = ThreadServer(app)
    srv.server.config.http = http_protocol()
    srv.start(wait_ready=False)
    deadline = time.time() + 60
    while httpx.get(srv.url + "/health").status_code != 200:
        assert time.time() < deadline
        time.sleep(0.05)
    yield srv.url, app.state.specdec
    srv.stop()


def complete(url: str, key: str, prompt: str, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    res = httpx.post(url + C, json=body, headers=auth(key), timeout=60)
    assert res.status_code == 200, res.text
    return res.json()


def samples(url: str, key: str) -> dict:
    """/metrics as {(name, labels without model_name): value}."""
    res = httpx.get(url + "/metrics", headers=auth(key))
    assert res.status_code == 200
    out = {}
    for family in text_string_to_metric_families(res.text):
        for s in family.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


# -- the keys file ----------------------------------------------------------------------------------


def test_keys_file_names_tenants_and_limits_and_its_errors_never_show_a_key():
    keys = parse_keys(keys_text("concurrency=2 queue=5 cache_share=0.25"), "k", concurrency=8, queue=64)
    assert keys[ALICE.encode()] == Tenant("alice", 2, 5, 0.25)
    assert keys[BOB.encode()] == Tenant("bob", 8, 64, 0.5)  # the defaults: --max-batch, --max-queue, 1/2
    for text, needle in ((f"alice {ALICE} speed=3", "line 1: unknown limit 'speed'"),
                         (f"alice {ALICE} concurrency=0", "line 1: concurrency must be an integer >= 1"),
                         (f"alice {ALICE} cache_share=1.5", "line 1: cache_share must be in (0, 1]"),
                         (f"alice {ALICE}\nbob {ALICE}", "line 2: this key is already another line's"),
                         (f"alice {ALICE}\nalice {BOB}", "line 2: tenant 'alice' is named twice"),
                         ("alice short", "line 1: the key is shorter than 8 characters"),
                         (f"al/ice {ALICE}", "line 1: a tenant name is"), ("# nothing", "no keys")):
        with pytest.raises(Exception) as err:
            parse_keys(text, "k", 8, 64)
        assert needle in str(err.value) and ALICE not in str(err.value) and BOB not in str(err.value)
    ring = KeyRing.build(None, None, 8, 64)  # no keys: everyone is the default tenant
    assert ring.identify(None).name == DEFAULT_TENANT
    single = KeyRing.build("sesame-key", None, 8, 64)
    assert single.identify("Bearer sesame-key").name == DEFAULT_TENANT and single.identify("Bearer sesame") is None
    assert cache_partition("request", Tenant("a", 1, 1, 1), "s") == ("a", "s")
    assert cache_partition("tenant", Tenant("a", 1, 1, 1), "s") == ("a", "")
    assert cache_partition("off", Tenant("a", 1, 1, 1), "s") is None


def test_cli_refuses_a_bad_keys_file_in_one_line(tmp_path, capsys):
    from specdec.cli import main as cli_main

    bad = tmp_path / "keys.txt"
    bad.write_text(f"alice {ALICE} concurrency=lots\n")
    assert cli_main(["serve", "--api-keys-file", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"specdec: error: {bad} line 1: concurrency must be an integer >= 1, got 'lots'"]


def test_the_tenant_gate_hands_places_over_in_order_and_a_cancelled_waiter_leaks_none():
    gate, alice = TenantGate(), Tenant("alice", 1, 2, 1.0)

    async def main():
        await gate.acquire(alice)
        second = asyncio.ensure_future(gate.acquire(alice))
        third = asyncio.ensure_future(gate.acquire(alice))
        await asyncio.sleep(0)
        with pytest.raises(TenantBusyError, match="tenant 'alice'"):
            await gate.acquire(alice)  # one generating, two waiting: full
        third.cancel()  # a client that leaves while waiting
        await asyncio.sleep(0)
        gate.release("alice")  # the first finishes: its place passes to the second, in order
        await asyncio.wait_for(second, 1)
        assert third.cancelled() and (gate.running("alice"), gate.waiting("alice")) == (1, 0)
        gate.release("alice")
        assert gate.running("alice") == 0
        await asyncio.wait_for(gate.acquire(alice), 1)  # free again at once

    asyncio.run(main())


# -- what needs a key ---------------------------------------------------------------------------------


def test_every_route_but_health_needs_a_key(served):
    url, _ = served
    for path in ("/metrics", "/docs", "/redoc", "/openapi.json", "/v1/models"):
        res = httpx.get(url + path)
        assert res.status_code == 401 and res.json()["error"]["code"] == "invalid_api_key", path
        assert httpx.get(url + path, headers=auth("Bearer sk-wrong-key")).status_code == 401
        assert httpx.get(url + path, headers=auth(ALICE)).status_code == 200, path
    assert httpx.get(url + "/metrics", headers=auth(OPS)).status_code == 200
    # The metrics key reads, it does not generate.
    assert httpx.post(url + C, json={"prompt": "hi"}, headers=auth(OPS)).status_code == 401
    health = httpx.get(url + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert complete(url, BOB, "hello there")["usage"]["completion_tokens"] == 1


def test_cache_salt_is_checked(served):
    url, _ = served
    for salt, needle in (("", "non-empty string"), ("s" * 257, "at most 256 characters, got 257"), (7, "string")):
        res = httpx.post(url + C, json={"prompt": "hi", "cache_salt": salt}, headers=auth(ALICE))
        assert res.status_code == 400 and res.json()["error"]["param"] == "cache_salt", res.text
        assert needle in res.json()["error"]["message"]
    ok = httpx.post(url + C, json={"prompt": "hi", "max_tokens": 1, "cache_salt": "x" * 43, "prompt_cache_key": "k"},
                    headers=auth(ALICE))
    assert ok.status_code == 200


# -- the PIN through the prefix cache's counters ----------------------------------------------------------


def recover_pin(url: str, key: str, salt: str | None = None) -> tuple[str, list[int]]:
    """Guess the PIN a digit at a time from `usage.prompt_tokens_details.cached_tokens` (what
    /metrics' hit counter showed per request in issue 44): the guess whose prompt matched one more
    cached character wins. Returns (the digits recovered, every guess's cached tokens)."""
    extra = {"cache_salt": salt} if salt else {}
    found, seen = "", []
    for _ in PIN:
        cached = {}
        for d in "0123456789":
            usage = complete(url, key, PREFIX + found + d + "#", **extra)["usage"]
            cached[d] = usage["prompt_tokens_details"]["cached_tokens"]
        seen += cached.values()
        best = max(cached, key=cached.get)
        if list(cached.values()).count(cached[best]) > 1:
            break  # nothing singles a digit out
        found += best
    return found, seen


def test_the_pin_leaks_within_a_partition_only(served):
    url, state = served
    store = state.scheduler.prefix_cache
    store.audit = True  # count what an unpartitioned store would have served
    complete(url, ALICE, SECRET, cache_salt="team-a")  # the victim's prompt enters the cache
    hits_before = samples(url, OPS)[("specdec:prefix_cache_hit_tokens_total", ())]
    withheld_before = store.stats.partition_withheld_tokens
    # Another tenant, and the same tenant with another salt (or none): no digit. Their guesses hit
    # only their own earlier guesses (the shared PREFIX, never a digit past it).
    seen = []
    for key, salt in ((BOB, None), (ALICE, "team-b"), (ALICE, None)):
        found, cached = recover_pin(url, key, salt)
        assert found == "" and max(cached) <= len(PREFIX), (key, salt, cached)
        seen += cached
    after = samples(url, OPS)
    # The server-wide hit counter moved by the attackers' own hits alone.
    assert after[("specdec:prefix_cache_hit_tokens_total", ())] - hits_before == sum(seen)
    assert after[("specdec:prefix_cache_cross_partition_hit_tokens_total", ())] == 0
    assert store.stats.cross_partition_hit_tokens == 0
    # ... although a shared cache would have served them the secret's digits: the attack was real.
    assert store.stats.partition_withheld_tokens - withheld_before >= 3
    # The same tenant and salt reads it back: the channel exists, inside the partition only.
    assert recover_pin(url, ALICE, "team-a")[0] == PIN
    store.audit = False


def test_a_tenants_metrics_show_its_own_requests_only(served):
    url, _ = served
    complete(url, BOB, SECRET)
    complete(url, BOB, SECRET)  # a hit in bob's own partition
    mine = samples(url, BOB)
    assert {dict(labels).get("tenant") for _, labels in mine} == {"bob"}
    assert not any(name.startswith("specdec:prefix_cache_hit") for name, _ in mine)  # server-wide: ops only
    assert mine[("specdec:tenant_prefix_cache_hit_tokens_total", (("tenant", "bob"),))] >= len(SECRET) - 1
    everything = samples(url, OPS)
    assert ("specdec:prefix_cache_hit_tokens_total", ()) in everything
    assert {dict(labels).get("tenant") for _, labels in everything} >= {"alice", "bob"}


# -- the PIN through the time to first token ---------------------------------------------------------------


def mann_whitney_p(a: list[float], b: list[float]) -> float:
    """Two-sided p-value of the Mann-Whitney U test (scipy's, asymptotic with ties corrected)."""
    from scipy.stats import mannwhitneyu

    return float(mannwhitneyu(a, b, alternative="two-sided", method="asymptotic").pvalue)


def test_time_to_first_token_separates_a_hit_within_a_partition_only(engine):
    """Same tenant and salt: faster than a fresh prompt (the channel is real). Another tenant, or
    the same tenant with another salt, asking for the victim's prompt: indistinguishable from a
    fresh prompt of the same length."""
    sched = BatchScheduler(engine.model, engine.tokenizer, max_batch=1, max_model_len=512, prefill_chunk=0,
                           prefix_cache_tokens=64 * 512, adaptive=False).start()
    rng = random.Random(44)
    alphabet = "abcdefghijklmnopqrstuvwxyz ,."
    secret = "".join(rng.choice(alphabet) for _ in range(440)) + PIN
    alice, bob = Tenant("alice", 1, 1, 1.0), Tenant("bob", 1, 1, 1.0)

    def ttft(prompt: str, tenant: Tenant, salt: str | None) -> float:
        req = Request(engine.tokenizer.encode(prompt), 1, SamplingParams(), tenant=tenant.name,
                      cache_partition=cache_partition("request", tenant, salt))
        return sched.submit(req).result().timing.ttft_s

    try:
        ttft(secret, alice, "team-a")  # the victim's prompt, now cached
        times = {"same": [], "fresh": [], "tenant": [], "salt": []}
        for i in range(20):
            tail = f"#{i:02d}"
            fresh = "".join(rng.choice(alphabet) for _ in range(len(secret))) + tail
            # Each probe in a partition of its own (a tenant's probes would otherwise hit their own
            # earlier probes, which are theirs to hit).
            probes = [("same", secret + tail, alice, "team-a"), ("fresh", fresh, alice, "team-a"),
                      ("tenant", secret + tail, bob, f"probe-{i}"), ("salt", secret + tail, alice, f"team-b-{i}")]
            rng.shuffle(probes)  # interleaved in a random order: drift and order effects hit every kind alike
            for kind, prompt, tenant, salt in probes:
                times[kind].append(ttft(prompt, tenant, salt))
        stats = sched.prefix_cache.stats
        assert stats.cross_partition_hit_tokens == 0 and stats.hit_tokens >= 20 * len(secret)
    finally:
        sched.shutdown()
    assert statistics.median(times["same"]) < statistics.median(times["fresh"])
    assert mann_whitney_p(times["same"], times["fresh"]) < 0.01, times
    for kind in ("tenant", "salt"):
        assert mann_whitney_p(times[kind], times["fresh"]) > 0.001, (kind, times)


def test_no_lookup_drafter_carries_one_request_into_another(engine):
    """The suffix drafter keeps statistics across the requests it sees; the server gives each
    request a fresh one (`spawn`), so the drafters it loaded never see a request."""
    sched = BatchScheduler(engine.model, engine.tokenizer, max_batch=2, max_model_len=512, adaptive=False).start()
    try:
        for drafter in ("suffix", "ngram"):
            req = Request(engine.tokenizer.encode(SECRET), 8, SamplingParams(), drafter=drafter, tenant="alice")
            assert sched.submit(req).result().usage.completion_tokens == 8
        assert sched.drafters["suffix"].num_entries == 0
        assert sched.drafters["suffix"].spawn().num_entries == 0
    finally:
        sched.shutdown()


# -- tenants' places ---------------------------------------------------------------------------------------


def test_a_tenant_over_its_places_gets_429_and_another_tenant_does_not(served):
    url, _ = served
    long = {"prompt": "abc abd", "max_tokens": 200, "temperature": 0, "speculative": False}

    async def main():
        async with httpx.AsyncClient(timeout=60) as http:
            alices = [http.post(url + C, json=long, headers=auth(ALICE)) for _ in range(5)]
            bobs = [http.post(url + C, json={**long, "max_tokens": 5}, headers=auth(BOB)) for _ in range(3)]
            return await asyncio.gather(*alices, *bobs)

    results = asyncio.run(main())
    alice, bob = results[:5], results[5:]
    assert sorted(r.status_code for r in alice) == [200, 200, 429, 429, 429]  # one generating, one waiting
    refused = next(r for r in alice if r.status_code == 429).json()["error"]
    assert refused["type"] == "rate_limit_error" and "tenant 'alice'" in refused["message"]
    assert [r.status_code for r in bob] == [200, 200, 200]


# -- bounded work --------------------------------------------------------------------------------------------


class HealthProbe:
    """GET /health in a loop from a thread of its own; the latency of each answer."""

    def __init__(self, url: str):
        self.url, self.latencies, self._stop = url, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(timeout=10) as http:
            while not self._stop.is_set():
                start = time.perf_counter()
                assert http.get(self.url + "/health").status_code == 200
                self.latencies.append(time.perf_counter() - start)
                time.sleep(0.01)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join(10)


def raw_exchange(port: int, head: bytes, body_chunks, limit_s: float = 5.0) -> tuple[bytes, float]:
    """Send `head` then body chunks until the server answers; (its answer, seconds to it)."""
    start = time.perf_counter()
    with socket.create_connection((HOST, port), timeout=limit_s) as sock:
        sock.sendall(head)
        sock.setblocking(False)
        answer = b""
        for chunk in body_chunks:
            try:
                answer += sock.recv(65536)
            except BlockingIOError:
                pass
            if answer:
                break
            try:
                sock.sendall(chunk)
            except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                break
        sock.setblocking(True)
        while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) == 0:
            more = sock.recv(65536)
            if not more:
                break
            answer += more
    return answer, time.perf_counter() - start


def test_a_50_mb_body_is_a_quick_413_and_health_keeps_answering(served):
    url, _ = served
    port = int(url.rsplit(":", 1)[1])
    size = 50_000_000
    request = f"POST {C} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {ALICE}\r\ncontent-type: application/json\r\n"
    with HealthProbe(url) as probe:
        time.sleep(0.2)
        # Announced by Content-Length: refused before the body is read.
        answer, seconds = raw_exchange(port, (request + f"content-length: {size}\r\n\r\n").encode(),
                                       (b"x" * 65536 for _ in range(size // 65536)))
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413") and seconds < 1.0, (head, seconds)
        assert json.loads(body)["error"]["code"] == "request_too_large"
        # Chunked, so the size shows only while reading: refused once past the limit.
        chunk = b"10000\r\n" + b"x" * 65536 + b"\r\n"
        answer, seconds = raw_exchange(port, (request + "transfer-encoding: chunked\r\n\r\n").encode(),
                                       (chunk for _ in range(size // 65536)))
        assert answer.startswith(b"HTTP/1.1 413") and seconds < 1.0, (answer[:200], seconds)
        # The largest body allowed, a prompt far past the context: tokenised off the event loop.
        prompt = "a" * 1_000_000
        start = time.perf_counter()
        res = httpx.post(url + C, json={"prompt": prompt, "max_tokens": 1}, headers=auth(ALICE), timeout=60)
        assert res.status_code == 400 and "context" in res.json()["error"]["message"], res.text
        big_s = time.perf_counter() - start
        time.sleep(0.1)
    lat = sorted(probe.latencies)
    assert len(lat) >= 10
    # Every answer well inside 100 ms but for scheduling noise on a shared machine: the 95th
    # percentile within it, and none near a stall (a 1 MB prompt tokenised on the loop stalls it).
    assert lat[int(0.95 * (len(lat) - 1))] < 0.1 and lat[-1] < 0.5, (lat[-5:], big_s)


def test_malformed_http_gets_the_error_object(served):
    url, _ = served
    port = int(url.rsplit(":", 1)[1])
    answer, _ = raw_exchange(port, b"GET /health HTTP/1.1\r\nhost: x\r\nbad header line\r\n\r\n", [])
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "malformed_request"


# -- reloading the keys ---------------------------------------------------------------------------------------


def test_keys_reload_and_a_broken_file_keeps_the_old_keys(served, keys_file, caplog):
    url, state = served
    try:
        keys_file.write_text(keys_text("concurrency=1 queue=1") + f"carol {CAROL}\n")
        assert state.reload_keys()
        assert httpx.get(url + "/v1/models", headers=auth(CAROL)).status_code == 200
        assert state.scheduler.prefix_cache.owner_budgets["carol"] == state.scheduler.prefix_cache.budget // 3
        keys_file.write_text(f"carol {CAROL} queue=-1\n")
        with caplog.at_level(logging.WARNING, logger="specdec.server"):
            caplog.clear()
            assert not state.reload_keys()
        lines = [r.getMessage() for r in caplog.records if r.name == "specdec.server"]
        assert len(lines) == 1 and "not reloaded" in lines[0] and "line 1" in lines[0] and CAROL not in lines[0]
        for key in (ALICE, BOB, CAROL):  # the previous keys stay in force
            assert httpx.get(url + "/v1/models", headers=auth(key)).status_code == 200
    finally:
        keys_file.write_text(keys_text("concurrency=1 queue=1"))
        state.reload_keys()
    assert httpx.get(url + "/v1/models", headers=auth(CAROL)).status_code == 401


def test_serve_says_ready_logs_each_request_and_reloads_on_sighup(tiny_folder, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text(keys_text())
    port = free_port()
    url = f"http://{HOST}:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "serve", "--model", str(tiny_folder), "--dtype", "float32",
         "--port", str(port), "--drafter", "ngram", "--served-model-name", "tiny", "--api-keys-file", str(keys)],
        stderr=subprocess.PIPE, text=True)
    try:
        lines = [proc.stderr.readline()]
        assert lines[0].startswith("specdec: loading") and "serving" not in lines[0], lines
        lines.append(proc.stderr.readline())
        # No --max-model-len: the tiny model's own context, 512 tokens.
        assert lines[1].strip() == f"specdec: ready: serving 'tiny' on {url} (context 512 tokens a request, 16 at once)", lines
        assert httpx.get(url + "/health").status_code == 200
        complete(url, ALICE, SECRET)
        assert httpx.post(url + C, json={"prompt": SECRET}, headers=auth("Bearer nope-nope-nope")).status_code == 401
        keys.write_text(keys_text() + f"carol {CAROL}\n")
        proc.send_signal(signal.SIGHUP)
        deadline = time.time() + 20
        while httpx.get(url + "/v1/models", headers=auth(CAROL)).status_code != 200:
            assert time.time() < deadline
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        lines += proc.stderr.read().splitlines()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "\n".join(lines)
    access = [ln for ln in lines if ln.startswith("specdec: access")]
    ok = next(ln for ln in access if "tenant=alice" in ln)
    for part in ("status=200", "POST /v1/completions", f"prompt_tokens={len(SECRET)}", "completion_tokens=1",
                 "tokens_per_forward="):
        assert part in ok, ok
    assert any("tenant=- " in ln and "status=401" in ln for ln in access)
    assert "reloaded: 3 tenants" in text and lines[-1].startswith("specdec: shut down after")
    assert "requests (200:" in lines[-1] and "401: 1" in lines[-1]
    for secret in (ALICE, BOB, CAROL, PIN, "nope-nope"):  # never a key or a prompt
        assert secret not in text
