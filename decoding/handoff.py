"""When the model thread hands a round's events to the HTTP event loop.

Both run Python, so they share the GIL. Every PyTorch op releases it; an event loop woken
by a round's events takes it at the model thread's first op and keeps it for its turn
(the chunk's JSON, metrics, the socket write), while the model thread, back from a
microsecond op, waits for it. Measured through the streamed
chat endpoint (plain decoding, one stream, the GGUF default): the embedding lookup that
opens a pass took 0.87 ms (median) instead of ~0.03.

So the engine holds a round's events back and hands them over when the target's next
pass is prepared and about to enter its long native call: the round calls the engine's
``Outbox.hand_over`` between ``Target.prepare_pass`` and ``Target.run_pass``, where the
GIL stays released for milliseconds, and the loop's turn runs beside the pass instead
of in front of it. The events then leave up to one round's preparation later (drafting,
the pass's layout), which never holds up a token's successor. Figures:
docs/performance.md, "Handing events over".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decoding.streams import RequestStream, StreamItem


class Outbox:
    """What the model thread has for streams and has not handed over yet, in order."""

    def __init__(self) -> None:
        self._items: list[tuple[RequestStream, StreamItem]] = []

    def send(self, stream: RequestStream, item: StreamItem) -> None:
        """Queue ``item`` (an event, or ``END``) for ``stream`` (a ``RequestStream``)."""
        self._items.append((stream, item))

    def hand_over(self) -> None:
        """Give every stream what was queued for it, in order."""
        items, self._items = self._items, []
        for stream, item in items:
            stream._put(item)
