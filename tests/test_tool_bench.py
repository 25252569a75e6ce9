"""The function-calling cases and their scoring (scripts/tool_cases.py), and the tool benchmark
(scripts/tool_bench.py) run end to end against a server on the tiny Qwen2.5-templated model: its
accuracy table and agent loops (speculation on and off giving the same calls at temperature 0)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))

import tool_cases as C  # noqa: E402

jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.usefixtures("one_thread")


def test_own_cases_are_many_and_their_truth_fits_the_offered_tool():
    cases = C.own_cases()
    assert len(cases) >= 100 and len({c["id"] for c in cases}) == len(cases)
    for case in cases:
        (name, args), = case["truth"][0].items()
        tools = {t["function"]["name"]: t["function"]["parameters"] for t in case["tools"]}
        assert name in tools and len(tools) == 3
        jsonschema.validate({k: v[0] for k, v in args.items()}, tools[name])
        assert C.case_right([(name, json.dumps({k: v[0] for k, v in args.items()}))], case["truth"])


def test_scoring_takes_accepted_values_only():
    truth = [{"f": {"a": [10], "city": ["New York"], "unit": ["celsius", ""]}}]
    assert C.call_right("f", '{"a": 10.0, "city": "new york"}', truth)  # loose strings, 10 == 10.0, unit optional
    assert C.call_right("f", '{"a": 10, "city": "New York", "unit": "celsius"}', truth)
    for name, args in [("g", '{"a": 10, "city": "New York"}'),  # another function
                       ("f", '{"a": 11, "city": "New York"}'),  # a wrong value
                       ("f", '{"city": "New York"}'),  # a required argument missing
                       ("f", '{"a": 10, "city": "New York", "x": 1}'),  # an extra argument
                       ("f", '{"a": 10, "city": "New York", "unit": "kelvin"}'),
                       ("f", "{bad json")]:
        assert not C.call_right(name, args, truth), (name, args)
    assert not C.case_right([("f", '{"a": 10, "city": "New York"}')] * 2, truth)  # one call, not two
    assert not C.call_right("f", '{"a": true, "city": "New York"}', [{"f": {"a": [1], "city": ["New York"]}}])


def test_bfcl_cases_become_openai_tools(tmp_path):
    """BFCL's shape (a wheel holding its data files), as the bfcl-eval wheel ships it."""
    import zipfile

    question = {"id": "simple_python_0", "question": [[{"role": "user", "content": "Area of a 10 by 5 triangle?"}]],
                "function": [{"name": "geometry.area", "description": "Area.", "parameters": {
                    "type": "dict", "properties": {"base": {"type": "integer"}, "h": {"type": "float"},
                                                   "dims": {"type": "tuple", "items": {"type": "integer"}},
                                                   "x": {"type": "any"}},
                    "required": ["base", "h"]}}]}
    answer = {"id": "simple_python_0", "ground_truth": [{"geometry.area": {"base": [10], "h": [5.0], "dims": [""]}}]}
    wheel = tmp_path / "bfcl_eval-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("bfcl_eval/data/BFCL_v4_simple_python.json", json.dumps(question) + "\n")
        z.writestr("bfcl_eval/data/possible_answer/BFCL_v4_simple_python.json", json.dumps(answer) + "\n")
    case, = C.bfcl_cases(100, str(wheel))
    fn = case["tools"][0]["function"]
    assert fn["name"] == "geometry_area" and case["truth"] == [{"geometry_area": answer["ground_truth"][0]["geometry.area"]}]
    assert fn["parameters"]["type"] == "object" and fn["parameters"]["properties"]["h"] == {"type": "number"}
    assert fn["parameters"]["properties"]["dims"]["type"] == "array" and fn["parameters"]["properties"]["x"] == {}
    jsonschema.Draft202012Validator.check_schema(fn["parameters"])
    assert C.case_right([("geometry_area", '{"base": 10, "h": 5}')], case["truth"])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from test_server import SETTINGS, ThreadServer
    from tool_models import make_tool_model

    from specdec import Engine
    from specdec.server.app import ServerSettings, create_app

    pytest.importorskip("llguidance")
    folder, _ = make_tool_model(tmp_path_factory.mktemp("tool-bench"), "qwen")
    engine = Engine.load(str(folder), dtype="float32")
    settings = ServerSettings(model=str(folder), **{**SETTINGS, "max_model_len": 2048})
    srv = ThreadServer(create_app(settings, load=lambda s: (engine.model, engine.tokenizer))).start()
    yield srv.url
    srv.stop()


def test_the_bench_runs_against_a_server(server, tmp_path, monkeypatch):
    pytest.importorskip("openai")
    import tool_bench

    monkeypatch.setattr(tool_bench, "PART_CHARS", 240)  # the tiny model's tokenizer: ~1 token a character
    out = tmp_path / "tools.json"
    result = tool_bench.main(["--base-url", server + "/v1", "--cases", "own", "--limit", "3", "--loops", "1",
                              "--max-turns", "2", "--max-tokens", "24", "--history", "3", "--history-repeats", "1",
                              "--peer-base-url", server + "/v1", "--out", str(out)])
    assert json.loads(out.read_text())["accuracy"] == result["accuracy"]
    row = result["accuracy"]["own"]
    assert row["cases"] == 3 and 0 <= row["right"] <= row["as_tool_calls"] <= 3
    assert row["identical_off"] == 3  # greedy: the same answer with speculation off
    assert [c["right"] for c in row["per_case"]].count(True) == row["right"] and len(row["per_case"]) == 3
    assert len(result["loops"]) == 3 * len(tool_bench.SCENARIOS)  # on, off, and the peer (here the same server)
    assert [x["speculative"] for x in result["loops"][:3]] == [True, False, "peer"]
    assert result["loop_speedup"] > 0 and result["loop_speedup_over_peer"] > 0 and len(result["peer_history"]) == 1
    for loop in result["loops"]:
        assert loop["total_s"] > 0 and 1 <= len(loop["turns"]) <= 2
        assert all(t["tokens"] is not None and t["turn_s"] > 0 for t in loop["turns"])
        for t in loop["turns"]:  # each turn's passes from the stream's statistics (specdec's fields only)
            if loop["speculative"] == "peer":
                assert t["target_passes"] is None
            else:
                assert 1 <= t["target_passes"] <= t["tokens"] and t["prompt_tokens"] > t["cached_tokens"] >= 0
                assert 0 <= t["accepted_tokens"] <= t["draft_tokens"]
                if loop["speculative"] is False:
                    assert t["target_passes"] == t["tokens"] and t["draft_tokens"] == 0
    turns, = result["history"]  # each turn re-sends the last one's prompt: the prefix cache serves it
    assert [t["turn"] for t in turns] == [1, 2, 3] and all(t["ttft_s"] > 0 for t in turns)
    for before, now in zip(turns, turns[1:]):
        assert now["prompt_tokens"] > before["prompt_tokens"] + 100
        assert before["prompt_tokens"] - 4 <= now["cached_tokens"] < now["prompt_tokens"]
