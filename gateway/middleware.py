"""Per-request bookkeeping around every HTTP request: arrival time (for latency
and time to first token) and the request/error counters, by response status."""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import error_type_of
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
