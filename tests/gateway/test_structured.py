"""Structured outputs and tool calls through the official ``openai`` client against a
real server on the tiny model: whatever the (random) model would say, the grammar
makes it valid."""

from __future__ import annotations

import json
import time
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.gateway.conftest import TINY, openai_client

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"], "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                       "required": ["zone"], "additionalProperties": False},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)
    colour: Literal["red", "green", "blue"]


@pytest.fixture(scope="module")
def client(tiny_url: str) -> openai.OpenAI:
    return openai_client(tiny_url)


def _parse(client: openai.OpenAI, **kwargs: Any) -> Any:
    beta = getattr(client, "beta", None)
    chat = client.chat.completions if hasattr(client.chat.completions, "parse") else (
        beta.chat.completions)  # type: ignore[union-attr]
    return chat.parse(**kwargs)


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    for seed in range(3):
        completion = _parse(client, model=TINY, messages=ASK, response_format=Person,
                            max_tokens=120, temperature=0.8, seed=seed)
        person = completion.choices[0].message.parsed
        assert isinstance(person, Person) and completion.choices[0].finish_reason == "stop"


def test_json_object_streamed_and_whole(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": TINY, "messages": ASK, "max_tokens": 60,
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "p", "strict": True,
                                  "schema": Person.model_json_schema()}}}
    whole = client.chat.completions.create(**kwargs, temperature=0)
    assert Person.model_validate_json(whole.choices[0].message.content or "")
    chunks = list(client.chat.completions.create(**kwargs, temperature=0, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    obj = client.chat.completions.create(model=TINY, messages=ASK, max_tokens=40,
                                         response_format={"type": "json_object"})
    choice = obj.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content or ""), dict)
    else:  # cut short by max_tokens: an object begun
        assert choice.finish_reason == "length" and (choice.message.content or "").startswith("{")


def test_completions_take_a_response_format(client: openai.OpenAI) -> None:
    out = client.completions.create(model=TINY, prompt="A colour:", max_tokens=20,
                                    extra_body={"response_format": {
                                        "type": "json_schema", "json_schema": {
                                            "name": "c", "schema": {"enum": ["red", "blue"]}}}})
    assert json.loads(out.choices[0].text) in ("red", "blue")


def _check_call(call: Any, tools: dict[str, dict[str, Any]]) -> None:
    import jsonschema_rs

    assert call.id.startswith("call_") and call.type == "function"
    schema = tools[call.function.name]["function"]["parameters"]
    jsonschema_rs.validate(schema, json.loads(call.function.arguments))


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_whole_and_streamed(client: openai.OpenAI, choice: str) -> None:
    tools = {"get_weather": WEATHER, "get_time": TIME}
    tool_choice: Any = ("required" if choice == "required"
                        else {"type": "function", "function": {"name": "get_time"}})
    kwargs: dict[str, Any] = {"model": TINY, "messages": ASK, "tools": list(tools.values()),
                              "tool_choice": tool_choice, "max_tokens": 80, "temperature": 0,
                              "parallel_tool_calls": False}
    whole = client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and message.content is None
    assert message.tool_calls and len(message.tool_calls) == 1
    _check_call(message.tool_calls[0], tools)
    if choice == "named":
        assert message.tool_calls[0].function.name == "get_time"
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == message.tool_calls[0].function.name
    assert all(d.index == 0 for d in deltas) and all(d.id is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == (
        message.tool_calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_may_answer_in_text_or_call(client: openai.OpenAI) -> None:
    """The tiny model mostly answers in text under ``auto``; a call, when it starts, is
    valid. Both must come back in OpenAI's shape, streamed or not."""
    tools = {"get_weather": WEATHER}
    seen = set()
    for seed in range(4):
        kwargs: dict[str, Any] = {"model": TINY, "messages": ASK, "tools": [WEATHER],
                                  "max_tokens": 30, "temperature": 1.0, "seed": seed}
        whole = client.chat.completions.create(**kwargs)
        message = whole.choices[0].message
        if message.tool_calls:
            seen.add("call")
            _check_call(message.tool_calls[0], tools)
        else:
            seen.add("text")
            assert isinstance(message.content, str)
            assert not message.content.startswith("<tool_call>")
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == (message.content or "")
    assert seen


def test_auto_continues_a_call_it_began(client: openai.OpenAI) -> None:
    """Prefilled as if the model had begun a call: the rest is constrained to one."""
    out = client.completions.create(model=TINY, prompt="<tool_call>", max_tokens=5)
    assert out.choices  # the plain model is free; the chat path below is constrained
    whole = client.chat.completions.create(
        model=TINY, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=60,
        temperature=0.7, seed=3)
    assert whole.choices[0].message.tool_calls


def test_multi_turn_with_tool_results(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=TINY, messages=ASK, tools=[WEATHER],
                                           tool_choice="required", max_tokens=60)
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    messages: list[Any] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    second = client.chat.completions.create(model=TINY, messages=messages, tools=[WEATHER],
                                            max_tokens=10)
    message = second.choices[0].message
    assert isinstance(message.content, str) or message.tool_calls
    assert first.usage is not None and second.usage is not None
    # the call and its result are in the prompt now
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10
    plain = client.chat.completions.create(model=TINY, messages=messages, max_tokens=3)
    assert plain.choices[0].message.content is not None  # history without tools offered


@pytest.mark.parametrize("body, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(" * 300 + "a" + ")*" * 300}}}},
     "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "bogus"}}}}, "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"enum": [f"v{i}" + "y" * 40 for i in range(30000)]}}}},
     "schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
])
def test_bad_schemas_are_a_400_in_bounded_time(client: openai.OpenAI, body: dict[str, Any],
                                               needle: str) -> None:
    start = time.monotonic()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=TINY, messages=ASK, max_tokens=5,
                                       extra_body=body)
    assert time.monotonic() - start < 30
    assert needle in str(caught.value)
    ok = client.chat.completions.create(model=TINY, messages=ASK, max_tokens=3)
    assert ok.choices[0].finish_reason == "length"  # the model thread is still serving


def test_the_cheap_checks_come_before_the_grammar(client: openai.OpenAI) -> None:
    """A request asking for more tokens than the context holds is refused for that before
    its schema is compiled (which may take seconds): with a schema the compiler refuses,
    the answer names the length, not the schema."""
    bogus = {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "bogus"}}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=TINY, messages=ASK, max_tokens=10**6,
                                       extra_body=bogus)
    assert caught.value.code == "context_length_exceeded", caught.value
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=TINY, prompt="Hello", max_tokens=10**6,
                                  extra_body=bogus)
    assert caught.value.code == "context_length_exceeded", caught.value
    with pytest.raises(openai.BadRequestError) as caught:  # the schema alone: refused for it
        client.chat.completions.create(model=TINY, messages=ASK, max_tokens=5,
                                       extra_body=bogus)
    assert "schema" in str(caught.value)
