"""The gateway's decisions over many brokers: which brokers discovery adds and removes,
which brokers may take a row of a model, and which of those a row goes to.

Pure: no sockets, no event loop, no clock (times are arguments) and no random source of
its own (the chooser takes one), so that every rule here is tested with a fake clock and
hypothesis (tests/unit/core/test_routing.py). batcher/gateway/brokers.py acts on them.

Routing is the power of two choices on outstanding rows: two brokers drawn at random among
those ready for the model, the row to the one with fewer rows in flight. Measured against
round robin in benchmarks/gateway_routing.py (docs/gateway.md, "Many brokers").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

#: The routing rules `choose` knows: the power of two choices, and round robin (the
#: baseline it is measured against).
ROUTINGS = ("p2c", "round-robin")


def membership_change(current: Iterable[str], wanted: Iterable[str]) -> tuple[list[str], list[str]]:
    """(the brokers to add, the brokers to remove), each sorted, so that the current set
    becomes the wanted one: what discovery does with each answer it gets."""
    have, want = set(current), set(wanted)
    return sorted(want - have), sorted(have - want)


def choose_two(
    candidates: Sequence[T], outstanding: Callable[[T], int], randbelow: Callable[[int], int]
) -> T:
    """The power of two choices: two distinct candidates drawn with `randbelow(n)` (an int
    in 0..n-1), the one with fewer `outstanding` rows (the first drawn on a tie). Nearly
    as good as the least loaded of all, without herding every gateway onto the same one.
    ValueError for no candidates."""
    n = len(candidates)
    if n == 0:
        raise ValueError("no broker to choose from")
    if n == 1:
        return candidates[0]
    i = randbelow(n)
    j = randbelow(n - 1)
    if j >= i:
        j += 1
    first, second = candidates[i], candidates[j]
    return second if outstanding(second) < outstanding(first) else first


def choose_round_robin(candidates: Sequence[T], turn: int) -> T:
    """The `turn`-th candidate in turn: round robin, the baseline. ValueError for none."""
    if not candidates:
        raise ValueError("no broker to choose from")
    return candidates[turn % len(candidates)]


@dataclass
class BrokerHealth:
    """What the gateway knows of one broker: its connection (from the link) and what its
    last `stats` said (every heartbeat). A broker not heard within `heartbeat_s` of being
    asked (a paused process, a partition that keeps the TCP connection) is `silent`."""

    connected: bool = False
    #: Its last stats answer, or None: not heard since it (re)connected.
    heard_at: float | None = None
    #: When the question still unanswered was asked, or None.
    asked_at: float | None = None
    draining: bool = False
    ready_models: frozenset[str] = field(default_factory=frozenset)
    configured_models: frozenset[str] = field(default_factory=frozenset)
    #: Per model, the workers its offered load needs at the broker's target utilization
    #: (its `stats` scaling entry, before rounding up: batcher.core.scaling).
    workers_needed: dict[str, float] = field(default_factory=dict)

    def silent(self, now: float, heartbeat_s: float) -> bool:
        """Asked more than `heartbeat_s` ago and not answered since."""
        return self.asked_at is not None and now - self.asked_at > heartbeat_s

    def takes(self, model: str, now: float, heartbeat_s: float) -> bool:
        """Connected, heard, answering, not draining and ready for `model`: a broker that
        may be given new rows of it."""
        return (
            self.connected
            and self.heard_at is not None
            and not self.draining
            and not self.silent(now, heartbeat_s)
            and model in self.ready_models
        )

    def open(self, now: float, heartbeat_s: float) -> bool:
        """Connected, answering and not draining: where a row goes when no broker is known
        ready for its model (one not asked yet, or a model no broker has: it says so)."""
        return self.connected and not self.draining and not self.silent(now, heartbeat_s)

    def heard(self, stats: object, now: float) -> None:
        """Its `stats` answer: draining (`stopping`), and which models it has and has ready."""
        self.heard_at, self.asked_at = now, None
        models = stats.get("models") if isinstance(stats, dict) else None
        models = models if isinstance(models, dict) else {}
        entries = {str(k): v for k, v in models.items() if isinstance(v, dict)}
        self.draining = bool(stats.get("stopping")) if isinstance(stats, dict) else False
        self.ready_models = frozenset(m for m, e in entries.items() if e.get("ready"))
        self.configured_models = frozenset(m for m, e in entries.items() if e.get("configured"))
        self.workers_needed = {m: n for m, e in entries.items() if (n := _workers_needed(e)) is not None}

    def lost(self) -> None:
        """The connection went: nothing it said before holds for the next one."""
        self.connected, self.heard_at, self.asked_at = False, None, None
        self.ready_models = self.configured_models = frozenset()
        self.workers_needed = {}


def _workers_needed(entry: dict[Any, Any]) -> float | None:
    """A model entry's `scaling.workers_needed`, when it is a finite number >= 0."""
    scaling = entry.get("scaling")
    needed = scaling.get("workers_needed") if isinstance(scaling, dict) else None
    if isinstance(needed, bool) or not isinstance(needed, int | float) or not 0 <= needed < math.inf:
        return None
    return float(needed)


def workers_needed_total(healths: Iterable[BrokerHealth]) -> dict[str, float]:
    """Per model, the workers needed summed over the brokers still connected: the load of a
    whole deployment in workers (rounded up only after the sum, batcher.core.scaling)."""
    total: dict[str, float] = {}
    for h in healths:
        if h.connected:
            for model, needed in h.workers_needed.items():
                total[model] = total.get(model, 0.0) + needed
    return total


def eligible(
    names: Sequence[str],
    health: Callable[[str], BrokerHealth],
    model: str,
    now: float,
    heartbeat_s: float,
    exclude: Collection[str] = (),
) -> list[str]:
    """The brokers a new row of `model` may go to, best tier first: those ready for it;
    else those open (connected, answering, not draining); else those connected (a draining
    or silent broker answers 503 or the deadline does, as one broker would)."""
    names = [n for n in names if n not in exclude]
    healths = [(n, health(n)) for n in names]
    tiers = (
        [n for n, h in healths if h.takes(model, now, heartbeat_s)],
        [n for n, h in healths if h.open(now, heartbeat_s)],
        [n for n, h in healths if h.connected],
    )
    return next((tier for tier in tiers if tier), [])


def gateway_ready(healths: Iterable[BrokerHealth], now: float, heartbeat_s: float) -> bool:
    """Ready when every model some broker has configured is ready on at least one broker
    that takes rows, and some model is (a gateway with no model serves nothing)."""
    configured: set[str] = set()
    ready: set[str] = set()
    for h in healths:
        configured |= h.configured_models
        if h.connected and h.heard_at is not None and not h.draining and not h.silent(now, heartbeat_s):
            ready |= h.ready_models
    return bool(ready) and configured <= ready
