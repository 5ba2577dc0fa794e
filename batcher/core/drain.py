"""A broker's drain as data: from the first stop signal no request is taken, queued and
running work may finish within the grace, and what is left then (or at a second signal)
is answered `shutting_down`. The loop asks `verdict(now, ...)` each turn and does what
it says."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class DrainVerdict(enum.Enum):
    """What a draining broker does this turn."""

    WAIT = "wait"  # work is left and the grace runs: go on serving it
    ANSWER_ALL = "answer_all"  # answer every request left `shutting_down`, then stop
    DONE = "done"  # nothing is left: stop


@dataclass(frozen=True, slots=True)
class Drain:
    """Begun at `since` (the stop signal), with `grace_s` for the work already taken."""

    since: float
    grace_s: float

    def __post_init__(self) -> None:
        if not self.grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")

    @property
    def grace_end(self) -> float:
        """When the grace ends: the loop must wake by then."""
        return self.since + self.grace_s

    def verdict(self, now: float, *, busy: bool, forced: bool) -> DrainVerdict:
        """`busy`: requests are queued, running or streaming; `forced`: a second stop
        signal came, which asks for an exit at once."""
        if not busy:
            return DrainVerdict.DONE
        if forced or now >= self.grace_end:
            return DrainVerdict.ANSWER_ALL
        return DrainVerdict.WAIT
