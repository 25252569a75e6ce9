"""Structured output under speculation (llguidance): greedy output with every drafter identical to
plain constrained decoding, the grammar state untouched by the drafts it checks, sampled output
exact in distribution with a grammar mask (chi-square, and a broken variant that fails),
schema-valid JSON from the server for many seeds and temperatures, streaming and not, and a 400
for every bad constraint.
"""

import itertools
import json
import re

import httpx
import pytest
import torch

from specdec import Engine, SamplingParams
from specdec.drafters import DraftModelDrafter, NgramDrafter, SuffixDrafter
from specdec.errors import InvalidRequestError
from specdec.sampling import adjust_logits, make_generator, process_logits, sample
from specdec.verify import verify_sampling

from helpers import TINY_VOCAB as V, byte_alphabet, make_tiny_hf, pooled_chisquare_p

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from test_penalties import Oracle, OracleTree

pytestmark = pytest.mark.usefixtures("one_thread")


def make_byte_tokenizer(folder) -> None:
    """A byte-level BPE tokenizer without merges (ids 0-2 special, 3..96 = the bytes of ASCII
    32..125, the same ids as test_server's character tokenizer), which a grammar engine can read,
    with a chat template."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = byte_alphabet()
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    for b in range(32, 126):
        vocab[alphabet[b]] = len(vocab)
    raw = RawTokenizer(models.BPE(vocab, [], unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    tok.save_pretrained(str(folder))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder, _ = make_tiny_hf(tmp_path_factory.mktemp("st"), "gemma3", seed=0)
    make_byte_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def plain(folder):
    return Engine.load(str(folder), dtype="float32")


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b c"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
REGEX = r"(ab|cd)+x[0-9]{2}"
GRAMMAR = 'start: "say " word ("," word)*\nword: /[a-z]{1,4}/'
SPECS = [{"json": SCHEMA}, {"json_object": True}, {"regex": REGEX}, {"choice": ["yes", "no way", "maybe"]},
         {"grammar": GRAMMAR}]


def matches(spec, text):
    (kind, value), = spec.items()
    if kind == "json":
        jsonschema.validate(json.loads(text), value)
        return True
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(value, text) is not None
    if kind == "choice":
        return text in value
    return re.fullmatch(r"say [a-z]{1,4}(,[a-z]{1,4})*", text) is not None


PROMPTS = ["name: ab ab ab ab", "x x x x"]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: next(iter(s)))
def test_greedy_identity_with_every_drafter(folder, plain, spec):
    model, tokenizer = plain.model, plain.tokenizer
    draft = Engine.load(str(folder), dtype="float32").model  # the same weights: long accepted runs
    accepted = 0
    for prompt in PROMPTS:
        want = plain.generate(prompt=prompt, max_new_tokens=40, structured=spec)
        if want.finish_reason == "stop":
            assert matches(spec, want.text)
        ids = tokenizer.encode(prompt)
        for drafter, kw in [(NgramDrafter(), {}), (SuffixDrafter(), {}), (NgramDrafter(), {"draft_tree": "3x2x6"}),
                            (DraftModelDrafter(draft, V, draft_p_min=0.0), {}),
                            (Oracle(ids, want.token_ids), {}),
                            (OracleTree(ids, want.token_ids), {"draft_tree": "4x2x8"})]:
            k = {} if "draft_tree" in kw else {"num_speculative_tokens": 4, "draft_length": "fixed"}
            spec_engine = Engine(model, tokenizer, drafter=drafter, **k, **kw)
            got = spec_engine.generate(prompt=prompt, max_new_tokens=40, structured=spec)
            assert got.token_ids == want.token_ids, drafter.name
            accepted += got.stats.accepted_tokens
    assert accepted > (5 if "choice" in spec else 20)  # short answers accept less


def test_grammar_with_penalties_greedy_identity(plain):
    params = SamplingParams(frequency_penalty=0.8, repetition_penalty=1.2, logit_bias={5: 2.0})
    spec = {"json": SCHEMA}
    want = plain.generate(prompt=PROMPTS[0], max_new_tokens=40, structured=spec, sampling=params)
    ids = plain.tokenizer.encode(PROMPTS[0])
    spec_engine = Engine(plain.model, plain.tokenizer, drafter=Oracle(ids, want.token_ids), num_speculative_tokens=5,
                         draft_length="fixed")
    got = spec_engine.generate(prompt=PROMPTS[0], max_new_tokens=40, structured=spec, sampling=params)
    assert got.token_ids == want.token_ids and got.stats.accepted_tokens > 10


def test_min_tokens_never_outlasts_the_grammar(plain):
    # The choice ends after 2-3 tokens while min_tokens still masks EOS: the grammar wins.
    spec_engine = Engine(plain.model, plain.tokenizer, drafter=NgramDrafter(), num_speculative_tokens=3)
    for params in (SamplingParams(min_tokens=10), SamplingParams(min_tokens=10, temperature=1.0, seed=3)):
        out = spec_engine.generate(prompt="hi", max_new_tokens=20, structured={"choice": ["no", "yes"]},
                                   sampling=params)
        assert out.text in ("no", "yes") and out.finish_reason == "stop"


def test_masks_leave_the_matcher_at_the_committed_tokens(plain):
    state = plain.compile_structured({"regex": REGEX})
    enc = plain.tokenizer.encode
    state.advance(enc("ab"))
    paths = [[], enc("c"), enc("cd"), enc("cdx"), enc("cz"), enc("czd"), enc("x1")]
    masks = state.masks(paths)
    for j, path in enumerate(paths):
        fresh = plain.compile_structured({"regex": REGEX})
        fresh.advance(enc("ab"))
        if fresh.matcher.validate_tokens(path) < len(path):
            assert masks[j].all()  # unreachable: a draft is rejected before it
            continue
        fresh.advance(path)
        assert torch.equal(masks[j], fresh._mask()), path
    # After all that probing, the state still allows exactly what it did after "ab".
    fresh = plain.compile_structured({"regex": REGEX})
    fresh.advance(enc("ab"))
    assert torch.equal(state._mask(), fresh._mask())
    assert set(masks[3].nonzero().flatten().tolist()) == set(enc("0123456789"))


def test_sampled_output_always_matches(plain):
    spec_engine = Engine(plain.model, plain.tokenizer, drafter=NgramDrafter(), num_speculative_tokens=4,
                         draft_length="fixed")
    for spec in SPECS:
        for seed, temp in itertools.product(range(6), (0.5, 1.0, 1.5)):
            out = spec_engine.generate(prompt=PROMPTS[seed % 2], max_new_tokens=80, structured=spec,
                                       sampling=SamplingParams(temperature=temp, seed=seed, top_p=0.95))
            if out.finish_reason == "stop":
                assert matches(spec, out.text), (spec, out.text)
            else:  # out of tokens: a prefix of a valid output, never a token outside the grammar
                assert len(out.token_ids) == 80


@pytest.mark.parametrize("spec,param", [
    ({"json": {"type": "foo"}}, "structured"),
    ({"json": "{not json"}, "structured"),
    ({"json": 5}, "structured"),
    ({"json": {"type": "string", "pattern": "(?=a)b"}}, "structured"),  # look-ahead: unsupported
    ({"regex": "é+"}, "structured"),  # no token of this ASCII tokenizer can start it
    ({"regex": "(ab"}, "structured"),
    ({"grammar": "start: foo"}, "structured"),
    ({"choice": []}, "structured"),
    ({"kind": "x"}, "structured"),
])
def test_bad_constraints_are_request_errors(plain, spec, param):
    with pytest.raises(InvalidRequestError) as info:
        plain.generate(prompt="hi", max_new_tokens=4, structured=spec)
    assert info.value.param == param


# -- exact distribution with a grammar mask -------------------------------------------------------

VT, N, SAMPLES = 5, 3, 6000
g = torch.Generator().manual_seed(5)
TARGET = torch.randn(VT, VT, generator=g) * 1.5
DRAFT = torch.randn(VT, VT, generator=g) * 1.5  # knows nothing of the grammar: mass on forbidden tokens
PARAMS = SamplingParams(temperature=1.0, presence_penalty=0.5, logit_bias={1: 1.0})


def allowed(history):
    """A toy grammar over 5 tokens: never the token after the last one (mod 5), never 0 twice."""
    ok = torch.ones(VT, dtype=torch.bool)
    ok[(history[-1] + 1) % VT] = False
    if history.count(0) >= 2:
        ok[0] = False
    return ok


def p_rows(out, draft):
    ctx = [0] + out
    paths = [draft[:i] for i in range(len(draft) + 1)]
    logits = adjust_logits(TARGET[[ctx[-1]] + draft], PARAMS, [0], out, paths, eos_ids=[])
    mask = torch.stack([allowed(ctx + path) for path in paths])
    return process_logits(logits.masked_fill(~mask, float("-inf")), PARAMS)


def cut_at_forbidden(p, q, draft, generator, out):
    # The broken rule: stop the draft at its first forbidden token and sample p' there.
    ctx = [0] + out
    for i, t in enumerate(draft):
        if not allowed(ctx + draft[:i])[t]:
            v = verify_sampling(p[: i + 1], q[:i], draft[:i], generator)
            return v
    return verify_sampling(p, q, draft, generator)


def spec_sample(k, broken, generator):
    out = []
    while len(out) < N:
        draft, qs, last = [], [], ([0] + out)[-1]
        for _ in range(k):
            q = process_logits(DRAFT[last], PARAMS)
            last = int(sample(q, generator))
            draft.append(last)
            qs.append(q)
        p = p_rows(out, draft)
        v = cut_at_forbidden(p, torch.stack(qs), draft, generator, out) if broken else \
            verify_sampling(p, torch.stack(qs), draft, generator)
        out += v.tokens
    return tuple(out[:N])


def p_value(k, broken, seed):
    generator = make_generator(seed, "cpu")
    counts = {}
    for _ in range(SAMPLES):
        key = spec_sample(k, broken, generator)
        counts[key] = counts.get(key, 0) + 1
    cells = list(itertools.product(range(VT), repeat=N))
    probs = []
    for cell in cells:
        prob = 1.0
        for i, t in enumerate(cell):
            prob *= float(p_rows(list(cell[:i]), [])[0, t])
        probs.append(prob)
    if not broken:
        assert all(counts.get(c, 0) == 0 for c, pr in zip(cells, probs) if pr == 0)  # never outside the grammar
    return pooled_chisquare_p(counts, cells, probs, SAMPLES)


@pytest.mark.parametrize("k", [2, 4])
def test_masked_speculative_sampling_is_exact(k):
    assert p_value(k, broken=False, seed=3) > 1e-3


def test_cutting_the_draft_at_a_forbidden_token_fails():
    assert p_value(3, broken=True, seed=3) < 1e-6


# -- the server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(folder, plain):
    from specdec.server.app import ServerSettings, create_app
    from test_server import SETTINGS, ThreadServer

    srv = ThreadServer(create_app(ServerSettings(model=str(folder), **SETTINGS),
                                  load=lambda s: (plain.model, plain.tokenizer))).start()
    yield srv.url
    srv.stop()


def post(url, path, body, stream=False):
    r = httpx.post(url + path, json=body, timeout=120)
    if not stream or r.status_code != 200:
        return r.status_code, r.json()
    text = ""
    for event in r.text.split("\n\n"):
        if event.startswith("data: ") and event != "data: [DONE]":
            chunk = json.loads(event[6:])
            for choice in chunk["choices"]:
                text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
    return 200, text


@pytest.mark.parametrize("stream", [False, True])
def test_server_json_schema_always_validates(server, stream):
    chat = "/v1/chat/completions"
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    for seed, temp in itertools.product(range(4), (0.0, 0.8, 1.3)):
        body = {"messages": [{"role": "user", "content": "a person as JSON"}], "max_tokens": 120, "seed": seed,
                "temperature": temp, "response_format": response_format, "stream": stream,
                "speculative": {"drafter": "ngram", "num_tokens": 4}}
        status, out = post(server, chat, body, stream)
        assert status == 200, out
        text = out if stream else out["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(text), SCHEMA)


def test_server_completion_fields_and_aliases(server, plain):
    c = "/v1/completions"
    want = plain.generate(prompt="x x x x", max_new_tokens=30, structured={"regex": REGEX}).text
    for extra in ({"structured_outputs": {"regex": REGEX}}, {"guided_regex": REGEX}):
        status, out = post(server, c, {"prompt": "x x x x", "max_tokens": 30, "temperature": 0, **extra})
        assert status == 200 and out["choices"][0]["text"] == want
    status, out = post(server, c, {"prompt": "hi", "max_tokens": 30, "temperature": 1.0, "seed": 1,
                                   "structured_outputs": {"choice": ["red", "green"]}})
    assert status == 200 and out["choices"][0]["text"] in ("red", "green")
    status, out = post(server, c, {"prompt": "hi", "max_tokens": 60, "temperature": 0.7, "seed": 2,
                                   "response_format": {"type": "json_object"}})
    assert status == 200 and isinstance(json.loads(out["choices"][0]["text"]), dict)


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"structured_outputs": {"json": {"type": "string", "pattern": "(?<=a)b"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "é+"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": [1]}, "structured_outputs"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice"),
    ({"guided_grammar": "start: ("}, "guided_grammar"),
    ({"guided_json": "{bad"}, "guided_json"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
])
def test_server_bad_constraints_are_400(server, extra, param):
    for path, base in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        status, out = post(server, path, {**base, "max_tokens": 4, **extra})
        assert status == 400, out
        assert out["error"]["param"] == param and out["error"]["type"] == "invalid_request_error"
    assert httpx.get(server + "/health").status_code == 200
