"""The link core: when to beat, when a peer is lost, when to try it again and when to give up.

One rule for every link batcher keeps to a peer: a worker's to its broker, the gateway's
to its broker, a MultiClient's to each frontend, serve's to each worker process it
respawns. Pure: no sockets, no clock; `now` is an argument and each call returns data
(`Beat`, `Drop`, `Reconnect`, `GiveUp`), as h11's state machine does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """How long to wait after failures in a row: `initial_s` after the first, `factor`
    times longer after each further one, never more than `cap_s`. With `jitter` (a
    fraction in [0, 1)), each wait is shortened by up to that fraction, by a draw in
    [0, 1) the caller gives (so that many peers that failed together do not all come back
    at once); without it, the waits are exact."""

    initial_s: float
    cap_s: float
    factor: float = 2.0
    jitter: float = 0.0

    def __post_init__(self) -> None:
        if not (_finite(self.initial_s) and self.initial_s > 0):
            raise ValueError(f"initial_s must be > 0, got {self.initial_s!r}")
        if not (_finite(self.cap_s) and self.cap_s >= self.initial_s):
            raise ValueError(f"cap_s must be finite and >= initial_s ({self.initial_s}), got {self.cap_s!r}")
        if not (_finite(self.factor) and self.factor >= 1):
            raise ValueError(f"factor must be >= 1, got {self.factor!r}")
        if not (_finite(self.jitter) and 0 <= self.jitter < 1):
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter!r}")

    def delay_s(self, failures: int, draw: float = 0.0) -> float:
        """The wait after the `failures`-th failure in a row (1 is the first); `draw` in
        [0, 1) takes `jitter` off it in proportion."""
        if type(failures) is not int or failures < 1:
            raise ValueError(f"failures must be an int >= 1, got {failures!r}")
        if not 0 <= draw < 1:
            raise ValueError(f"draw must be in [0, 1), got {draw!r}")
        base = float(self.cap_s)
        if self.factor == 1 or failures - 1 < self._steps_to_cap():
            base = min(base, self.initial_s * self.factor ** (failures - 1))
        return base * (1.0 - self.jitter * draw)

    def _steps_to_cap(self) -> int:
        """A number of doublings (factor-ings) past which the wait is surely `cap_s`, so
        that a long run of failures never computes factor ** n out of range."""
        return math.ceil(math.log(self.cap_s / self.initial_s) / math.log(self.factor)) + 1


@dataclass(frozen=True)
class Beat:
    """Send the peer a heartbeat now."""


@dataclass(frozen=True)
class Drop:
    """Close the connection now (`why`); a `Reconnect` is due in `retry_in_s`."""

    why: str
    retry_in_s: float
    failures: int  # failures in a row, this one included (0: it ended a stable run)


@dataclass(frozen=True)
class Reconnect:
    """Open a fresh connection now (the link takes it as made: `connected`)."""


@dataclass(frozen=True)
class GiveUp:
    """Stop trying: `failures` in a row, the last for `why`."""

    why: str
    failures: int


Action = Beat | Drop | Reconnect | GiveUp


class PeerLink:
    """One link's state: connected or waiting to reconnect, the failures in a row, the
    next heartbeat, when the peer was last heard.

    - `connected(now)`: a fresh connection (the peer has had no time to speak yet).
    - `heard(now)`: the peer said something (so the link is up). Once it has been heard for `stable_s` on
      one connection, the link is stable and the failures in a row start again from 0.
    - `refused(why, now)`: the connection failed (a refused handshake, a lost peer, a
      process that died); `Drop` with the wait before the next try, or `GiveUp` after
      `give_up_after` failures in a row. With `count_stable_failure` false, the failure
      that ends a stable run is not one of them (serve's rule: a worker that had started
      and then died is respawned after `initial_s`, and only start-up failures count).
    - `due(now)`: what to do now, taken as done: `Beat` (every `beat_s` while
      connected), `Drop` (no word from the peer for `expiry_s`), `Reconnect` (the wait
      is over), or None.
    - `next_wakeup()`: when `due` will next return an action (None: never, by itself).
    - `stalled(by_s, now)`: this process did not run for `by_s`; that is no silence.
    """

    def __init__(
        self,
        backoff: Backoff,
        *,
        beat_s: float | None = None,
        expiry_s: float | None = None,
        stable_s: float = 0.0,
        give_up_after: int | None = None,
        count_stable_failure: bool = True,
        rand: Callable[[], float] | None = None,
    ) -> None:
        _check_timing(beat_s, expiry_s)
        if not (_finite(stable_s) and stable_s >= 0):
            raise ValueError(f"stable_s must be >= 0, got {stable_s!r}")
        if give_up_after is not None and (type(give_up_after) is not int or give_up_after < 1):
            raise ValueError(f"give_up_after must be an int >= 1 or None, got {give_up_after!r}")
        self.backoff = backoff
        self.beat_s, self.expiry_s = beat_s, expiry_s
        self.stable_s = stable_s
        self.give_up_after = give_up_after
        self.count_stable_failure = count_stable_failure
        self._rand = rand
        self.up = False  # a connection is open
        self.given_up = False
        self.failures = 0  # in a row, since the link was last stable
        self.retry_at: float | None = None  # when a Reconnect is due (not up)
        self.heard_at: float | None = None  # on this connection
        self._first_heard_at: float | None = None  # on this connection
        self._next_beat: float | None = None

    def connected(self, now: float) -> None:
        """A fresh connection is open: beats start, and its expiry counts from `now`."""
        self.up, self.retry_at = True, None
        self.heard_at, self._first_heard_at = now, None
        self._next_beat = None if self.beat_s is None else now + self.beat_s

    def heard(self, now: float) -> None:
        """The peer spoke (any message, or a handshake that succeeded): it is up."""
        if not self.up:
            self.connected(now)
        self.heard_at = now
        if self._first_heard_at is None:
            self._first_heard_at = now
        if self._stable(now):
            self.failures = 0

    def stalled(self, by_s: float, now: float) -> None:
        """This process did not run for `by_s` (batcher.core.stalls): the peer's silence
        then does not count, so its expiry moves as much later (the last word never
        later than `now`)."""
        if self.up and self.heard_at is not None and by_s > 0:
            self.heard_at = min(self.heard_at + by_s, now)

    def refused(self, why: str, now: float) -> Drop | GiveUp:
        """The connection failed (or could not be made): close it, and try again after
        the back-off, or give up."""
        stable = self._stable(now)
        if stable:
            self.failures = 0
        if not stable or self.count_stable_failure:
            self.failures += 1
        self.up, self.heard_at, self._first_heard_at, self._next_beat = False, None, None, None
        if self.give_up_after is not None and self.failures >= self.give_up_after:
            self.given_up, self.retry_at = True, None
            return GiveUp(why, self.failures)
        draw = self._rand() if self._rand is not None and self.backoff.jitter else 0.0
        delay = self.backoff.delay_s(max(1, self.failures), draw)
        self.retry_at = now + delay
        return Drop(why, delay, self.failures)

    def due(self, now: float) -> Action | None:
        """What to do at `now`, taken as done; call again until None."""
        if self.given_up:
            return None
        if not self.up:
            if self.retry_at is not None and now >= self.retry_at:
                self.connected(now)
                return Reconnect()
            return None
        expires = self._expires_at()
        if expires is not None and now >= expires:
            return self.refused(f"no word from the peer in {self.expiry_s:g}s", now)
        if self._next_beat is not None and now >= self._next_beat:
            assert self.beat_s is not None
            self._next_beat = now + self.beat_s
            return Beat()
        return None

    def next_wakeup(self) -> float | None:
        """The earliest time `due` returns an action, if nothing else happens first."""
        if self.given_up:
            return None
        if not self.up:
            return self.retry_at
        times = [t for t in (self._next_beat, self._expires_at()) if t is not None]
        return min(times) if times else None

    def retime(self, beat_s: float | None, expiry_s: float | None, now: float) -> None:
        """New heartbeat settings (the peer said its own): a shorter beat is due within
        `beat_s` of `now`; the expiry counts from the last word heard."""
        _check_timing(beat_s, expiry_s)
        self.beat_s, self.expiry_s = beat_s, expiry_s
        if not self.up or beat_s is None:  # a down link's beats start at its next connection
            self._next_beat = None
            return
        self._next_beat = now + beat_s if self._next_beat is None else min(self._next_beat, now + beat_s)

    def _stable(self, now: float) -> bool:
        first = self._first_heard_at
        return self.up and first is not None and now - first >= self.stable_s

    def _expires_at(self) -> float | None:
        if self.expiry_s is None or self.heard_at is None:
            return None
        return self.heard_at + self.expiry_s


def _finite(value: object) -> bool:
    """A real number (not a bool, NaN or an infinity)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_timing(beat_s: float | None, expiry_s: float | None) -> None:
    for name, value in (("beat_s", beat_s), ("expiry_s", expiry_s)):
        if value is not None and not (_finite(value) and value > 0):
            raise ValueError(f"{name} must be > 0 or None, got {value!r}")
