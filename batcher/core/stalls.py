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
    """The stalls already counted, so that two watchers of one stall (a loop's poll and a
    thread's timed wait, both late after one SIGCONT) skip it once."""

    def __init__(self) -> None:
        self._counted_until = -math.inf

    def new_s(self, stall: tuple[float, float]) -> float:
        """The seconds of `stall` not counted before (0.0 for one counted already); counted
        from now on. Stalls are told in the order they end."""
        began, ended = stall
        began = max(began, self._counted_until)
        if ended <= began:
            return 0.0
        self._counted_until = ended
        return ended - began
