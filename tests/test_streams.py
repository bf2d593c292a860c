"""Handing events from another thread to streams consumed in an event loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from decoding.handoff import Outbox
from decoding.streams import END, RequestStream
from decoding.types import GenerationRequest

CEILING_S = 60.0  # for 50 hand-overs and an END: only a hang reaches it


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

        async def collect(stream: RequestStream) -> list[object]:
            return [e async for e in stream]

        thread = threading.Thread(target=model_thread)
        thread.start()
        try:
            got = await asyncio.wait_for(asyncio.gather(collect(first), collect(second)),
                                         CEILING_S)
        except TimeoutError:
            pytest.fail(f"the streams did not end within {CEILING_S:.0f} s of the model "
                        f"thread's start: a hand-over (or the END) never reached them")
        thread.join(CEILING_S)
        assert not thread.is_alive(), "the model thread did not finish its hand-overs"
        return got[0], got[1]

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
