"""The chaos test: one run, every fault in turn, under steady load from several clients.

SIGKILL a worker, then another, SIGSTOP a third past its liveness, then restart the
broker. Each worker fault is fired while that worker is inside a batch, and the broker's
`stats` must show it: one more worker lost, and the batch it held re-sent (and answered
by another worker). While the broker lives, every request gets exactly one reply (never
two, never another request's) and, since no request is caught by two faults, its own
result. Across the broker restart, every client call returns its own result or raises
a typed error and none hangs; with retries on, every call gets its result.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import zmq

from batcher.client.sync import BatcherError, Client
from batcher.serve.launcher import free_tcp_address
from tests.helpers import HEARTBEAT, broker_stats, model_stats, wait_until
from tests.reliability_models import MARKS_ENV, DealerLoad, read_marks, stop_inside_a_batch

pytestmark = pytest.mark.integration

WORKERS = 4
MODEL = "sleepy"
SLEEPY = f"{MODEL}=tests.reliability_models:Sleepy"
BATCH_S = 0.05  # each batch's run time: long enough to be caught inside


def _calls(client: Client, prefix: str, count: int, out: list[Any]) -> None:
    """`count` requests one after another; each outcome (output or typed error) recorded."""
    for i in range(count):
        try:
            out.append(client.request({"tag": f"{prefix}-{i}"}))
        except BatcherError as exc:
            out.append(exc)


def _counters(frontend: str, ctx: zmq.Context[Any]) -> tuple[int, int]:
    """(workers_lost, batches_retried) from the broker's stats."""
    stats = broker_stats(frontend, ctx, timeout_s=5)
    assert stats, "the broker did not answer stats"
    return stats["workers_lost"], stats["batches_retried"]


def _fault(
    load: DealerLoad, frontend: str, ctx: zmq.Context[Any], marks: Path, pid: int, sig: int
) -> dict[str, Any]:
    """Under load: fire `sig` (SIGKILL, or SIGSTOP left in place) at worker `pid` while it
    runs a batch; check from stats that the broker took it for dead and re-sent its batches,
    and that the batch it was running was answered by another worker. Returns with every
    request sent before the fault was detected answered, so none of them meets the next."""
    lost, retried = _counters(frontend, ctx)
    workers = model_stats(frontend, ctx, MODEL)["workers"]
    held = stop_inside_a_batch(marks, pid, 20, keep_going=load.step)
    if sig != signal.SIGSTOP:
        os.kill(pid, sig)
    load.run_until(
        lambda: model_stats(frontend, ctx, MODEL).get("workers") == workers - 1,
        10,
        f"worker {pid} taken for dead",
    )
    sent_before = set(load.sent)
    load.run_until(lambda: sent_before <= load.replies.keys(), 15, "every request sent so far answered")
    for tag in held["tags"]:
        reply = load.replies[tag][0]
        assert reply.get("ok") and reply["output"]["pid"] != pid, f"{tag} held by {pid}: {reply}"
    now_lost, now_retried = _counters(frontend, ctx)
    assert now_lost == lost + 1, f"workers_lost {lost} -> {now_lost} for one fault"
    assert now_retried >= retried + 1, f"batches_retried {retried} -> {now_retried}: its batch not re-sent"
    return held


def test_chaos_kill_kill_stop_then_broker_restart(spawn, zctx, tmp_path) -> None:  # type: ignore[no-untyped-def]
    marks = tmp_path / "marks.jsonl"
    frontend, backend = free_tcp_address(), free_tcp_address()
    broker_args = ("broker", "--frontend", frontend, "--backend", backend, "--model", SLEEPY, *HEARTBEAT)
    broker = spawn(*broker_args)
    workers = [
        spawn("worker", "--connect", backend, "--model", SLEEPY, *HEARTBEAT, env={MARKS_ENV: str(marks)})
        for _ in range(WORKERS)
    ]
    wait_until(lambda: model_stats(frontend, zctx, MODEL).get("workers") == WORKERS, 30, "workers joined")

    # Phase 1: faults of workers while the broker lives; count every reply of every request.
    load = DealerLoad(zctx, frontend, clients=4, depth=8, sleep_s=BATCH_S)
    stopped = workers[2].pid
    try:
        _fault(load, frontend, zctx, marks, workers[0].pid, signal.SIGKILL)
        _fault(load, frontend, zctx, marks, workers[1].pid, signal.SIGKILL)
        _fault(load, frontend, zctx, marks, stopped, signal.SIGSTOP)  # past 3 x 250 ms of silence
        os.kill(stopped, signal.SIGCONT)
        # It ends its batch late (the broker drops that reply), is told DISCONNECT and
        # announces itself again; then it serves requests sent after it rejoined.
        load.run_until(
            lambda: model_stats(frontend, zctx, MODEL).get("workers") == 2, 10, "the stopped worker rejoined"
        )
        sent_before = set(load.sent)
        load.run_until(
            lambda: any(
                r[0].get("ok") and r[0]["output"]["pid"] == stopped
                for t, r in load.replies.items()
                if t not in sent_before
            ),
            10,
            "the rejoined worker serving",
        )
        assert load.drain(15), f"requests without a reply: {sorted(load.outstanding())[:5]}"
        summary = load.summary()
    finally:
        load.close()
    assert summary["sent"] > 200, summary  # the load was steady, not a trickle
    assert summary["lost"] == 0 and summary["duplicated"] == 0, summary
    assert summary["wrong"] == 0 and summary["foreign"] == 0, summary
    assert summary["ok"] == summary["sent"] and not summary["errors"], summary  # none met two faults
    assert any(m["event"] == "end" and m["pid"] == stopped for m in read_marks(marks)), "no late end"
    stats = broker_stats(frontend, zctx, timeout_s=5)
    assert stats["workers_lost"] == 3, stats  # the three faults, and nothing else
    assert stats["dropped_backend_messages"] >= 1, stats  # at least the stopped worker's late reply

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
        # the broker dies while calls are flowing...
        wait_until(lambda: len(plain_results) >= 3 and len(retried_results) >= 3, 10, "calls answered")
        os.kill(broker.pid, signal.SIGKILL)
        broker.process.wait(timeout=5)
        # ...and comes back once a plain call has failed for want of it
        wait_until(
            lambda: any(isinstance(r, BatcherError) for r in list(plain_results)), 10, "a plain call failed"
        )
        spawn(*broker_args)
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a client call hung across the restart"

    # Without retries: each call its own result, or a timeout while there was no broker;
    # and the same client gets results again once the new broker is up.
    assert len(plain_results) == 40
    for i, r in enumerate(plain_results):
        if isinstance(r, BatcherError):
            assert r.code == "timeout", f"plain-{i}: {r!r}"
        else:
            assert r["input"] == {"tag": f"plain-{i}"}, f"plain-{i}: {r}"
    assert not isinstance(plain_results[-1], BatcherError), plain_results[-5:]
    # With retries: every call its own result.
    assert len(retried_results) == 40
    failures = [r for r in retried_results if isinstance(r, BatcherError)]
    assert not failures, failures
    assert [r["input"]["tag"] for r in retried_results] == [f"retried-{i}" for i in range(40)]
    # the surviving workers rejoined the new broker by themselves, none restarted
    wait_until(lambda: model_stats(frontend, zctx, MODEL).get("workers") == 2, 15, "workers rejoined")
    assert workers[2].process.poll() is None and workers[3].process.poll() is None
