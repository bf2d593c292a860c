"""Progress bars for the benchmarks: tqdm on stderr, only when stderr is a terminal."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm


@contextmanager
def progress(total: int, desc: str, enabled: bool = True) -> Iterator[tqdm]:
    """A bar of ``total`` steps; a silent one when ``enabled`` is false or stderr is not a
    terminal. While it shows, log lines are written above it rather than through it."""
    show = enabled and sys.stderr.isatty()
    with ExitStack() as stack:
        if show:
            stack.enter_context(logging_redirect_tqdm())
        bar = stack.enter_context(tqdm(total=total, desc=desc, file=sys.stderr,
                                       disable=not show, leave=False, dynamic_ncols=True))
        yield bar
