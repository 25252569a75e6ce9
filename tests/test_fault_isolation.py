"""A bad request fails alone (issue 44): beside 8 good requests in one batch, the bad row gets one
error and the 8 get none and equal their outputs run alone.

Faults are injected where each phase of the step does a row's work (`step.py`): its drafter's
proposal, a batched draft shared with good rows, the target forward (narrowed down by halves), its
sampling, its grammar, its prefill and a prefill shared through the prefix cache. A fault the
request caused (an `InvalidRequestError`) reaches it as a 400 with its own message; any other is a
500 that says only which request failed, never the exception's text. Over HTTP, the triggers found
by the attack in the issue are refused (400) or, where the request is valid, served, while 8
concurrent good requests come back unchanged.
"""

import threading

import httpx
import pytest
import torch

from specdec import Engine, SamplingParams
from specdec.drafters import NgramDrafter
from specdec.drafters.base import DrafterBase, DrafterNeeds
from specdec.errors import InvalidRequestError
from specdec.scheduler import BatchScheduler, Request

from helpers import random_prompts

pytest.importorskip("llguidance")
# The tiny Gemma 3 with a byte-level tokenizer a grammar engine reads, its plain engine and a
# server of it: what the structured-output tests use.
from test_structured import folder, plain, server  # noqa: E402,F401 (fixtures; need llguidance)

pytestmark = pytest.mark.usefixtures("one_thread")

POISON = 0  # a token id (<pad>) whose presence in a forward the faulty model refuses
SECRET = "ACME-CONFIDENTIAL"  # in every injected exception's text: no other request may read it
N = 12  # new tokens per request
GOOD = random_prompts(8, length=20, seed=5)  # over the prefix cache's 16-token minimum
AVOID = ((POISON, -100.0),)  # good rows never emit the poison token (the same alone and batched)


class FaultyModel:
    """The target, refusing any forward whose tokens hold POISON (a fault the forward raises)."""

    def __init__(self, model):
        self._model = model
        self.model = model  # what a split target offers too: the module that answers for it
        self.refused: list[tuple[int, int]] = []  # [rows, T] of each forward refused

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, tokens, *args, **kwargs):
        if (tokens == POISON).any():
            self.refused.append(tuple(tokens.shape))
            raise RuntimeError(f"{SECRET}: the forward cannot take this block")
        return self._model(tokens, *args, **kwargs)


class Lookalike(DrafterBase):
    """A lookup drafter (ngram's guesses) that raises for a context holding `trigger`; with
    `batched`, its rows draft in one shared call, which raises if any member's context does."""

    name = "lookalike"

    def __init__(self, trigger: int | None = None, batched: bool = False, key=None):
        self.trigger, self.batched, self.key = trigger, batched, key if key is not None else object()
        self.inner = NgramDrafter()
        self.needs = DrafterNeeds(batches=batched)  # declared: its rows draft in one shared call

    def spawn(self):
        return Lookalike(self.trigger, self.batched, self.key)

    def _check(self, context):
        if self.trigger is not None and self.trigger in context:
            raise RuntimeError(f"{SECRET}: the drafter failed on this context")

    def propose(self, context, k):
        self._check(context)
        return self.inner.propose(context, k)

    def batch_key(self):
        return self.key

    def batch_member(self):
        return self

    def reserve(self, rows, length):
        pass

    def propose_batch(self, drafters, contexts, ks):
        for d, c in zip(drafters, contexts):
            d._check(c)
        return [d.propose(c, k) for d, c, k in zip(drafters, contexts, ks)]


class FailingGrammar:
    """A grammar state that allows everything, then fails at its `after`-th mask."""

    def __init__(self, after: int, error: Exception):
        self.calls, self.after, self.error = 0, after, error

    def masks(self, paths):
        self.calls += 1
        if self.calls >= self.after:
            raise self.error
        return torch.ones(len(paths), 97, dtype=torch.bool)

    def forced(self):
        return []  # it allows everything, so it forces nothing

    def advance(self, tokens):
        pass


def alone(plain: Engine, ids: list[int]) -> list[int]:
    return plain.generate(prompt_ids=ids, max_new_tokens=N, sampling=SamplingParams(logit_bias=AVOID),
                          speculative=False).token_ids


def run_batch(plain, bad: Request, *, drafters=None, drafter="ngram", model=None, prefix_cache_tokens=0,
              before=()):
    """The 8 good requests and `bad` (5th) admitted together and driven to the end by hand (no
    scheduler thread: the batch is what the test says). Returns the good results and the bad's."""
    loaded = {"none": None, "ngram": NgramDrafter(), **(drafters or {})}
    sched = BatchScheduler(model or plain.model, plain.tokenizer, drafter=drafter, drafters=loaded, max_batch=16,
                           prefill_chunk=0, prefix_cache_tokens=prefix_cache_tokens, adaptive=False)
    for ids in before:  # earlier requests, finished before the batch (a prefix cache's entries)
        h = sched.submit(Request(ids, 2, SamplingParams(logit_bias=AVOID)))
        while not h.finished:
            sched.run_once(wait=False)
        h.result()
    good = [Request(ids, N, SamplingParams(logit_bias=AVOID)) for ids in GOOD]
    handles = [sched.submit(r) for r in good[:4] + [bad] + good[4:]]
    while not all(h.finished for h in handles):
        sched.run_once(wait=False)
    results = [h.result() for h in handles]
    return results[:4] + results[5:], results[4], sched


@pytest.fixture(scope="module")
def references(plain):
    return {tuple(ids): alone(plain, ids) for ids in GOOD}


def run_and_check(plain, references, bad, status, **kwargs):
    goods, result, sched = run_batch(plain, bad, **kwargs)
    assert [g.finish_reason for g in goods] == ["length"] * 8
    assert [g.token_ids for g in goods] == [references[tuple(ids)] for ids in GOOD]
    assert result.finish_reason == "error"
    assert result.error is not None and result.error.status == status
    assert SECRET not in result.error.message or status == 400
    return result, sched


def test_a_failing_drafter_fails_its_row_alone(plain, references):
    bad = Request(GOOD[0][:4] + [POISON, 78, 79], N, SamplingParams(logit_bias=AVOID), drafter="lookalike")
    result, _ = run_and_check(plain, references, bad, 500, drafters={"lookalike": Lookalike(trigger=POISON)})
    assert "request" in result.error.message and SECRET not in result.error.message


def test_a_failing_batched_draft_is_retried_row_by_row(plain, references):
    # Every row drafts with the same batched drafter; the shared call raises for the bad one's
    # context, so each row proposes alone and only the bad row fails.
    bad = Request([5, 6, POISON, 8, 9, 10], N, SamplingParams(logit_bias=AVOID))
    run_and_check(plain, references, bad, 500, drafters={"lookalike": Lookalike(trigger=POISON, batched=True)},
                  drafter="lookalike")


def test_a_forward_that_fails_for_one_row_is_narrowed_to_it(plain, references):
    # The bad row's bias makes POISON its first token, so the next step's forward holds it as that
    # row's lead token: the forward of all 9 rows raises, then each half again, down to the row.
    bad = Request(GOOD[3][:5], N, SamplingParams(logit_bias=((POISON, 100.0),)))
    model = FaultyModel(plain.model)
    run_and_check(plain, references, bad, 500, model=model)
    assert [rows for rows, _ in model.refused] == [9, 5, 2, 1]  # all, then the halves that hold row 4


def test_a_failing_prefill_fails_its_request_alone(plain, references):
    bad = Request([4, 5, POISON, 6, 7], N, SamplingParams(logit_bias=AVOID))
    model = FaultyModel(plain.model)
    run_and_check(plain, references, bad, 500, model=model)
    assert model.refused == [(1, 5)]


def test_a_shared_prefill_from_the_prefix_cache_is_retried_alone(plain, references):
    # Every good prompt but its last token (and the bad one's) is in the prefix cache, so the
    # batch's prompts would go in together through one `prefill_last` forward; the bad one's
    # last token is POISON, so that forward raises and each prompt is prefilled by itself.
    stem = [ids[:-1] for ids in GOOD] + [GOOD[2][:-1]]
    bad = Request(GOOD[2][:-1] + [POISON], N, SamplingParams(logit_bias=AVOID))
    model = FaultyModel(plain.model)
    _, sched = run_and_check(plain, references, bad, 500, model=model, prefix_cache_tokens=4096, before=stem)
    assert model.refused[0][0] > 1 and model.refused[-1] == (1, 1)  # shared, then the bad prompt alone
    assert sched.counters.prompt_tokens_cached >= 9 * 19
    assert sched.counters.prompt_tokens == sum(len(p) for p in stem) + 9 * 20  # the retried ones once


def test_a_sampling_fault_fails_its_row_alone(plain, references):
    sampling = SamplingParams(temperature=1.0, seed=3)
    object.__setattr__(sampling, "temperature", float("nan"))  # past validation: a sampler bug's stand-in
    run_and_check(plain, references, Request(GOOD[1][:6], N, sampling), 500)


@pytest.mark.parametrize("error, status", [(RuntimeError(f"{SECRET}: mask"), 500),
                                           (InvalidRequestError("response_format: the grammar gave up", "x"), 400)])
def test_a_grammar_fault_fails_its_row_alone(plain, references, error, status):
    bad = Request(GOOD[6][:7], N, SamplingParams(logit_bias=AVOID), grammar=FailingGrammar(3, error))
    result, _ = run_and_check(plain, references, bad, status)
    if status == 400:  # the request's own fault: told what it was
        assert result.error.message == "response_format: the grammar gave up" and result.error.param == "x"


# -- over HTTP: the attack's triggers beside 8 concurrent good requests ---------------------------------


PROMPTS = ["The cat", "Hello there", "A list: 1, 2,", "Why is the sky", "def f(x):", "Once upon", "SELECT *",
           "Dear Sir"]
TRIGGERS = [
    ({"repetition_penalty": 1e-39, "temperature": 1.0}, 400, "repetition_penalty"),
    ({"temperature": 1e39, "min_tokens": 4, "seed": 1}, 200, None),
    ({"temperature": 1e39, "response_format": {"type": "json_object"}, "seed": 1}, 200, None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}}}}, 400, "response_format"),
    ({"guided_regex": f"/{SECRET}-a{{1000000}}/"}, 400, "guided_regex"),
    ({"guided_regex": "a\ud800"}, 400, "guided_regex"),
    ({"guided_grammar": 'start: "\ud800"'}, 400, "guided_grammar"),
    ({"structured_outputs": {"regex": "\ud800b"}}, 400, "structured_outputs"),
    ({"logit_bias": {"1" * 5000: 1}}, 400, "logit_bias"),
]


def _post(url, body, out, i):
    import json

    with httpx.Client(base_url=url, timeout=120) as client:
        out[i] = client.post("/v1/completions", content=json.dumps(body).encode(),
                             headers={"content-type": "application/json"})


@pytest.mark.parametrize("fields, status, param", TRIGGERS, ids=[str(i) for i in range(len(TRIGGERS))])
def test_the_attacks_triggers_beside_eight_good_requests(server, plain, fields, status, param):
    bodies = [{"prompt": p, "max_tokens": 8, "temperature": 0} for p in PROMPTS]
    bodies.insert(4, {"prompt": "Secret plan", "max_tokens": 8, **fields})
    out = [None] * len(bodies)
    threads = [threading.Thread(target=_post, args=(server, b, out, i)) for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bad = out.pop(4)
    assert bad.status_code == status, bad.text
    if status == 400:
        error = bad.json()["error"]
        assert error["param"].startswith(param) and error["type"] == "invalid_request_error"
    for prompt, res in zip(PROMPTS, out):
        assert res.status_code == 200, res.text
        text = res.json()["choices"][0]["text"]
        assert text == plain.generate(prompt=prompt, max_new_tokens=8, speculative=False).text
        assert SECRET not in res.text


@pytest.fixture(scope="module")
def faulty_server(folder, plain):
    from specdec.server.app import ServerSettings, create_app
    from test_server import SETTINGS, ThreadServer

    srv = ThreadServer(create_app(ServerSettings(model=str(folder), **SETTINGS),
                                  load=lambda s: (FaultyModel(plain.model), plain.tokenizer))).start()
    yield srv.url
    srv.stop()


def _stream(url, body, out, i):
    with httpx.Client(base_url=url, timeout=120) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as res:
            out[i] = (res.status_code, [line for line in res.iter_lines() if line])


def test_a_fault_after_the_first_byte_is_an_sse_error_event_of_its_stream_alone(faulty_server, plain):
    # The bad stream's first token is POISON (its bias), so the step after it fails its row: its
    # role chunk is out already, so the error comes as an event, and the stream ends.
    import json

    bad = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True, "temperature": 0,
           "logit_bias": {str(POISON): 100}}
    goods = [{"prompt": p, "max_tokens": 8, "temperature": 0, "logit_bias": {str(POISON): -100}} for p in PROMPTS]
    out = [None] * (len(goods) + 1)
    threads = [threading.Thread(target=_post, args=(faulty_server, b, out, i)) for i, b in enumerate(goods)]
    threads.append(threading.Thread(target=_stream, args=(faulty_server, bad, out, len(goods))))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    status, events = out.pop()
    assert status == 200
    assert json.loads(events[0][len("data: "):])["choices"][0]["delta"]["role"] == "assistant"
    errors = [json.loads(e[len("data: "):])["error"] for e in events if e.startswith('data: {"error"')]
    assert len(errors) == 1 and errors[0]["type"] == "internal_error" and SECRET not in errors[0]["message"]
    rid = json.loads(events[0][len("data: "):])["id"].removeprefix("chatcmpl-")
    assert f"request {rid}" in errors[0]["message"]  # the id the client and the access line know
    assert events[-1] == "data: [DONE]"
    for prompt, res in zip(PROMPTS, out):
        assert res.status_code == 200, res.text
        want = plain.generate(prompt=prompt, max_new_tokens=8, sampling=SamplingParams(logit_bias=AVOID),
                              speculative=False).text
        assert res.json()["choices"][0]["text"] == want


def test_a_grammar_past_its_budget_does_not_stall_the_server(server):
    """Compiling the attack's `a{1000000}` takes the grammar engine its whole work budget (about a
    second): in the request's handler, off the event loop, so `/health` keeps answering meanwhile."""
    import time

    out = [None]
    bad = threading.Thread(target=_post, args=(server, {"prompt": "x", "max_tokens": 4,
                                                        "guided_regex": "a{1000000}"}, out, 0))
    latencies = []
    with httpx.Client(base_url=server, timeout=30) as client:
        client.get("/health")
        bad.start()
        while bad.is_alive():
            started = time.perf_counter()
            assert client.get("/health").status_code == 200
            latencies.append(time.perf_counter() - started)
            time.sleep(0.01)
    bad.join()
    assert out[0].status_code == 400 and out[0].json()["error"]["param"] == "guided_regex"
    assert len(latencies) >= 5 and max(latencies) < 0.5, latencies
