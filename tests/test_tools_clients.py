"""Agent frameworks from PyPI against the server's tool calling, with tool_choice="required" on the
tiny random Qwen2.5-templated model: the OpenAI Agents SDK (through its chat-completions model)
runs a function tool with arguments valid for its schema, and LangChain's `ChatOpenAI.bind_tools`
returns a valid call."""

import asyncio

import pytest

pytest.importorskip("llguidance")

from test_tools_server import server  # noqa: F401 (the fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_openai_agents_sdk_runs_a_tool(server):  # noqa: F811
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


def test_langchain_bind_tools_returns_a_valid_call(server):  # noqa: F811
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
