"""Clocks a test drives, so that time is an input and not a race with the machine."""

from __future__ import annotations

import threading


class ManualClock:
    """A clock that moves only when told (``advance``)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


class TickingClock:
    """A clock that moves ``tick`` seconds each time it is read: request deadlines pass
    after a fixed number of engine iterations, however fast the machine decodes."""

    def __init__(self, tick: float) -> None:
        self.tick = tick
        self.now = 0.0
        self.lock = threading.Lock()

    def __call__(self) -> float:
        with self.lock:
            self.now += self.tick
            return self.now
