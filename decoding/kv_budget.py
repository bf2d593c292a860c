"""Admission under a KV budget: the most KV a request can need, what the running requests
hold at their longest, and whether one more fits. A plain object over the target's KV
sizes, so the scheduler's admission and the KV gauge count the same bytes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from decoding.types import GenerationRequest


class KvSizes(Protocol):
    """What the budget reads of a target (``decoding.target.Target``): its context and
    the size of its KV buffers."""

    @property
    def max_context(self) -> int: ...

    def kv_bytes(self, rows: int, positions: int) -> int: ...


@dataclass(frozen=True)
class KvBudget:
    target: KvSizes
    max_bytes: int | None  # None: no bound

    def positions(self, request: GenerationRequest) -> int:
        """The most KV positions ``request`` can need: its prompt, its tokens and one more."""
        prompt = len(request.prompt_ids)
        return prompt + min(request.max_new_tokens, self.target.max_context - prompt) + 1

    def reserved(self, positions: Sequence[int]) -> int:
        """The KV that sequences of up to these positions hold at their longest."""
        return self.target.kv_bytes(len(positions), max(positions)) if positions else 0

    def room(self, running: Sequence[int], positions: int) -> bool:
        """Whether a request of ``positions`` fits beside ``running`` ones; one always
        fits when none runs."""
        return (self.max_bytes is None or not running
                or self.reserved([*running, positions]) <= self.max_bytes)
