"""The target's final hidden states that a sequence keeps for a drafter that reads them
(``Drafter.reads_features``): every verify pass computes them for its tokens anyway, so
keeping the rows of what was committed costs a copy of a few rows a round."""

from __future__ import annotations

import torch

WINDOW = 2048  # positions kept: a drafter that lags further starts again from these


class FeatureRows:
    """Rows by position: row i is the state at position ``start + i``, which predicted
    the token at ``start + i + 1``. Positions are kept contiguous: rows that would leave
    a gap replace the rows held."""

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self.start = 0
        self._rows: torch.Tensor | None = None  # [capacity, H]
        self._count = 0

    @property
    def end(self) -> int:
        """One past the last position held."""
        return self.start + self._count

    def add(self, position: int,
            rows: torch.Tensor,  # [n, H]: positions position .. position + n - 1
            ) -> None:
        """Hold ``rows`` from ``position`` on, forgetting any held at or after it."""
        if rows.shape[0] == 0:
            return
        if self._rows is None or position > self.end or position < self.start:
            self.start, self._count = position, 0  # a gap, or before what is held
        at = position - self.start
        needed = at + rows.shape[0]
        if self._rows is None or needed > self._rows.shape[0]:
            grown = rows.new_empty((max(needed, 2 * self._count, 64), rows.shape[1]))
            if self._rows is not None:
                grown[:at] = self._rows[:at]
            self._rows = grown
        self._rows[at:needed] = rows
        self._count = needed
        if self._count > 2 * self.window:  # keep the last window (amortised: a copy
            drop = self._count - self.window  # every window rows)
            self._rows[: self.window] = self._rows[drop : self._count].clone()
            self.start += drop
            self._count = self.window

    def add_verified(self, pending: int,
                     rows: torch.Tensor,  # [passed, H]: the pending token, drafts, alternative
                     accepted: int, alternative_taken: bool) -> None:
        """Hold the rows of a verify pass that verification kept: the pending token's (at
        position ``pending``) and the ``accepted`` drafts', or the pending token's and the
        alternative's (the pass's last) when the alternative was taken."""
        self.add(pending, rows[[0, -1]] if alternative_taken else rows[: accepted + 1])

    def get(self, begin: int, end: int) -> torch.Tensor:  # [end - begin, H]
        """The rows of positions ``begin`` .. ``end - 1`` (all held)."""
        if not self.start <= begin <= end <= self.end or self._rows is None:
            raise IndexError(f"positions {begin}..{end} are not all held "
                             f"({self.start}..{self.end})")
        return self._rows[begin - self.start : end - self.start]
