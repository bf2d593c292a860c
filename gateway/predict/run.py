"""Running one API request end to end on the engine: its span and metrics, its
choices submitted (all or none), their round events interleaved and counted in the one
loop over them, and delivered as an SSE stream or as one JSON body, as the request's
format writes them (``gateway.encode``); the engine work is cancelled if the client
leaves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse
from starlette.types import Receive, Scope, Send

from decoding.engine import Engine, RequestStream
from decoding.types import FinishReason, GenerationRequest, RoundEvent
from gateway.decode.plan import RequestPlan
from gateway.encode.formats import Format, Sent
from gateway.encode.totals import ChoiceTotals, Ended, speculation_of, usage_of
from gateway.service.state import GatewayState
from gateway.wire.errors import CLIENT_CLOSED_STATUS, APIError, engine_errors, error_type_of
from observability.telemetry import RequestTelemetry

log = logging.getLogger(__name__)

T = TypeVar("T")


# -- on the engine ----------------------------------------------------------------------


def request_trace(state: GatewayState, request: Request, plan: RequestPlan
                  ) -> RequestTelemetry | None:
    """The request's span and metrics (None when the server has no telemetry)."""
    if state.telemetry is None:
        return None
    return state.telemetry.request(
        request.url.path, plan.job.id, request.headers, arrived=request.state.arrived,
        attributes={
            "gen_ai.request.max_tokens": plan.requests[0].max_new_tokens,
            "gen_ai.request.temperature": plan.request.temperature,
            "gen_ai.request.top_p": plan.request.top_p,
            "gen_ai.request.seed": plan.request.seed,
            "gen_ai.request.choice.count": len(plan.requests),
        })


def submit_traced(engine: Engine, requests: Sequence[GenerationRequest],
                  trace: RequestTelemetry | None) -> list[RequestStream]:
    """``submit_all``; a refusal still ends the request's span."""
    try:
        return submit_all(engine, requests)
    except Exception as exc:
        if trace is not None:
            status = getattr(exc, "status_code", 500)
            trace.finish(status, error_type_of(status), count_error=False)  # the middleware counts
        raise


def submit_all(engine: Engine, requests: Sequence[GenerationRequest]) -> list[RequestStream]:
    """Submit every choice, or none: a refusal cancels those already queued."""
    streams: list[RequestStream] = []
    try:
        with engine_errors():
            for request in requests:
                streams.append(engine.submit(request))
    except APIError:
        for stream in streams:
            stream.cancel()
        raise
    return streams


@dataclass(frozen=True)
class Idle:
    """No choice has had an event for the heartbeat interval."""


async def interleave(streams: Sequence[RequestStream], idle_s: float | None = None
                     ) -> AsyncGenerator[tuple[int, RoundEvent | Ended | Idle]]:
    """Events of all choices as they arrive, tagged with the choice index; each
    choice ends with one ``Ended``; with ``idle_s``, an ``Idle`` (index -1) after every
    ``idle_s`` seconds without an event. Closing the iterator cancels every choice."""
    queue: asyncio.Queue[tuple[int, RoundEvent | Ended]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        finished = False
        try:
            async for event in stream:
                finished = finished or event.finished
                queue.put_nowait((index, event))
        finally:  # always, so the consumer never waits for a choice that is gone
            queue.put_nowait((index, Ended(finished)))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(tasks)
        while open_streams:
            try:
                index, item = await asyncio.wait_for(queue.get(), idle_s)
            except TimeoutError:
                yield -1, Idle()
                continue
            if isinstance(item, Ended):
                open_streams -= 1
            yield index, item
    finally:
        for stream in streams:
            stream.cancel()  # a no-op for finished streams; frees the others
        for task in tasks:
            task.cancel()


# -- to the client ----------------------------------------------------------------------


class _EventStream(EventSourceResponse):
    """An SSE response that runs ``on_close`` however the response ends."""

    def __init__(self, content: AsyncIterator[str | dict[str, str]],
                 on_close: Callable[[], None],
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class ResponseRun:
    """One API request's choices on the engine, and their delivery: ``submit`` puts
    every choice on the engine (or, refused, none), after which the run counts as in
    flight until closed; ``respond`` answers with an SSE stream or one body, both read
    through ``rounds``, the one loop over the choices' events."""

    def __init__(self, state: GatewayState, plan: RequestPlan, fmt: Format, endpoint: str,
                 trace: RequestTelemetry | None = None) -> None:
        self.state = state
        self.plan = plan
        self.job = plan.job
        self.fmt = fmt
        self.endpoint = endpoint
        self.user = plan.request.user  # the client's end-user id, for the request log only
        self.outcome = "disconnected"
        self.trace = trace
        self.tool_choice = plan.tools.mode if plan.tools is not None else None
        self.operator_cap = plan.operator_cap  # --max-tokens, where it bounds this request
        self.stream_error: str | None = None  # error type of a failure after streaming began
        self.status = 200
        self.error_code: str | None = None
        self.streams: list[RequestStream] = []
        self.totals: list[ChoiceTotals] = []
        self.started = time.monotonic()

    def submit(self, engine: Engine) -> None:
        """Every choice on the engine, or none (a refusal raises, its span ended)."""
        self.streams = submit_traced(engine, self.plan.requests, self.trace)
        self.totals = [ChoiceTotals(drafter=s.drafter, prediction=s.request.prediction)
                       for s in self.streams]
        self.state.begin(self.streams)
        self.started = time.monotonic()

    async def respond(self, receive: Callable[[], Awaitable[Any]], stream: bool | None
                      ) -> Response:
        """The submitted choices' answer: an SSE stream of their events, or one body."""
        if stream:
            return self.streaming_response()
        return await self.whole_response(receive)

    async def rounds(self, idle_s: float | None = None
                     ) -> AsyncIterator[tuple[int, RoundEvent | Ended | Idle]]:
        """The one loop over the choices' events (``interleave``): each round counted in
        its choice's totals and its span, and each end in its totals, before it is handed
        on. Closing it cancels every choice still running."""
        async with aclosing(interleave(self.streams, idle_s)) as events:
            async for index, item in events:
                if isinstance(item, Ended):
                    self.totals[index].end(item)
                elif isinstance(item, RoundEvent):
                    self.totals[index].add(item)
                    self._observe(index, item)
                yield index, item

    def failed(self, index: int) -> APIError | None:
        """Choice ``index``'s failure, if it failed (after streaming began: the stream's
        outcome and error type say so)."""
        error = self.totals[index].error
        if error is not None:
            self.outcome = f"error {error.status_code}"
            self.stream_error = error_type_of(error.status_code, error.code)
        return error

    # -- streaming ------------------------------------------------------------------------

    def streaming_response(self) -> Response:
        return _EventStream(
            self.events(),
            on_close=self._close,
            ping=self.state.settings.sse_ping_interval,
            sep="\n",
            headers={"X-Request-Id": self.job.id},
        )

    @property
    def heartbeat_s(self) -> float:
        return self.state.settings.sse_heartbeat_interval

    async def events(self) -> AsyncIterator[Sent]:
        """The stream's events, as the format writes them: its opening at once (before
        the prompt is read), then what each round of each choice sends, an idle event
        whenever none came for the heartbeat interval, and its closing; or, when a choice
        fails, the failure, last."""
        for sent in self.fmt.opening():
            yield sent
        async for index, item in self.rounds(self.heartbeat_s):
            if isinstance(item, Idle):
                for sent in self.fmt.idle():
                    yield sent
                continue
            if isinstance(item, RoundEvent):
                for sent in self.fmt.round(index, item, self.totals[index]):
                    yield sent
            error = self.failed(index)
            if error is not None:
                for sent in self.fmt.failure(error, self.totals[index]):
                    yield sent
                return
        *closing, last = self.fmt.closing(self.totals)
        for sent in closing:
            yield sent
        self.outcome = "ok"
        yield last

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
        async for index, item in self.rounds():
            if isinstance(item, RoundEvent):
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
        """The run's end: out of flight, the request's log lines, then its span."""
        self.state.end(self.streams)
        if self.outcome == "disconnected":
            log.info("request %s: client disconnected; cancelled %d choice(s)",
                     self.job.id, len(self.streams))
        self._log_capped()
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

    def _log_capped(self) -> None:
        """One line when the operator's cap, not the request, cut an answer."""
        cap = self.operator_cap
        cut = [i for i, t in enumerate(self.totals)
               if cap is not None and t.finish_reason is FinishReason.LENGTH
               and t.completion_tokens >= cap]
        if cut:
            log.info("request %s: the operator cap (--max-tokens) cut it at %d tokens "
                     "(choice %s)", self.job.id, cap, ", ".join(map(str, cut)))


# -- the client leaving ---------------------------------------------------------------


async def wait_for_disconnect(receive: Callable[[], Awaitable[dict[str, object]]]) -> None:
    """Return once the client has gone (the request body must be fully read)."""
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return


async def unless_disconnected(
    work: Awaitable[T], disconnected: Awaitable[None], on_disconnect: Callable[[], None]
) -> T | None:
    """Run ``work``; if the client disconnects first, call ``on_disconnect``, abandon
    the work and return None."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(disconnected)
    try:
        await asyncio.wait([work_task, watch_task], return_when=asyncio.FIRST_COMPLETED)
        if work_task.done():
            return work_task.result()
        on_disconnect()
        work_task.cancel()
        return None
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
