"""The server and the CLI under hostile input and real clients (issue 31).

Each case the issue lists has its test here: lone surrogates, tiny temperatures, deep JSON and huge
integers, fields that are refused rather than ignored, content types, the error object's `code`,
the keep-alive connection after an error, a non-streaming client that disconnects, a model that
fails to load, a port in use. The drain (503 while finishing) is checked in
test_server.py::test_cli_serve_drains_on_sigterm, the property-based run in test_server_fuzz.py.

The tiny random Gemma 3 with a character-level tokenizer of test_server.py serves them, over
loopback, in a thread of the test process.
"""

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from specdec import SamplingParams
from specdec.cli import main as cli_main
from specdec.server.app import ServerSettings, create_app
from specdec.server.protocol import NOT_IMPLEMENTED
from test_server import HOST, PROMPT, SETTINGS, ThreadServer, free_port, metric

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_folder, engine):
    settings = ServerSettings(model=str(tiny_folder), **SETTINGS)
    srv = ThreadServer(create_app(settings, load=lambda s: (engine.model, engine.tokenizer))).start()
    yield srv.url
    srv.stop()


@pytest.fixture()
def http(server):
    """One pooled connection, as a real client keeps it."""
    with httpx.Client(base_url=server, timeout=60, limits=httpx.Limits(max_connections=1)) as client:
        yield client


def post_raw(http: httpx.Client, path: str, body, content_type: str | None = "application/json") -> httpx.Response:
    """POST `body` (a dict, serialised with \\u escapes so lone surrogates survive, or bytes)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {} if content_type is None else {"content-type": content_type}
    return http.post(path, content=content, headers=headers)


def local_port(res: httpx.Response) -> int:
    return res.extensions["network_stream"].get_extra_info("client_addr")[1]


def assert_error(res: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert res.status_code == status, res.text
    error = res.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] is None or isinstance(error["code"], str)
    if param != "any":
        assert error["param"] == param, error
    return error


def assert_same_connection_answers(http: httpx.Client, res: httpx.Response) -> None:
    """The next request of a pooled client goes over the same connection and is answered."""
    with http.stream("GET", "/health") as after:
        assert after.status_code == 200
        assert local_port(after) == local_port(res)


# -- 1. client faults that were 500s ----------------------------------------------------------


SURROGATES = [
    (C, {"prompt": "\ud800"}, "prompt"),
    (C, {"prompt": "x\udfffy"}, "prompt"),
    (C, {"prompt": ["x\udfffy"]}, "prompt"),
    (C, {"prompt": "hi", "stop": ["ok", "\udc00"]}, "stop"),
    (CHAT, {"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udbffb"}]}]},
     "messages[0].content"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body,param", SURROGATES)
def test_lone_surrogates_are_a_400_naming_the_field(http, path, body, param, stream):
    with http.stream("POST", path, content=json.dumps({**body, "max_tokens": 2, "stream": stream}).encode(),
                     headers={"content-type": "application/json"}) as res:
        res.read()
    error = assert_error(res, 400, param)
    assert "surrogate" in error["message"]
    assert_same_connection_answers(http, res)


def test_invalid_utf8_in_the_cli_prompt_is_one_line(tiny_folder):
    # The OS hands Python the undecodable byte as a lone surrogate (surrogateescape).
    res = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--model", str(tiny_folder),
                          "--prompt", b"ab\xffc"], capture_output=True, timeout=120)
    err = res.stderr.decode(errors="replace").strip().splitlines()
    assert res.returncode == 2 and b"Traceback" not in res.stderr
    assert err == ["specdec: error: --prompt is not valid UTF-8 (byte 0xff at character 2)"]


TINY_TEMPERATURES = [1e-30, 1e-40, 1e-45, 1e-100, 1e-300, 5e-324]


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_a_tiny_temperature_samples_the_argmax(http, engine, temperature):
    greedy = engine.generate(prompt=PROMPT, max_new_tokens=12, sampling=SamplingParams()).text
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": temperature, "seed": 3}
    res = post_raw(http, C, body)
    assert res.status_code == 200, res.text
    assert res.json()["choices"][0]["text"] == greedy
    with http.stream("POST", C, json={**body, "stream": True}) as res:
        events = [ln for ln in res.iter_lines() if ln]
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]) == greedy
    # The speculative path (rejection sampling against the n-gram drafter's one-hot q) as well.
    spec = post_raw(http, C, {**body, "speculative": {"drafter": "ngram", "num_tokens": 4}})
    assert spec.json()["choices"][0]["text"] == greedy


def test_a_tiny_temperature_in_the_cli(tiny_folder, engine, capsys):
    greedy = engine.generate(prompt=PROMPT, max_new_tokens=10, sampling=SamplingParams()).text
    code = cli_main(["generate", "--model", str(tiny_folder), "--dtype", "float32", "--prompt", PROMPT,
                     "--max-tokens", "10", "--temperature", "5e-324", "--drafter", "ngram", "--json"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["text"] == greedy


def test_stream_with_json_in_the_cli_is_a_clear_error(tiny_folder, capsys):
    assert cli_main(["generate", "--model", str(tiny_folder), "--prompt", "hi", "--stream", "--json"]) == 2
    assert capsys.readouterr().err.strip() == ("specdec: error: --stream cannot be combined with --json, which "
                                               "print the whole result at the end")


RAW = [
    ("nested 2,000 deep", b'{"prompt": ' + b"[" * 2000 + b"]" * 2000 + b"}", "nests deeper"),
    ("nested 100 deep", b'{"prompt": "hi", "x": ' + b"[" * 100 + b"]" * 100 + b"}", "nests deeper"),
    ("objects nested 2,000 deep", b'{"a":' * 2000 + b"1" + b"}" * 2000, "nests deeper"),
    ("an integer of 4,301 digits", b'{"prompt": "hi", "seed": ' + b"7" * 4301 + b"}", "not valid JSON"),
    ("an integer of 5,000 digits in a list", b'{"prompt": [' + b"9" * 5000 + b"]}", "not valid JSON"),
    ("NaN", b'{"prompt": "hi", "temperature": NaN}', "not a JSON number"),
    ("Infinity", b'{"prompt": "hi", "top_p": -Infinity}', "not a JSON number"),
    ("an overflowing float", b'{"prompt": "hi", "temperature": 1e400}', "finite"),
    ("UTF-16", json.dumps({"prompt": "hi"}).encode("utf-16"), "not UTF-8"),
    ("Latin-1", '{"prompt": "caf\xe9"}'.encode("latin-1"), "not UTF-8"),
]


@pytest.mark.parametrize("name,raw,needle", RAW, ids=[r[0] for r in RAW])
def test_hostile_json_is_a_400(http, name, raw, needle):
    res = post_raw(http, C, raw)
    assert needle in assert_error(res, 400)["message"]
    assert_same_connection_answers(http, res)


# -- 3. standard fields: honoured or refused, never ignored -------------------------------------


def _refused_value(neutral: tuple):
    for candidate in (True, 7, [{"type": "function", "function": {"name": "f"}}], {"type": "json_object"}, "x"):
        if not any(candidate == n and type(candidate) is type(n) for n in neutral):
            return candidate


NOT_IMPLEMENTED_CASES = [(C, name, neutral) for name, (neutral, _) in NOT_IMPLEMENTED["completions"].items()] + \
    [(CHAT, name, neutral) for name, (neutral, _) in NOT_IMPLEMENTED["chat"].items()
     if name not in NOT_IMPLEMENTED["completions"]]


@pytest.mark.parametrize("path,name,neutral", NOT_IMPLEMENTED_CASES,
                         ids=[f"{'chat' if p == CHAT else 'completions'}-{n}" for p, n, _ in NOT_IMPLEMENTED_CASES])
def test_not_implemented_fields_are_refused_unless_neutral(http, path, name, neutral):
    base = {"prompt": "hi"} if path == C else {"messages": MSG}
    base = {**base, "max_tokens": 2, "temperature": 0}
    error = assert_error(post_raw(http, path, {**base, name: _refused_value(neutral)}), 400, name)
    assert error["code"] == "unsupported_parameter"
    for value in (None, *neutral):  # their neutral values change nothing, so they are accepted
        assert post_raw(http, path, {**base, name: value}).status_code == 200


def test_the_issues_list_is_refused(http):
    """The fields issue 31 found accepted and ignored, each with a value that would matter."""
    chat = {"messages": MSG, "max_tokens": 2}
    cases = [
        (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        (CHAT, {"tool_choice": "required"}, "tool_choice"),
        (CHAT, {"functions": [{"name": "f"}]}, "functions"),
        (CHAT, {"parallel_tool_calls": False}, "parallel_tool_calls"),
        (C, {"prompt_logprobs": 1}, "prompt_logprobs"),
        (C, {"top_logprobs": 2}, "top_logprobs"),
        (C, {"stop": ""}, "stop"),
        (C, {"stop": ["a", ""]}, "stop"),
        (CHAT, {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]},
         "messages[0].tool_calls"),
        (CHAT, {"stream": True, "stream_options": {"continuous_usage_stats": True}},
         "stream_options.continuous_usage_stats"),
    ]
    for path, extra, param in cases:
        base = {"prompt": "hi", "max_tokens": 2} if path == C else chat
        assert_error(post_raw(http, path, {**base, **extra}), 400, param)


def test_chat_template_switches_are_honoured(http, engine):
    first = {"role": "user", "content": "hi there"}

    def chat(messages, **extra):
        res = post_raw(http, CHAT, {"messages": messages, "max_tokens": 8, "temperature": 0, **extra})
        assert res.status_code == 200, res.text
        return res.json()

    def greedy(text):
        return engine.generate(prompt=text, max_new_tokens=8, sampling=SamplingParams()).text

    out = chat([first], add_generation_prompt=False)
    assert out["usage"]["prompt_tokens"] == len("<user>hi there|")
    assert out["choices"][0]["message"]["content"] == greedy("<user>hi there|")
    # continue_final_message: the rendering stops right after the last message's text.
    out = chat([first, {"role": "assistant", "content": "Sure, th"}], add_generation_prompt=False,
               continue_final_message=True)
    rendered = "<user>hi there|<assistant>Sure, th"
    assert out["usage"]["prompt_tokens"] == len(rendered)
    assert out["choices"][0]["message"]["content"] == greedy(rendered)
    assert_error(post_raw(http, CHAT, {"messages": MSG, "continue_final_message": True}), 400,
                 "continue_final_message")


def test_whole_floats_are_integers_and_unknown_fields_are_ignored(http):
    body = {"prompt": "hi", "n": 1.0, "max_tokens": 3.0, "top_k": 5.0, "seed": 2.0, "temperature": 0,
            "x_vendor_option": {"anything": [1, 2]}}
    res = post_raw(http, C, body)
    assert res.status_code == 200 and res.json()["usage"]["completion_tokens"] == 3
    assert_error(post_raw(http, C, {**body, "n": 1.5}), 400, "n")
    assert_error(post_raw(http, C, {**body, "n": 2.0}), 400, "n")


# -- 4. the rough edges -----------------------------------------------------------------------


@pytest.mark.parametrize("content_type,raw,status", [
    ("application/x-www-form-urlencoded", b"prompt=hi", 415),
    ("multipart/form-data; boundary=xyz",
     b'--xyz\r\ncontent-disposition: form-data; name="prompt"\r\n\r\nhi\r\n--xyz--', 415),
    ("text/plain", b'{"prompt": "hi"}', 415),
    ("application/json; charset=utf-16", json.dumps({"prompt": "hi"}).encode("utf-16"), 415),
    ("application/json; charset=UTF-8", b'{"prompt": "hi", "max_tokens": 1}', 200),
    ("application/vnd.api+json", b'{"prompt": "hi", "max_tokens": 1}', 200),
    (None, b'{"prompt": "hi", "max_tokens": 1}', 200),
])
def test_content_types(http, content_type, raw, status):
    res = post_raw(http, C, raw, content_type)
    if status == 200:
        assert res.status_code == 200, res.text
    else:
        assert assert_error(res, status)["code"] == "unsupported_media_type"
    assert_same_connection_answers(http, res)


def test_wrong_method_is_a_405_with_allow(http):
    res = http.get(C)
    assert_error(res, 405)
    assert res.headers["allow"] == "POST"
    res = http.post("/health")
    assert_error(res, 405)
    assert res.headers["allow"] == "GET"
    assert_error(http.get("/v1/nothing"), 404)


def test_error_codes_are_strings_or_null(http):
    assert assert_error(post_raw(http, C, {"prompt": "hi", "max_tokens": 0}), 400)["code"] is None
    assert assert_error(post_raw(http, C, {"prompt": "hi", "model": "gpt-9"}), 404)["code"] == "model_not_found"
    assert assert_error(post_raw(http, C, {"prompt": "hi", "echo": True}), 400)["code"] == "unsupported_parameter"
    assert assert_error(http.get("/nowhere"), 404)["code"] is None


def test_openapi_declares_the_request_bodies(http):
    spec = http.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for path, model in ((C, "CompletionRequest"), (CHAT, "ChatCompletionRequest")):
        body = spec["paths"][path]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
    fields = set(schemas["CompletionRequest"]["properties"])
    assert {"prompt", "max_tokens", "temperature", "stop", "speculative"} <= fields
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    # Every $ref points at a declared schema.
    refs = [m for m in json.dumps(spec).split('"$ref": "')[1:]]
    assert all(ref.split('"')[0].removeprefix("#/components/schemas/") in schemas for ref in refs)
    assert list(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert http.get("/metrics").headers["content-type"].startswith("text/plain")


@pytest.fixture(scope="module")
def keyed_server(tiny_folder, engine):
    settings = ServerSettings(model=str(tiny_folder), **SETTINGS, api_key="sesame")
    srv = ThreadServer(create_app(settings, load=lambda s: (engine.model, engine.tokenizer))).start()
    yield srv.url
    srv.stop()


def test_bearer_scheme_is_case_insensitive(keyed_server):
    body = {"prompt": "hi", "max_tokens": 1}
    for scheme in ("Bearer", "bearer", "BEARER"):
        res = httpx.post(keyed_server + C, json=body, headers={"authorization": f"{scheme} sesame"})
        assert res.status_code == 200, (scheme, res.text)
    for header in ("bearer Sesame", "Basic sesame", "sesame", "Bearer"):
        res = httpx.post(keyed_server + C, json=body, headers={"authorization": header})
        assert assert_error(res, 401)["code"] == "invalid_api_key"


def test_an_internal_fault_closes_its_connection(tiny_folder, engine):
    """A bug (here a tokenizer that raises) is a 500 with `Connection: close`, so a pooled client
    does not send its next request into a connection the server drops."""

    class Broken:
        def __getattr__(self, name):
            return getattr(engine.tokenizer, name)

        def encode(self, text):
            raise RuntimeError("boom")

    settings = ServerSettings(model=str(tiny_folder), **SETTINGS)
    srv = ThreadServer(create_app(settings, load=lambda s: (engine.model, Broken()))).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            res = post_raw(http, C, {"prompt": "hi", "max_tokens": 1})
            assert_error(res, 500)
            assert res.headers["connection"] == "close"
            assert http.post(C, json={"prompt": [5, 6], "max_tokens": 1}).status_code == 200
    finally:
        srv.stop()


# -- 2. a non-streaming client that disconnects; a full queue ----------------------------------
#
# These need a request that surely runs for many seconds: the default model generating up to
# 1000 tokens (the tiny model can finish hundreds of tokens within the client's half second when
# the machine is idle). One batch row, no queue.

LONG = {"prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0, "speculative": False}


@pytest.fixture(scope="module")
def one_row_server(default_engine_fp32):
    eng = default_engine_fp32
    settings = ServerSettings(served_model_name="gemma", max_batch=1, max_queue=0, max_model_len=1024,
                              dtype="float32")
    srv = ThreadServer(create_app(settings, load=lambda s: (eng.model, eng.tokenizer))).start()
    yield srv.url
    srv.stop()


def wait_idle(url: str) -> None:
    deadline = time.time() + 10
    while metric(url, "num_requests_running") != 0:
        assert time.time() < deadline
        time.sleep(0.02)


def test_disconnected_non_streaming_request_frees_its_row(one_row_server):
    url = one_row_server
    wait_idle(url)
    cancelled = metric(url, "request_success_total", ',finished_reason="cancelled"')
    finished = metric(url, "request_success_total", ',finished_reason="length"')
    try:
        res = httpx.post(url + C, json=LONG, timeout=httpx.Timeout(30, read=0.5))
    except httpx.ReadTimeout:  # the client gives up after half a second and closes its connection
        gone = time.time()
    else:
        pytest.fail(f"answered before the client left: {res.status_code} {res.text[:200]}")
    # Counted cancelled, not finished (1000 tokens would end as "length"): the row was freed. The
    # deadline only keeps a failure from hanging; how fast is not this test's business.
    while metric(url, "request_success_total", ',finished_reason="cancelled"') != cancelled + 1:
        assert metric(url, "request_success_total", ',finished_reason="length"') == finished, "it ran to the end"
        assert time.time() - gone < 120, "the abandoned request still holds its batch row"
        time.sleep(0.02)
    assert metric(url, "num_requests_running") == 0


def test_a_full_queue_is_a_429_with_retry_after(one_row_server):
    url = one_row_server
    wait_idle(url)
    with httpx.Client(timeout=60) as hold, hold.stream("POST", url + C, json={**LONG, "stream": True}) as first:
        lines = first.iter_lines()  # kept: a dropped iterator closes the connection
        next(lines)
        assert metric(url, "num_requests_running") == 1  # the one row is taken; the queue holds 0
        res = httpx.post(url + C, json={**LONG, "max_tokens": 2})
        error = assert_error(res, 429)
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
        assert int(res.headers["retry-after"]) >= 1


# -- the CLI's serve: a model that fails to load, a port in use ---------------------------------


def test_serve_with_a_corrupt_model_exits_with_the_load_error(tmp_path):
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    port = free_port()
    res = subprocess.run([sys.executable, "-m", "specdec.cli", "serve", "--model", str(bad), "--port", str(port)],
                         capture_output=True, text=True, timeout=180)
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert last.startswith("specdec: error: the model failed to load:") and "corrupt.gguf" in last
    assert "serving" not in res.stderr  # "ready: serving ..." comes only once a model is loaded
    with socket.socket() as s:  # and the port is free again
        s.bind((HOST, port))


def test_serve_on_a_port_in_use_says_so(tiny_folder):
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "specdec.cli", "serve", "--model", str(tiny_folder),
                              "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr and "serving" not in res.stderr
    assert res.stderr.strip().splitlines() == [
        f"specdec: error: port {port} on {HOST} is already in use (another server?): pick another with --port"]


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_serve_refuses_a_port_out_of_range(tiny_folder, port, capsys):
    # Before anything is bound: getaddrinfo would otherwise take 70000 as 70000 % 65536.
    assert cli_main(["serve", "--model", str(tiny_folder), "--port", port]) == 2
    assert capsys.readouterr().err.strip() == f"specdec: error: --port must be in [0, 65535], got {port}"
