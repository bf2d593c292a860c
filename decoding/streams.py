"""A request's stream of round events, consumable from a thread or from asyncio, and
the errors a submission can raise.

The model thread hands events to an event loop through the loop's ``Doorbell``: it
queues them, then wakes the loop with one byte written while it keeps the GIL. (asyncio's
``call_soon_threadsafe`` writes its wake-up byte with the GIL released; the woken loop
then often takes the GIL first and the model thread waits out the loop's whole turn
before its next pass can start. Figures: docs/performance.md, "Handing events over".)
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from decoding.types import GenerationRequest, RoundEvent

END = object()  # put after a stream's last event


def _gil_held_write() -> Callable[[int], object]:
    """``write(fd, one byte)`` that keeps the GIL (libc's through ctypes.PyDLL, which
    does not release it); ``os.write`` where libc cannot be found."""
    try:
        write = ctypes.PyDLL(None).write
        write.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
        write.restype = ctypes.c_ssize_t
        return lambda fd: write(fd, b"\0", 1)
    except (OSError, AttributeError):
        return lambda fd: os.write(fd, b"\0")


_ring = _gil_held_write()


class Doorbell:
    """Items for one event loop's queues from other threads, and the pipe that wakes the
    loop to deliver them (in the order posted)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._items: deque[tuple[asyncio.Queue[Any], Any]] = deque()
        self._read, self._write = os.pipe()
        for fd in (self._read, self._write):
            os.set_blocking(fd, False)
        loop.add_reader(self._read, self._deliver)
        weakref.finalize(self, _close, self._read, self._write)

    def post(self, target: asyncio.Queue[Any], item: Any) -> None:
        """Queue ``item`` for ``target`` (any thread); it arrives after the next ring."""
        self._items.append((target, item))

    def ring(self) -> None:
        """Wake the loop (any thread; keeps the GIL). A full pipe already wakes it."""
        _ring(self._write)

    def _deliver(self) -> None:  # in the loop
        with contextlib.suppress(BlockingIOError):
            os.read(self._read, 4096)
        while self._items:
            target, item = self._items.popleft()
            target.put_nowait(item)


def _close(*fds: int) -> None:
    for fd in fds:
        os.close(fd)


_doorbells: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Doorbell] = (
    weakref.WeakKeyDictionary())


def doorbell(loop: asyncio.AbstractEventLoop) -> Doorbell:
    """The running ``loop``'s doorbell (made on first use, in the loop's thread)."""
    bell = _doorbells.get(loop)
    if bell is None:
        bell = _doorbells[loop] = Doorbell(loop)
    return bell


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
    _async_queue: asyncio.Queue[Any] | None = None
    _doorbell: Doorbell | None = None
    _sync_queue: queue.Queue[Any] = field(default_factory=queue.Queue)
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        try:
            self._loop = asyncio.get_running_loop()
            self._async_queue = asyncio.Queue()
            self._doorbell = doorbell(self._loop)
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
        while (item := self._sync_queue.get()) is not END:
            yield item

    async def __aiter__(self) -> AsyncIterator[RoundEvent]:
        if self._async_queue is None:
            raise RuntimeError("this stream was created outside an event loop; use `for`")
        while (item := await self._async_queue.get()) is not END:
            yield item

    def _put(self, item: Any) -> Doorbell | None:
        """Queue ``item`` for the consumer; the doorbell to ring for it to arrive (None:
        it has arrived)."""
        if self._loop is None:
            self._sync_queue.put(item)
            return None
        assert self._async_queue is not None and self._doorbell is not None
        if self._loop.is_closed():  # the consumer's event loop is gone
            self.cancel()
            return None
        self._doorbell.post(self._async_queue, item)
        return self._doorbell
