"""Predicted outputs in the scheduler and the server: rows with and without a prediction in one
batched step, each equal to plain decoding alone; prediction rows' own cap (chains past the batch's
k); both endpoints, streaming and not, through the official `openai` client with the usage details;
`speculative: false`; the 400s naming `prediction`."""

import json

import httpx
import openai
import pytest

from specdec import Engine
from specdec.drafters import NgramDrafter
from specdec.drafters.prediction import Prediction
from specdec.scheduler import BatchScheduler, Request
from specdec.server.app import ServerSettings, create_app
from specdec.server.protocol import MAX_PREDICTION_CHARS

from test_prediction import predictions
from test_server import SETTINGS, ThreadServer, metric

pytestmark = pytest.mark.usefixtures("one_thread")

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "say abc abd abe; x = 1"}]
RENDERED = "<user>say abc abd abe; x = 1|<assistant>"
PROMPTS = ("abc abd abe; x = 1; y = 2; ", "hello world, hello", "a b c a b c", "zz; zz; zz")


@pytest.fixture(scope="module")
def server(tiny_folder, engine):
    srv = ThreadServer(create_app(ServerSettings(model=str(tiny_folder), **SETTINGS),
                                  load=lambda s: (engine.model, engine.tokenizer))).start()
    yield srv.url
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


def check_usage(usage, prediction: str, tokenizer) -> None:
    details = usage.completion_tokens_details
    total = len(tokenizer.encode_plain(prediction)) if prediction else 0
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == total
    assert details.accepted_prediction_tokens <= usage.completion_tokens


def drive(sched, handles):
    while not all(h.finished for h in handles):
        sched.run_once(wait=False)
    return [h.result() for h in handles]


def test_rows_with_and_without_predictions_share_steps(engine):
    tok = engine.tokenizer
    sched = BatchScheduler(engine.model, tok, drafter="ngram", drafters={"ngram": NgramDrafter()},
                           num_speculative_tokens=3, max_batch=8, max_model_len=256, spec_token_budget=64,
                           adaptive=False)
    requests, refs = [], []
    for i, prompt in enumerate(PROMPTS):
        n = 14 + 9 * i
        ref = engine.generate(prompt=prompt, max_new_tokens=n)
        for j, prediction in enumerate(predictions(ref.text, prompt).values()):
            predicted = Prediction.of(prediction, tok) if (i + j) % 3 else None
            requests.append(Request(tok.encode(prompt), n, prediction=predicted))
            refs.append(ref.token_ids)
    results = drive(sched, [sched.submit(r) for r in requests])
    assert [r.token_ids for r in results] == refs
    assert sched.counters.step_rows / sched.counters.steps > 3  # rows really shared steps
    for request, result in zip(requests, results):
        usage = result.usage
        assert (usage.prediction is None) == (request.prediction is None)
        if usage.prediction is not None:
            assert usage.prediction.accepted + usage.prediction.rejected == len(request.prediction.ids)
            assert usage.prediction.accepted <= usage.completion_tokens


def test_a_prediction_row_drafts_past_the_batch_cap(engine):
    """The batch's cap (max_speculative_tokens 16, k 3) does not hold a prediction row to a few
    tokens: where the prediction holds its chains grow past 16 (the budget of 64 shared by the two
    prediction rows: 31 each); a request's own num_tokens still applies."""
    tok = engine.tokenizer
    prompt = PROMPTS[0]
    ref = engine.generate(prompt=prompt, max_new_tokens=150)
    sched = BatchScheduler(engine.model, tok, drafter="none", num_speculative_tokens=3, max_batch=4,
                           max_model_len=400, spec_token_budget=64, adaptive=False)
    own, capped = drive(sched, [sched.submit(Request(tok.encode(prompt), 150, prediction=Prediction.of(ref.text, tok))),
                               sched.submit(Request(tok.encode(prompt), 150, num_speculative_tokens=5,
                                                    prediction=Prediction.of(ref.text, tok)))])
    assert own.token_ids == capped.token_ids == ref.token_ids
    assert len(own.stats.drafted_per_position) > 16
    assert 0 < len(capped.stats.drafted_per_position) <= 5


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parts", [False, True])
def test_openai_client_chat_with_a_prediction(client, engine, stream, parts):
    ref = engine.generate(prompt=RENDERED, max_new_tokens=40)
    for prediction in (ref.text, predictions(ref.text, RENDERED)["stale"], ""):
        content = [{"type": "text", "text": prediction[:7]}, {"type": "text", "text": prediction[7:]}] \
            if parts else prediction
        kwargs = dict(model="tiny", messages=MSG, max_completion_tokens=40, temperature=0,
                      prediction={"type": "content", "content": content})
        if not stream:
            out = client.chat.completions.create(**kwargs)
            text, usage = out.choices[0].message.content, out.usage
        else:
            chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        assert text == ref.text
        check_usage(usage, prediction, engine.tokenizer)
        if prediction == ref.text:
            assert usage.completion_tokens_details.rejected_prediction_tokens == 0


@pytest.mark.parametrize("stream", [False, True])
def test_completions_with_a_prediction(server, client, engine, stream):
    prompt = PROMPTS[1]
    ref = engine.generate(prompt=prompt, max_new_tokens=30)
    prediction = predictions(ref.text, prompt)["stale"]
    extra = {"prediction": {"type": "content", "content": prediction}}
    if not stream:
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0, extra_body=extra)
        text, usage = out.choices[0].text, out.usage
    else:
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0, stream=True,
                                                stream_options={"include_usage": True}, extra_body=extra))
        text, usage = "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage
    assert text == ref.text
    check_usage(usage, prediction, engine.tokenizer)
    plain = httpx.post(server + C, json={"prompt": prompt, "max_tokens": 5}).json()["usage"]
    assert "completion_tokens_details" not in plain  # no prediction, no prediction counts


def test_speculative_false_turns_prediction_drafting_off(server, engine):
    prompt = PROMPTS[0]
    ref = engine.generate(prompt=prompt, max_new_tokens=30)
    body = {"prompt": prompt, "max_tokens": 30, "temperature": 0,
            "prediction": {"type": "content", "content": ref.text}}
    before = metric(server, "spec_decode_num_draft_tokens_total")
    off = httpx.post(server + C, json={**body, "speculative": False}, timeout=60).json()
    assert metric(server, "spec_decode_num_draft_tokens_total") == before
    on = httpx.post(server + C, json=body, timeout=60).json()
    assert metric(server, "spec_decode_num_draft_tokens_total") > before
    assert off["choices"][0]["text"] == on["choices"][0]["text"] == ref.text
    assert off["usage"]["completion_tokens_details"] == on["usage"]["completion_tokens_details"]


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
BAD = [
    ({"prediction": "just text"}, "prediction"),
    ({"prediction": {"type": "content"}}, "prediction"),
    ({"prediction": {"type": "file", "content": "x"}}, "prediction"),
    ({"prediction": {"type": "content", "content": 5}}, "prediction.content"),
    ({"prediction": {"type": "content", "content": [{"type": "image_url", "image_url": "x"}]}}, "prediction.content"),
    ({"prediction": {"type": "content", "content": "x" * (MAX_PREDICTION_CHARS + 1)}}, "prediction.content"),
    ({"prediction": {"type": "content", "content": "x"}, "n": 2}, "prediction"),
]


@pytest.mark.parametrize("path,extra,param", [(p, e, q) for p in (C, CHAT) for e, q in BAD] + [
    (CHAT, {"prediction": {"type": "content", "content": "x"}, "tools": TOOLS}, "prediction")])
def test_bad_predictions_are_400s_naming_prediction(server, path, extra, param):
    base = {"prompt": "hi"} if path == C else {"messages": MSG}
    res = httpx.post(server + path, json={**base, "max_tokens": 2, **extra})
    assert res.status_code == 400, res.text
    error = res.json()["error"]
    assert error["param"] == param and "prediction" in error["message"]
    lone = httpx.post(server + path, content=json.dumps(
        {**base, "prediction": {"type": "content", "content": "a\\ud800b"}}).replace("\\\\ud800", "\\ud800"),
                      headers={"content-type": "application/json"})
    assert lone.status_code == 400 and lone.json()["error"]["param"] == "prediction.content"
