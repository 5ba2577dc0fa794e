"""The chaos test: one run, every fault in turn, under steady load from several clients.

SIGKILL a worker, then another, SIGSTOP a third past its liveness, then restart the
broker. While the broker lives, every request gets exactly one reply (its result or an
explicit error code, never two, never another request's). Across the broker restart,
every client call returns a result or raises a typed error and none hangs; with retries
on, every call gets its result.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pytest

from batcher.client import BatcherError, Client
from batcher.launcher import free_tcp_address
from tests.helpers import HEARTBEAT, model_stats, wait_until
from tests.reliability_models import DealerLoad

pytestmark = pytest.mark.integration

WORKERS = 4
SIM = ("--model", "sim", "--sim-base-ms", "5", "--sim-per-item-ms", "0.5")


def _calls(client: Client, prefix: str, count: int, out: list[Any]) -> None:
    """`count` requests one after another; each outcome (output or typed error) recorded."""
    for i in range(count):
        try:
            out.append(client.request({"tag": f"{prefix}-{i}"}))
        except BatcherError as exc:
            out.append(exc)


def test_chaos_kill_kill_stop_then_broker_restart(spawn, zctx) -> None:  # type: ignore[no-untyped-def]
    frontend, backend = free_tcp_address(), free_tcp_address()
    broker_args = ("broker", "--frontend", frontend, "--backend", backend, "--model", "sim", *HEARTBEAT)
    broker = spawn(*broker_args)
    workers = [spawn("worker", "--connect", backend, *SIM, *HEARTBEAT) for _ in range(WORKERS)]
    wait_until(lambda: model_stats(frontend, zctx, "sim").get("workers") == WORKERS, 30, "workers joined")

    # Phase 1: faults of workers while the broker lives; count every reply of every request.
    load = DealerLoad(zctx, frontend, clients=4, depth=8)
    try:
        load.run_for(0.5)
        os.kill(workers[0].pid, signal.SIGKILL)
        load.run_for(0.5)
        os.kill(workers[1].pid, signal.SIGKILL)
        load.run_for(0.5)
        os.kill(workers[2].pid, signal.SIGSTOP)
        load.run_for(1.0)  # more than 3 x 100 ms of silence: taken for dead, its batch re-sent
        os.kill(workers[2].pid, signal.SIGCONT)
        load.run_for(0.5)
        assert load.drain(15), f"requests without a reply: {sorted(load.outstanding())[:5]}"
        summary = load.summary()
    finally:
        load.close()
    assert summary["sent"] > 200, summary  # the load was steady, not a trickle
    assert summary["lost"] == 0 and summary["duplicated"] == 0, summary
    assert summary["wrong"] == 0 and summary["foreign"] == 0, summary
    assert summary["ok"] + sum(summary["errors"].values()) == summary["sent"], summary
    assert set(summary["errors"]) <= {"worker_failed"}, summary  # explicit codes only

    # Phase 2: the broker is killed and restarted on the same addresses under client calls.
    plain_results: list[Any] = []
    retried_results: list[Any] = []
    with (
        Client(frontend, timeout_s=1.0, context=zctx) as plain,
        Client(frontend, timeout_s=1.0, retries=5, context=zctx) as retrying,
    ):
        threads = [
            threading.Thread(target=_calls, args=(plain, "plain", 40, plain_results)),
            threading.Thread(target=_calls, args=(retrying, "retried", 40, retried_results)),
        ]
        for t in threads:
            t.start()
        # the broker dies while calls are flowing
        wait_until(lambda: len(plain_results) >= 3 and len(retried_results) >= 3, 10, "calls answered")
        os.kill(broker.pid, signal.SIGKILL)
        broker.process.wait(timeout=5)
        spawn(*broker_args)
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a client call hung across the restart"

    assert len(plain_results) == 40  # every call returned: a result or a typed error
    assert all(isinstance(r, dict | BatcherError) for r in plain_results), plain_results
    assert len(retried_results) == 40
    failures = [r for r in retried_results if isinstance(r, BatcherError)]
    assert not failures, failures
    assert [r["echo"]["tag"] for r in retried_results] == [f"retried-{i}" for i in range(40)]
    # the surviving workers rejoined the new broker by themselves, none restarted
    wait_until(lambda: model_stats(frontend, zctx, "sim").get("workers") == 2, 15, "workers rejoined")
    assert workers[2].process.poll() is None and workers[3].process.poll() is None
