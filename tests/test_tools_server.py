"""Tool calling over /v1/chat/completions (server/toolapi.py): calls as `message.tool_calls` with
OpenAI's finish reasons, streamed chunks that the official `openai` client's stream helper
assembles into the call the non-streaming answer holds (and manual accumulation, one argument
fragment per generated token, strict tools through the helper's parsing), a tool loop through the client (history
with assistant calls and tool results), a 400 naming the field for each bad input, and two agent
frameworks from PyPI with tool_choice="required": the OpenAI Agents SDK (its chat-completions
model) runs a function tool, LangChain's `ChatOpenAI.bind_tools` returns a valid call. On the tiny
random Qwen2.5-templated model (tests/tool_models.py), drafting with n-grams."""

import asyncio
import json

import httpx
import pytest

from tool_models import make_tool_model

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

from test_server import SETTINGS, ThreadServer
from test_tools import SCHEMAS, TOOLS

pytestmark = pytest.mark.usefixtures("one_thread")

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from specdec import Engine
    from specdec.server.app import ServerSettings, create_app

    folder, _ = make_tool_model(tmp_path_factory.mktemp("tools-server"), "qwen")
    engine = Engine.load(str(folder), dtype="float32")
    settings = ServerSettings(model=str(folder), **{**SETTINGS, "max_model_len": 2048})
    srv = ThreadServer(create_app(settings, load=lambda s: (engine.model, engine.tokenizer))).start()
    yield srv.url
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server, body):
    return httpx.post(server + "/v1/chat/completions", json={"model": "tiny", **body}, timeout=120)


def valid(call):
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert call.id and call.type == "function"


@pytest.mark.parametrize("choice,finish", [("required", "tool_calls"),
                                           ({"type": "function", "function": {"name": "get_time"}}, "stop")])
def test_constrained_calls_come_back_as_tool_calls(client, choice, finish):
    for seed in range(4):
        res = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice,
                                             parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=seed)
        choice0 = res.choices[0]
        if choice0.finish_reason == "length":
            continue
        assert choice0.finish_reason == finish and choice0.message.content is None
        assert len(choice0.message.tool_calls) == 1
        valid(choice0.message.tool_calls[0])
        if isinstance(choice, dict):
            assert choice0.message.tool_calls[0].function.name == "get_time"


def test_a_call_cut_by_max_tokens_is_length(client):
    res = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                         max_tokens=5, temperature=0)
    assert res.choices[0].finish_reason == "length" and not res.choices[0].message.tool_calls


def test_streamed_calls_assemble_into_the_non_streaming_answer(client, server):
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              max_tokens=200, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    with client.chat.completions.stream(**kw) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    got = [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls]
    assert got == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    # Manual accumulation of the deltas, as agent code does it.
    acc = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for part in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = acc.setdefault(part.index, {"id": part.id, "name": part.function.name, "arguments": ""})
            entry["arguments"] += part.function.arguments or ""
    assert [(e["name"], e["arguments"]) for e in acc.values()] == got and acc[0]["id"]
    # OpenAI's chunk order: the call's index, id, type and name first, then argument fragments as
    # the model writes them (without speculation one token, here one byte, per step: one per chunk).
    args = whole.message.tool_calls[0].function.arguments
    lines = httpx.post(server + "/v1/chat/completions", json={**kw, "stream": True, "speculative": False},
                       timeout=120).text.split("\n\n")
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    parts = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
    assert parts[0]["id"] and parts[0]["function"] == {"name": whole.message.tool_calls[0].function.name,
                                                       "arguments": ""}
    assert all("id" not in p and set(p["function"]) == {"arguments"} for p in parts[1:])
    assert "".join(p["function"]["arguments"] for p in parts) == args
    assert len(parts) - 1 == len(args)


def test_strict_tools_stream_through_the_clients_parsing_helper(client):
    """Strict tools: the openai stream helper parses the growing arguments (its partial-JSON events)
    and the final call's parsed arguments, which strict mode's schema holds exactly."""
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]
    kw = dict(model="tiny", messages=ASK, tools=strict, tool_choice="required", parallel_tool_calls=False,
              max_tokens=200, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0]
    growing = []
    with client.chat.completions.stream(**kw) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                growing.append(event.arguments)
        final = stream.get_final_completion().choices[0]
    call = final.message.tool_calls[0]
    assert call.function.arguments == whole.message.tool_calls[0].function.arguments
    assert call.function.parsed_arguments == json.loads(call.function.arguments)
    valid(call)
    assert len(growing) > 1 and all(b.startswith(a) for a, b in zip(growing, growing[1:]))
    assert growing[-1] == call.function.arguments


def test_a_tool_loop_through_the_openai_client(client):
    messages = list(ASK)
    res = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=200, temperature=0)
    call = res.choices[0].message.tool_calls[0]
    messages.append(res.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})})
    # The next turn renders the call and its result through the template, and may call again.
    again = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=200, temperature=0)
    assert again.choices[0].finish_reason in ("tool_calls", "length")
    auto = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=20, temperature=0)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    none = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="none",
                                          max_tokens=8, temperature=0)
    assert none.choices[0].message.tool_calls is None


def test_auto_without_a_call_is_content(client):
    res = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=12, temperature=0)
    assert res.choices[0].message.content and not res.choices[0].message.tool_calls
    assert res.choices[0].finish_reason == "length"


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": 1}'}}
BAD = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string",
                                                                               "pattern": "(?=a)b"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "messages": ASK + [{"role": "tool", "tool_call_id": "x", "content": "1"}]},
     "messages[1].tool_call_id"),
    ({"tools": TOOLS, "messages": ASK + [{"role": "assistant", "tool_calls": [
        {**CALL, "function": {"name": "get_time", "arguments": "{tz"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "custom", "custom": {"name": "c"}}]}, "tools[0].type"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}},
     "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
]


@pytest.mark.parametrize("extra,param", BAD, ids=[p for _, p in BAD])
def test_bad_tool_input_is_a_400_naming_the_field(server, extra, param):
    res = post(server, {"messages": ASK, "max_tokens": 4, **extra})
    assert res.status_code == 400, res.text
    assert res.json()["error"]["param"] == param, res.json()


def test_a_pattern_past_the_budget_is_a_400_beside_a_running_stream(client, server, monkeypatch):
    """Under a small lexer budget a tool pattern the call grammar's probe cannot see is refused in
    the handler (its own probe), while a call already streaming goes on to the same answer."""
    from llguidance import LLParserLimits

    from specdec import structured

    kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              max_tokens=120, temperature=0)
    want = client.chat.completions.create(**kw).choices[0].message.tool_calls[0].function.arguments
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "[ab]*a[ab]{30}"}}, "required": ["a"]}}}
    with client.chat.completions.stream(**kw) as stream:
        next(iter(stream))  # under way, its grammar compiled at the default budget
        monkeypatch.setattr(structured, "_limits", lambda: LLParserLimits(verbose_errors=False, step_lexer_fuel=300))
        bad = post(server, {"messages": ASK, "max_tokens": 20, "tools": [tool], "tool_choice": "required"})
        monkeypatch.undo()
        final = stream.get_final_completion().choices[0]
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "tools[0].function.parameters.properties.a.pattern"
    assert final.message.tool_calls[0].function.arguments == want


def test_an_auto_call_is_valid_and_streams_as_the_whole_answer(client, server):
    """Under "auto" a logit bias on <tool_call> makes the random model open a call: the lazy
    constraint keeps the call valid, speculation on and off give the same answer, and the stream
    assembles into the non-streaming answer."""
    opening = 259  # <tool_call> in tool_models' Qwen tokenizer
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, parallel_tool_calls=False, max_tokens=120, temperature=0,
              logit_bias={str(opening): 2})
    whole = client.chat.completions.create(**kw).choices[0]
    plain = client.chat.completions.create(**kw, extra_body={"speculative": False}).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1
    valid(whole.message.tool_calls[0])
    assert (plain.message.content, plain.message.tool_calls[0].function.arguments) == \
        (whole.message.content, whole.message.tool_calls[0].function.arguments)
    with client.chat.completions.stream(**kw) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls" and (streamed.message.content or None) == whole.message.content
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


# -- agent frameworks ----------------------------------------------------------------------------


def test_openai_agents_sdk_runs_a_tool(server):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    client = AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = agents.OpenAIChatCompletionsModel(model="tiny", openai_client=client)
    agent = agents.Agent(name="weather", instructions="Answer with the tool.", model=model, tools=[get_weather],
                         model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=120,
                                                             parallel_tool_calls=False),
                         tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=2))
    assert len(seen) == 1 and isinstance(seen[0], str)
    assert result.final_output == f"sunny in {seen[0]}"


def test_langchain_bind_tools_returns_a_valid_call(server):
    pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_time(tz: int) -> str:
        """The time in a time zone, as an hour offset."""
        return "noon"

    llm = ChatOpenAI(model="tiny", base_url=server + "/v1", api_key="unused", temperature=0, max_tokens=120,
                     max_retries=0)
    answer = llm.bind_tools([get_time], tool_choice="required").invoke("What time is it in Paris?")
    assert len(answer.tool_calls) >= 1
    call = answer.tool_calls[0]
    assert call["name"] == "get_time" and isinstance(call["args"]["tz"], int) and call["id"]
    assert get_time.invoke(call["args"]) == "noon"
