"""Around every HTTP request: its bookkeeping (arrival time, for latency and time to
first token, and the request/error counters by response status), and HEAD answered as
GET without the body."""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.wire.errors import error_type_of
from observability.metrics import Metrics

KNOWN_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models",
                   "/health", "/ready")


def endpoint_label(path: str) -> str:
    """A bounded label: a known route, else ``other`` (never the raw path)."""
    for known in KNOWN_ENDPOINTS:
        if path == known or (known == "/v1/models" and path.startswith(known + "/")):
            return known
    return "other"


class RequestMetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})["arrived"] = time.monotonic()
        status = 500

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            endpoint = endpoint_label(scope.get("path", ""))
            self.metrics.requests.labels(endpoint, str(status)).inc()
            if status >= 400:
                self.metrics.request_errors.labels(endpoint, error_type_of(status)).inc()


class HeadAsGetMiddleware:
    """HEAD on every route that answers GET (the pages, health, readiness, models): the
    GET response's status and headers without its body (RFC 9110, 9.3.2). A route
    without GET answers HEAD as it answers GET: 405 with its ``Allow`` header."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def send_without_body(message: Message) -> None:
            if message["type"] != "http.response.body":
                await send(message)
            elif not message.get("more_body", False):
                await send({"type": "http.response.body", "body": b"", "more_body": False})

        await self.app({**scope, "method": "GET"}, receive, send_without_body)
