"""Reliability: real processes, real faults (SIGKILL, SIGSTOP, start-up crashes, broker
restarts, SIGTERM), and the client-facing guarantees around them.

The guarantee checked throughout: every request a client sent gets exactly one reply,
its result or an explicit error code, whatever happens to the workers. The heartbeat
is 250 ms (x 3 liveness) here to keep the tests fast; benchmarks/reliability.py
measures the same faults with the defaults (500 ms x 3).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq

from batcher.client.sync import (
    BatcherError,
    Cancelled,
    Client,
    ClientTimeout,
    DeadlineExceeded,
)
from batcher.serve.launcher import free_tcp_address
from tests.helpers import (
    FAST_SIM,
    HEARTBEAT,
    broker_stats,
    model_stats,
    pack,
    recv_replies,
    recv_reply,
    start_broker,
    unpack,
    wait_until,
)
from tests.reliability_models import (
    MARKS_ENV,
    DealerLoad,
    LoggedServe,
    in_flight_on,
    read_marks,
    stop_inside_a_batch,
)

pytestmark = pytest.mark.integration

SLEEPY = "sleepy=tests.reliability_models:Sleepy"
BROKEN = "tests.reliability_models:CrashAtStartup"


def check_exactly_once(load: DealerLoad, allowed_errors: set[str]) -> dict[str, Any]:
    """Every request sent got exactly one reply, its own result or an allowed error code."""
    summary = load.summary()
    assert not load.foreign, f"replies to ids never sent on that socket: {load.foreign[:5]}"
    twice = {t: r for t, r in load.replies.items() if len(r) > 1}
    assert not twice, f"{len(twice)} requests answered more than once: {list(twice.items())[:3]}"
    lost = sorted(load.outstanding())
    assert not lost, f"{len(lost)} requests never answered: {lost[:10]}"
    assert summary["wrong"] == 0, f"results for other requests: {summary}"
    assert set(summary["errors"]) <= allowed_errors, summary
    return summary


@pytest.fixture
def served(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., LoggedServe]]:
    """Factory: `served(*args, workers=N)` starts `batcher serve ARGS` (log level INFO, its
    log in a file) and waits for N workers. Teardown SIGCONTs and stops its process group;
    on failure the log is printed."""
    started: list[LoggedServe] = []

    def start(*args: str, workers: int, timeout_s: float = 30.0) -> LoggedServe:
        s = LoggedServe(args, tmp_path / f"serve-{len(started)}.log")
        started.append(s)
        return s.start(workers, timeout_s=timeout_s)

    yield start
    for s in started:
        s.stop(timeout_s=5.0)
    if any(getattr(getattr(request.node, f"rep_{w}", None), "failed", False) for w in ("setup", "call")):
        for s in started:
            print(f"----- log of {' '.join(s.sp.command())}\n{s.log()}")


@pytest.fixture
def marks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The file the Sleepy workers of this test write their batch marks to."""
    path = tmp_path / "marks.jsonl"
    monkeypatch.setenv(MARKS_ENV, str(path))
    return path


# --- worker faults ----------------------------------------------------------------------------------


def test_sigkill_worker_under_load_every_request_answered_once_and_worker_respawned(served, marks, zctx):
    s = served(
        "--workers", "2", "--model", SLEEPY, *HEARTBEAT, "--max-batch-size", "4", "--max-wait-ms", "2",
        workers=2,
    )  # fmt: skip
    before = s.worker_pids()
    assert len(before) == 2, before
    victim = min(before)
    load = DealerLoad(zctx, s.frontend, clients=3, depth=4, sleep_s=0.2)
    try:
        held = stop_inside_a_batch(marks, victim, 20, keep_going=load.step)
        os.kill(victim, signal.SIGKILL)  # a batch running on it, its reply not sent

        def respawned() -> bool:
            new = s.worker_pids() - before
            served_by_new = any(
                r[0]["ok"] and r[0]["output"]["pid"] in new for r in load.replies.values() if r
            )
            return served_by_new and model_stats(s.frontend, zctx, "sleepy").get("workers") == 2

        load.run_until(respawned, 20, "a respawned worker serving, and 2 workers in stats")
        load.drain(15)
    finally:
        load.close()

    summary = check_exactly_once(load, allowed_errors={"worker_failed"})
    assert summary["ok"] >= 12, summary
    for tag in held["tags"]:  # the batch the victim held was re-dispatched to another worker
        reply = load.replies[tag][0]
        assert reply["ok"] and reply["output"]["pid"] != victim, reply
    stats = broker_stats(s.frontend, zctx, timeout_s=5)
    assert stats["workers_lost"] == 1, stats  # the victim, and no other
    assert stats["batches_retried"] >= 1, stats  # at least the batch it was running
    log = s.log()
    # serve saw its process exit and told the broker (or the broker found it first: its
    # silence, or the failed send of its next batch).
    assert "taken for dead" in log or "unreachable" in log, log
    assert "respawning in" in log and f"(pid {victim}) exited with code -9" in log, log


def test_serve_tells_its_broker_at_once_when_a_worker_process_exits(served, marks, zctx):
    """With a 10 s heartbeat the broker would notice a killed worker only at its next
    heartbeat to it (up to 10 s) or after 30 s of silence; serve sees the process exit
    within its 0.2 s supervision tick and tells the broker, which re-sends the batch."""
    s = served(
        "--workers", "2", "--model", SLEEPY, "--heartbeat-ms", "10000", "--max-batch-size", "1",
        workers=2,
    )  # fmt: skip
    victim = min(s.worker_pids())
    load = DealerLoad(zctx, s.frontend, clients=2, depth=2, sleep_s=0.2)
    try:
        held = stop_inside_a_batch(marks, victim, 20, keep_going=load.step)
        os.kill(victim, signal.SIGKILL)
        load.run_until(
            lambda: all(load.replies.get(tag) for tag in held["tags"]), 30, "the victim's batch answered"
        )
        load.drain(30)
    finally:
        load.close()
    for tag in held["tags"]:
        reply = load.replies[tag][0]
        assert reply["ok"] and reply["output"]["pid"] != victim, reply
    check_exactly_once(load, allowed_errors=set())
    log = s.log()
    assert "its process exited with code -9: taken for dead" in log, log
    stats = broker_stats(s.frontend, zctx, timeout_s=5)
    assert stats["workers_lost"] == 1 and stats["batches_retried"] >= 1, stats  # running + prefetched


def one_sleepy_batch(
    served: Callable[..., LoggedServe], marks: Path, connect: Callable[..., Any], prefix: str
) -> tuple[LoggedServe, Any, list[str], dict[str, Any]]:
    """serve with 2 Sleepy workers (heartbeat 250 ms x 3), a DEALER, and one full batch of 4
    requests of 1 s each, tagged `prefix`0..3, once a worker has begun it: (serve, the
    DEALER, the tags, the batch's start mark)."""
    s = served(
        "--workers", "2", "--model", SLEEPY, *HEARTBEAT,
        "--max-batch-size", "4", "--policy", "window", "--max-wait-ms", "2000",
        workers=2,
    )  # fmt: skip
    sock = connect(zmq.DEALER, s.frontend)
    tags = [f"{prefix}{i}" for i in range(4)]
    for tag in tags:  # one full batch: it goes to one worker at once
        sock.send_multipart([b"", pack({"id": tag, "input": {"tag": tag, "sleep": 1.0}})])
    started = wait_until(
        lambda: next((m for m in read_marks(marks) if m["event"] == "start"), None), 10, "the batch started"
    )
    return s, sock, tags, started


def test_sigstop_worker_past_liveness_batch_redispatched_then_it_rejoins_without_duplicates(
    served, marks, zctx, connect
):
    s, sock, tags, started = one_sleepy_batch(served, marks, connect, "s")
    victim = started["pid"]
    try:
        held = stop_inside_a_batch(marks, victim, 10)
        assert sorted(held["tags"]) == tags, held
        replies = [recv_reply(sock, timeout_s=10) for _ in tags]
        assert sorted(r["id"] for r in replies) == tags, replies
        for reply in replies:
            assert reply["ok"] and reply["output"]["pid"] != victim, f"not re-dispatched: {reply}"
        stats = broker_stats(s.frontend, zctx, timeout_s=5)
        assert stats["models"]["sleepy"]["workers"] == 1, f"the stopped worker still counted: {stats}"
        assert stats["workers_lost"] == 1 and stats["batches_retried"] >= 1, stats  # running + prefetched
    finally:
        os.kill(victim, signal.SIGCONT)

    # The stopped worker finishes its batch late; the broker drops that reply, and the
    # worker, told DISCONNECT, announces itself again (same process, new connection).
    wait_until(
        lambda: any(m["event"] == "end" and m["pid"] == victim for m in read_marks(marks)), 10, "late end"
    )
    wait_until(lambda: model_stats(s.frontend, zctx, "sleepy").get("workers") == 2, 10, "the worker rejoined")
    assert victim in s.worker_pids(), "the stopped worker was replaced rather than rejoining"
    stats = broker_stats(s.frontend, zctx, timeout_s=5)
    assert stats["workers_lost"] == 1, f"rejoining counted as a second loss: {stats}"
    assert stats["dropped_backend_messages"] >= 1, f"its late reply was not dropped: {stats}"
    # A barrier on the same socket: a duplicate forwarded before it would arrive first.
    sock.send_multipart([b"", pack({"id": "barrier", "op": "stats"})])
    barrier = recv_reply(sock)
    assert barrier["id"] == "barrier", f"a second reply reached the client: {barrier}"
    # The rejoined worker serves again: a full batch goes to the least recently used worker.
    after = [f"after{i}" for i in range(4)]
    for tag in after:
        sock.send_multipart([b"", pack({"id": tag, "input": {"tag": tag}})])
    replies = [recv_reply(sock) for _ in after]
    assert sorted(r["id"] for r in replies) == after, replies
    assert all(r["ok"] and r["output"]["pid"] == victim for r in replies), replies
    assert "taken for dead" in s.log()


def test_serve_stopped_whole_past_liveness_goes_on_after_sigcont_with_nothing_taken_for_dead(
    served, marks, zctx, connect
):
    """SIGSTOP serve's whole process group (broker and workers: `docker pause`, a suspended
    VM) for 8 x the liveness while a batch runs, then SIGCONT: neither side takes the
    other's silence for a death (none of them ran meanwhile), so the batch is answered by
    the worker that held it, with no retry, and both workers stay as they were."""
    s, sock, tags, started = one_sleepy_batch(served, marks, connect, "p")
    pids = s.worker_pids()
    group = s.group_alive()
    os.killpg(s.pid, signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        wait_until(
            lambda: all(psutil.Process(p).status() == psutil.STATUS_STOPPED for p in group), 5, "stopped"
        )
        assert in_flight_on(marks, started["pid"]), "the batch ended before the stop landed"
        time.sleep(max(0.0, stopped_at + 6.0 - time.monotonic()))  # the fault: 8 x 750 ms of liveness
    finally:
        os.killpg(s.pid, signal.SIGCONT)
    replies = [recv_reply(sock, timeout_s=10) for _ in tags]
    assert sorted(r["id"] for r in replies) == tags, replies
    assert all(r["ok"] and r["output"]["pid"] == started["pid"] for r in replies), replies
    stats = broker_stats(s.frontend, zctx, timeout_s=5)
    lost = {k: stats[k] for k in ("workers_lost", "batches_retried", "batches_timed_out")}
    assert lost == {"workers_lost": 0, "batches_retried": 0, "batches_timed_out": 0}, stats
    assert stats["models"]["sleepy"]["workers"] == 2, stats
    assert s.worker_pids() == pids, "a worker was replaced"
    log = s.log()
    assert "the broker did not run for" in log and "lost the broker" not in log, log


def test_worker_dying_at_startup_is_given_up_after_5_attempts_and_serve_serves_on(served, zctx):
    s = served("--gpus", "0,1", "--workers", "1", "--model", "sim", "--model", BROKEN, *FAST_SIM, workers=1)
    crash = "simulated crash loading the weights for gpu 1"
    with Client(s.frontend, timeout_s=10, context=zctx) as c:
        served_meanwhile = 0
        served_after_crash: set[int] = set()  # crashes so far, at each request served
        deadline = time.monotonic() + 40
        while "giving up" not in (log := s.log()):  # 5 starts, 0.5 + 1 + 2 + 4 s apart
            assert time.monotonic() < deadline, "serve never gave up on the broken worker"
            assert c.request(served_meanwhile)["echo"] == served_meanwhile
            served_meanwhile += 1
            served_after_crash.add(log.count(crash))
        # served all along: after each of the first 4 crashes, before the next start failed
        assert {1, 2, 3, 4} <= served_after_crash, served_after_crash
        log = s.log()
        broken = f"worker for model {BROKEN} on gpu 1"
        assert log.count(crash) == 5, log
        assert log.count(f"started {broken} (pid") == 5, log
        assert log.count("exited with code 3 after") == 4, log  # and 4 respawns
        assert f"{broken} died 5 times in a row" in log and "giving up on it" in log, log
        assert s.process.poll() is None, "serve exited"
        assert c.request("still")["echo"] == "still"
        models = c.control("stats")["models"]
        assert models["sim"]["workers"] == 1 and models[BROKEN]["workers"] == 0, models
        with pytest.raises(BatcherError) as nobody:  # an explicit answer, not a hang
            c.request("x", model=BROKEN, timeout_ms=200)
        assert nobody.value.code in ("worker_failed", "deadline_exceeded"), nobody.value
    assert len(s.worker_pids()) == 1


def test_requests_for_a_named_model_whose_workers_were_given_up_are_refused(served, zctx):
    s = served("--workers", "1", "--model", "sim", "--model", f"broken={BROKEN}", *FAST_SIM, workers=1)
    wait_until(lambda: "giving up" in s.log(), 40, "serve gave up", interval_s=0.1, error=RuntimeError)
    with Client(s.frontend, timeout_s=3, context=zctx) as c:
        reply = c.submit("x", model="broken").wait()
    assert reply["error"]["code"] == "worker_failed", f"expected worker_failed, got {reply}"


# --- shutdown -----------------------------------------------------------------------------------------


def test_sigterm_drains_queued_and_running_requests_then_serve_exits_0(served, zctx, connect):
    s = served(
        "--workers", "1", "--model", SLEEPY, "--max-batch-size", "2", "--policy", "window",
        "--max-wait-ms", "10000",
        workers=1,
    )  # fmt: skip
    sock = connect(zmq.DEALER, s.frontend)
    late = connect(zmq.DEALER, s.frontend)
    for i in range(6):  # 3 batches of 2, 0.3 s each: running or held by the worker, or queued
        sock.send_multipart([b"", pack({"id": i, "input": {"tag": i, "sleep": 0.3}})])
    wait_until(
        lambda: (
            (m := model_stats(s.frontend, zctx, "sleepy")).get("batches_in_flight")
            and m["queued"] + 2 * m["batches_in_flight"] == 6
            and m["queued"] > 0
        ),
        10,
        "all six with the broker, some still queued",
    )
    worker_pids = s.worker_pids()
    signalled = time.monotonic()
    os.kill(s.pid, signal.SIGTERM)
    wait_until(lambda: broker_stats(s.frontend, zctx).get("stopping"), 5, "draining")
    late.send_multipart([b"", pack({"id": "late", "input": {"tag": "late"}})])
    refused = recv_reply(late)
    assert refused["id"] == "late" and refused["error"]["code"] == "shutting_down", refused

    replies = {}
    for _ in range(6):
        reply = recv_reply(sock)
        assert reply["id"] not in replies, f"second reply: {reply}"
        replies[reply["id"]] = reply
    for i in range(6):
        assert replies[i]["ok"] and replies[i]["output"]["input"]["tag"] == i, replies[i]
    # The drain ends when the work does (0.9 s of it), not when the broker's 10 s grace runs out.
    with contextlib.suppress(subprocess.TimeoutExpired):
        s.process.wait(timeout=max(0.0, signalled + 9.0 - time.monotonic()))
    assert s.process.returncode == 0, f"serve: {s.process.returncode} 9 s after SIGTERM (None: running)"
    assert not s.group_alive(), f"left running: {s.group_alive()} (workers were {worker_pids})"


def test_second_sigterm_stops_serve_at_once_answering_everything(served, marks, zctx, connect):
    s = served(
        "--workers", "1", "--model", SLEEPY, "--max-batch-size", "2", "--policy", "window",
        "--max-wait-ms", "10000",
        workers=1,
    )  # fmt: skip
    sock = connect(zmq.DEALER, s.frontend)
    for i in range(4):  # two batches of 2, each would run 30 s
        sock.send_multipart([b"", pack({"id": i, "input": {"tag": i, "sleep": 30}})])
    # The model's own start mark, not the broker's batches_in_flight: the broker counts a batch
    # once sent, and a SIGTERM before the worker read it left no mark at all (a CI failure).
    wait_until(lambda: read_marks(marks), 10, "a batch running", error=RuntimeError)
    os.kill(s.pid, signal.SIGTERM)
    wait_until(lambda: broker_stats(s.frontend, zctx).get("stopping"), 5, "draining", error=RuntimeError)
    os.kill(s.pid, signal.SIGTERM)
    codes = sorted(recv_reply(sock, timeout_s=5)["error"]["code"] for _ in range(4))
    assert codes == ["shutting_down"] * 4, codes
    # At once: well within the 30 s the running batch would need (exiting takes well under 2 s).
    with contextlib.suppress(subprocess.TimeoutExpired):
        s.process.wait(timeout=20)
    assert s.process.returncode is not None, "serve still running 20 s after the second SIGTERM"
    assert not s.group_alive(), f"left running: {s.group_alive()}"
    ended = [m for m in read_marks(marks) if m["event"] == "end"]
    assert read_marks(marks) and not ended, f"serve waited for a batch to end: {ended}"


# --- broker restart -------------------------------------------------------------------------------------


def test_broker_restart_worker_rejoins_by_itself_and_retrying_client_gets_every_result(spawn, zctx):
    frontend, backend = free_tcp_address(), free_tcp_address()
    broker_args = ("broker", "--frontend", frontend, "--backend", backend, "--model", "sim", *HEARTBEAT,
                   "--max-batch-size", "4", "--max-wait-ms", "2")  # fmt: skip
    first_broker = spawn(*broker_args)
    worker = spawn("worker", "--connect", backend, "--model", "sim", *HEARTBEAT,
                   "--sim-base-ms", "150", "--sim-per-item-ms", "0")  # fmt: skip
    wait_until(lambda: model_stats(frontend, zctx, "sim").get("workers") == 1, 20, "the worker joined")

    with Client(frontend, timeout_s=2.0, retries=2, context=zctx) as c:
        before = [c.submit(f"before-{i}") for i in range(6)]
        wait_until(
            lambda: model_stats(frontend, zctx, "sim").get("batches_in_flight"), 5, "a batch in flight"
        )
        os.kill(first_broker.pid, signal.SIGKILL)
        first_broker.process.wait(timeout=5)
        during = [c.submit(f"during-{i}") for i in range(6)]  # no broker at all
        spawn(*broker_args)
        wait_until(lambda: model_stats(frontend, zctx, "sim").get("workers") == 1, 20, "the worker rejoined")
        assert worker.process.poll() is None, "the worker exited instead of reconnecting"
        after = [c.submit(f"after-{i}") for i in range(6)]
        for p in before + during + after:
            reply = p.wait()
            sent = unpack(p.body)["input"]
            assert reply["ok"] and reply["output"]["echo"] == sent, reply
            assert reply["worker"].endswith(f"/{worker.pid}"), reply
    worker_log = worker.stderr_path.read_text()
    assert "lost the broker" in worker_log or "does not know us" in worker_log, worker_log


def test_reply_for_a_dead_brokers_batch_is_never_delivered_to_the_new_brokers_clients(
    spawn, zctx, connect, tmp_path
):
    marks = tmp_path / "marks.jsonl"
    frontend, backend = free_tcp_address(), free_tcp_address()
    broker_args = ("broker", "--frontend", frontend, "--backend", backend, "--model", SLEEPY, *HEARTBEAT)
    first_broker = spawn(*broker_args)
    spawn("worker", "--connect", backend, "--model", SLEEPY, *HEARTBEAT, env={MARKS_ENV: str(marks)})

    def joined() -> bool:
        return model_stats(frontend, zctx, "sleepy").get("workers") == 1

    wait_until(joined, 20, "the worker joined", error=RuntimeError)
    old_client = connect(zmq.DEALER, frontend)
    old_client.send_multipart([b"", pack({"id": 1, "input": {"tag": "old client's", "sleep": 3.0}})])
    wait_until(lambda: read_marks(marks), 10, "the old broker's batch 1 started", error=RuntimeError)
    os.kill(first_broker.pid, signal.SIGKILL)
    first_broker.process.wait(timeout=5)
    spawn(*broker_args)
    # The worker's socket reconnects to the new broker while the old batch still runs, and
    # the old batch's REPLY goes out on it when the model returns; the new broker must not
    # take it for one of its own batches.
    assert len(read_marks(marks)) == 1, "the old batch should still be running"

    new_client = connect(zmq.DEALER, frontend)  # queued until the worker (re)joins
    new_client.send_multipart([b"", pack({"id": 1, "input": {"tag": "new client's"}})])
    reply = recv_reply(new_client, timeout_s=10)
    assert reply["ok"] and reply["output"]["input"]["tag"] == "new client's", (
        f"the new client got another client's result: {reply}"
    )


# --- the client's own timeout and retries -------------------------------------------------------------


def test_client_without_broker_raises_client_timeout_within_its_timeout(zctx):
    address = free_tcp_address()  # nothing listens there
    with Client(address, timeout_s=0.5, context=zctx) as c:
        started = time.monotonic()
        with pytest.raises(ClientTimeout) as err:
            c.request("x")
        took = time.monotonic() - started
        assert 0.5 <= took < 5.0, took  # never before its timeout; the bound: tenfold slack
        assert err.value.code == "timeout" and "after 1 attempt(s)" in err.value.message
    with Client(address, timeout_s=0.3, retries=2, context=zctx) as c:
        started = time.monotonic()
        with pytest.raises(ClientTimeout) as err:
            c.request("x")
        took = time.monotonic() - started
        assert 0.9 <= took < 9.0, took  # 3 attempts of 0.3 s each, in full
        assert "after 3 attempt(s)" in err.value.message


def broker_without_workers(spawn: Callable[..., Any], zctx: zmq.Context[Any], *args: str) -> tuple[str, str]:
    """`batcher broker` for model sim with no worker, once it answers; (frontend, backend)."""
    return start_broker(spawn, zctx, "--model", "sim", *args)


def test_client_retries_resend_and_duplicates_are_dropped(spawn, zctx):
    frontend, _ = broker_without_workers(spawn, zctx)
    with Client(frontend, timeout_s=1.0, retries=2, context=zctx) as c:
        started = time.monotonic()
        # Re-sent at 1 and 2 s; the first copy's deadline (2.5 s) answers it before the client
        # would give up (3 s): DeadlineExceeded, not ClientTimeout. The two later copies
        # expire too (3.5 and 4.5 s), and their replies are dropped.
        with pytest.raises(DeadlineExceeded):
            c.submit("x", timeout_ms=2500).result()
        assert time.monotonic() - started >= 2.5, "answered before its deadline"
        wait_until(
            lambda: c.control("stats")["models"]["sim"]["outcomes"].get("deadline_exceeded") == 3,
            15,
            "all three copies expired at the broker",
        )
        assert c.control("stats")["models"]["sim"]["outcomes"] == {"deadline_exceeded": 3}
        assert c.duplicates_dropped == 2


def test_cancel_a_queued_request(spawn, zctx):
    frontend, backend = broker_without_workers(spawn, zctx)
    with Client(frontend, timeout_s=20, context=zctx) as c:
        keep = c.submit("keep")
        drop = c.submit("drop")
        wait_until(lambda: c.control("stats")["models"]["sim"]["queued"] == 2, 5, "both queued")
        drop.cancel()
        with pytest.raises(Cancelled):
            drop.result()
        sim = c.control("stats")["models"]["sim"]
        assert sim["queued"] == 1 and sim["outcomes"] == {"cancelled": 1}, sim
        assert not keep.done()
        spawn("worker", "--connect", backend, "--model", "sim", *FAST_SIM)
        assert keep.result()["echo"] == "keep"  # only the cancelled one was dropped


def test_deadlines_end_to_end_and_default_timeout(spawn, zctx):
    frontend, _ = broker_without_workers(spawn, zctx, "--default-timeout-ms", "300")
    with Client(frontend, timeout_s=5, context=zctx) as c:
        # Answered by the broker (DeadlineExceeded, not the client's own 5 s ClientTimeout),
        # never before the deadline; the upper bound only with tenfold slack.
        for timeout_ms, deadline_s in ((None, 0.3), (100, 0.1), (600, 0.6)):
            started = time.monotonic()
            with pytest.raises(DeadlineExceeded):
                c.request("queued", timeout_ms=timeout_ms)
            took = time.monotonic() - started
            assert deadline_s <= took < 10 * deadline_s, f"timeout_ms {timeout_ms}: after {took:.2f}s"
        assert c.control("stats")["models"]["sim"]["outcomes"] == {"deadline_exceeded": 3}


def test_overload_refuses_the_11th_and_loses_none_of_the_first_10(spawn, zctx, connect):
    frontend, backend = broker_without_workers(spawn, zctx, "--max-queue", "10", "--max-wait-ms", "1")
    sock = connect(zmq.DEALER, frontend)
    for i in range(11):
        sock.send_multipart([b"", pack({"id": i, "input": i})])
    refused = recv_reply(sock)
    assert refused["id"] == 10 and refused["error"]["code"] == "overloaded", refused
    sock.send_multipart([b"", pack({"id": "barrier", "op": "stats"})])
    stats = recv_reply(sock)
    assert stats["id"] == "barrier", f"a queued request was answered with no worker: {stats}"
    sim = stats["output"]["models"]["sim"]
    assert sim["queued"] == 10 and sim["outcomes"] == {"overloaded": 1}, sim

    spawn("worker", "--connect", backend, "--model", "sim", *FAST_SIM)  # now the queue can drain
    replies: dict[int, dict[str, Any]] = {}
    while len(replies) < 10:
        reply = recv_reply(sock, timeout_s=20)
        assert reply["id"] not in replies, f"second reply: {reply}"
        replies[reply["id"]] = reply
    assert sorted(replies) == list(range(10))
    for i, reply in replies.items():
        assert reply["ok"] and reply["output"]["echo"] == i, reply


# --- a hung model: the batch time limit (issue 14) ---------------------------------------------------

HANG = "hangs=tests.fixture_models:hang_on"


def test_a_poison_request_takes_down_at_most_max_retries_plus_one_workers_and_its_mates_are_served(
    served, zctx, connect
):
    """A batch of 4 holding one request on which the model hangs (its heartbeats go on):
    past --batch-timeout-ms 1000 its worker is killed by serve and respawned, and the four
    are retried each alone. The three others are served; the poison hangs a second worker
    and, its retries (--max-retries 1) used, is answered worker_failed naming the limit.
    Meanwhile requests on the other worker are served."""
    s = served(
        "--workers", "2", "--model", HANG, "--batch-timeout-ms", "1000", "--max-retries", "1",
        "--max-batch-size", "4", "--max-wait-ms", "100", "--policy", "window",
        workers=2,
    )  # fmt: skip
    before = s.worker_pids()
    sock = connect(zmq.DEALER, s.frontend)
    for i, x in enumerate(["a", "hang", "b", "c"]):
        sock.send_multipart([b"", pack({"id": i, "model": "hangs", "input": x})])
    wait_until(lambda: model_stats(s.frontend, zctx, "hangs").get("busy_workers") == 1, 10, "the batch out")
    for i in range(4, 8):  # while that batch hangs, other requests go to the other worker
        sock.send_multipart([b"", pack({"id": i, "model": "hangs", "input": f"x{i}"})])
    received = recv_replies(sock, 8, timeout_s=60)
    replies = {r["id"]: r for r in received}
    assert [r["id"] for r in received][:4] == [4, 5, 6, 7]  # served long before the retries end
    assert all(replies[i]["output"]["input"] == f"x{i}" for i in range(4, 8))
    assert [replies[i]["output"]["input"] for i in (0, 2, 3)] == ["a", "b", "c"]
    assert all(replies[i]["batch_size"] == 1 for i in (0, 2, 3))  # retried alone
    assert replies[1]["error"] == {
        "code": "worker_failed",
        "message": "its batch ran past the time limit of 1000 ms (--batch-timeout-ms)",
    }
    stats = broker_stats(s.frontend, zctx, timeout_s=5)
    assert stats["batches_timed_out"] == 2 and stats["workers_lost"] == 2, stats  # max_retries + 1
    wait_until(lambda: model_stats(s.frontend, zctx, "hangs").get("workers") == 2, 30, "respawned")
    assert len(s.worker_pids() - before) == 2  # both hung ones replaced
    assert "its model hung" in s.log()


# --- a request that crashes its worker (issue 28, items 7 and 8) ------------------------------------

CRASH = "crash=tests.fixture_models:crash"


def test_a_request_that_kills_its_worker_fails_alone_and_its_batch_mates_are_served(served, zctx, connect):
    """A batch of 4 holding one request on which the model kills its process (os._exit, as
    a segfault would): the four are retried each alone, so the three others are served;
    the poison kills a second worker and, its retry used (--max-retries 1), is answered
    worker_failed. Both workers are respawned: a death after joining is no failed start."""
    s = served(
        "--workers", "2", "--model", CRASH, *HEARTBEAT, "--max-retries", "1",
        "--max-batch-size", "4", "--max-wait-ms", "100", "--policy", "window",
        workers=2,
    )  # fmt: skip
    before = s.worker_pids()
    sock = connect(zmq.DEALER, s.frontend)
    for i, x in enumerate(["a", "crash", "b", "c"]):
        sock.send_multipart([b"", pack({"id": i, "model": "crash", "input": x})])
    replies = {r["id"]: r for r in recv_replies(sock, 4, timeout_s=60)}
    assert [replies[i].get("output") for i in (0, 2, 3)] == ["a", "b", "c"], replies
    assert all(replies[i]["batch_size"] == 1 for i in (0, 2, 3))  # retried alone
    poison = replies[1]["error"]
    assert poison["code"] == "worker_failed", poison
    assert "exited with code 3" in poison["message"] or "disconnected" in poison["message"], poison
    assert broker_stats(s.frontend, zctx, timeout_s=5)["workers_lost"] == 2  # max_retries + 1
    wait_until(lambda: model_stats(s.frontend, zctx, "crash").get("workers") == 2, 30, "both respawned")
    assert len(s.worker_pids() - before) == 2


def test_requests_that_crash_their_worker_never_make_serve_give_up_on_the_model(served, zctx, connect):
    """One worker; three crashing requests cost it six deaths, each a second or two after
    its start (the give-up rule counts five deaths in a row within 10 s of a start). The
    worker had joined the broker each time, so these are no failed starts: it is respawned
    every time, each poison gets worker_failed, and a well-formed request is served after."""
    s = served("--workers", "1", "--model", CRASH, *HEARTBEAT, "--max-retries", "1", workers=1)
    sock = connect(zmq.DEALER, s.frontend)
    for i in range(3):
        sock.send_multipart([b"", pack({"id": i, "model": "crash", "input": "crash"})])
        reply = recv_reply(sock, timeout_s=60)
        assert reply["id"] == i and reply["error"]["code"] == "worker_failed", reply
        assert "failed to start" not in reply["error"]["message"], reply
    sock.send_multipart([b"", pack({"id": "fine", "model": "crash", "input": "fine"})])
    reply = recv_reply(sock, timeout_s=60)
    assert reply.get("output") == "fine", reply
    assert broker_stats(s.frontend, zctx, timeout_s=5)["workers_lost"] == 6
    assert "giving up on it" not in s.log()


# hang_on runs on the main thread (told to exit by the heartbeat thread), NoGil on the
# worker's model thread (told to exit by the main thread, free meanwhile)
@pytest.mark.parametrize(
    ("model", "poison"),
    [(HANG, "hang"), ("hangs=tests.fixture_models:NoGil", {"i": 1, "sleep": 3600})],
    ids=["main-thread", "model-thread"],
)
def test_a_remote_worker_whose_batch_hangs_is_told_to_exit(spawn, zctx, connect, model, poison):
    frontend, backend = start_broker(spawn, zctx, "--model", "hangs", "--batch-timeout-ms", "300")
    hung = spawn("worker", "--connect", backend, "--model", model)
    wait_until(lambda: model_stats(frontend, zctx, "hangs").get("workers") == 1, 30, "the worker joined")
    sock = connect(zmq.DEALER, frontend)
    sock.send_multipart([b"", pack({"id": 1, "model": "hangs", "input": poison})])
    assert hung.process.wait(timeout=30) == 75  # told to exit
    assert "the broker took a batch of ours for hung" in hung.stderr_path.read_text()
    spare = spawn("worker", "--connect", backend, "--model", model)  # the request is retried on it...
    (reply,) = recv_replies(sock, 1, timeout_s=30)
    assert reply["error"] == {  # ...hangs it too, and has used its one retry (--max-retries 1)
        "code": "worker_failed",
        "message": "its batch ran past the time limit of 300 ms (--batch-timeout-ms)",
    }
    assert spare.process.wait(timeout=30) == 75
    assert broker_stats(frontend, zctx, timeout_s=5)["batches_timed_out"] == 2
