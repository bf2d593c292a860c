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

Waking the loop is itself such a hand-off: ``call_soon_threadsafe`` writes to the loop's
self-pipe, a socket call that releases the GIL, and the woken loop took it there and ran
its turn while the model thread, back from the write, waited to go on into its pass. So
the model thread only queues a round's events for a courier thread (a queue put, which
keeps the GIL) and goes straight into the pass; the courier, which gets the GIL once the
pass releases it, wakes the loop. One courier per outbox delivers in the order handed
over.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decoding.streams import RequestStream

log = logging.getLogger(__name__)

Batch = list[tuple["RequestStream", object]]


class Outbox:
    """What the model thread has for streams and has not handed over yet, in order; and
    the courier thread that delivers what was handed over."""

    def __init__(self) -> None:
        self._items: Batch = []
        self._batches: queue.SimpleQueue[Batch | None] = queue.SimpleQueue()
        self._courier: threading.Thread | None = None

    def send(self, stream: RequestStream, item: object) -> None:
        """Queue ``item`` (an event, or ``END``) for ``stream`` (a ``RequestStream``)."""
        self._items.append((stream, item))

    def hand_over(self) -> None:
        """Give every stream what was queued for it, in order: the courier delivers it
        (this returns at once)."""
        if not self._items:
            return
        items, self._items = self._items, []
        if self._courier is None:
            self._courier = threading.Thread(target=self._deliver, name="specserve-courier",
                                             daemon=True)
            self._courier.start()
        self._batches.put(items)

    def close(self, timeout: float | None = None) -> None:
        """Wait until everything handed over is delivered, then stop the courier (a later
        ``hand_over`` starts another)."""
        courier, self._courier = self._courier, None
        if courier is not None:
            self._batches.put(None)
            courier.join(timeout)

    def _deliver(self) -> None:
        while (items := self._batches.get()) is not None:
            for stream, item in items:
                try:
                    stream._put(item)
                except Exception:  # one stream's fault must not stop the others' events
                    log.exception("could not deliver an event to request %s",
                                  stream.request.request_id)
