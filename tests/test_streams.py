"""Handing events from another thread to streams consumed in an event loop."""

from __future__ import annotations

import asyncio
import threading

from decoding.handoff import Outbox
from decoding.streams import END, RequestStream
from decoding.types import GenerationRequest


def _request() -> GenerationRequest:
    return GenerationRequest(prompt_ids=(1, 2), max_new_tokens=4)


def test_a_hand_over_from_another_thread_reaches_each_stream_in_order() -> None:
    async def main() -> tuple[list[object], list[object]]:
        first, second = RequestStream(_request(), None), RequestStream(_request(), None)
        outbox = Outbox()

        def model_thread() -> None:
            for i in range(50):
                outbox.send(first, i)
                outbox.send(second, -i)
                if i % 7 == 0:
                    outbox.hand_over()
            outbox.send(first, END)
            outbox.send(second, END)
            outbox.hand_over()

        thread = threading.Thread(target=model_thread)
        thread.start()
        got = ([e async for e in first], [e async for e in second])
        thread.join()
        return got

    first, second = asyncio.run(main())
    assert first == list(range(50))
    assert second == [-i for i in range(50)]


def test_a_stream_whose_loop_is_gone_is_cancelled() -> None:
    async def make() -> RequestStream:
        return RequestStream(_request(), None)

    loop = asyncio.new_event_loop()
    stream = loop.run_until_complete(make())
    loop.close()
    outbox = Outbox()
    outbox.send(stream, 1)
    outbox.hand_over()
    outbox.close(timeout=10)
    assert stream.cancelled


class _Recording(RequestStream):
    """A stream that notes which thread delivered each item."""

    def __init__(self) -> None:
        super().__init__(_request(), None)
        self.threads: list[str] = []

    def _put(self, item: object) -> None:
        self.threads.append(threading.current_thread().name)
        super()._put(item)


class _Broken(_Recording):
    def _put(self, item: object) -> None:
        raise OSError("this stream's consumer is broken")


def test_the_courier_delivers_so_the_model_thread_never_wakes_the_loop_itself() -> None:
    outbox = Outbox()
    stream = _Recording()
    for i in range(3):
        outbox.send(stream, i)
        outbox.hand_over()  # returns at once: the courier delivers
    outbox.send(stream, END)
    outbox.hand_over()
    outbox.close(timeout=10)
    assert list(stream) == [0, 1, 2]
    assert stream.threads == ["specserve-courier"] * 4
    assert threading.current_thread().name not in stream.threads


def test_one_broken_stream_does_not_stop_the_others_events_and_close_restarts() -> None:
    outbox = Outbox()
    broken, fine = _Broken(), _Recording()
    outbox.send(broken, 1)
    outbox.send(fine, 1)
    outbox.hand_over()
    outbox.close(timeout=10)
    outbox.send(broken, 2)
    outbox.send(fine, 2)
    outbox.send(fine, END)
    outbox.hand_over()  # a new courier after close
    outbox.close(timeout=10)
    assert list(fine) == [1, 2]
    assert len(fine.threads) == 3


def test_a_hand_over_with_nothing_queued_starts_no_courier() -> None:
    def couriers() -> int:
        return sum(t.name == "specserve-courier" for t in threading.enumerate())

    before = couriers()
    outbox = Outbox()
    outbox.hand_over()
    assert couriers() == before
    outbox.send(_Recording(), 1)
    outbox.hand_over()
    assert couriers() == before + 1
    outbox.close(timeout=10)
    assert couriers() == before
