"""One object the gateway talks to: metrics, a span and a log line per request.

``Telemetry`` is built once per server; ``Telemetry.request()`` returns a
``RequestTelemetry`` that is told about each round as it is delivered and about
the end of the request, and records everything from those facts.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.trace import TracerProvider

from observability.logging import log_request
from observability.metrics import Metrics
from observability.rounds import RoundFacts
from observability.tracing import RequestSpan, build_tracer_provider

# the GenAI operation of each endpoint (a Responses request is a chat)
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion",
             "/v1/responses": "chat"}
PREDICTION = "prediction"  # a round drafted from the request's own predicted output: its
# figures go under this drafter label, apart from the server drafter's


class Telemetry:
    def __init__(self, model: str, metrics: Metrics | None = None,
                 tracer_provider: TracerProvider | None = None, log_prompts: bool = False) -> None:
        self.model = model
        self.metrics = metrics or Metrics()
        self.tracer_provider = tracer_provider or build_tracer_provider()
        self.tracer = self.tracer_provider.get_tracer("specserve")
        self.log_prompts = log_prompts

    def request(self, endpoint: str, request_id: str, headers: Mapping[str, str],
                attributes: Mapping[str, Any], arrived: float) -> RequestTelemetry:
        operation = ENDPOINTS.get(endpoint, "text_completion")
        span = RequestSpan(self.tracer, operation, self.model, attributes, headers)
        return RequestTelemetry(self, endpoint, request_id, span, arrived)

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()


@dataclass
class RequestTelemetry:
    telemetry: Telemetry
    endpoint: str
    request_id: str
    span: RequestSpan
    arrived: float  # time.monotonic() when the request arrived
    first_token_at: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    drafted: int = 0
    accepted: int = 0
    finish_reasons: list[str] = field(default_factory=list)

    def queued(self, submitted_at: float, started_at: float | None) -> None:
        if started_at is not None:
            self.telemetry.metrics.queue_time.labels(self.telemetry.model).observe(
                max(0.0, started_at - submitted_at))

    def round(self, event: RoundFacts, drafter: str | None) -> None:
        m, model = self.telemetry.metrics, self.telemetry.model
        now = time.monotonic()
        committed = len(event.token_ids)
        if event.round_index == 0 and committed:
            self.prompt_tokens += event.prompt_tokens
            self.cached_tokens += event.cached_tokens
            m.prompt_tokens.labels(model).inc(event.prompt_tokens)
        if committed:
            if self.first_token_at is None:
                self.first_token_at = now
                m.ttft.labels(model, self.endpoint).observe(now - self.arrived)
            elif event.round_index > 0:
                t = event.timing
                per_token = (t.draft_s + t.verify_s + t.bookkeeping_s) / committed
                for _ in range(committed):
                    m.inter_token.labels(model).observe(per_token)
            m.generation_tokens.labels(model).inc(committed)
            self.output_tokens += committed
        if event.round_index > 0 and committed:
            source = PREDICTION if event.draft_source == PREDICTION else drafter or "none"
            m.record_round(model, source, event.draft_tokens, event.accepted_tokens,
                           event.timing.draft_s, event.timing.verify_s)
            m.batch_size.labels(model).observe(event.batch_size)
            if event.constraint_s > 0:
                m.grammar_mask_time.labels(model).observe(event.constraint_s)
            if event.forced_tokens:
                m.grammar_forced_tokens.labels(model).inc(event.forced_tokens)
                m.grammar_forced_accepted.labels(model).inc(event.forced_accepted)
        self.drafted += event.draft_tokens
        self.accepted += event.accepted_tokens
        if event.finish_reason is not None:
            self.finish_reasons.append(event.finish_reason.value)
            m.finished.labels(model, event.finish_reason.value).inc()
        if committed or event.finish_reason is not None:
            self.span.round(event, drafter)

    def tool_calls(self, count: int, tool_choice: str) -> None:
        """The request offered tools under ``tool_choice`` (auto, required, named) and
        its answers made ``count`` calls."""
        m = self.telemetry.metrics
        m.tool_calls.labels(self.telemetry.model, self.endpoint, tool_choice).inc(count)
        self.span.span.set_attribute("specserve.tool_calls", count)

    def finish(self, status: int, error_type: str | None, count_error: bool = True,
               user: str | None = None) -> None:
        m, model = self.telemetry.metrics, self.telemetry.model
        latency = time.monotonic() - self.arrived
        m.e2e_latency.labels(model, self.endpoint).observe(latency)
        if error_type is not None and count_error:
            m.request_errors.labels(self.endpoint, error_type).inc()
        self.span.finish(self.request_id, self.finish_reasons, self.prompt_tokens,
                         self.output_tokens, error_type)
        log_request(
            request_id=self.request_id, endpoint=self.endpoint, model=model, status=status,
            error_type=error_type, prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens, completion_tokens=self.output_tokens,
            latency_s=round(latency, 4),
            ttft_s=None if self.first_token_at is None else round(
                self.first_token_at - self.arrived, 4),
            draft_tokens=self.drafted, accepted_tokens=self.accepted,
            acceptance_rate=round(self.accepted / self.drafted, 4) if self.drafted else None,
            finish_reasons=self.finish_reasons, user=user,
        )
