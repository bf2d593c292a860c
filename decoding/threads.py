"""CPU threads per forward pass.

Every pass runs on all of the process's intra-op threads by default: the kernels split a
pass's work into more chunks than threads and let each thread claim the next chunk, so a
thread the system lends to the HTTP event loop delays the pass by a chunk, not by its
whole share (runtime/native/csrc/common.h, ``split``). ``decode_threads`` sets fewer for passes
without prompt chunks. The thread count does not change any result (the kernels split
work across outputs, never a reduction: tests/test_invariance.py). Figures:
docs/performance.md, "Threads"."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def default_decode_threads() -> int:
    """PyTorch's intra-op threads: every core the process has."""
    return max(1, torch.get_num_threads())


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
