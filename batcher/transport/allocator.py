"""glibc's allocator, set for large messages: freed memory reused at once, and given
back to the operating system every few seconds.

By default glibc serves an allocation over its mmap threshold (128 KiB at first, raised
on the fly up to 32 MiB) with a fresh mapping, and gives the top of its heap back as
soon as 128 KiB of it is free. A 1 MiB message then costs 256 page faults each time its
buffer is allocated, in every process it passes through: measured with 1 MiB requests
through the echo model, the worker spent most of its time in them, and setting the two
thresholds high (`keep_freed_memory`) raised the throughput from 416 to 867 requests/s
(docs/benchmarks-history.md, "Tensors and large bodies").

Kept memory must still go back: after a burst of large requests the heap would stay at
its high-water mark for the process's life, which to anyone watching looks exactly
like a leak. `malloc_trim(0)` hands every whole free page back (glibc 2.8 and later, in
every arena), and is cheap enough to call every few seconds (TRIM_INTERVAL_S).
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Callable
from typing import Any

#: How often the broker and idle workers trim: rare enough to cost nothing, soon enough after a burst.
TRIM_INTERVAL_S = 5.0
#: Allocations up to this size come from the heap, not a mapping of their own.
MMAP_THRESHOLD_BYTES = 64 * 1024 * 1024
#: Free memory at the top of the heap kept for reuse until the next trim.
TRIM_THRESHOLD_BYTES = 256 * 1024 * 1024

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def _glibc() -> Any:
    """This process's C library, when it is glibc; else None."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Set this process's allocator to reuse freed large buffers (see the module's
    docstring); False where the C library is not glibc. Call `heap_trimmer()`'s trim
    every TRIM_INTERVAL_S with it."""
    libc = _glibc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


def heap_trimmer() -> Callable[[], None] | None:
    """A call to this process's `malloc_trim(0)`, or None where the C library is not glibc."""
    malloc_trim = getattr(_glibc(), "malloc_trim", None)
    if malloc_trim is None:
        return None
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim.restype = ctypes.c_int

    def trim() -> None:
        malloc_trim(0)

    return trim
