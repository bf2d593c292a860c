"""CPU threads per forward pass.

A decoding pass (every running stream's round, no prompt chunk) is a few tokens: its
products are small, and on a machine with few cores the HTTP server's event loop
needs a core of its own while the model decodes. Such passes run on
``decode_threads`` (by default one fewer than the process's threads); passes holding
prompt chunks run on all of them. The thread count does not change any result
(the kernels split work across outputs, never a reduction: tests/test_invariance.py).
Figures: docs/performance.md, "Threads"."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def default_decode_threads() -> int:
    """One fewer than PyTorch's intra-op threads (at least one)."""
    return max(1, torch.get_num_threads() - 1)


@contextmanager
def cpu_threads(n: int | None) -> Iterator[None]:
    """Run the block on ``n`` intra-op threads (None: as configured)."""
    before = torch.get_num_threads()
    if n is None or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
