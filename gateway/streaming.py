"""Delivering one request's choices: as an SSE stream (one event per engine
round) or as one JSON body, cancelling the engine work if the client leaves.

Stream framing: ``data: {chunk}`` per round of any choice (interleaved, each
with its ``index``), the usage chunk (``choices: []``) when
``stream_options.include_usage`` is set, then ``data: [DONE]``. A failure after
the stream began (timeout, model error, shutdown) is sent as
``data: {"error": {...}}`` and the stream ends without ``[DONE]``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Response
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse
from starlette.types import Receive, Scope, Send

from decoding.engine import RequestStream
from decoding.types import RoundEvent
from gateway.errors import CLIENT_CLOSED_STATUS, error_type_of
from gateway.formats import Format, Job
from gateway.generation import interleave, unless_disconnected, wait_for_disconnect
from gateway.params import AnyRequest, include_usage
from gateway.state import GatewayState
from gateway.totals import ChoiceTotals, Ended, speculation_of, usage_of
from observability.telemetry import RequestTelemetry

log = logging.getLogger(__name__)

DONE = "[DONE]"
_DROP_WHEN_NONE = ("usage", "speculation", "seed")


def chunk_json(chunk: Any) -> str:
    """A chunk as compact JSON, without null extras or null delta fields."""
    data = chunk.model_dump(mode="json")
    for key in _DROP_WHEN_NONE:
        if data.get(key) is None:
            data.pop(key, None)
    for choice in data.get("choices", ()):
        delta = choice.get("delta")
        if isinstance(delta, dict):
            choice["delta"] = {k: v for k, v in delta.items() if v is not None}
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


class _EventStream(EventSourceResponse):
    """An SSE response that runs ``on_close`` however the response ends."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None],
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class ResponseRun:
    """One API request's choices on the engine, and their delivery."""

    def __init__(self, state: GatewayState, job: Job, fmt: Format,
                 streams: list[RequestStream], endpoint: str, user: str | None = None,
                 trace: RequestTelemetry | None = None, tool_choice: str | None = None
                 ) -> None:
        self.state = state
        self.job = job
        self.fmt = fmt
        self.streams = streams
        self.endpoint = endpoint
        self.user = user  # the client's end-user id, for the request log only
        self.totals = [ChoiceTotals(drafter=s.drafter) for s in streams]
        self.started = time.monotonic()
        self.outcome = "disconnected"
        self.trace = trace
        self.tool_choice = tool_choice  # the tool plan's mode, when tools may be called
        self.stream_error: str | None = None  # error type of a failure after streaming began
        self.status = 200
        self.error_code: str | None = None
        state.begin(streams)

    # -- streaming ------------------------------------------------------------------------

    def streaming_response(self, api_request: AnyRequest) -> Response:
        settings = self.state.settings
        return _EventStream(
            self._events(include_usage(api_request)),
            on_close=self._close,
            ping=settings.sse_ping_interval,
            sep="\n",
            headers={"X-Request-Id": self.job.id},
        )

    async def _events(self, usage: bool) -> AsyncIterator[str]:
        async for index, item in interleave(self.streams):
            totals = self.totals[index]
            if isinstance(item, Ended):
                totals.end(item)
            else:
                totals.add(item)
                self._observe(index, item)
                chunk = self.fmt.chunk(index, item, totals)
                if chunk is not None:
                    yield chunk_json(chunk)
            if totals.error is not None:
                self.outcome = f"error {totals.error.status_code}"
                self.stream_error = error_type_of(totals.error.status_code, totals.error.code)
                yield json.dumps(totals.error.body())
                return
        if usage:
            yield chunk_json(self.fmt.usage_chunk(self.totals))
        self.outcome = "ok"
        yield DONE

    # -- one JSON body --------------------------------------------------------------------

    async def whole_response(self, receive: Callable[[], Awaitable[Any]]) -> Response:
        try:
            finished = await unless_disconnected(
                self._collect(), wait_for_disconnect(receive), self._client_gone)
            if finished is None:
                return Response(status_code=CLIENT_CLOSED_STATUS)
            error = next((t.error for t in self.totals if t.error is not None), None)
            if error is not None:
                self.outcome = f"error {error.status_code}"
                self.status = error.status_code
                self.error_code = error.code
                raise error
            self.outcome = "ok"
            body = self.fmt.response(self.totals).model_dump(mode="json")
            if body.get("seed") is None:  # greedy: no seed to report
                body.pop("seed", None)
            return JSONResponse(body, headers={"X-Request-Id": self.job.id})
        finally:
            self._close()

    async def _collect(self) -> bool:
        async for index, item in interleave(self.streams):
            if isinstance(item, Ended):
                self.totals[index].end(item)
            else:
                self.totals[index].add(item)
                self._observe(index, item)
                self.fmt.observe(index, item)
        return True

    def _observe(self, index: int, event: RoundEvent) -> None:
        if self.trace is not None:
            self.trace.round(event, self.streams[index].drafter)

    def _client_gone(self) -> None:
        for stream in self.streams:
            stream.cancel()

    # -- the end --------------------------------------------------------------------------

    def _close(self) -> None:
        self.state.end(self.streams)
        if self.trace is not None:
            for stream in self.streams:
                self.trace.queued(stream.submitted_at, stream.started_at)
            status = CLIENT_CLOSED_STATUS if self.outcome == "disconnected" else self.status
            error = self.stream_error or (
                error_type_of(self.status, self.error_code)
                if self.status >= 400 else None)
            if self.tool_choice is not None:
                self.trace.tool_calls(self.fmt.tool_calls(), self.tool_choice)
            # Statuses sent before the body are counted by the middleware; a failure
            # inside a stream is counted here.
            self.trace.finish(status, error, count_error=self.stream_error is not None,
                              user=self.user)
        if self.outcome == "disconnected":
            log.info("request %s: client disconnected; cancelled %d choice(s)",
                     self.job.id, len(self.streams))
        usage = usage_of(self.totals, self.job.per_prompt)
        stats = speculation_of(self.totals)
        log.info(
            "request %s %s (user %s): %s in %.3f s, %d prompt + %d completion tokens, "
            "%d rounds, %d drafted, %d accepted",
            self.job.id, self.endpoint, self.user or "-", self.outcome,
            time.monotonic() - self.started,
            usage.prompt_tokens, usage.completion_tokens, stats.rounds, stats.draft_tokens,
            stats.accepted_tokens,
        )
