"""A client's request past its wait for a reply, as data: sent again (while retries last)
or answered `timeout`. Every Python client (Client, AsyncClient, MultiClient) asks
`expire(pending, now, retries)` and does what it says, so the retry rule is written once
and tested with plain floats for the time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from batcher.errors import SettingsError


class Waiting(Protocol):
    """What the rule needs of a request in flight."""

    @property
    def attempts(self) -> int:
        """How many times it was sent so far."""
        ...

    @property
    def wait_s(self) -> float | None:
        """How long each attempt waits for its reply (None: for ever)."""
        ...


@dataclass(frozen=True, slots=True)
class Attempts:
    """A request in flight as plain values, for a client that keeps no object per request
    (AsyncClient: its waits are asyncio timeouts)."""

    attempts: int
    wait_s: float | None


@dataclass(frozen=True, slots=True)
class Resend:
    """Send the request again now: it is then its attempt `attempt`, and that attempt is
    answered `timeout` or expires again at `deadline`."""

    attempt: int
    deadline: float


@dataclass(frozen=True, slots=True)
class TimedOut:
    """Answer the request `timeout`: it went `attempts` times without a reply in time."""

    attempts: int


def check_retries(retries: int) -> None:
    """Reject a retry count a client cannot follow, with the message users see."""
    if retries < 0:
        raise SettingsError(f"retries must be >= 0, got {retries}")


def expire(pending: Waiting, now: float, retries: int) -> Resend | TimedOut:
    """What to do with `pending`, whose latest attempt got no reply in time, at `now`:
    a request that waits for ever never expires by time, so it is never resent; one
    that was sent `retries` + 1 times has had all its tries."""
    if pending.wait_s is not None and pending.attempts <= retries:
        return Resend(pending.attempts + 1, now + pending.wait_s)
    return TimedOut(pending.attempts)
