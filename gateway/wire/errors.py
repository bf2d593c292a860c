"""Typed API errors and the one place that turns them into OpenAI error JSON.

Handlers raise an :class:`APIError` subclass; :func:`install_error_handlers`
maps it, pydantic validation errors, unknown routes and unexpected exceptions
to ``{"error": {"message", "type", "param", "code"}}`` with the right status; a
client that leaves before its body arrived gets nothing (logged as 499).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from decoding.engine import EngineClosedError, QueueFullError, UnknownDrafterError
from decoding.sequence import ContextOverflowError

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1  # what a 429 suggests; the queue drains round by round
CLIENT_CLOSED_STATUS = 499  # nobody reads it; recorded in the access log and metrics


class APIError(Exception):
    """An error with an HTTP status, shown to the client in OpenAI's format."""

    status_code = 500
    error_type = "server_error"
    default_code: str | None = None

    def __init_subclass__(cls, *, status: int, kind: str = "invalid_request_error",
                          code: str | None = None, **kwargs: Any) -> None:
        """A kind of error: its HTTP status, OpenAI's error type and its default code."""
        super().__init_subclass__(**kwargs)
        cls.status_code, cls.error_type, cls.default_code = status, kind, code

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


class InvalidRequestError(APIError, status=400):
    """The request cannot be served as it is: a field, a prompt or a schema is wrong."""


class AuthenticationError(APIError, status=401, code="invalid_api_key"):
    """No API key, or not the server's."""


class NotFoundError(APIError, status=404, code="not_found"):
    """No such route or model."""


class PayloadTooLargeError(APIError, status=413, code="payload_too_large"):
    """The body is over the server's limit."""


class RateLimitError(APIError, status=429, kind="rate_limit_error", code="queue_full"):
    """The engine's queue is full: retry after a moment."""


class InternalError(APIError, status=500, kind="server_error", code="internal_error"):
    """Something failed inside the server; the request alone is failed."""


class ServiceUnavailableError(APIError, status=503, kind="server_error", code="unavailable"):
    """The model is loading, failed to load, or the server is draining."""


class GenerationTimeoutError(APIError, status=504, kind="timeout_error",
                             code="request_timeout"):
    """The request ran past its time limit."""


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def model_not_found(name: str) -> NotFoundError:
    return NotFoundError(f"The model `{name}` does not exist.", param="model",
                         code="model_not_found")


@contextmanager
def engine_errors() -> Iterator[None]:
    """Translate the engine's admission errors into API errors."""
    try:
        yield
    except QueueFullError as exc:
        raise RateLimitError(
            f"The server is busy: {exc}. Retry after {RETRY_AFTER_SECONDS} s.",
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        ) from exc
    except EngineClosedError as exc:
        raise ServiceUnavailableError(str(exc), code="shutting_down") from exc
    except UnknownDrafterError as exc:
        raise InvalidRequestError(str(exc), param="speculation.drafter",
                                  code="unknown_drafter") from exc
    except ContextOverflowError as exc:
        raise InvalidRequestError(str(exc), param="messages",
                                  code="context_length_exceeded") from exc


# -- pydantic errors ---------------------------------------------------------------


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


def _is_union_tag(part: str) -> bool:
    """pydantic names the union member that failed (``list[str]``); not a field."""
    return part in _UNION_TAGS or "[" in part or "(" in part or part.startswith("function-")


def format_location(loc: Sequence[int | str]) -> str:
    """``("messages", 0, "content")`` -> ``"messages[0].content"``."""
    out = ""
    for part in loc:
        if isinstance(part, str) and _is_union_tag(part):
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def from_validation_errors(errors: Sequence[Mapping[str, Any]]) -> InvalidRequestError:
    """The first pydantic error as one 400 naming the offending field."""
    if not errors:
        return InvalidRequestError("The request is invalid.")
    # A union reports one error per member; the deepest one is the informative one
    # (``depth``: its location's length before union tags were taken out of it).
    head = tuple(errors[0].get("loc", ()))[:1]
    first = max((e for e in errors if tuple(e.get("loc", ()))[:1] == head),
                key=lambda e: e.get("depth", len(e.get("loc", ()))))
    others = len({tuple(e.get("loc", ()))[:1] for e in errors}) - 1
    loc = [p for p in first.get("loc", ()) if p != "body"]
    param = format_location(loc) or (first.get("ctx") or {}).get("param")
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
        code = "unknown_parameter"
    elif kind == "unsupported_parameter":
        message = str(first.get("msg"))
        code = "unsupported_parameter"
    elif kind == "missing":
        message = f"Missing required parameter: '{param}'."
        code = "missing_required_parameter"
    else:
        message = f"Invalid value for '{param}': {first.get('msg')}" if param \
            else str(first.get("msg"))
        code = "invalid_value"
    if others:
        message += f" ({others} more invalid field(s) in the request)"
    return InvalidRequestError(message, param=param, code=code)


# -- handlers ----------------------------------------------------------------------


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    if exc.status_code >= 500:
        level = logging.INFO if exc.status_code == 503 else logging.WARNING
        log.log(level, "%s %s -> %d: %s", request.method, request.url.path, exc.status_code,
                exc.message)
    return error_response(exc)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError | ValidationError)
    return error_response(from_validation_errors(exc.errors()))


_HTTP_STATUS_ERRORS: dict[int, type[APIError]] = {
    400: InvalidRequestError, 401: AuthenticationError, 404: NotFoundError,
    413: PayloadTooLargeError, 429: RateLimitError, 503: ServiceUnavailableError,
}


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        error: APIError = NotFoundError(f"Unknown route: {request.method} {request.url.path}")
    elif exc.status_code == 405:
        error = InvalidRequestError(
            f"Method {request.method} is not allowed on {request.url.path}",
            code="method_not_allowed")
        error.status_code = 405
    else:
        cls = _HTTP_STATUS_ERRORS.get(exc.status_code, InternalError)
        error = cls(str(exc.detail))
        error.status_code = exc.status_code
    error.headers.update(exc.headers or {})
    return error_response(error)


async def _client_gone(request: Request, exc: Exception) -> Response:
    """The client left while its body was still being read: nothing to answer."""
    log.info("%s %s: the client disconnected before its request body arrived",
             request.method, request.url.path)
    return Response(status_code=CLIENT_CLOSED_STATUS)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(InternalError("The server had an error while processing the request."))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ClientDisconnect, _client_gone)
    app.add_exception_handler(Exception, _unexpected)


_ERROR_TYPES = {400: "invalid_request", 401: "authentication", 404: "not_found",
                413: "payload_too_large", 429: "rate_limited",
                CLIENT_CLOSED_STATUS: "client_closed", 503: "unavailable", 504: "timeout"}


def error_type_of(status: int, code: str | None = None) -> str:
    """The bounded ``type`` label of specserve_request_errors_total for a failure."""
    if code == "generation_error":
        return "model_error"
    return _ERROR_TYPES.get(status, "internal" if status >= 500 else "invalid_request")
