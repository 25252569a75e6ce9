"""Property-based requests against the live server (hypothesis, derandomised).

Bodies are built field by field from the request models: valid values, edge values and arbitrary
JSON for every field the models declare, the known-but-not-implemented fields of
`protocol.NOT_IMPLEMENTED`, unknown fields, lone surrogates, whole floats for integers; and raw
bodies (bytes, deep nesting, long integers, other encodings and content types, wrong methods).
Every case goes over ONE pooled keep-alive connection to uvicorn serving the tiny model in a
thread, and must hold:

- no response is a 5xx;
- every 4xx is an OpenAI error object (message, type, param, code: a string or null);
- a 200 is a whole completion (or an SSE stream ending in `data: [DONE]`);
- the server then answers `GET /health` on the same connection (or the error said
  `Connection: close`).

A second generator is built from the server's own `/openapi.json` (`from_schema`, over the request
bodies it declares): bodies valid by the published schema, the required fields and up to 4 optional
ones, SCHEMA_CASES per endpoint, with `max_tokens` cut to 3 where a case sets it higher (the schema
allows the whole context).

Beside every fuzzed request, innocent ones run concurrently on their own connection (`innocents`):
greedy completions that must all succeed and equal the same prompt decoded alone, whatever the
fuzzed request beside them did (issue 44: one client cannot break another).

Budget: `derandomize=True` (a fixed seed: the same cases every run), CASES cases per endpoint and
RAW_CASES raw ones, generation capped at 3 tokens; about a minute on 2 busy cores.
"""

import json
import threading
import time
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.server.app import ServerSettings, create_app
from specdec.server.protocol import NOT_IMPLEMENTED
from test_server import SETTINGS, ThreadServer

C, CHAT = "/v1/completions", "/v1/chat/completions"
CASES = 300
RAW_CASES = 200
SCHEMA_CASES = 150
INNOCENT_PROMPTS = ["The cat", "Hello there", "def f(x):", "Once upon"]
FUZZ = settings(max_examples=CASES, derandomize=True, deadline=None, database=None, print_blob=True,
                suppress_health_check=list(HealthCheck))

statuses: Counter = Counter()  # (endpoint, status) over the whole module, checked at its end


@pytest.fixture(scope="module")
def server(tiny_folder, engine):
    settings_ = ServerSettings(model=str(tiny_folder), **{**SETTINGS, "max_model_len": 128})
    srv = ThreadServer(create_app(settings_, load=lambda s: (engine.model, engine.tokenizer))).start()
    yield srv.url
    srv.stop()


class Innocents:
    """Greedy completions sent one after another on their own connection while the fuzz runs,
    each checked against the same prompt decoded alone. Bounded: at most `limit` requests, and it
    stops when the module's fuzz ends."""

    def __init__(self, url: str, engine, limit: int = 5000):
        self.url, self.limit = url, limit
        self.want = {p: engine.generate(prompt=p, max_new_tokens=4, speculative=False).text
                     for p in INNOCENT_PROMPTS}
        self.sent, self.failures = 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(base_url=self.url, timeout=60) as client:
            while not self._stop.is_set() and self.sent < self.limit:
                prompt = INNOCENT_PROMPTS[self.sent % len(INNOCENT_PROMPTS)]
                res = client.post(C, json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
                self.sent += 1
                if res.status_code != 200 or res.json()["choices"][0]["text"] != self.want[prompt]:
                    self.failures.append((prompt, res.status_code, res.text[:300]))
                time.sleep(0.005)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(60)


@pytest.fixture(scope="module")
def innocents(server, engine):
    with Innocents(server, engine) as running:
        yield running


@pytest.fixture(scope="module")
def http(server, innocents):
    with httpx.Client(base_url=server, timeout=60, limits=httpx.Limits(max_connections=1)) as client:
        yield client


# -- strategies ---------------------------------------------------------------------------------

surrogate = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
printable = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=125), min_size=1, max_size=12)
hostile_text = st.one_of(st.just(""), st.text(max_size=12),
                         st.builds(lambda a, s, b: a + s + b, st.text(max_size=3), surrogate, st.text(max_size=3)))
text = st.one_of(printable, hostile_text)
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False,
                      allow_infinity=False), text)
json_any = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                        max_leaves=6)


def mixed(valid, *hostile):
    """Mostly (3 in 4) `valid`, otherwise one of the `hostile` values or any JSON value at all."""
    hostile = st.one_of(*hostile, json_any)
    return st.integers(0, 3).flatmap(lambda i: hostile if i == 3 else valid)


def whole(ints):
    return st.one_of(ints, ints.map(float))


# Generation stays at a few tokens: valid lengths are 1-3; anything else is invalid. (Null, which
# any JSON value may be, means 16 for completions and the rest of the context for chat, so chat's
# max_tokens is never null.)
small_tokens = mixed(whole(st.integers(1, 3)), st.sampled_from([0, -1, 129, 10**30, 1.5, "2", True]))
chat_tokens = small_tokens.filter(lambda v: v is not None)
numbers = st.one_of(st.floats(0, 1, allow_nan=False), st.sampled_from([0, 1, 1e-100, 5e-324, 1e-40]))
bad_numbers = st.one_of(st.floats(-2, 3, allow_nan=False), st.sampled_from([1e308, -0.0, 1, 2]))
token_ids = st.lists(st.integers(3, 96), min_size=1, max_size=8)
bad_token_ids = st.lists(st.integers(-3, 120), max_size=8)

common = {
    "model": mixed(st.just("tiny"), text),
    "temperature": mixed(numbers, bad_numbers),
    "top_p": mixed(numbers.filter(lambda x: x > 0), bad_numbers),
    "top_k": mixed(whole(st.integers(-1, 120)), st.integers(-5, -2), st.just(10**40)),
    "min_p": mixed(numbers.filter(lambda x: x < 1), bad_numbers),
    "seed": mixed(whole(st.integers(-(2**70), 2**70))),
    "stop": mixed(st.one_of(printable, st.lists(printable, max_size=3)), hostile_text, st.lists(text, max_size=18)),
    "stream": mixed(st.booleans()),
    "stream_options": mixed(st.fixed_dictionaries({}, optional={
        "include_usage": mixed(st.booleans()), "continuous_usage_stats": mixed(st.sampled_from([None, False])),
        "include_obfuscation": mixed(st.sampled_from([None, False]))})),
    "n": mixed(st.sampled_from([1, 1.0]), st.sampled_from([2, 0, "1", 1.5])),
    "speculative": mixed(st.one_of(st.booleans(), st.fixed_dictionaries({}, optional={
        "drafter": mixed(st.sampled_from(["none", "ngram", "suffix"]), st.just("eagle")),
        "num_tokens": mixed(whole(st.integers(0, 16)), st.integers(-2, 40))}))),
    "presence_penalty": mixed(st.floats(-2, 2, allow_nan=False), bad_numbers, st.sampled_from([2.5, -3])),
    "frequency_penalty": mixed(st.floats(-2, 2, allow_nan=False), bad_numbers, st.sampled_from([2.5, -3])),
    "repetition_penalty": mixed(st.floats(0.5, 2, allow_nan=False), st.sampled_from([0, -1, 0.0])),
    "logit_bias": mixed(st.one_of(st.sampled_from([None, {}]), st.dictionaries(
        st.integers(0, 96).map(str), st.floats(-100, 100, allow_nan=False), max_size=2)),
        st.dictionaries(text, numbers, max_size=2), st.just({"97": 1.0}), st.just({"5": 101})),
    "min_tokens": mixed(whole(st.integers(0, 3)), st.sampled_from([-1, 1.5, True])),
    "ignore_eos": mixed(st.booleans()),
    "user": mixed(text),
}
unknown_fields = st.dictionaries(st.text(alphabet="abcdefxyz_", min_size=1, max_size=8).map(lambda k: "x_" + k),
                                 json_any, max_size=2)  # fields nobody defines


def not_implemented(endpoint):
    """Each known-but-not-implemented field: its neutral values (accepted) or anything (refused)."""
    return {name: mixed(st.sampled_from([None, *neutral])) for name, (neutral, _) in NOT_IMPLEMENTED[endpoint].items()}


def request(endpoint, required, specific):
    """The required fields, plus up to 4 of the optional ones, plus up to 2 unknown ones."""
    pool = {**common, **specific, **not_implemented(endpoint)}
    chosen = st.lists(st.sampled_from(sorted(pool)), max_size=4, unique=True)
    optional = chosen.flatmap(lambda names: st.fixed_dictionaries({name: pool[name] for name in names}))
    return st.builds(lambda req, opt, unknown: {**unknown, **opt, **req}, st.fixed_dictionaries(required),
                     optional, unknown_fields)


part = st.fixed_dictionaries({"type": mixed(st.just("text"), st.just("image_url")), "text": mixed(printable, text)})
message = st.fixed_dictionaries(
    {"role": mixed(st.sampled_from(["system", "developer", "user", "assistant", "tool"]), st.just("wizard"))},
    optional={"content": mixed(st.one_of(printable, st.lists(part, min_size=1, max_size=2)), text),
              "name": mixed(printable, text), "tool_call_id": mixed(printable, text),
              **{k: mixed(st.sampled_from([None, *n])) for k, (n, _) in NOT_IMPLEMENTED["message"].items()}})
messages = mixed(st.lists(message, min_size=1, max_size=3), st.just([]))

prompt = mixed(st.one_of(printable, token_ids, st.lists(printable, max_size=1), st.lists(token_ids, max_size=1)),
               hostile_text, bad_token_ids, st.lists(text, max_size=3))
completion_body = request("completions", {"prompt": prompt,
                                          "max_tokens": small_tokens}, {
    "logprobs": mixed(whole(st.integers(0, 20)), st.integers(-2, 40)),
    "echo": mixed(st.just(False), st.just(True)),
    "best_of": mixed(st.sampled_from([None, 1]), st.integers(-1, 3)),
    "suffix": mixed(st.sampled_from([None, ""]), text),
})
chat_body = request("chat", {"messages": messages, "max_tokens": chat_tokens}, {
    "max_completion_tokens": small_tokens,
    "logprobs": mixed(st.booleans()),
    "top_logprobs": mixed(whole(st.integers(0, 20)), st.integers(-2, 40)),
    "add_generation_prompt": mixed(st.booleans()),
    "continue_final_message": mixed(st.booleans()),
})


# -- the properties -----------------------------------------------------------------------------


def check(http: httpx.Client, endpoint: str, method: str, path: str, content: bytes | None,
          headers: dict[str, str]) -> None:
    request = http.build_request(method, path, content=content, headers=headers)
    res = http.send(request, stream=True)
    try:
        port = res.extensions["network_stream"].get_extra_info("client_addr")[1]
        res.read()
    finally:
        res.close()
    statuses[endpoint, res.status_code] += 1
    assert res.status_code < 500, res.text
    if res.status_code >= 400:
        error = res.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
        assert error["param"] is None or isinstance(error["param"], str)
        assert error["code"] is None or isinstance(error["code"], str)
    elif res.headers["content-type"].startswith("text/event-stream"):
        events = [e for e in res.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]" and not any(e.startswith('data: {"error"') for e in events), res.text
    elif method == "POST":
        assert res.json()["choices"][0]["finish_reason"] in ("stop", "length"), res.text
    after = http.send(http.build_request("GET", "/health"), stream=True)
    try:
        assert after.status_code == 200
        if res.headers.get("connection") != "close":
            assert after.extensions["network_stream"].get_extra_info("client_addr")[1] == port, \
                "the server dropped a keep-alive connection after this response"
        after.read()
    finally:
        after.close()


def send_json(http, endpoint, path, body):
    # \\u escapes (ensure_ascii) carry lone surrogates, which UTF-8 cannot.
    check(http, endpoint, "POST", path, json.dumps(body).encode(), {"content-type": "application/json"})


@FUZZ
@given(body=completion_body)
def test_fuzz_completions(http, body):
    send_json(http, "completions", C, body)


@FUZZ
@given(body=chat_body)
def test_fuzz_chat(http, body):
    send_json(http, "chat", CHAT, body)


raw_body = st.one_of(
    st.binary(max_size=40),
    st.integers(1, 3000).map(lambda d: b'{"prompt": ' + b"[" * d + b"]" * d + b"}"),
    st.integers(1, 3000).map(lambda d: b'{"a":' * d + b"0" + b"}" * d),
    st.integers(1, 6000).map(lambda n: b'{"prompt": "hi", "max_tokens": 1, "seed": ' + b"9" * n + b"}"),
    st.sampled_from([b"NaN", b'{"prompt": "hi", "temperature": Infinity}', b"[]", b"null", b'"x"', b"{}",
                     b'{"prompt": "hi", "max_tokens": 1}', b'{"messages": [{"role": "user", "content": "x"}]}']),
    st.builds(lambda body, codec: json.dumps(body).encode(codec), st.fixed_dictionaries(
        {"prompt": st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=125), min_size=1, max_size=8),
         "max_tokens": st.integers(1, 2)}), st.sampled_from(["utf-8", "utf-16", "utf-32", "latin-1"])),
)
content_type = st.sampled_from([None, "application/json", "application/json; charset=utf-8", "APPLICATION/JSON",
                                "application/json; charset=utf-16", "application/x-www-form-urlencoded",
                                "multipart/form-data; boundary=x", "text/plain", "application/problem+json", ""])


# Mostly a POST to an endpoint that reads the body; sometimes a wrong method or path.
target = st.integers(0, 3).flatmap(lambda i: st.tuples(
    st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "POST"]),
    st.sampled_from([C, CHAT, "/v1/models", "/health", "/metrics", "/v1/nothing", "/openapi.json"]))
    if i == 3 else st.tuples(st.just("POST"), st.sampled_from([C, CHAT])))


@settings(FUZZ, max_examples=RAW_CASES)
@given(target=target, body=raw_body, ctype=content_type)
def test_fuzz_raw_bodies(http, target, body, ctype):
    method, path = target
    headers = {} if ctype is None else {"content-type": ctype}
    check(http, "raw", method, path, body, headers)


def from_schema(schema: dict, root: dict):
    """A strategy for JSON values valid by `schema` (the subset of JSON Schema that pydantic writes:
    $ref into `root`, anyOf, enum, const, type, numeric bounds, string lengths, items, properties,
    required); an object takes its required properties and up to 4 of its optional ones."""
    if "$ref" in schema:
        node = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        return from_schema(node, root)
    if "anyOf" in schema:
        return st.one_of(*(from_schema(option, root) for option in schema["anyOf"]))
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    low = schema.get("minimum", schema.get("ge", schema.get("exclusiveMinimum")))
    high = schema.get("maximum", schema.get("le", schema.get("exclusiveMaximum")))
    if kind == "integer":
        low = -(2**40) if low is None else int(low) + ("exclusiveMinimum" in schema)
        return st.integers(low, (2**40) if high is None else int(high) - ("exclusiveMaximum" in schema))
    if kind == "number":
        return st.floats(low, high, allow_nan=False, allow_infinity=False,
                         exclude_min="exclusiveMinimum" in schema, exclude_max="exclusiveMaximum" in schema)
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 12), 12))
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), root), min_size=schema.get("minItems", 0),
                        max_size=max(schema.get("minItems", 0), 3))
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = {name: from_schema(props[name], root) for name in schema.get("required", [])}
        optional = sorted(set(props) - set(required))
        chosen = st.lists(st.sampled_from(optional), max_size=4, unique=True) if optional else st.just([])
        return chosen.flatmap(lambda names: st.fixed_dictionaries(
            {**required, **{name: from_schema(props[name], root) for name in names}}))
    return json_any  # no constraint (a field typed Any)


def _schema_bodies(endpoint: str, path: str):
    """Bodies valid by the request schema that `/openapi.json` publishes for `path`, its
    components in scope for the `$ref`s."""
    from specdec.server.app import ServerSettings as S

    doc = create_app(S()).openapi()
    components = doc["components"]["schemas"]
    ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return from_schema({"$ref": ref}, doc).map(_few_tokens)


def _few_tokens(body: dict) -> dict:
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and body[key] > 3:
            body[key] = 3
    return body


@settings(FUZZ, max_examples=SCHEMA_CASES)
@given(body=_schema_bodies("completions", C))
def test_schema_fuzz_completions(http, body):
    send_json(http, "schema-completions", C, body)


@settings(FUZZ, max_examples=SCHEMA_CASES)
@given(body=_schema_bodies("chat", CHAT))
def test_schema_fuzz_chat(http, body):
    send_json(http, "schema-chat", CHAT, body)


def test_innocent_requests_never_failed_beside_the_fuzz(innocents):
    """Every innocent request sent while the cases above ran succeeded with its alone output."""
    innocents.__exit__()
    assert innocents.sent >= 50, innocents.sent  # they really ran beside the fuzz
    assert innocents.failures == []


def test_the_fuzz_run_reached_both_outcomes():
    """The runs above exercised successes as well as refusals (and ran every case): a generator
    that only ever produced garbage would prove little."""
    for endpoint, cases in (("completions", CASES), ("chat", CASES), ("raw", RAW_CASES)):
        counts = {status: n for (e, status), n in statuses.items() if e == endpoint}
        assert sum(counts.values()) >= cases, (endpoint, counts)
        assert counts.get(200, 0) >= cases // 20 and sum(n for s, n in counts.items() if s >= 400) >= cases // 5, \
            (endpoint, counts)
    for endpoint in ("schema-completions", "schema-chat"):  # schema-valid cases: many must be served
        counts = {status: n for (e, status), n in statuses.items() if e == endpoint}
        assert sum(counts.values()) >= SCHEMA_CASES and counts.get(200, 0) >= SCHEMA_CASES // 20, (endpoint, counts)
    print("fuzz cases by endpoint and status:", dict(sorted(statuses.items())))
