"""OpenTelemetry tracing: one server span per request, one child span per round.

Attribute names follow the GenAI semantic conventions (``gen_ai.*``); our own
per-round attributes live under ``specserve.round.*``. Spans are exported over
OTLP only when an endpoint is configured (the serve flag or the standard
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``);
otherwise nothing is recorded (the sampler drops every span, and a request's rounds
start no spans: a recorded round span cost the event loop ~15 us a round, for nothing).
No global provider is installed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from observability.rounds import RoundFacts

log = logging.getLogger(__name__)

PROVIDER_NAME = "specserve"
_PROPAGATOR = TraceContextTextMapPropagator()


def build_tracer_provider(
    service_name: str = "specserve",
    otlp_endpoint: str | None = None,
    exporter: SpanExporter | None = None,
) -> TracerProvider:
    """A provider with a ``service.name`` resource; exports over OTLP/HTTP when an
    endpoint is configured, or to ``exporter`` when given (tests)."""
    attributes = {"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)}
    endpoint = (otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    if exporter is None and endpoint:
        exporter = _otlp_exporter(endpoint, explicit=otlp_endpoint is not None)
    if exporter is None:  # spans would go nowhere: record none
        return TracerProvider(resource=Resource.create(attributes), sampler=ALWAYS_OFF)
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _otlp_exporter(endpoint: str, explicit: bool) -> SpanExporter:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:  # a dependency of the package: a broken installation
        raise ImportError(
            "an OTLP endpoint is configured but the package "
            "opentelemetry-exporter-otlp-proto-http is missing; reinstall specserve "
            f"(pip install specserve) ({exc})") from exc
    if explicit and not endpoint.rstrip("/").endswith("/v1/traces"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    log.info("exporting traces over OTLP/HTTP to %s", endpoint)
    # Without an explicit endpoint the exporter reads the OTEL_* variables itself.
    return OTLPSpanExporter(endpoint=endpoint) if explicit else OTLPSpanExporter()


class RequestSpan:
    """The span of one generation request and its per-round children."""

    def __init__(self, tracer: Tracer, operation: str, model: str,
                 attributes: Mapping[str, Any], headers: Mapping[str, str]) -> None:
        parent: Context = _PROPAGATOR.extract(carrier=dict(headers))
        self.span: Span = tracer.start_span(
            f"{operation} {model}", context=parent, kind=SpanKind.SERVER,
            attributes={
                "gen_ai.operation.name": operation,
                "gen_ai.provider.name": PROVIDER_NAME,
                "gen_ai.request.model": model,
                **{k: v for k, v in attributes.items() if v is not None},
            },
        )
        self.tracer = tracer
        self._context = set_span_in_context(self.span)

    def round(self, event: RoundFacts, drafter: str | None) -> None:
        """A child span covering the round that produced ``event`` (ended now); none
        where the request's span is not recorded."""
        if not self.span.is_recording():
            return
        end = time.time_ns()
        t = event.timing
        duration_ns = int((t.draft_s + t.verify_s + t.bookkeeping_s) * 1e9)
        span = self.tracer.start_span(
            "speculation_round", context=self._context, start_time=end - duration_ns,
            attributes={
                "specserve.round.index": event.round_index,
                "specserve.round.draft_tokens": event.draft_tokens,
                "specserve.round.accepted_tokens": event.accepted_tokens,
                "specserve.round.committed_tokens": len(event.token_ids),
                "specserve.round.draft_ms": t.draft_s * 1000,
                "specserve.round.verify_ms": t.verify_s * 1000,
                "specserve.round.drafter": drafter or "none",
                "specserve.round.draft_source": event.draft_source or "none",
                "specserve.round.cached_tokens": event.cached_tokens,
                "specserve.round.batch_size": event.batch_size,
            },
        )
        span.end(end_time=end)

    def finish(self, response_id: str, finish_reasons: list[str], input_tokens: int,
               output_tokens: int, error_type: str | None = None) -> None:
        self.span.set_attributes({
            "gen_ai.response.id": response_id,
            "gen_ai.response.finish_reasons": finish_reasons,
            "gen_ai.usage.input_tokens": input_tokens,
            "gen_ai.usage.output_tokens": output_tokens,
        })
        if error_type is not None:
            self.span.set_attribute("error.type", error_type)
            self.span.set_status(Status(StatusCode.ERROR))
        self.span.end()
