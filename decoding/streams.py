"""A request's stream of round events, consumable from a thread or from asyncio, and
the errors a submission can raise."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import final

from decoding.types import GenerationRequest, RoundEvent


@final
class End:
    """What is put after a stream's last event (its one instance is ``END``)."""


END = End()
StreamItem = RoundEvent | End  # what a stream's queue holds


class QueueFullError(RuntimeError):
    """The waiting queue is full; the client should retry later."""


class EngineClosedError(RuntimeError):
    """The engine is shutting down and admits no new requests."""


class UnknownDrafterError(ValueError):
    """The request asked for a drafter the server has not loaded."""


@dataclass
class RequestStream:
    """The events of one request, consumable from a thread or from asyncio."""

    request: GenerationRequest
    drafter: str | None
    submitted_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None  # when the first round began
    _loop: asyncio.AbstractEventLoop | None = None
    _async_queue: asyncio.Queue[StreamItem] | None = None
    _sync_queue: queue.Queue[StreamItem] = field(default_factory=queue.Queue)
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        try:
            self._loop = asyncio.get_running_loop()
            self._async_queue = asyncio.Queue()
        except RuntimeError:
            self._loop = None

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop generating; the engine frees the request before its next round."""
        self._cancelled.set()

    def __iter__(self) -> Iterator[RoundEvent]:
        if self._loop is not None:
            raise RuntimeError("this stream was created in an event loop; use `async for`")
        while not isinstance(item := self._sync_queue.get(), End):
            yield item

    async def __aiter__(self) -> AsyncIterator[RoundEvent]:
        if self._async_queue is None:
            raise RuntimeError("this stream was created outside an event loop; use `for`")
        while not isinstance(item := await self._async_queue.get(), End):
            yield item

    def _put(self, item: StreamItem) -> None:
        if self._loop is None:
            self._sync_queue.put(item)
            return
        assert self._async_queue is not None
        try:
            self._loop.call_soon_threadsafe(self._async_queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is gone
            self.cancel()
