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
    assert stream.cancelled
