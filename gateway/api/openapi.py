"""The OpenAPI document served at ``/openapi.json``, accurate for every route.

The completion handlers read the raw body themselves (to refuse an oversized
body before parsing it, and to report an invalid field in OpenAI's error
format), so FastAPI cannot see their request models. The routes declare them
with :func:`completion_route`, together with both forms of a 200 (one JSON body,
or server-sent events when ``stream`` is true) and every error status a route
can answer, each in OpenAI's error format; :func:`install_openapi` adds the
request models' schemas and, when API keys are configured, the bearer scheme.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode

from gateway.wire.bodies import ChatCompletionChunk, Completion, ErrorResponse
from gateway.wire.requests import ChatCompletionRequest, CompletionRequest
from gateway.wire.response_events import EVENT_MODELS as RESPONSE_EVENTS
from gateway.wire.response_events import ResponseObject, event_types
from gateway.wire.responses import ResponsesRequest
from gateway.wire.tokenize import REQUEST_MODELS as TOKENIZE_REQUESTS

REF = "#/components/schemas/{model}"
BEARER = "bearerAuth"
# Models the handlers use without FastAPI seeing them: request bodies and stream events.
REQUEST_MODELS: tuple[type[BaseModel], ...] = (ChatCompletionRequest, CompletionRequest,
                                               ResponsesRequest, *TOKENIZE_REQUESTS)
KEYED_PATHS = ("/tokenize", "/detokenize")  # beside /v1/*: the routes an API key guards
EVENT_MODELS: tuple[type[BaseModel], ...] = (ChatCompletionChunk, Completion, ErrorResponse,
                                              ResponseObject, *RESPONSE_EVENTS)

ERROR_DESCRIPTIONS = {
    400: "The request is invalid; `param` names the offending field.",
    401: "The API key is missing or wrong (only when the server has keys).",
    404: "The model does not exist.",
    413: "The request body is larger than the server accepts.",
    429: "The queue is full; retry after `Retry-After` seconds.",
    500: "The server or the model failed on this request.",
    503: "The model is loading or failed to load, or the server is shutting down.",
    504: "The request ran past the server's time limit.",
}
COMPLETION_ERRORS = (400, 401, 404, 413, 429, 500, 503, 504)
MODEL_ERRORS = (401, 500, 503)

_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.",
                                "required": True, "schema": {"type": "string"}}}
_REQUEST_ID = {"X-Request-Id": {"description": "The completion's `id`.", "required": True,
                                "schema": {"type": "string"}}}


def ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses`` entries of these error statuses, in OpenAI's error format."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {"model": ErrorResponse,
                                 "description": ERROR_DESCRIPTIONS[status]}
        if status == 429:
            entry["headers"] = _RETRY_AFTER
        out[status] = entry
    return out


def event_schema(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event of a completion stream: its ``data`` is a chunk, the
    error that ended the stream, or ``[DONE]`` (OpenAPI 3.2's ``itemSchema``; in
    3.1, tools read an event stream's ``schema`` as that of one event)."""
    payload = {"oneOf": [ref(chunk), ref(ErrorResponse)]}
    data = {"anyOf": [
        {"const": "[DONE]"},
        {"type": "string", "contentMediaType": "application/json", "contentSchema": payload},
    ]}
    return {"type": "object", "required": ["data"], "properties": {"data": data}}


def completion_route(request: type[BaseModel], response: type[BaseModel],
                     chunk: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI keyword arguments of a completion route's decorator."""
    events = {"schema": event_schema(chunk)}
    ok = {
        "model": response,
        "description": (
            f"With `stream` false or absent, one `{response.__name__}`. With `stream` true, "
            f"server-sent events: `data: <{chunk.__name__}>` per round of any choice, the "
            "usage chunk when `stream_options.include_usage` is true, then `data: [DONE]`; "
            "a failure after the stream began is sent as `data: <ErrorResponse>` and the "
            "stream ends. The `text/event-stream` schema describes one event."),
        "headers": _REQUEST_ID,
        "content": {"text/event-stream": events},
    }
    body = {"required": True, "content": {"application/json": {"schema": ref(request)}}}
    return {"responses": {200: ok, **error_responses(*COMPLETION_ERRORS)},
            "openapi_extra": {"requestBody": body}}


def typed_event_schema() -> dict[str, Any]:
    """One server-sent event of a ``/v1/responses`` stream: an ``event:`` line naming
    its type and ``data``, one of the typed events (no ``[DONE]``)."""
    payload = {"oneOf": [ref(model) for model in RESPONSE_EVENTS]}
    data = {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}
    return {"type": "object", "required": ["event", "data"],
            "properties": {"event": {"enum": event_types()}, "data": data}}


def responses_route() -> dict[str, Any]:
    """The OpenAPI keyword arguments of the ``/v1/responses`` route's decorator."""
    ok = {
        "model": ResponseObject,
        "description": (
            "With `stream` false or absent, one Response object. With `stream` true, typed "
            "server-sent events (`event: <type>` and `data: <event>`, `sequence_number` from "
            "0): `response.created`, `response.in_progress`, the output items' events, then "
            "`response.completed`, `response.incomplete` or `response.failed`; no "
            "`data: [DONE]`. The `text/event-stream` schema describes one event."),
        "headers": _REQUEST_ID,
        "content": {"text/event-stream": {"schema": typed_event_schema()}},
    }
    body = {"required": True, "content": {"application/json": {"schema": ref(ResponsesRequest)}}}
    return {"responses": {200: ok, **error_responses(*COMPLETION_ERRORS)},
            "openapi_extra": {"requestBody": body}}


def model_schemas(models: Iterable[type[BaseModel]], mode: JsonSchemaMode
                  ) -> dict[str, Any]:
    """JSON schemas of ``models`` and the models they contain, by name, for components."""
    schemas: dict[str, Any] = {}
    for model in models:
        schema = model.model_json_schema(ref_template=REF, mode=mode)
        found = {**schema.pop("$defs", {}), model.__name__: schema}
        for name, definition in found.items():
            if schemas.setdefault(name, definition) != definition:
                raise RuntimeError(f"two different models are named {name!r}")
    return schemas


def install_openapi(app: FastAPI, bearer: bool,
                    vocab_size: Callable[[], int | None] = lambda: None) -> None:
    """Serve the completed document; ``bearer`` when the server has API keys;
    ``vocab_size``: the served model's, once it is loaded (None before): the document
    then bounds the token ids ``/detokenize`` takes, and is kept from then on."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = build_document(app, bearer)
            vocab = vocab_size()
            if vocab is None:
                return document
            bound_token_ids(document, vocab)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def bound_token_ids(document: dict[str, Any], vocab_size: int) -> None:
    """The token ids a request may send (``/detokenize``'s, a completion's token-id
    prompts) lie in the served model's vocabulary."""
    schemas = document["components"]["schemas"]
    ids = [schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]]
    for form in schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
        items = form.get("items", {})
        if items.get("type") == "integer":  # a token-id list
            ids.append(items)
        elif items.get("type") == "array":  # a list of them
            ids.append(items["items"])
    for schema in ids:
        schema["maximum"] = vocab_size - 1


def build_document(app: FastAPI, bearer: bool) -> dict[str, Any]:
    document = get_openapi(title=app.title, version=app.version, description=app.description,
                           routes=app.routes)
    components = document.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    _drop_validation_error(document)
    for name, schema in model_schemas(REQUEST_MODELS, "validation").items():
        if schemas.setdefault(name, schema) != schema:
            raise RuntimeError(f"a request model and a response model are both named {name!r}")
    for name, schema in model_schemas(EVENT_MODELS, "serialization").items():
        schemas.setdefault(name, schema)  # FastAPI's rendering of a shared model is kept
    if bearer:
        components["securitySchemes"] = {BEARER: {"type": "http", "scheme": "bearer"}}
        for path, operations in document["paths"].items():
            if path.startswith("/v1/") or path in KEYED_PATHS:
                for operation in operations.values():
                    operation["security"] = [{BEARER: []}]
    return document


def _drop_validation_error(document: dict[str, Any]) -> None:
    """FastAPI documents a 422 for routes with parameters; this server answers an
    invalid request with a 400 in OpenAI's format instead (see ``gateway.wire.errors``)."""
    for operations in document["paths"].values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    schemas = document.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
