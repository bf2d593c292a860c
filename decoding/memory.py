"""Handing freed memory back to the system.

Loading a model frees far more than it keeps (a GGUF reader's metadata objects,
dequantized temporaries, float copies). glibc keeps freed heap pages unless asked, and
they would count as the server's memory; the loaders call ``release_freed_memory`` once
their temporaries are gone."""

from __future__ import annotations

import contextlib
import ctypes
import gc


def release_freed_memory() -> None:
    """Collect garbage, then return the C heap's free pages to the system (glibc's
    ``malloc_trim``; elsewhere nothing)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)
