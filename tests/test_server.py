"""The OpenAI-compatible server, driven over loopback by the official `openai` client and httpx.

Most tests run a tiny random Gemma 3 (float32) with a character-level tokenizer that has a chat
template, served by uvicorn in a thread; one test starts the real `specdec serve` command in a
subprocess to check SIGTERM draining; a few run on the default model.
"""

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from specdec import Engine, SamplingParams
from specdec.server.app import ServerSettings, create_app, load_model

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ThreadServer:
    """uvicorn serving `app` on a free loopback port, in a thread of the test process."""

    def __init__(self, app):
        import uvicorn

        self.app = app
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=HOST, port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, wait_ready: bool = True) -> "ThreadServer":
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)
        while wait_ready and httpx.get(self.url + "/health").status_code != 200:
            assert time.time() < deadline, "model did not load"
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    @property
    def scheduler(self):
        return self.app.state.specdec.scheduler


def hold_scheduler(scheduler, ready, timeout: float = 120) -> threading.Event:
    """Park a running scheduler's loop between two of its iterations until `ready()` holds, once.

    Returns when the loop is parked. Requests that arrive meanwhile all wait, and the next iteration
    admits them together (up to `max_batch`): a test that asserts on batching sets up its batch
    this way instead of counting on when the HTTP requests and the scheduler thread happen to run.
    `timeout` only keeps a test whose `ready()` never comes from hanging; the event returned is set
    when the loop went on because `ready()` held (a test asserts it).
    """
    parked, was_ready = threading.Event(), threading.Event()
    real = scheduler.run_once

    def held(wait: bool = True) -> bool:
        del scheduler.run_once  # once: the iterations after this one are the loop's own
        parked.set()
        deadline = time.monotonic() + timeout
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.01)
        if ready():
            was_ready.set()
        return real(wait)

    scheduler.run_once = held
    scheduler.cancel(-1)  # wakes an idle loop (no request has id -1): its next iteration is the held one
    assert parked.wait(timeout), "the scheduler loop did not come round"
    return was_ready


def metric(url: str, name: str, labels: str = "") -> float:
    """One sample of /metrics: specdec:`name` with these labels besides model_name, written as
    label text (e.g. ',position="0"'); 0 when the server has no such sample yet."""
    wanted = dict(re.findall(r'(\w+)="([^"]*)"', labels))
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            rest = {k: v for k, v in sample.labels.items() if k != "model_name"}
            if sample.name == f"specdec:{name}" and rest == wanted:
                return sample.value
    return 0.0


# The budget rule only: the goodput rule (unit-tested in test_scheduler.py) would learn that a random
# tiny model's drafts do not pay and stop drafting, which would leave these tests nothing to check.
SETTINGS = dict(served_model_name="tiny", drafter="ngram", num_speculative_tokens=4, max_batch=8, max_queue=64,
                max_model_len=512, dtype="float32", speculation_control="budget")


@pytest.fixture(scope="module")
def thread_server(tiny_folder, engine):
    settings = ServerSettings(model=str(tiny_folder), **SETTINGS)
    srv = ThreadServer(create_app(settings, load=lambda s: (engine.model, engine.tokenizer))).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def server(thread_server):
    return thread_server.url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


def greedy(engine, prompt, n, stop=None):
    return engine.generate(prompt=prompt, max_new_tokens=n, sampling=SamplingParams(), stop=stop)


PROMPT = "abc abc abc abd abc ab"


# -- the happy paths ---------------------------------------------------------------------------


def test_models_and_health(server, client):
    assert httpx.get(server + "/health").status_code == 200
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion_equals_plain_greedy(client, engine):
    ref = greedy(engine, PROMPT, 24)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    choice = out.choices[0]
    assert choice.text == ref.text and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(PROMPT) and out.usage.completion_tokens == 24
    assert out.usage.total_tokens == len(PROMPT) + 24
    # Token-id prompts are accepted too and give the same continuation.
    ids = engine.tokenizer.encode(PROMPT)
    assert client.completions.create(model="tiny", prompt=ids, max_tokens=24, temperature=0).choices[0].text == ref.text


def test_penalties_and_bias_equal_plain_decoding(client, engine):
    # The server drafts with ngram; the reference is plain decoding with the same adjustments.
    a = engine.tokenizer.encode("a")[0]
    params = dict(frequency_penalty=0.6, presence_penalty=0.2, repetition_penalty=1.3, logit_bias={a: 3.0},
                  min_tokens=5)
    ref = engine.generate(prompt=PROMPT, max_new_tokens=24, sampling=SamplingParams(**params))
    assert ref.text != greedy(engine, PROMPT, 24).text  # the adjustments matter here
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                    frequency_penalty=0.6, presence_penalty=0.2, logit_bias={str(a): 3.0},
                                    extra_body={"repetition_penalty": 1.3, "min_tokens": 5})
    assert out.choices[0].text == ref.text


def test_stream_equals_non_stream_and_usage_comes_last(server, client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "hello hello hello"}], max_tokens=20,
                  temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and len(text) > 0
    assert whole.choices[0].message.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # Raw SSE: every event is `data: ...`, the usage chunk sits right before `data: [DONE]`.
    body = {**kwargs, "stream": True, "stream_options": {"include_usage": True}}
    lines = [ln for ln in httpx.post(server + "/v1/chat/completions", json=body).text.split("\n\n") if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["usage"]["total_tokens"] > 0


def test_chat_uses_the_template(client, engine):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=12, temperature=0)
    rendered = "<system>be brief|<user>hi there|<assistant>"
    assert out.usage.prompt_tokens == len(rendered)
    assert out.choices[0].message.content == greedy(engine, rendered, 12).text


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences(client, engine, stream):
    full = greedy(engine, PROMPT, 40).text
    stop = full[12:14]
    cut = full[: full.find(stop)]
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop, "\x7f"])
    if stream:
        chunks = list(client.completions.create(**kwargs, stream=True))
        text = "".join(c.choices[0].text for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        out = client.completions.create(**kwargs).choices[0]
        text, reason = out.text, out.finish_reason
    assert text == cut and reason == "stop"


def test_seed_reproducibility(client):
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=30, temperature=1.0, top_p=0.95)
    a = client.completions.create(**kwargs, seed=5).choices[0].text
    b = client.completions.create(**kwargs, seed=5).choices[0].text
    c = client.completions.create(**kwargs, seed=6).choices[0].text
    assert a == b and a != c


def test_logprobs_are_the_targets(client, engine, tiny_folder):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text and len(lp.token_logprobs) == 10
    # Independent check: HF transformers' log-softmax over the prompt + output.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_folder), dtype=torch.float32).eval()
    ids = engine.tokenizer.encode(PROMPT + out.choices[0].text)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    n = len(PROMPT)
    expected = [float(ref[n - 1 + i, ids[n + i]]) for i in range(10)]
    # The server's cache holds float16 keys and values (the CPU default, `kv_cache.resolve_kv_dtype`),
    # which moves a log-prob by ~1e-4 from HF's float32 attention.
    assert lp.token_logprobs == pytest.approx(expected, abs=1e-3)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and max(top.values()) == pytest.approx(chosen)  # greedy picks the top
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)


def test_speculation_override(server, client, engine):
    ref = greedy(engine, PROMPT, 30).text

    def run(**extra):
        before = metric(server, "spec_decode_num_draft_tokens_total")
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0, extra_body=extra)
        return out.choices[0].text, metric(server, "spec_decode_num_draft_tokens_total") - before

    assert run(speculative=False) == (ref, 0)
    text, drafted = run(speculative={"drafter": "suffix", "num_tokens": 3})
    assert text == ref and drafted > 0
    text, drafted = run()  # the server's default: ngram, k = 4
    assert text == ref and drafted > 0


# -- errors ------------------------------------------------------------------------------------

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
BAD = [
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    (C, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    (C, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    (C, {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    (C, {"prompt": "hi", "min_p": 1.0}, 400, "min_p"),
    (C, {"prompt": "hi", "seed": "x"}, 400, "seed"),
    (C, {"prompt": "hi", "stop": 5}, 400, "stop"),
    (C, {"prompt": "hi", "n": 2}, 400, "n"),
    (C, {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    (C, {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    (C, {"prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty"),
    (C, {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (C, {"prompt": "hi", "min_tokens": -1}, 400, "min_tokens"),
    (C, {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"97": 1}}, 400, "logit_bias"),  # outside the tiny vocabulary
    (C, {"prompt": "hi", "speculative": {"drafter": "magic"}}, 400, "speculative.drafter"),
    (C, {"prompt": "hi", "speculative": {"drafter": "/models/draft"}}, 400, "speculative.drafter"),  # never a path
    (C, {"prompt": "hi", "speculative": {"drafter": 3}}, 400, "speculative"),
    (C, {"prompt": "hi", "speculative": {"num_tokens": 99}}, 400, "speculative.num_tokens"),
    (C, {"prompt": [5, 1000]}, 400, "prompt"),
    (C, {"prompt": ["a", "b"]}, 400, "prompt"),
    (C, {"prompt": "hi", "max_tokens": 600}, 400, "max_tokens"),  # beyond the 512-token context
    (C, {"prompt": 7}, 400, "prompt"),
    (C, {}, 400, "prompt"),
    (C, {"prompt": "hi", "model": "nope"}, 404, "model"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "max_completion_tokens": -3}, 400, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body,status,param", BAD)
def test_bad_input_gets_its_error(server, path, body, status, param, stream):
    res = httpx.post(server + path, json={**body, "stream": stream})
    assert res.status_code == status, res.text
    error = res.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert error["code"] is None or isinstance(error["code"], str)  # OpenAI's convention, never the status


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_malformed_body(server, raw):
    res = httpx.post(server + C, content=raw, headers={"content-type": "application/json"})
    assert res.status_code == 400 and res.json()["error"]["type"] == "invalid_request_error"


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", stream=True, temperature=-1)


# -- load, limits, disconnects ---------------------------------------------------------------


def test_32_concurrent_streams_match_running_alone(thread_server, engine):
    server = thread_server.url
    prompts = [f"{i} apples, {i} pears; {i} apples, {i}" for i in range(32)]
    lengths = [12 + (i % 5) * 3 for i in range(32)]
    refs = [greedy(engine, p, n).text for p, n in zip(prompts, lengths)]
    steps0, rows0 = metric(server, "batch_steps_total"), metric(server, "batch_rows_total")

    async def one(aclient, prompt, n):
        stream = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            usage = chunk.usage or usage
        return text, usage.completion_tokens

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)
        return await asyncio.gather(*(one(aclient, p, n) for p, n in zip(prompts, lengths)))

    # A full batch queued before the scheduler goes on: 8 admitted together, the rest as rows leave
    # (the tenant's gate lets max_batch requests at a time into the scheduler, the rest wait there).
    sched = thread_server.scheduler
    together = hold_scheduler(sched, lambda: sched.num_waiting == sched.max_batch)
    results = asyncio.run(main())
    assert together.is_set()
    assert [t for t, _ in results] == refs
    assert [n for _, n in results] == lengths
    steps, rows = metric(server, "batch_steps_total") - steps0, metric(server, "batch_rows_total") - rows0
    assert rows / steps > 2  # requests really shared forward passes (max batch 8)
    assert metric(server, "num_requests_running") == 0 and metric(server, "num_requests_waiting") == 0


def test_disconnected_stream_frees_its_slot(server):
    cancelled = metric(server, "request_success_total", ',finished_reason="cancelled"')
    finished = metric(server, "request_success_total", ',finished_reason="length"')
    body = {"prompt": PROMPT, "max_tokens": 480, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server + C, json=body) as res:
            lines = res.iter_lines()
            assert next(lines).startswith("data: ")
            assert metric(server, "num_requests_running") == 1
    # The connection is closed: the row is freed and the request counted cancelled (not finished:
    # 480 tokens would end as "length"). The deadline only keeps a failure from hanging.
    deadline = time.time() + 60
    while metric(server, "num_requests_running") != 0:
        assert time.time() < deadline, "the abandoned stream still holds its batch row"
        time.sleep(0.02)
    while metric(server, "request_success_total", ',finished_reason="cancelled"') != cancelled + 1:
        assert metric(server, "request_success_total", ',finished_reason="length"') == finished, "it ran to the end"
        assert time.time() < deadline
        time.sleep(0.02)


@pytest.fixture(scope="module")
def small_thread_server(tiny_folder, engine):
    """One batch row, one queue place, an API key."""
    settings = ServerSettings(model=str(tiny_folder), **{**SETTINGS, "max_batch": 1, "max_queue": 1},
                              api_key="sesame")
    srv = ThreadServer(create_app(settings, load=lambda s: (engine.model, engine.tokenizer))).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def small_server(small_thread_server):
    return small_thread_server.url


def test_burst_beyond_the_queue_gets_429(small_thread_server):
    """12 requests at once for one batch row and one queue place: with the scheduler held until
    the refusals are in, exactly two get in (the row's place and the queue's), ten get 429."""
    url = small_thread_server.url
    auth = {"authorization": "Bearer sesame"}
    retry_after = []

    async def one(http, i):
        body = {"prompt": PROMPT, "max_tokens": 150, "temperature": 0, "stream": i % 2 == 0}
        res = await http.post(url + C, json=body, headers=auth)
        retry_after.append((res.status_code, res.headers.get("retry-after")))
        return res.status_code, (res.json() if res.status_code != 200 else None)

    async def main():
        async with httpx.AsyncClient(timeout=300) as http:
            return await asyncio.gather(*(one(http, i) for i in range(12)))

    refused = hold_scheduler(small_thread_server.scheduler, lambda: sum(c == 429 for c, _ in retry_after) >= 10)
    results = asyncio.run(main())
    assert refused.is_set()
    codes = [c for c, _ in results]
    assert codes.count(200) == 2 and codes.count(429) == 10
    assert all(e["error"]["type"] == "rate_limit_error" for c, e in results if c == 429)
    assert all(int(h) >= 1 for c, h in retry_after if c == 429)


def test_api_key(small_server):
    res = httpx.post(small_server + C, json={"prompt": "hi", "max_tokens": 2})
    assert res.status_code == 401 and res.json()["error"]["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=small_server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="tiny", prompt="hi", max_tokens=2)
    right = openai.OpenAI(base_url=small_server + "/v1", api_key="sesame", max_retries=0)
    assert right.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0).usage.completion_tokens == 2
    assert httpx.get(small_server + "/health").status_code == 200  # probes need no key


def test_health_is_503_while_loading(tiny_folder, engine):
    release = threading.Event()

    def slow_load(settings):
        release.wait(30)
        return engine.model, engine.tokenizer

    srv = ThreadServer(create_app(ServerSettings(model=str(tiny_folder), **SETTINGS), load=slow_load))
    srv.start(wait_ready=False)
    try:
        assert httpx.get(srv.url + "/health").status_code == 503
        res = httpx.post(srv.url + C, json={"prompt": "hi"})
        assert res.status_code == 503 and res.json()["error"]["message"]
        release.set()
        deadline = time.time() + 10
        while httpx.get(srv.url + "/health").status_code != 200:
            assert time.time() < deadline
            time.sleep(0.05)
    finally:
        release.set()
        srv.stop()


def test_cli_serve_drains_on_sigterm(tiny_folder):
    port = free_port()
    url = f"http://{HOST}:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "serve", "--model", str(tiny_folder), "--dtype", "float32",
         "--port", str(port), "--drafter", "ngram", "--served-model-name", "tiny"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 90
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline
            time.sleep(0.2)
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 480, "temperature": 0, "stream": True}
        # 480 tokens without drafting: long enough to see the drain answer meanwhile.
        body = {**body, "speculative": False}
        with httpx.stream("POST", url + C, json=body, timeout=60) as res:
            lines = (ln for ln in res.iter_lines() if ln)
            first = next(lines)
            proc.send_signal(signal.SIGTERM)  # mid-stream
            # Draining: still listening, and a new request gets 503 (not "connection refused").
            deadline = time.time() + 10
            while (health := httpx.get(url + "/health")).status_code == 200:
                assert time.time() < deadline
                time.sleep(0.02)
            assert health.status_code == 503 and health.json() == {"status": "draining"}
            refused = httpx.post(url + C, json={"prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 503 and refused.headers["connection"] == "close"
            assert refused.json()["error"]["type"] == "service_unavailable" and refused.headers["retry-after"]
            rest = list(lines)
        chunks = [json.loads(ln[6:]) for ln in [first] + rest[:-1]]
        assert rest[-1] == "data: [DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert len("".join(c["choices"][0]["text"] for c in chunks)) == 480  # one char per token
        assert proc.wait(30) == 0
        with pytest.raises(httpx.ConnectError):  # and then gone
            httpx.get(url + "/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- the default model -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_server(default_engine_fp32):
    eng = default_engine_fp32
    settings = ServerSettings(served_model_name="gemma", drafter="ngram", max_batch=4, max_model_len=1024,
                              dtype="float32")
    srv = ThreadServer(create_app(settings, load=lambda s: (eng.model, eng.tokenizer))).start()
    yield srv.url
    srv.stop()


def test_default_model_end_to_end(default_server, default_engine_fp32):
    prompts = ["def fibonacci(n):\n    if n < 2:\n        return n\n",
               "The quick brown fox jumps over the lazy dog. The quick brown fox"]
    refs = [default_engine_fp32.generate(prompt=p, max_new_tokens=24).text for p in prompts]
    client = openai.OpenAI(base_url=default_server + "/v1", api_key="unused", max_retries=0, timeout=120)

    async def both():
        aclient = openai.AsyncOpenAI(base_url=default_server + "/v1", api_key="unused", max_retries=0, timeout=120)
        outs = await asyncio.gather(*(aclient.completions.create(model="gemma", prompt=p, max_tokens=24, temperature=0)
                                      for p in prompts))
        return [o.choices[0].text for o in outs]

    assert asyncio.run(both()) == refs  # batched + speculative == plain greedy alone
    assert metric(default_server, "spec_decode_num_accepted_tokens_total") > 0
    # The base GGUF has no chat template: a clear 400, not a made-up format.
    with pytest.raises(openai.BadRequestError, match="chat template"):
        client.chat.completions.create(model="gemma", messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("name,needle", [("missing.gguf", "model not found"),
                                         ("notes.txt", "expected a .gguf file or a folder")])
def test_cli_serve_rejects_a_bad_model_path_before_binding(tmp_path, name, needle):
    # The load runs in the background once the port is bound, so a path that cannot be a model is
    # checked first: one line and exit status 2, not a server whose /health reports the error.
    (tmp_path / "notes.txt").write_text("not a model")
    model = str(tmp_path / name)
    res = subprocess.run([sys.executable, "-m", "specdec.cli", "serve", "--model", model, "--port", str(free_port())],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert needle in res.stderr.strip().splitlines()[-1]
    assert "serving" not in res.stderr
