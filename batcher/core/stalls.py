"""Stalls: spans of time this process did not run (SIGSTOP then SIGCONT, `docker pause`,
a suspended VM, a starved CPU).

A process that was not running heard nothing meanwhile, and watched nothing run: a peer
it could not hear then was not silent, and a batch it could not watch then did not run
late. So every judge of silence (`link.PeerLink.stalled`, `pool.WorkerPool.stalled`) or
of a time limit skips those spans. A broker and its workers stopped together (serve's
process group) then go on where they were, with nothing taken for dead.

A stall is seen as a wait that ended later than asked (`overslept`): a poll with a
timeout, a thread's timed wait. A wait ended late by less than STALL_MIN_S is a busy
machine's scheduling, not a stall. Pure: the times are arguments.
"""

from __future__ import annotations

import math
from collections import deque

#: A wait that ends later than asked by more than this is a stall: a loaded machine's
#: scheduling delays stay below it, and a heartbeat's expiry (seconds) is far above it.
STALL_MIN_S = 0.1


def overslept(began_at: float, wait_s: float, woke_at: float) -> tuple[float, float] | None:
    """The stall (from, to) in a wait of `wait_s` begun at `began_at` that ended at
    `woke_at`; None when it ended in time (or its wait had no end: `wait_s` < 0 or
    infinite)."""
    if not 0 <= wait_s < math.inf:
        return None
    due = began_at + wait_s
    return (due, woke_at) if woke_at - due > STALL_MIN_S else None


class Stalls:
    """The stalls a process saw, each counted once. The loop counts them as it finds them
    (`count`); another watcher of the same process (a thread's timed wait, late after the
    same SIGCONT) only notes its own (`seen`, safe from any thread), for the loop's next
    `count` to take with the loop's own. That watcher also says when its wait is to end
    (`waiting`): after a SIGCONT the loop may run first, stopped outside its own wait
    (in a model, say), and the other's wait overdue is then the stall it saw."""

    def __init__(self) -> None:
        self._counted_until = -math.inf
        self._seen: deque[tuple[float, float]] = deque()
        self._wait_due = math.inf  # when the other watcher's wait is to end

    def pending(self, now: float) -> bool:
        """Whether another watcher noted a stall not counted yet, or its wait is overdue."""
        return bool(self._seen) or now - self._wait_due > STALL_MIN_S

    def waiting(self, began: float, wait_s: float) -> None:
        """The other watcher begins a wait of `wait_s` (safe from any thread)."""
        self._wait_due = began + wait_s

    def woke(self) -> None:
        """The other watcher's wait ended (and its stall, if any, was `seen`): it is no
        longer due to end, whatever it does next."""
        self._wait_due = math.inf

    def seen(self, stall: tuple[float, float]) -> None:
        """A stall another watcher found, for the next `count`."""
        self._seen.append(stall)

    def count(self, stall: tuple[float, float] | None = None, now: float = -math.inf) -> float:
        """The seconds of `stall`, of the stalls seen since the last count and of the
        other watcher's wait overdue at `now` that were not counted before (0.0 when
        every one was: two watchers of one stall)."""
        stalls = [self._seen.popleft() for _ in range(len(self._seen))]
        if stall is not None:
            stalls.append(stall)
        if (overdue := overslept(self._wait_due, 0.0, now)) is not None:
            stalls.append(overdue)
        return sum(self._new_s(began, ended) for began, ended in sorted(stalls, key=lambda s: s[1]))

    def _new_s(self, began: float, ended: float) -> float:
        began = max(began, self._counted_until)
        if ended <= began:
            return 0.0
        self._counted_until = ended
        return ended - began
