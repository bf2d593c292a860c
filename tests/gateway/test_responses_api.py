"""``/v1/responses`` (stateless) through the official ``openai`` client on a real server."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.conftest import TINY, openai_client
from tests.gateway.test_structured import WEATHER, Person


@pytest.fixture(scope="module")
def client(tiny_url: str) -> openai.OpenAI:
    return openai_client(tiny_url)


FUNCTION = {"type": "function", **WEATHER["function"]}


def test_text_response_whole_and_streamed(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": TINY, "input": "Say hi.", "instructions": "Be brief.",
                              "max_output_tokens": 8, "temperature": 0}
    whole = client.responses.create(**kwargs)
    assert whole.object == "response" and whole.status == "incomplete"
    assert whole.incomplete_details and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output_text and whole.usage and whole.usage.output_tokens == 8
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert kinds[-1] == "response.incomplete" and "response.output_text.done" in kinds
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_json_schema_text_format(client: openai.OpenAI) -> None:
    out = client.responses.create(model=TINY, input=[{"role": "user", "content": "A person."}],
                                  max_output_tokens=80, text={"format": {
                                      "type": "json_schema", "name": "person",
                                      "schema": {**Person.model_json_schema(),
                                                 "additionalProperties": False},
                                      "strict": True}})
    assert out.status == "completed", out.output_text
    Person.model_validate_json(out.output_text)


def test_function_calls_and_their_outputs(client: openai.OpenAI) -> None:
    whole = client.responses.create(model=TINY, input="Weather in Paris?", tools=[FUNCTION],
                                    tool_choice="required", max_output_tokens=60,
                                    temperature=0, parallel_tool_calls=False)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert whole.status == "completed" and len(calls) == 1
    assert calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert set(json.loads(calls[0].arguments)) == {"city", "unit"}
    events = list(client.responses.create(model=TINY, input="Weather in Paris?",
                                          tools=[FUNCTION], tool_choice="required",
                                          max_output_tokens=60, temperature=0, stream=True,
                                          parallel_tool_calls=False))
    first = next(e.item.id for e in events if e.type == "response.output_item.added")
    args = "".join(e.delta for e in events
                   if e.type == "response.function_call_arguments.delta" and e.item_id == first)
    assert args == calls[0].arguments and events[-1].type == "response.completed"
    follow = client.responses.create(model=TINY, max_output_tokens=5, tools=[FUNCTION], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
         "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C"}])
    assert follow.usage and follow.usage.input_tokens > whole.usage.input_tokens  # type: ignore[union-attr]


@pytest.mark.parametrize("body, param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"text": {"format": {"type": "json_schema", "name": "x",
                          "schema": {"type": "bogus"}}}}, "text.format"),
])
def test_refused(client: openai.OpenAI, body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=TINY, input="x", extra_body=body)
    assert caught.value.param == param


def test_an_integral_float_max_output_tokens_is_that_integer(tiny_url: str) -> None:
    """JSON Schema's ``integer`` (the published schema) includes 16.0, as OpenAI's API
    does: 16.0 is served as 16 (echoed as an integer, at most 16 tokens); 16.5 is refused."""
    body = {"model": TINY, "input": "Count to fifty.", "temperature": 0}
    with httpx.Client(base_url=tiny_url, timeout=120) as http:
        served = http.post("/v1/responses", json={**body, "max_output_tokens": 16.0})
        refused = http.post("/v1/responses", json={**body, "max_output_tokens": 16.5})
    assert served.status_code == 200, served.text
    answer = served.json()
    assert type(answer["max_output_tokens"]) is int and answer["max_output_tokens"] == 16
    assert 0 < answer["usage"]["output_tokens"] <= 16
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "max_output_tokens"
