"""specdec's extension fields on the wire (`server/web.py`): each streamed chunk's text split by
where its tokens came from, the last chunk's statistics, the loaded drafters on /v1/models, and the
page at / with its Content-Security-Policy. Served by the tiny Gemma 3 with the character tokenizer
(one character a token, so a draft segment is a token); the official `openai` client parses every
chunk."""

import json

import httpx
import openai
import pytest

from specdec.server.app import ServerSettings, create_app
from specdec.sources import SourceSplitter
from specdec.server.web import PAGE_FILES
from test_server import SETTINGS, ThreadServer

pytestmark = pytest.mark.usefixtures("one_thread")

SOURCES = {"draft", "target", "bonus"}
EXT = {"specdec": {"tokens": True, "stats": True}}
# Repeats, so prompt lookup drafts and a random model still accepts some of it.
PROMPT = "abcabcabcabcabcabcabcabcabcabc"


@pytest.fixture(scope="module")
def server(tiny_folder, engine):
    settings = ServerSettings(model=str(tiny_folder), **SETTINGS)
    srv = ThreadServer(create_app(settings, load=lambda s: (engine.model, engine.tokenizer))).start()
    yield srv.url
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


def segments(chunk) -> list[dict]:
    return (chunk.model_extra or {}).get("specdec", {}).get("tokens", [])


def test_the_splitter_cuts_held_back_text_and_keeps_each_pieces_source():
    split = SourceSplitter()
    # " the" is partly held back (it may begin a stop string): its rest comes with the next delta.
    assert split.split([" over", " the"], ["draft", "bonus"], " over th") == [(" over", "draft"), (" th", "bonus")]
    # A token inside a multi-byte character adds no text; the next one carries the character.
    assert split.split(["", "\u00e9"], ["draft", "target"], "e\u00e9") == [("e", "bonus"), ("\u00e9", "target")]
    # Past a stop string: pushed text that is never sent is dropped with the request.
    assert split.split([" dog", "s"], ["target", "draft"], "") == []


def test_completion_chunks_split_their_text_by_token_source(client):
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0).choices[0].text
    text, parts, stats = "", [], None
    for chunk in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
                                           extra_body=EXT):
        own = segments(chunk)
        assert "".join(s["text"] for s in own) == chunk.choices[0].text  # the pieces are the chunk's text
        text += chunk.choices[0].text
        parts += own
        stats = (chunk.model_extra or {}).get("specdec", {}).get("stats", stats)
    assert text == plain
    assert {s["source"] for s in parts} <= SOURCES
    drafted = [s for s in parts if s["source"] == "draft"]
    assert drafted, "prompt lookup drafted nothing that was accepted"
    assert stats["completion_tokens"] == 40 and stats["accepted_tokens"] >= len(drafted)
    assert stats["target_passes"] < 40 and stats["tokens_per_pass"] == pytest.approx(40 / stats["target_passes"])
    assert len(stats["drafted_per_position"]) == len(stats["accepted_per_position"]) >= 1
    assert stats["accepted_per_position"][0] <= stats["drafted_per_position"][0]


def test_a_held_back_stop_prefix_keeps_the_pieces_equal_to_the_text(client):
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0).choices[0].text
    stop = full[20:24]  # its first characters arrive before the rest: the stream holds them back
    cut = full[: full.index(stop)]
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
                                       stop=[stop], extra_body=EXT)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == cut
    for chunk in chunks:
        assert "".join(s["text"] for s in segments(chunk)) == chunk.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_chunks_carry_sources_and_the_last_one_the_statistics(client):
    messages = [{"role": "user", "content": PROMPT}]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=30, temperature=0)
    content, last = "", None
    for chunk in client.chat.completions.create(model="tiny", messages=messages, max_tokens=30, temperature=0,
                                                stream=True, extra_body=EXT):
        delta = chunk.choices[0].delta.content or ""
        assert "".join(s["text"] for s in segments(chunk)) == delta
        content += delta
        last = chunk
    assert content == plain.choices[0].message.content
    assert last.choices[0].finish_reason == "length"
    assert last.model_extra["specdec"]["stats"]["completion_tokens"] == 30


def test_a_plain_request_gets_plain_chunks(server):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=60) as res:
        events = [json.loads(line[6:]) for line in res.iter_lines() if line.startswith("data: {")]
    assert events and all("specdec" not in e for e in events)


@pytest.mark.parametrize("ext,param", [({"tokenz": True}, "specdec.tokenz"), ({"tokens": "yes"}, "specdec.tokens"),
                                       (True, "specdec")])
def test_a_malformed_extension_is_a_400_naming_it(server, ext, param):
    res = httpx.post(server + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "specdec": ext})
    assert res.status_code == 400 and res.json()["error"]["param"] == param


def test_models_lists_the_loaded_drafters(server):
    model = httpx.get(server + "/v1/models").json()["data"][0]
    assert model["specdec"] == {"drafters": ["none", "ngram", "suffix"], "default_drafter": "ngram",
                                "chat_template": True}


def test_the_page_loads_without_a_key_and_the_api_still_needs_one(tiny_folder, engine):
    settings = ServerSettings(model=str(tiny_folder), **{**SETTINGS, "api_key": "sk-page"})
    srv = ThreadServer(create_app(settings, load=lambda s: (engine.model, engine.tokenizer))).start(wait_ready=False)
    try:
        for path in PAGE_FILES:
            res = httpx.get(srv.url + path)
            assert res.status_code == 200 and res.content
            assert "default-src 'self'" in res.headers["content-security-policy"]
            assert "'unsafe-inline'" not in res.headers["content-security-policy"]
            assert res.headers["x-content-type-options"] == "nosniff"
        assert "<script>" not in httpx.get(srv.url + "/").text  # only script files, nothing inline
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer sk-page"}).status_code == 200
    finally:
        srv.stop()
