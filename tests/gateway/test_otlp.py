"""Traces over OTLP/HTTP to a real receiver: a small HTTP server in the test that
decodes the protobuf export requests the server sends."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from decoding.engine import Engine
from gateway.server import create_app
from tests.gateway.conftest import CHAT, TINY, in_process, tiny_settings

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class Receiver(ThreadingHTTPServer):
    """Accepts OTLP/HTTP protobuf trace exports on /v1/traces and keeps their spans."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.spans: list[Any] = []
        self.resources: list[dict[str, str]] = []
        self.content_types: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:  # the exporter's one request kind
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.content_types.append(self.headers.get("Content-Type", ""))
        if self.path != "/v1/traces":
            self.send_response(404)
            self.end_headers()
            return
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        for resource_spans in export.resource_spans:
            self.server.resources.append({a.key: a.value.string_value
                                          for a in resource_spans.resource.attributes})
            for scope in resource_spans.scope_spans:
                self.server.spans.extend(scope.spans)
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: Any) -> None:
        return None


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _attributes(span: Any) -> dict[str, Any]:
    values = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        values[a.key] = getattr(a.value, kind) if kind else None
    return values


async def test_spans_reach_a_real_otlp_receiver(receiver: Receiver, tiny_engine: Engine,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "specserve-test")
    app = create_app(tiny_settings(otlp_endpoint=receiver.url), engine=tiny_engine)
    async with in_process(app) as client:  # leaving it flushes the exporter
        reply = await client.post(
            "/v1/chat/completions",
            json={"model": TINY, "messages": CHAT, "max_tokens": 12, "temperature": 0},
            headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
        assert reply.status_code == 200
    rounds = reply.json()["speculation"]["rounds"]
    assert receiver.content_types and all(t == "application/x-protobuf"
                                          for t in receiver.content_types)
    assert {"service.name": "specserve-test"}.items() <= receiver.resources[0].items()
    (request,) = [s for s in receiver.spans if s.name == f"chat {TINY}"]
    assert request.trace_id.hex() == TRACE_ID and request.parent_span_id.hex() == PARENT_ID
    attributes = _attributes(request)
    assert attributes["gen_ai.request.model"] == TINY
    assert attributes["gen_ai.usage.output_tokens"] == 12
    children = [s for s in receiver.spans if s.parent_span_id == request.span_id]
    assert len(children) == rounds >= 1
    assert {s.name for s in children} == {"speculation_round"}
    indexes = sorted(_attributes(s)["specserve.round.index"] for s in children)
    assert indexes == list(range(rounds))
    assert all(s.trace_id.hex() == TRACE_ID for s in children)


def test_the_exporter_is_installed_with_the_server() -> None:
    """A main dependency, not an extra: tracing is part of what the server ships."""
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml")
                            .read_text())["project"]
    assert any(r.startswith("opentelemetry-exporter-otlp-proto-http")
               for r in project["dependencies"])


async def test_responses_spans_reach_a_real_otlp_receiver(receiver: Receiver,
                                                          tiny_engine: Engine) -> None:
    """A streamed /v1/responses request exports its server span and one child per round."""
    app = create_app(tiny_settings(otlp_endpoint=receiver.url), engine=tiny_engine)
    async with in_process(app) as client:
        reply = await client.post(
            "/v1/responses", headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
            json={"model": TINY, "input": "Hi", "max_output_tokens": 10, "temperature": 0,
                  "stream": True})
        assert reply.status_code == 200
    final = json.loads(reply.text.rstrip().splitlines()[-1][len("data: "):])["response"]
    (request,) = [s for s in receiver.spans if s.name == f"chat {TINY}"]
    assert request.trace_id.hex() == TRACE_ID and request.parent_span_id.hex() == PARENT_ID
    attributes = _attributes(request)
    assert attributes["gen_ai.response.id"] == final["id"]
    assert attributes["gen_ai.usage.output_tokens"] == final["usage"]["output_tokens"] == 10
    children = [s for s in receiver.spans if s.parent_span_id == request.span_id]
    assert len(children) == final["speculation"]["rounds"] >= 1
