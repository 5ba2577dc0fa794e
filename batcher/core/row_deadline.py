"""A gateway row past its deadline, as data. The broker answers a row by its deadline
(`deadline_exceeded`) unless it is paused or swamped; the gateway then cancels the row at
the broker CANCEL_AFTER_S past the deadline, so the cancel has left before any client is
told, and gives up on it (a 504 / DEADLINE_EXCEEDED) REPLY_GRACE_S past it. The gateway
asks `step(now)` when its timer fires and does what it says; time is an argument."""

from __future__ import annotations

import enum
from dataclasses import dataclass

#: How long past a row's deadline the gateway waits for the broker's answer (a 504 then).
REPLY_GRACE_S = 1.0
#: When, past a row's deadline, the gateway cancels it at the broker if still unanswered:
#: after the broker's own deadline_exceeded would have come, before the 504.
CANCEL_AFTER_S = 0.5


class RowStep(enum.Enum):
    """What the gateway does with the rows of a request still unanswered."""

    WAIT = "wait"  # before the cancel is due: the broker may still answer
    CANCEL_AT_BROKER = "cancel_at_broker"  # drop them at the broker; their client still waits
    GIVE_UP = "give_up"  # answer their client `timeout`


@dataclass(frozen=True, slots=True)
class RowDeadline:
    """A request's rows sent with `deadline` (the broker's clock is not ours: this is the
    gateway's own time of it)."""

    deadline: float
    cancel_after_s: float = CANCEL_AFTER_S
    reply_grace_s: float = REPLY_GRACE_S

    def __post_init__(self) -> None:
        if not 0 <= self.cancel_after_s < self.reply_grace_s:
            got = f"got {self.cancel_after_s} and {self.reply_grace_s}"
            raise ValueError(f"need 0 <= cancel_after_s < reply_grace_s, {got}")

    @property
    def cancel_at(self) -> float:
        """When unanswered rows are cancelled at the broker."""
        return self.deadline + self.cancel_after_s

    @property
    def give_up_at(self) -> float:
        """When unanswered rows are answered `timeout`."""
        return self.deadline + self.reply_grace_s

    def step(self, now: float) -> RowStep:
        """What is due at `now` for rows still unanswered."""
        if now >= self.give_up_at:
            return RowStep.GIVE_UP
        if now >= self.cancel_at:
            return RowStep.CANCEL_AT_BROKER
        return RowStep.WAIT

    def next_wakeup(self, now: float) -> float:
        """When `step` next changes its answer (its last: the give-up)."""
        return self.cancel_at if now < self.cancel_at else self.give_up_at
