"""Running a request's choices on the engine: submit them, interleave their
round events, and stop when the client goes away.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

from decoding.engine import Engine, RequestStream
from decoding.types import GenerationRequest, RoundEvent
from gateway.errors import (
    APIError,
    engine_errors,
)
from gateway.totals import Ended

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
