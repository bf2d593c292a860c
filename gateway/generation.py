"""Running a request's choices on the engine: submit them, interleave their
round events, keep per-choice totals, and stop when the client goes away.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from decoding.engine import Engine, RequestStream
from decoding.types import FinishReason, GenerationRequest, RoundEvent
from gateway.errors import (
    APIError,
    GenerationTimeoutError,
    InternalError,
    ServiceUnavailableError,
    engine_errors,
)
from gateway.responses import PromptTokensDetails, SpeculationStats, Usage

log = logging.getLogger(__name__)

T = TypeVar("T")


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
class Ended:
    """A choice's stream closed; ``finished`` says whether it saw its final event."""

    finished: bool


async def interleave(streams: Sequence[RequestStream]
                     ) -> AsyncIterator[tuple[int, RoundEvent | Ended]]:
    """Events of all choices as they arrive, tagged with the choice index; each
    choice ends with one ``Ended``. Closing the iterator cancels every choice."""
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
            index, item = await queue.get()
            if isinstance(item, Ended):
                open_streams -= 1
            yield index, item
    finally:
        for stream in streams:
            stream.cancel()  # a no-op for finished streams; frees the others
        for task in tasks:
            task.cancel()


@dataclass
class ChoiceTotals:
    """What one choice has produced so far."""

    drafter: str | None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    finish_reason: FinishReason | None = None
    error: APIError | None = None
    text: list[str] = field(default_factory=list)

    def add(self, event: RoundEvent) -> None:
        self.prompt_tokens = event.prompt_tokens or self.prompt_tokens
        self.cached_tokens = max(self.cached_tokens, event.cached_tokens)
        self.completion_tokens = max(self.completion_tokens, event.completion_tokens)
        if event.token_ids:
            self.rounds += 1
        self.drafted += event.draft_tokens
        self.accepted += event.accepted_tokens
        self.text.append(event.text)
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
            self.error = event_error(event)

    def end(self, ended: Ended) -> None:
        if not ended.finished and self.error is None:
            self.error = ServiceUnavailableError(
                "The request was cancelled because the server is shutting down.",
                code="shutting_down")

    def stats(self) -> SpeculationStats:
        return SpeculationStats.of(self.drafter, self.rounds, self.drafted, self.accepted)


def event_error(event: RoundEvent) -> APIError | None:
    """The API error a final event stands for, if any."""
    reason = event.finish_reason
    if reason is FinishReason.TIMEOUT:
        return GenerationTimeoutError("The request ran past the server's time limit.")
    if reason is FinishReason.ERROR:
        return InternalError(event.error or "The model failed on this request.",
                             code="generation_error")
    if reason is FinishReason.CANCELLED:
        return ServiceUnavailableError(
            "The request was cancelled because the server is shutting down.",
            code="shutting_down")
    return None


def finish_reason_text(reason: FinishReason | None) -> str | None:
    if reason in (FinishReason.STOP, FinishReason.LENGTH):
        return reason.value
    return None


def usage_of(totals: Sequence[ChoiceTotals], per_prompt: int) -> Usage:
    """Prompt tokens count once per prompt (not per choice), as OpenAI does."""
    prompt = sum(t.prompt_tokens for t in totals[::per_prompt])
    cached = sum(t.cached_tokens for t in totals[::per_prompt])
    completion = sum(t.completion_tokens for t in totals)
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


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
