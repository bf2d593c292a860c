"""LangChain's ``ChatOpenAI`` (langchain-openai) against a real server of the default
model: structured output by JSON schema and by function calling, tools bound and
called, streaming. Greedy decoding with a small model can write silly values, so the
checks are about structure (schema-valid objects, the right function), not content."""

from __future__ import annotations

from typing import Any, Literal

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ConfigDict, Field

from tests.reliability.support import ServeProcess
from tests.sdk.conftest import MODEL

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(300)]


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=20)
    age: int


class WeatherArgs(BaseModel):
    # With strict=True LangChain keeps extra="forbid" as additionalProperties: false (without
    # it LangChain drops it, and a schema that allows more keys gets more keys)
    model_config = ConfigDict(extra="forbid")

    city: str = Field(max_length=30)
    unit: Literal["c", "f"]


@tool(args_schema=WeatherArgs)
def get_weather(city: str, unit: Literal["c", "f"]) -> str:
    """The current weather in a city."""
    return f"21 {unit} in {city}"


def assert_weather_call(call: Any) -> None:
    """A call of get_weather whose arguments are valid against its schema."""
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    WeatherArgs.model_validate(call["args"])


@pytest.fixture(scope="module")
def llm(default_server: ServeProcess) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=f"{default_server.url}/v1", api_key="unused",
                      temperature=0, max_completion_tokens=60, max_retries=0, timeout=120)


ASK = [HumanMessage("Describe a person: name and age.")]
WEATHER = [HumanMessage("What is the weather in Paris?")]


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output(llm: ChatOpenAI, method: Literal["json_schema",
                                                            "function_calling"]) -> None:
    structured = llm.with_structured_output(Person, method=method, include_raw=True)
    out: Any = structured.invoke(ASK)
    assert out["parsing_error"] is None, out
    person = out["parsed"]
    assert isinstance(person, Person)
    Person.model_validate(person.model_dump())  # the constraints hold (max_length)
    raw = out["raw"]
    assert isinstance(raw, AIMessage)
    if method == "function_calling":
        assert [call["name"] for call in raw.tool_calls] == ["Person"]


def test_bind_tools_and_invoke(llm: ChatOpenAI) -> None:
    bound = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True,
                           parallel_tool_calls=False)
    message = bound.invoke(WEATHER)
    assert isinstance(message, AIMessage)
    (call,) = message.tool_calls
    assert_weather_call(call)
    result = get_weather.invoke(call)
    assert isinstance(result, ToolMessage)
    follow = llm.bind_tools([get_weather]).invoke([*WEATHER, message, result])
    assert isinstance(follow, AIMessage)
    assert follow.usage_metadata and message.usage_metadata
    assert follow.usage_metadata["input_tokens"] > message.usage_metadata["input_tokens"]


def test_streaming_text_and_tool_calls(llm: ChatOpenAI) -> None:
    chunks = list(llm.stream([HumanMessage("Say hello.")]))
    assert len(chunks) > 1 and all(isinstance(c, AIMessageChunk) for c in chunks)
    text = "".join(str(c.content) for c in chunks)
    assert text and text == llm.invoke([HumanMessage("Say hello.")]).content
    bound = llm.bind_tools([get_weather], tool_choice="required", strict=True,
                           parallel_tool_calls=False)
    total: Any = None
    for chunk in bound.stream(WEATHER):
        total = chunk if total is None else total + chunk
    assert isinstance(total, AIMessageChunk)
    (call,) = total.tool_calls
    assert_weather_call(call)
