"""Admission under a KV budget, in blocks of positions: what a request needs to start (its
prompt's blocks and a margin, never its longest answer) and what the pool has free. A
plain object over the target's KV accounting (``Target.kv_usage``), so the scheduler's
admission, the engine's preemption and the KV gauges count the same blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from runtime.runner.passes import KVUsage, blocks_for

# Blocks a request needs free beyond its prompt's to be admitted: room to write its first
# rounds (the pool's other free blocks are shared by every running request as they grow)
ADMISSION_MARGIN = 1


class KvPool(Protocol):
    """What the budget reads of a target (``decoding.target.Target``)."""

    @property
    def max_context(self) -> int: ...

    def kv_usage(self) -> KVUsage: ...


@dataclass(frozen=True)
class KvBudget:
    target: KvPool
    max_bytes: int | None  # None: no bound

    @property
    def limit(self) -> int | None:
        """The blocks the pool may hold (None: no bound)."""
        return self.target.kv_usage().limit

    def to_start(self, positions: int) -> int:
        """The blocks a request that must compute ``positions`` positions needs free to be
        admitted."""
        return blocks_for(positions) + ADMISSION_MARGIN

    def free(self) -> int | None:
        """The blocks no running sequence holds (None: no bound)."""
        usage = self.target.kv_usage()
        return None if usage.limit is None else usage.limit - usage.used

    def positions(self) -> int | None:
        """The most positions one sequence alone may hold (None: no bound)."""
        limit = self.limit
        return None if limit is None else limit * self.target.kv_usage().block
