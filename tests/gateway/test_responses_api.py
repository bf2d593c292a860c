"""``/v1/responses`` (stateless) through the official ``openai`` client on a real server."""

from __future__ import annotations

import json
import logging
from pathlib import Path
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


# -- what Codex CLI sends -----------------------------------------------------------------

CODEX_DIR = Path(__file__).parents[1] / "codex"
# What Codex 0.169.0 sent: for `codex exec "Say hello."`, and after running the namespaced
# call (multi_agent_v1's wait_agent) that a scripted provider had answered with
CODEX_REQUEST = CODEX_DIR / "request.json"
CODEX_AFTER_CALL = CODEX_DIR / "request-after-call.json"


def codex_request(path: Path = CODEX_REQUEST, **changes: Any) -> dict[str, Any]:
    """Codex's request as ``responses.create`` arguments (``client_metadata`` is not one
    of the SDK's, so it goes in the extra body)."""
    body = {**json.loads(path.read_text()), **changes}
    extra = {"client_metadata": body.pop("client_metadata")}
    return {**body, "extra_body": extra}


NAMESPACE = {"type": "namespace", "name": "weather_v1", "description": "Weather tools.",
             "tools": [{**FUNCTION, "strict": False}]}


@pytest.mark.parametrize("path", [CODEX_REQUEST, CODEX_AFTER_CALL], ids=["turn", "after-call"])
def test_codex_request_meets_only_the_context_limit(client: openai.OpenAI, path: Path) -> None:
    """Everything Codex sends is accepted (developer messages, input_text parts, a
    namespace tool, a hosted web_search, reasoning, include, store, prompt_cache_key,
    client_metadata; a namespaced function_call and its output, with their ids and
    status); its ~9k-token prompt is then too long for the tiny model's 512."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**codex_request(path, model=TINY, stream=False))
    error = caught.value
    assert error.code == "context_length_exceeded" and error.param == "input", error.body
    assert "maximum context length is 512 tokens" in error.message


def test_namespace_calls_come_back_by_name_and_namespace(
        client: openai.OpenAI, caplog: pytest.LogCaptureFixture) -> None:
    tools: list[Any] = [NAMESPACE, {"type": "web_search", "external_web_access": False}]
    kwargs: dict[str, Any] = {
        "model": TINY, "input": "Weather in Paris?", "tools": tools, "tool_choice": "required",
        "parallel_tool_calls": False, "max_output_tokens": 60, "temperature": 0,
        "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"],
        "store": False, "prompt_cache_key": "thread-1", "metadata": {"run": "a"},
        "extra_body": {"client_metadata": {"session_id": "s-1"}}}
    with caplog.at_level(logging.INFO, logger="gateway.api.responses"):
        whole = client.responses.create(**kwargs)
    hosted = [r.getMessage() for r in caplog.records if "hosted tools" in r.getMessage()]
    assert len(hosted) == 1 and hosted[0].endswith(": web_search"), hosted
    calls = [item for item in whole.output if item.type == "function_call"]
    assert whole.status == "completed" and len(calls) == 1, whole.output
    assert (calls[0].namespace, calls[0].name) == ("weather_v1", "get_weather")
    assert set(json.loads(calls[0].arguments)) == {"city", "unit"}
    extra = whole.model_extra or {}
    assert extra["ignored_tools"] == ["web_search"]
    assert [t.type for t in whole.tools] == ["namespace", "web_search"]  # echoed as sent
    assert whole.prompt_cache_key == "thread-1" and whole.metadata == {"run": "a"}
    assert whole.reasoning and whole.reasoning.summary == "auto"
    assert not any(item.type == "reasoning" for item in whole.output)

    events = list(client.responses.create(**kwargs, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(d.type, getattr(d, "namespace", None), d.name) for d in done] == [  # type: ignore[union-attr]
        ("function_call", "weather_v1", "get_weather")]
    assert done[0].arguments == calls[0].arguments  # type: ignore[union-attr]
    assert events[-1].type == "response.completed"

    follow = client.responses.create(
        model=TINY, max_output_tokens=5, tools=tools, input=[
            {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
            {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
             "namespace": "weather_v1", "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id,
             "output": [{"type": "input_text", "text": "21 C"}]}])
    assert follow.status in ("completed", "incomplete") and follow.output
    assert follow.usage and whole.usage and follow.usage.input_tokens > whole.usage.input_tokens


def test_a_namespaced_function_is_a_plain_function_apart(client: openai.OpenAI) -> None:
    """The model sees ``weather_v1__get_weather``: a plain function of that name would be
    the same one, and is refused like any duplicate."""
    clash = {**FUNCTION, "name": "weather_v1__get_weather"}
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=TINY, input="x", tools=[NAMESPACE, clash])  # type: ignore[list-item]
    assert caught.value.param is not None and caught.value.param.startswith("tools")


@pytest.mark.parametrize("body, param", [
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"tools": [{"type": "custom", "name": "apply_patch"}]}, "tools"),
    ({"reasoning": {"effort": "enormous"}}, "reasoning"),
])
def test_what_is_not_served_is_refused(client: openai.OpenAI, body: dict[str, Any],
                                       param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=TINY, input="x", extra_body=body)
    assert caught.value.param is not None and caught.value.param.startswith(param), \
        caught.value.body


def test_a_long_namespace_still_round_trips(client: openai.OpenAI) -> None:
    """``<namespace>__<name>`` past 64 characters is shortened with a hash for the model,
    and the call still comes back by its own name and namespace."""
    long = {**NAMESPACE, "name": "n" * 64}
    out = client.responses.create(model=TINY, input="Weather?", tools=[long],  # type: ignore[list-item]
                                  tool_choice="required", parallel_tool_calls=False,
                                  max_output_tokens=60, temperature=0)
    call = next(item for item in out.output if item.type == "function_call")
    assert (call.namespace, call.name) == ("n" * 64, "get_weather")
