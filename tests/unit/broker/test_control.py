"""The broker's control plane (batcher/broker/control.py, sans-I/O): what a sender that is no
admin may ask when the broker has --curve-admins (issue 28 item 19)."""

from __future__ import annotations

from typing import Any

from batcher.broker.control import MUTATING_OPS, Controls
from batcher.broker.stats import BrokerStats
from batcher.core.pool import WorkerInfo, WorkerPool
from batcher.core.scheduler import BatchSettings, Scheduler
from batcher.wire.protocol import ErrorCode, Heartbeat


def controls() -> Controls:
    """Controls of a broker serving model `m` with one worker (pid 42, id 00ab), and a
    reload that answers at once, as serve's would once it is over."""
    scheduler = Scheduler(per_model={"m": BatchSettings()})
    pool = WorkerPool(scheduler, Heartbeat(), 1, now=0.0)
    pool.joined(b"\x00\xab", WorkerInfo("m", 0, 42), None, 0.0)
    c = Controls(scheduler, pool, BrokerStats(), frozenset({"m"}), lambda: {})
    c.on_reload = lambda model, reply: reply(True, {"model": model, "replaced": 1, "workers": 1})
    return c


def answer(c: Controls, op: str, admin: bool, model: str | None = "m") -> tuple[bool, Any]:
    got: list[tuple[bool, Any]] = []
    c.handle(op, model, lambda ok, result: got.append((ok, result)), admin)
    assert len(got) == 1
    return got[0]


def worker_names(c: Controls, admin: bool) -> list[str]:
    ok, snapshot = answer(c, "stats", admin)
    assert ok
    return [w["worker"] for w in snapshot["models"]["m"]["worker_list"]]


def test_reload_is_the_op_that_changes_the_service() -> None:
    assert frozenset({"reload", "split", "load", "unload"}) == MUTATING_OPS


def test_a_sender_that_is_no_admin_is_refused_reload_before_it_is_judged() -> None:
    c = controls()
    ok, (code, message) = answer(c, "reload", admin=False)
    assert not ok and code == ErrorCode.FORBIDDEN
    assert message == "reload changes the service: it needs a key in the broker's --curve-admins"
    ok, (code, _) = answer(c, "reload", admin=False, model=None)  # not bad_request: not judged
    assert not ok and code == ErrorCode.FORBIDDEN
    assert answer(c, "reload", admin=True) == (True, {"model": "m", "replaced": 1, "workers": 1})


def test_a_sender_that_is_no_admin_reads_stats_without_worker_pids_and_metadata_as_is() -> None:
    c = controls()
    assert worker_names(c, admin=True) == ["m/gpu0/pid42/id00ab"]
    assert worker_names(c, admin=False) == ["m/gpu0/id00ab"]
    ok, meta = answer(c, "metadata", admin=False)
    assert ok and meta == answer(c, "metadata", admin=True)[1] and meta["name"] == "m"
    ok, (code, _) = answer(c, "nonsense", admin=False)  # an unknown op is still bad_request
    assert not ok and code == ErrorCode.BAD_REQUEST
