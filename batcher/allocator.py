"""Give the memory freed after a burst back to the operating system.

A burst of large requests (1 MiB inputs queued behind a stopped worker) grows the
broker's heap by tens of MB. glibc keeps the freed pages, so the broker's RSS would stay
at the burst's high-water mark for the rest of its life, which to anyone watching it
looks exactly like a leak. `malloc_trim(0)` hands every whole free page back (glibc 2.8
and later, in every arena), and is cheap enough to call every few seconds. Fixing
glibc's mmap threshold instead would give each large message its own mapping, and its
page faults halved the broker's throughput of 1 MiB requests (measured).
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Callable

#: How often the broker trims: rare enough to cost nothing, soon enough after a burst.
TRIM_INTERVAL_S = 5.0


def heap_trimmer() -> Callable[[], None] | None:
    """A call to this process's `malloc_trim(0)`, or None where the C library is not glibc."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim.restype = ctypes.c_int

    def trim() -> None:
        malloc_trim(0)

    return trim
