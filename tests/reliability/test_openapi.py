"""The served OpenAPI document is accurate: every route, its request body, both
forms of its 200 and every error it can answer are documented, and the request
schemas accept exactly what the server accepts."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema_rs
import pytest
import schemathesis
from fastapi.routing import APIRoute
from hypothesis import HealthCheck, given, settings
from schemathesis.generation.modes import GenerationMode

from decoding.engine import Engine
from gateway.api.intake import parse_body
from gateway.api.openapi import COMPLETION_ERRORS, bound_token_ids
from gateway.api.routes import router, v1
from gateway.api.tokenize import router as tokenizing_router
from gateway.server import create_app
from gateway.wire.errors import InvalidRequestError
from gateway.wire.requests import ChatCompletionRequest, CompletionRequest
from gateway.wire.responses import ResponsesRequest
from tests.gateway.conftest import TINY, in_process, tiny_settings

# a request that never ends must fail the test, not hang the suite
pytestmark = pytest.mark.timeout(300)

CHAT = [{"role": "user", "content": "hi"}]
REQUEST_MODELS: dict[str, type[ChatCompletionRequest] | type[CompletionRequest]] = {
    "/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    return create_app(tiny_settings()).openapi()


def refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from refs(item)


def validator(document: dict[str, Any], name: str) -> jsonschema_rs.Validator:
    """A validator of one component schema, its references resolved in the document."""
    schema = {"$ref": f"#/components/schemas/{name}", "components": document["components"]}
    return jsonschema_rs.Draft202012Validator(schema)


@pytest.mark.parametrize("keys", [[], ["k"]], ids=["open", "with-keys"])
def test_document_is_valid_openapi(keys: list[str]) -> None:
    document = create_app(tiny_settings(api_keys=keys)).openapi()
    assert document["openapi"].startswith("3.1")
    schemathesis.openapi.from_dict(document).validate()  # the OpenAPI 3.1 meta-schema


def test_every_route_is_documented(document: dict[str, Any]) -> None:
    routes = [r for r in [*router.routes, *v1.routes, *tokenizing_router.routes]
              if isinstance(r, APIRoute)]
    for route in routes:
        path = route.path.replace(":path}", "}")
        for method in route.methods or ():
            operation = document["paths"][path][method.lower()]
            assert "200" in operation["responses"], (path, method)
            assert "422" not in operation["responses"], "validation errors are 400s here"
    assert len(routes) == 8


@pytest.mark.parametrize("path", sorted(REQUEST_MODELS))
def test_completion_routes_document_body_streams_and_errors(document: dict[str, Any],
                                                            path: str) -> None:
    operation = document["paths"][path]["post"]
    body = operation["requestBody"]
    assert body["required"] is True
    model = REQUEST_MODELS[path]
    assert body["content"]["application/json"]["schema"] == {
        "$ref": f"#/components/schemas/{model.__name__}"}
    ok = operation["responses"]["200"]
    assert set(ok["content"]) == {"application/json", "text/event-stream"}
    assert ok["headers"]["X-Request-Id"]["required"] is True
    for status in COMPLETION_ERRORS:
        error = operation["responses"][str(status)]
        assert error["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}
    assert operation["responses"]["429"]["headers"]["Retry-After"]["required"] is True


def test_every_reference_resolves(document: dict[str, Any]) -> None:
    schemas = document["components"]["schemas"]
    found = set(refs(document))
    assert found, "the document references no schema"
    for reference in found:
        assert reference.startswith("#/components/schemas/"), reference
        assert reference.rsplit("/", 1)[1] in schemas, reference
    assert "HTTPValidationError" not in schemas


def test_bearer_scheme_only_with_api_keys() -> None:
    open_doc = create_app(tiny_settings()).openapi()
    assert "securitySchemes" not in open_doc["components"]
    keyed = create_app(tiny_settings(api_keys=["k"])).openapi()
    assert keyed["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http", "scheme": "bearer"}
    assert keyed["paths"]["/v1/models"]["get"]["security"] == [{"bearerAuth": []}]
    assert "security" not in keyed["paths"]["/health"]["get"]


NAMESPACED: list[Any] = [  # as Codex CLI sends them
    {"type": "namespace", "name": "ns", "description": "d",
     "tools": [{"type": "function", "name": "f", "strict": False}]},
    {"type": "web_search", "external_web_access": False}]


# Bodies that probe where a schema and a validator tend to disagree: coercion,
# neutral values of unsupported fields, list bounds and JSON types.
BODIES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"model": "m", "messages": CHAT}),
    ("/v1/chat/completions", {"model": "m", "messages": []}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "max_tokens": "3"}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "max_tokens": 0}),
    # JSON Schema's integer includes 16.0 (and OpenAI takes it); 16.5 is no integer
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "max_tokens": 16.0}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "max_tokens": 16.5}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "top_k": 11966.0}),
    ("/v1/completions", {"model": "m", "prompt": [1.0, 2.0]}),
    # a positive top_logprobs needs logprobs: true (a cross-field rule: if/then)
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "top_logprobs": 2}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "top_logprobs": 2,
                              "logprobs": False}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "top_logprobs": 2,
                              "logprobs": True}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "top_logprobs": 0}),
    # tool_choice "required" or a named function needs tools (if/then)
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "tool_choice": "required"}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT,
                              "tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "tool_choice": "required",
                              "tools": []}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "tools": [],
                              "tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "tool_choice": "auto"}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "tool_choice": "required",
                              "tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "stream": "true"}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "stream": 1}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "temperature": 1}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "temperature": "1"}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "tools": []}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "tools": [{"type": "x"}]}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "store": False}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "store": 0}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT,
                              "response_format": {"type": "text"}}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT,
                              "response_format": {"type": "json_object"}}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "stop": ["a"] * 4}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "stop": ["a"] * 5}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "seed": 2**64}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "n": 17}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "unknown": 1}),
    ("/v1/chat/completions", {"model": "m",
                              "messages": [{"role": "tool", "content": "x"}]}),
    ("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": []}]}),
    ("/v1/completions", {"model": "m", "prompt": "x"}),
    ("/v1/completions", {"model": "m", "prompt": []}),
    ("/v1/completions", {"model": "m", "prompt": [[]]}),
    ("/v1/completions", {"model": "m", "prompt": [1, 2]}),
    ("/v1/completions", {"model": "m", "prompt": [1, "a"]}),
    ("/v1/completions", {"model": "m", "prompt": [True]}),
    ("/v1/completions", {"model": "m", "prompt": "x", "best_of": 1}),
    ("/v1/completions", {"model": "m", "prompt": "x", "best_of": True}),
    ("/v1/completions", {"model": "m", "prompt": "x", "suffix": ""}),
    ("/v1/completions", {"model": "m", "prompt": "x", "logprobs": 21}),
    # stream_options only with stream true (a cross-field rule: if/else in the schema)
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "stream_options": {}}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "stream": False,
                              "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "stream": None,
                              "stream_options": {}}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "stream_options": None}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "stream": True,
                              "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"model": "m", "prompt": "x", "stream_options": {}}),
    ("/v1/completions", {"model": "m", "prompt": "x", "stream": True, "stream_options": {}}),
    # "required" needs a function or a namespace among the tools, a hosted one is not run
    ("/v1/responses", {"model": "m", "input": "x", "tool_choice": "required",
                       "tools": [{"type": "web_search"}]}),
    ("/v1/responses", {"model": "m", "input": "x", "tool_choice": "required",
                       "tools": [{"type": "web_search"}, *NAMESPACED[:1]]}),
    ("/v1/responses", {"model": "m", "input": "x", "tools": [{"type": "web_search"}]}),
]


@pytest.mark.parametrize(("path", "body"), BODIES)
def test_request_schema_agrees_with_the_validator(document: dict[str, Any], path: str,
                                                  body: dict[str, Any]) -> None:
    model = {**REQUEST_MODELS, "/v1/responses": ResponsesRequest}[path]
    documented = validator(document, model.__name__).is_valid(body)
    try:
        parse_body(model, httpx.Request("POST", "/", json=body).content)
        accepted = True
    except InvalidRequestError:
        accepted = False
    assert documented == accepted, f"schema says {documented}, server says {accepted}"


# "required" or a named function with an empty tools list: what a schema that only
# asks for ``tools`` would let through, and the server refuses
NEEDS_TOOLS: list[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]] = [
    ("/v1/chat/completions", {"model": TINY, "messages": CHAT, "max_tokens": 1},
     {"type": "function", "function": {"name": "f"}},
     {"type": "function", "function": {"name": "f"}}),
    ("/v1/responses", {"model": TINY, "input": "hi", "max_output_tokens": 1},
     {"type": "function", "name": "f"}, {"type": "function", "name": "f"}),
]


@pytest.mark.parametrize(("path", "base", "named", "tool"), NEEDS_TOOLS,
                         ids=[n[0] for n in NEEDS_TOOLS])
async def test_a_tool_choice_that_needs_tools_is_refused_with_an_empty_tools_list(
        tiny_engine: Engine, path: str, base: dict[str, Any], named: dict[str, Any],
        tool: dict[str, Any]) -> None:
    """Both sides: the served /openapi.json (under a JSON Schema validator) and the
    server refuse tool_choice "required" or a named function with ``tools: []``, and
    both take the same request with the function in ``tools``."""
    async with in_process(create_app(tiny_settings(), engine=tiny_engine)) as client:
        served = (await client.get("/openapi.json")).json()
        body_schema = served["paths"][path]["post"]["requestBody"]["content"][
            "application/json"]["schema"]
        check = jsonschema_rs.Draft202012Validator(
            {**body_schema, "components": served["components"]})
        for choice in ("required", named):
            for tools in ([], [tool]):
                body = {**base, "tool_choice": choice, "tools": tools}
                response = await client.post(path, json=body)
                if tools:
                    assert check.is_valid(body), body
                    assert response.status_code == 200, response.text
                else:
                    assert not check.is_valid(body), f"the schema takes {body}"
                    assert response.status_code == 400, response.text
                    assert response.json()["error"]["param"] == "tool_choice"


async def test_served_document_is_the_accurate_one(tiny_engine: Engine,
                                                   document: dict[str, Any]) -> None:
    async with in_process(create_app(tiny_settings(), engine=tiny_engine)) as client:
        served = await client.get("/openapi.json")
        assert served.status_code == 200
        expected = copy.deepcopy(document)  # built before any model: no vocabulary yet
        bound_token_ids(expected, tiny_engine.target.vocab_size)
        assert served.json() == expected
        ready = await client.get("/ready")
        assert validator(document, "Readiness").is_valid(ready.json())
        health = await client.get("/health")
        assert validator(document, "Health").is_valid(health.json())


def event_validator(document: dict[str, Any], path: str) -> jsonschema_rs.Validator:
    """A validator of one stream event's ``data`` (decoded), from the document."""
    ok = document["paths"][path]["post"]["responses"]["200"]
    event = ok["content"]["text/event-stream"]["schema"]
    assert event["required"] == ["data"]
    payload = event["properties"]["data"]["anyOf"][1]
    assert payload["contentMediaType"] == "application/json"
    schema = {**payload["contentSchema"], "components": document["components"]}
    return jsonschema_rs.Draft202012Validator(schema)


@pytest.mark.parametrize("path", sorted(REQUEST_MODELS))
async def test_stream_events_match_the_documented_event_schema(
        tiny_engine: Engine, document: dict[str, Any], path: str) -> None:
    """Regression: the event stream was documented as one string, which tools read
    as the schema of each event (so every real event failed validation)."""
    check = event_validator(document, path)
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 5, "stream": True, "n": 2,
                            "stream_options": {"include_usage": True}}
    body.update({"messages": CHAT} if path == "/v1/chat/completions" else {"prompt": "Hi"})
    async with in_process(create_app(tiny_settings(), engine=tiny_engine)) as client:
        response = await client.post(path, json=body)
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 3
    for data in events[:-1]:
        assert check.is_valid(json.loads(data)), data
    assert check.is_valid({"error": {"message": "m", "type": "t", "param": None, "code": None}})
    assert not check.is_valid({"choices": "nope"})


@pytest.mark.parametrize("path", sorted(REQUEST_MODELS))
def test_generated_requests_honour_the_stream_options_rule(document: dict[str, Any],
                                                           path: str) -> None:
    """schemathesis reads the schema's if/else: the positive bodies it generates never
    carry ``stream_options`` without ``stream: true`` (which the server refuses)."""
    operation = schemathesis.openapi.from_dict(document)[path]["POST"]
    seen: list[dict[str, Any]] = []
    # only the bodies the rule is about: unfiltered, 150 draws held none of them in two
    # whole-suite runs (alone, some); filtered, every draw is one (the filter is slow: 40)
    with_options = operation.as_strategy(generation_mode=GenerationMode.POSITIVE).filter(
        lambda case: isinstance(case.body, dict) and case.body.get("stream_options") is not None)

    @given(case=with_options)
    @settings(max_examples=40, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def collect(case: Any) -> None:
        if isinstance(case.body, dict) and case.body.get("stream_options") is not None:
            seen.append(case.body)

    collect()
    assert seen, "no generated body carried stream_options"
    assert all(body.get("stream") is True for body in seen), seen[0]


def typed_event_validator(document: dict[str, Any]) -> jsonschema_rs.Validator:
    """A validator of one /v1/responses stream event's ``data`` (decoded)."""
    ok = document["paths"]["/v1/responses"]["post"]["responses"]["200"]
    event = ok["content"]["text/event-stream"]["schema"]
    assert event["required"] == ["event", "data"]
    payload = event["properties"]["data"]
    schema = {**payload["contentSchema"], "components": document["components"]}
    return jsonschema_rs.Draft202012Validator(schema)




@pytest.mark.parametrize("tools", [None, [{"type": "function", "name": "f"}], NAMESPACED],
                         ids=["text", "tool-call", "namespace-call"])
async def test_responses_events_and_body_match_the_document(
        tiny_engine: Engine, document: dict[str, Any], tools: list[Any] | None) -> None:
    check = typed_event_validator(document)
    body: dict[str, Any] = {"model": "tiny", "input": "Hi", "max_output_tokens": 6,
                            "reasoning": {"summary": "auto"}, "prompt_cache_key": "k",
                            "store": False, "include": ["reasoning.encrypted_content"]}
    if tools:
        body |= {"tools": tools, "tool_choice": "required",
                 "max_output_tokens": 40, "parallel_tool_calls": False}
    async with in_process(create_app(tiny_settings(), engine=tiny_engine)) as client:
        whole = await client.post("/v1/responses", json=body)
        streamed = await client.post("/v1/responses", json={**body, "stream": True})
    assert validator(document, "ResponseObject").is_valid(whole.json()), whole.text
    lines = streamed.text.splitlines()
    names = [line[7:] for line in lines if line.startswith("event: ")]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert [e["type"] for e in events] == names and len(events) >= (6 if tools else 3)
    for event in events:
        assert check.is_valid(event), event
    assert not check.is_valid({**events[-1], "type": "response.done"})
    assert not check.is_valid({**events[-1], "response": {"id": "x"}})
    if tools:
        item = next(e for e in events if "output_index" in e)
        assert not check.is_valid({**item, "output_index": "0"})
