"""The wall clock's offset from the monotonic clock, read so that a preemption cannot skew
it: each process turns its monotonic times into the epoch nanoseconds of its spans with
this offset, read once, and spans of several processes are compared (a child must not
start before its parent). Read naively (time.time_ns() - time.monotonic_ns()), a process
descheduled between the two reads is off by as long as it waited: milliseconds on a
loaded machine."""

from __future__ import annotations

import time

#: Readings taken; the one whose two monotonic reads were closest together wins.
SAMPLES = 16


def wall_offset_ns(samples: int = SAMPLES) -> int:
    """time.time_ns() - time.monotonic_ns(), from the reading bracketed most tightly by two
    monotonic reads (its error at most half that bracket: well under a microsecond)."""
    best_gap, best = -1, 0
    for _ in range(samples):
        before = time.monotonic_ns()
        wall = time.time_ns()
        after = time.monotonic_ns()
        if best_gap < 0 or after - before < best_gap:
            best_gap, best = after - before, wall - (before + after) // 2
    return best
