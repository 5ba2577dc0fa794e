"""Regression tests for issue "Hardening v1": the worker's and the supervisor's defects
found by black-box testing, each through real processes and sockets.

1. SIGTERM/SIGINT to serve's whole process group (systemd's KillMode=control-group, a
   terminal's Ctrl-C) must act like a signal to `serve` alone: the workers keep
   serving until the broker drained, even when a respawned worker could not load its
   model within the drain's grace period.
2. `batcher worker --connect <unusable address>` must fail at once, not hang.
3. The supervisor starts at most `max_starting` worker processes at a time.
4. A malformed BATCH message never crashes the worker.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq

from batcher.serve.launcher import ServeProcess, free_tcp_address
from batcher.transport.stopping import StopSignals
from batcher.wire import protocol
from tests.helpers import FakeBackend, broker_stats, pack, recv_reply, start_broker, unpack, wait_until
from workers.exit_codes import EXIT_BAD_ADDRESS
from workers.supervisor import STARTING_S, PoolSettings, Supervisor

pytestmark = pytest.mark.integration

MARK_ENV = "BATCHER_TEST_LOADED_MARK"
SLOW = "slow=tests.integration.reliability.test_worker_defects:SlowLoad"
FIRST_LOAD_S = 1.0
#: Far past the broker's 10 s drain grace: a worker replaced during the drain is too late.
RELOAD_S = 60.0


class SlowLoad:
    """A model whose first load (per test: MARK_ENV names a file) takes FIRST_LOAD_S and
    every later one RELOAD_S, as a big model's would; a batch sleeps its longest
    input's `sleep` and returns each input with the pid that ran it."""

    def __init__(self, gpu: int | None) -> None:
        mark = Path(os.environ[MARK_ENV])
        if mark.exists():
            time.sleep(RELOAD_S)  # a respawn: the test fails if anything waits for it
        else:
            mark.touch()
            time.sleep(FIRST_LOAD_S)

    def __call__(self, inputs: list[Any]) -> list[Any]:
        time.sleep(max(float(x.get("sleep", 0.0)) for x in inputs))
        return [{"i": x["i"], "pid": os.getpid()} for x in inputs]


def group_alive(pgid: int) -> list[int]:
    """Pids of the process group still running (zombies are not)."""
    out = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
    return out


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def worker_pids(sp: ServeProcess) -> list[int]:
    assert sp.process is not None
    return [p.pid for p in psutil.Process(sp.process.pid).children()]


def model_stats(sp: ServeProcess, ctx: zmq.Context[Any], model: str) -> dict[str, Any]:
    return dict(broker_stats(sp.frontend, ctx).get("models", {}).get(model, {}))


def serve_log(sp: ServeProcess) -> str:
    return Path(sp.stderr.name).read_text(errors="replace")


@pytest.fixture
def slow_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SlowLoad's mark file for this test (inherited by serve and its workers)."""
    monkeypatch.setenv(MARK_ENV, str(tmp_path / "loaded"))


def start_slow_serve(serve: Callable[..., ServeProcess]) -> ServeProcess:
    """One SlowLoad worker; batches of 4 leave only when full, so what is queued stays queued."""
    return serve(
        "--workers", "1", "--model", SLOW, "--max-batch-size", "4", "--policy", "window",
        "--max-wait-ms", "10000",
        workers=1, timeout_s=30,
    )  # fmt: skip


# --- 1. group SIGTERM/SIGINT with a slow-loading model ------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_group_sigterm_slow_model_every_queued_request_answered_ok_and_serve_exits_0(
    serve: Callable[..., ServeProcess],
    connect: Callable[[int, str], zmq.Socket[Any]],
    zctx: zmq.Context[Any],
    slow_model: None,
    signum: int,
) -> None:
    sp = start_slow_serve(serve)
    assert sp.process is not None
    (worker,) = worker_pids(sp)
    sock = connect(zmq.DEALER, sp.frontend)
    late = connect(zmq.DEALER, sp.frontend)
    n = 24  # 6 batches of 0.15 s: two held by the worker, the rest queued
    for i in range(n):
        sock.send_multipart([b"", pack({"id": i, "input": {"i": i, "sleep": 0.15}})])
    wait_until(
        lambda: (
            (m := model_stats(sp, zctx, "slow")).get("batches_in_flight")
            and m["queued"] + 4 * m["batches_in_flight"] == n
            and m["queued"] > 0
        ),
        10,
        "every request with the broker, some still queued",
        error=RuntimeError,
    )
    signalled = time.monotonic()
    os.killpg(sp.process.pid, signum)  # serve and its worker alike, as systemd does
    wait_until(lambda: broker_stats(sp.frontend, zctx).get("stopping"), 5, "serve draining")
    late.send_multipart([b"", pack({"id": "late", "input": {"i": -1}})])
    refused = recv_reply(late, 5)
    assert refused["error"]["code"] == "shutting_down", refused

    # A worker that left on the group's signal could only be replaced by one loading for
    # RELOAD_S, past the 10 s grace: the queue would be answered shutting_down.
    replies = {}
    for _ in range(n):
        reply = recv_reply(sock, 15)
        assert reply["id"] not in replies, f"second reply: {reply}"
        replies[reply["id"]] = reply
    for i in range(n):
        assert replies[i]["ok"], replies[i]
        assert replies[i]["output"] == {"i": i, "pid": worker}, "not answered by the original worker"
    assert sp.process.wait(timeout=10) == 0
    assert time.monotonic() - signalled < 8
    assert not group_alive(sp.process.pid), "processes left after serve exited"
    assert "respawning" not in serve_log(sp)


def test_second_group_sigterm_kills_the_busy_worker_and_serve_exits_at_once(
    serve: Callable[..., ServeProcess],
    connect: Callable[[int, str], zmq.Socket[Any]],
    zctx: zmq.Context[Any],
    slow_model: None,
) -> None:
    sp = start_slow_serve(serve)
    assert sp.process is not None
    sock = connect(zmq.DEALER, sp.frontend)
    for i in range(4):  # one batch that would run 30 s
        sock.send_multipart([b"", pack({"id": i, "input": {"i": i, "sleep": 30}})])
    wait_until(
        lambda: model_stats(sp, zctx, "slow").get("batches_in_flight"),
        10,
        "batch running",
        error=RuntimeError,
    )
    os.killpg(sp.process.pid, signal.SIGTERM)
    wait_until(
        lambda: broker_stats(sp.frontend, zctx).get("stopping"), 5, "serve draining", error=RuntimeError
    )
    signalled = time.monotonic()
    os.killpg(sp.process.pid, signal.SIGTERM)
    codes = sorted(recv_reply(sock, 5)["error"]["code"] for _ in range(4))
    assert codes == ["shutting_down"] * 4, codes
    sp.process.wait(timeout=5)
    assert time.monotonic() - signalled < 3, "serve waited for the busy worker"
    assert not group_alive(sp.process.pid), "processes left after serve exited"


def test_workers_exit_at_once_when_serve_is_sigkilled(serve: Callable[..., ServeProcess]) -> None:
    # A 20 s heartbeat: a worker that only looked for its parent between heartbeats
    # would outlive serve by up to 20 s; the closed pipe tells it at once.
    sp = serve("--workers", "2", "--heartbeat-ms", "20000", "--sim-base-ms", "1", workers=2)
    assert sp.process is not None
    workers = worker_pids(sp)
    assert len(workers) == 2
    sp.process.kill()
    sp.process.wait(5)
    wait_until(lambda: not any(running(p) for p in workers), 3, "serve's workers exited after it died")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_lone_worker_stops_cleanly_on_sigterm_and_sigint(
    spawn: Any, zctx: zmq.Context[Any], signum: int
) -> None:
    frontend, backend = start_broker(spawn, zctx, "--model", "echo")
    worker = spawn("worker", "--connect", backend, "--model", "echo")

    def workers() -> int | None:
        models = broker_stats(frontend, zctx).get("models")
        return models["echo"]["workers"] if models else None

    wait_until(lambda: workers() == 1, 20, "the worker joined", error=RuntimeError)
    worker.process.send_signal(signum)
    assert worker.process.wait(10) == 0
    assert "stopped after 0 batches" in worker.stderr_path.read_text()
    wait_until(lambda: workers() == 0, 5, "the broker saw the worker leave")


class _Watch:
    def __init__(self, connected: bool) -> None:
        self.connected = connected

    def poll(self) -> None:
        pass


@pytest.mark.parametrize(
    ("parent_pid", "watch", "linger_ms"),
    [
        (None, _Watch(True), 500),  # connected: the goodbye may take its 500 ms to leave
        (None, _Watch(False), 0),  # the broker is gone: nobody could take it
        (None, None, 0),  # no socket at all
        ("self", _Watch(True), 500),  # serve, our parent, lives
        (1, _Watch(True), 0),  # serve died (we were reparented): its broker with it
    ],
)
def test_a_workers_goodbye_lingers_only_while_a_broker_can_take_it(
    parent_pid: Any, watch: _Watch | None, linger_ms: int
) -> None:
    """The rule behind the prompt exit below, without the clock: the DISCONNECT's linger
    (libzmq holds an unsendable message for all of it at close) is 500 ms only while the
    connection is up and serve lives."""
    from types import SimpleNamespace

    from workers.worker import Worker

    parent = os.getppid() if parent_pid == "self" else parent_pid
    fake = SimpleNamespace(settings=SimpleNamespace(parent_pid=parent), _watch=watch)
    assert Worker._goodbye_linger_ms(fake) == linger_ms  # type: ignore[arg-type]


def test_a_worker_whose_broker_is_gone_exits_promptly_on_sigterm(spawn: Any, zctx: zmq.Context[Any]) -> None:
    """Issue 28 item 23: a worker's goodbye (DISCONNECT) was closed with a 500 ms linger
    even with no broker to take it, so the process waited that long after "stopped" (and
    the orphan of a killed serve longer still until reaped). With the broker gone it now
    exits at once. The deadline is generous for the work left (close, interpreter exit:
    about 30 ms), and shorter than that linger."""
    frontend, backend = free_tcp_address(), free_tcp_address()
    broker = spawn("broker", "--frontend", frontend, "--backend", backend, "--model", "echo")
    worker = spawn("worker", "--connect", backend, "--model", "echo", "--heartbeat-ms", "100")

    # joined, not just connected: killed before its handshake, it would take the broker
    # for a refusing one and back off rather than reconnect at once
    def joined() -> bool:
        return broker_stats(frontend, zctx).get("models", {}).get("echo", {}).get("workers") == 1

    wait_until(joined, 20, "worker joined")
    broker.process.kill()
    broker.process.wait(5)
    # It saw the broker go and connected a fresh socket, whose READY waits for a broker.
    wait_until(lambda: worker.stderr_path.read_text().count("ready for model") >= 2, 10, "reconnected")
    worker.process.send_signal(signal.SIGTERM)
    started = time.monotonic()
    assert worker.process.wait(10) == 0
    took_s = time.monotonic() - started
    assert "stopped after 0 batches" in worker.stderr_path.read_text()
    assert took_s < 0.45, f"the worker took {took_s:.2f}s to exit after SIGTERM"


# --- 2. bad --connect -----------------------------------------------------------------------------------


@pytest.mark.parametrize("address", ["garbage://x", "tcp://127.0.0.1", "tcp://127.0.0.1:*"])
def test_worker_bad_connect_fails_at_once_with_one_line(cli: Any, address: str) -> None:
    started = time.monotonic()
    result = cli("worker", "--connect", address, "--model", "echo", timeout_s=15)
    # click's usage error (exit 2): one "Error:" line naming the expected form, no traceback
    assert result.returncode == 2, result
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "expected tcp://HOST:PORT or ipc://PATH" in errors[0], result.stderr
    assert repr(address) in errors[0], errors[0]
    assert "Traceback" not in result.stderr
    assert "loaded" not in result.stderr  # checked before the model loads
    assert time.monotonic() - started < 10


def test_worker_bad_curve_key_fails_at_once_with_one_line(cli: Any, tmp_path: Path) -> None:
    key = tmp_path / "broker.key"
    key.write_text("not a key\n")
    result = cli("worker", "--connect", free_tcp_address(), "--curve-server-key", str(key), timeout_s=15)
    assert result.returncode == EXIT_BAD_ADDRESS, result
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot load key file" in lines[0], result.stderr


# --- 3. bounded start-up ------------------------------------------------------------------------------


class CatSupervisor(Supervisor):
    """Runs `cat` as each worker: it lives until its stdin, serve's pipe, is closed."""

    def command(self, model: str, gpu: int | None, *args: Any, **kwargs: Any) -> list[str]:
        cat = shutil.which("cat")
        assert cat is not None
        return [cat]


@pytest.fixture
def supervisors() -> Iterator[Callable[..., CatSupervisor]]:
    made: list[CatSupervisor] = []

    def make(workers: int, **kwargs: Any) -> CatSupervisor:
        kwargs.setdefault("gpus", tuple(range(workers)))  # one (simulated) GPU each
        sup = CatSupervisor(PoolSettings("tcp://127.0.0.1:1", ("sim",), workers, **kwargs))
        made.append(sup)
        return sup

    yield make
    for sup in made:
        sup.stop(timeout_s=5)


def started_gpus(sup: Supervisor) -> list[int]:
    return [w.gpu for w in sup.workers if w.process is not None]


def test_supervisor_starts_at_most_max_starting_workers_at_once(supervisors: Any) -> None:
    events: list[tuple[str, str]] = []
    sup = supervisors(5, max_starting=2)
    sup.on_event = lambda model, event: events.append((model, event))
    sup.start(now=100.0)
    assert started_gpus(sup) == [0, 1]
    sup.check(100.0 + STARTING_S / 2)
    assert started_gpus(sup) == [0, 1], "started while two were still starting"
    sup.check(100.0 + STARTING_S)
    assert started_gpus(sup) == [0, 1, 2, 3]
    sup.check(100.0 + 2 * STARTING_S)
    assert started_gpus(sup) == [0, 1, 2, 3, 4]
    assert all(w.restarts == 0 for w in sup.workers) and not events, "a first start counted as a respawn"
    procs = [w.process for w in sup.workers if w.process is not None]
    sup.stop(timeout_s=5)
    assert [p.returncode for p in procs] == [0] * 5, "stop() did not end them by closing their pipe"


def test_supervisor_default_pool_of_two_starts_at_once(supervisors: Any) -> None:
    sup = supervisors(2)
    sup.start()
    assert started_gpus(sup) == [0, 1]


def test_supervisor_workers_connect_to_loopback_for_a_wildcard_backend() -> None:
    command = Supervisor(PoolSettings("tcp://*:5556", ("sim",), 1)).command("sim", 0)
    assert command[command.index("--connect") + 1] == "tcp://127.0.0.1:5556"


# --- 4. malformed BATCH messages ----------------------------------------------------------------------


# echo, and a model run on the worker's model thread (workers/overlap.py), which decodes apart
@pytest.mark.parametrize("model", ["echo", "nogil=tests.fixture_models:NoGil"], ids=["echo", "model-thread"])
def test_malformed_batches_are_answered_or_dropped_and_the_worker_serves_on(
    spawn: Any, zctx: zmq.Context[Any], model: str
) -> None:
    fb = FakeBackend(zctx)
    worker = spawn("worker", "--connect", fb.address, "--model", model, "--heartbeat-ms", "10000")
    ident = fb.next(protocol.CMD_READY, 20)[0]
    one = pack({"id": "a", "input": 1})
    three = [pack({"id": i, "input": i}) for i in range(3)]

    def deep(depth: int) -> bytes:  # `depth` msgpack arrays, one in another
        return b"\x91" * depth + b"\x00"

    n1 = [len(one)]
    odd_id = pack({"id": [1, 2], "input": 2})
    cases: list[tuple[bytes, list[bytes]]] = [
        # No batch id can be read: nobody to answer, dropped.
        (b"\xc1", [one]),
        (b"\x91" * 100_000, [one]),
        (pack("header"), [one]),
        (pack([]), [one]),
        (pack(["7", [0.0], n1]), [one]),
        (pack([True, [0.0], n1]), [one]),
        # A batch id but no bodies that can be told apart: an empty REPLY (the broker fails them all).
        (pack([101, [0.0]]), [one]),
        (pack([102, [0.0], [len(one) + 1]]), [one]),
        (pack([103, [0.0, 0.0], ["x", 1]]), [one]),
        # Requests fine, metadata not: answered, without queue_ms.
        (pack([104, [1.5], [len(b) for b in three]]), three),
        (pack([105, None, n1]), [one]),
        (pack([106, "x", n1]), [one]),
        (pack([107, [[[1]]], n1]), [one]),
        (pack([108, [0.5], [len(odd_id)]]), [odd_id]),
        # A body that is not a request map is answered bad_request alone; its batch-mate is served.
        (pack([110, [0.0, 0.0, 0.0], [1, 1, len(one)]]), [b"\xc1", pack(5), one]),
        # Nested past Python's recursion limit (msgspec's), not past msgpack's (1024 levels):
        # read by the checks; past both: dropped as any header msgpack cannot read.
        (b"\x93" + pack(111) + deep(1010) + pack(n1), [one]),
        (b"\x94" + pack(112) + pack([0.5]) + pack(n1) + deep(1010), [one]),
        (b"\x93" + pack(113) + deep(5000) + pack(n1), [one]),
        (b"\x94" + pack(114) + pack([0.5]) + pack(n1) + deep(5000), [one]),
        (b"\x93" + pack(115) + deep(1010) + pack("x"), [one]),
        # An element past the third that msgpack refuses (invalid UTF-8) is ignored (6.3), by the checks too.
        (b"\x94" + pack(116) + pack([0.5]) + pack(n1) + b"\xa2\xff\xfe", [one]),
        (b"\x94" + pack(117) + pack([0.5]) + pack("x") + b"\xa2\xff\xfe", [one]),
        # And a good one.
        (pack([109, [2.5], n1]), [one]),
    ]
    # A HEARTBEAT whose settings are nested past the recursion limit is ignored (it killed the worker).
    fb.sock.send_multipart([ident, protocol.WORKER_PROTOCOL, protocol.CMD_HEARTBEAT, deep(1010)])
    for header, body in cases:
        fb.send_batch(ident, header, body)
    got: dict[int, list[dict[str, Any]]] = {}
    while 109 not in got:
        frames = fb.next(protocol.CMD_REPLY, 10)
        batch_id, _, lengths, *_ = unpack(frames[3])
        got[batch_id] = [unpack(r) for r in protocol.split_bodies(lengths, frames[4:])]
    assert sorted(got) == [*range(101, 113), *range(115, 118)], (
        "a dropped batch was answered, or a readable one was not"
    )
    assert got[101] == got[102] == got[103] == got[115] == got[117] == []
    assert [(r["id"], r["output"]) for r in got[116]] == [("a", 1)]
    assert [(r["id"], r["output"], r["queue_ms"]) for r in got[111]] == [("a", 1, None)]
    assert [(r["id"], r["output"], r["queue_ms"] >= 0.5) for r in got[112]] == [("a", 1, True)]
    assert [(r["id"], r["output"], r["queue_ms"]) for r in got[104]] == [
        (0, 0, None),
        (1, 1, None),
        (2, 2, None),
    ]
    for batch_id in (105, 106, 107):
        assert [(r["id"], r["output"], r["queue_ms"]) for r in got[batch_id]] == [("a", 1, None)]
    assert [(r["id"], r["output"]) for r in got[108]] == [(None, 2)]
    bad, not_a_map, fine = got[110]
    assert (bad["ok"], bad["error"]["code"]) == (False, "bad_request")
    assert bad["error"]["message"].startswith("body cannot be decoded: "), bad
    assert not_a_map["error"] == {"code": "bad_request", "message": "body must be a msgpack map, got int"}
    assert (fine["id"], fine["ok"], fine["output"]) == ("a", True, 1)
    wait_ms = got[109][0]["worker_wait_ms"]  # queue_ms counts the wait inside the worker too
    assert [(r["id"], r["ok"], r["queue_ms"]) for r in got[109]] == [("a", True, round(2.5 + wait_ms, 3))]
    assert worker.process.poll() is None, "the worker died"
    log = worker.stderr_path.read_text()
    assert "Traceback" not in log, log
    assert log.count("dropped a batch whose header cannot be read") == 8, log
    worker.process.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        worker.process.wait(10)
    assert worker.process.returncode == 0


def test_a_worker_killed_for_a_hung_model_is_not_a_start_up_death(supervisors: Any) -> None:
    """Killed again and again soon after it started (a poison request resent), a worker is
    respawned each time and never given up on; each exit is told once."""
    events: list[tuple[str, str]] = []
    exits: list[tuple[int, int | None]] = []
    sup = supervisors(1)
    sup.on_event = lambda model, event: events.append((model, event))
    sup.on_exit = lambda pid, code: exits.append((pid, code))
    now = 100.0
    sup.start(now=now)
    for _ in range(8):
        (w,) = sup.workers
        assert w.process is not None
        pid = w.process.pid
        sup.kill(pid)
        w.process.wait(timeout=10)
        now += 1.0  # within EARLY_DEATH_S of its start: would count as an early death
        sup.check(now)
        now += 10.0  # past any back-off
        sup.check(now)
        assert exits[-1] == (pid, -9)
    assert ("sim", "given_up") not in events and sup.workers[0].early_deaths == 0
    assert len(exits) == 8 and len({pid for pid, _ in exits}) == 8


def test_a_stop_signal_taken_by_another_thread_wakes_the_sleeping_loop_at_once() -> None:
    """The kernel may give SIGTERM to any thread that does not block it (a worker's
    heartbeat thread, the metrics server's), while the main thread sleeps in its poll:
    a worker with a 10 s heartbeat then took 10 s to notice SIGTERM."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signals = StopSignals()
    done = threading.Event()
    other = threading.Thread(target=done.wait, args=(10,), name="not the main thread")
    try:
        signals.install()
        other.start()
        assert other.ident is not None
        signal.pthread_kill(other.ident, signal.SIGTERM)
        readable, _, _ = select.select([signals.fd], [], [], 5.0)  # asleep in C, as in zmq_poll
        assert readable == [signals.fd], "the loop slept through a SIGTERM another thread took"
        assert signals.count == 1
    finally:
        done.set()
        other.join(5)
        signals.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
