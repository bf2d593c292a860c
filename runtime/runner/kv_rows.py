"""The batched runner's KV buffers: one row a sequence, one length a row.

One tensor per layer for keys and one for values, ``[rows, kv_heads, capacity,
head_dim]`` (held in the runner's ``Stack``, where the layer paths read them). Rolling
a sequence back is setting its length; nothing is copied or freed per round. Capacity
and rows grow by doubling when needed; a released row is refilled from the end (the
rows in use stay dense); the buffers shrink back when the last sequence leaves.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.runner.layout import SPAN_ALIGN
from runtime.runner.stack import Stack

log = logging.getLogger(__name__)

INITIAL_CAPACITY = SPAN_ALIGN
INITIAL_ROWS = 1  # grown as requests are admitted (Engine._fit_kv)
CAPACITY_ALIGN = SPAN_ALIGN  # an attention span never passes the capacity


@dataclass(eq=False)
class BatchedState:
    """One sequence: its row in the KV buffers and how many positions it holds."""

    row: int
    length: int = 0
    released: bool = False


def aligned(positions: int) -> int:
    """``positions`` rounded up to a whole number of attention spans."""
    return -(-positions // CAPACITY_ALIGN) * CAPACITY_ALIGN


class KVRows:
    """Hands out, grows, compacts and gives back the rows of ``stack``'s KV buffers."""

    def __init__(self, stack: Stack, device: torch.device) -> None:
        self.stack = stack
        self.device = device
        self._rows: list[BatchedState | None] = []
        self._capacity = 0
        self._allocate(INITIAL_ROWS, INITIAL_CAPACITY)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def rows_in_use(self) -> int:
        return sum(1 for s in self._rows if s is not None)

    @torch.inference_mode()
    def new_state(self) -> BatchedState:
        row = self.rows_in_use
        if row == len(self._rows):
            self._allocate(2 * len(self._rows), self._capacity)
        state = BatchedState(row=row)
        self._rows[row] = state
        return state

    @torch.inference_mode()
    def release(self, state: BatchedState) -> None:
        """Give the sequence's row back; the last row in use moves into the gap."""
        if state.released:
            return
        state.released = True
        state.length = 0
        last = self.rows_in_use - 1
        hole = state.row
        self._rows[hole] = None
        if hole != last:
            moved = self._rows[last]
            assert moved is not None
            n = moved.length
            for buffer in (*self.stack.keys, *self.stack.values):
                buffer[hole, :, :n].copy_(buffer[last, :, :n])
            self._rows[last] = None
            self._rows[hole] = moved
            moved.row = hole
        if last == 0 and (self._capacity > INITIAL_CAPACITY or len(self._rows) > INITIAL_ROWS):
            self.stack.keys, self.stack.values, self._rows = [], [], []  # idle: give it back
            self._allocate(INITIAL_ROWS, INITIAL_CAPACITY)

    @staticmethod
    def rollback(state: BatchedState, length: int) -> None:
        state.length = min(state.length, length)

    def fit(self, rows: int, positions: int) -> None:
        """Size the buffers for ``rows`` sequences of up to ``positions`` tokens: grow to
        it at once, or shrink when they are more than twice that (what the sequences
        hold is kept)."""
        rows = max(rows, INITIAL_ROWS, self.rows_in_use)
        longest = max((s.length for s in self._rows if s is not None), default=0)
        capacity = aligned(max(positions, INITIAL_CAPACITY, longest))
        if (rows > len(self._rows) or capacity > self._capacity
                or len(self._rows) > 2 * rows or self._capacity > 2 * capacity):
            self._allocate(rows, capacity)

    def reach(self, needed: int) -> None:
        """Make room for ``needed`` positions in every row."""
        if needed > self._capacity:
            self._allocate(len(self._rows), aligned(max(needed, 2 * self._capacity)))

    @torch.inference_mode()
    def adopt_alternative(self, state: BatchedState, start: int, n: int) -> None:
        """Move the last of a pass's ``n`` positions from ``start`` (an alternative) to
        right after its first, and forget the rest."""
        for buffer in (*self.stack.keys, *self.stack.values):
            buffer[state.row, :, start + 1].copy_(buffer[state.row, :, start + n - 1])
        state.length = start + 2

    @torch.inference_mode()
    def load_kv(self, state: BatchedState,
                kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if state.length:
            raise ValueError("load_kv needs an empty cache")
        if not kv:
            return
        n = int(kv[0][0].shape[2])
        self.reach(n)
        for layer, (keys, values) in enumerate(kv):
            self.stack.keys[layer][state.row, :, :n].copy_(keys[0])
            self.stack.values[layer][state.row, :, :n].copy_(values[0])
        state.length = n

    def kv(self, state: BatchedState) -> list[tuple[torch.Tensor, torch.Tensor]]:
        n, row = state.length, state.row
        return [(k[row : row + 1, :, :n], v[row : row + 1, :, :n])
                for k, v in zip(self.stack.keys, self.stack.values, strict=True)]

    @torch.inference_mode()
    def _allocate(self, rows: int, capacity: int) -> None:
        stack = self.stack
        shape = (rows, stack.kv_heads, capacity, stack.head_dim)
        keys = [torch.zeros(shape, dtype=stack.dtype, device=self.device) for _ in stack.layers]
        values = [torch.zeros(shape, dtype=stack.dtype, device=self.device)
                  for _ in stack.layers]
        used = self.rows_in_use if self._rows else 0
        longest = max((s.length for s in self._rows if s is not None), default=0)
        for old, new in zip((*stack.keys, *stack.values), (*keys, *values), strict=False):
            new[:used, :, :longest].copy_(old[:used, :, :longest])
        stack.keys, stack.values = keys, values
        self._rows = (self._rows + [None] * rows)[:rows]
        self._capacity = capacity
        log.debug("KV buffers: %d rows x %d positions", rows, capacity)
