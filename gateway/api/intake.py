"""What every endpoint does first with an HTTP request: find the gateway's state,
check the caller's API key, read the body within its size limit and parse it into
the endpoint's request model. Each refusal is an OpenAI-format error.
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Sequence
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from decoding.engine import Engine
from gateway.service.state import GatewayState
from gateway.wire.errors import (
    AuthenticationError,
    InvalidRequestError,
    PayloadTooLargeError,
    from_validation_errors,
    model_not_found,
)

M = TypeVar("M", bound=BaseModel)
_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")  # \ud800 to \udfff, as JSON writes them


def gateway_state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


async def require_api_key(request: Request) -> None:
    """Bearer-key check when keys are configured (constant-time comparison)."""
    keys = gateway_state(request).settings.api_keys
    if not keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationError(
            "Missing API key: send it as 'Authorization: Bearer <key>'.")
    given = token.strip().encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, key.encode())
    if not matched:
        raise AuthenticationError("Incorrect API key provided.")


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused with 413 as soon as it is known to exceed ``limit``."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(f"The request body is larger than {limit} bytes.")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"The request body is larger than {limit} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_body(model: type[M], body: bytes) -> M:
    payload = load_json(body)
    if not isinstance(payload, dict):
        raise InvalidRequestError("The request body must be a JSON object.",
                                  code="invalid_json")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        errors = [{**e, "loc": payload_location(payload, e.get("loc", ())),
                   "depth": len(e.get("loc", ()))} for e in exc.errors()]
        raise from_validation_errors(errors) from exc


def payload_location(payload: Any, loc: Sequence[int | str]) -> tuple[int | str, ...]:
    """``loc`` without the parts that name no key of the request on the way down: a
    discriminated union puts its member's tag there (``tools[0].function.parameters`` for
    a Responses tool, which has no ``function`` field). The last part stays (a missing
    field is named by it)."""
    out: list[int | str] = []
    node = payload
    for i, part in enumerate(loc):
        is_key = isinstance(part, str) and isinstance(node, dict) and part in node
        if isinstance(part, str) and isinstance(node, dict) and not is_key and i < len(loc) - 1:
            continue
        out.append(part)
        is_index = isinstance(part, int) and isinstance(node, list) and 0 <= part < len(node)
        node = node[part] if is_key or is_index else None
    return tuple(out)


def load_json(body: bytes) -> Any:
    """The body as JSON: UTF-8 text whose strings are all valid Unicode."""
    try:
        text = body.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError("The request body is not valid UTF-8.",
                                  code="invalid_json") from exc
    try:
        payload = json.loads(text)
    except RecursionError as exc:
        raise InvalidRequestError("The request body is nested too deeply.",
                                  code="invalid_json") from exc
    except ValueError as exc:
        raise InvalidRequestError("The request body is not valid JSON.",
                                  code="invalid_json") from exc
    if _ESCAPED_SURROGATE.search(text) is not None and _has_lone_surrogate(payload):
        raise InvalidRequestError(
            "The request body contains an unpaired UTF-16 surrogate escape (\\ud800 to "
            "\\udfff); strings must be valid Unicode.", code="invalid_json")
    return payload


def _has_lone_surrogate(payload: Any) -> bool:
    """Whether a string in ``payload`` (a key or a value, at any depth) cannot be
    encoded as UTF-8; walked without recursion, however deep the JSON."""
    stack = [payload]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


async def parse_request(request: Request, state: GatewayState, model: type[M]
                        ) -> tuple[M, Engine]:
    """The body as ``model``, for a model the server serves, and the engine that will
    answer it (checked before the body is read: a 503 while loading or draining)."""
    engine = state.require_engine()
    body = await read_body(request, state.settings.max_body_bytes)
    parsed = parse_body(model, body)
    name = getattr(parsed, "model", "")
    if name not in state.aliases:
        raise model_not_found(name)
    return parsed, engine
