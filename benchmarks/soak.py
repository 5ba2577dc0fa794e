"""Soak: an hour of open-loop load at 70% of the measured capacity on two models, with
payloads from 16 B to 1 MiB, and a fault a minute in rotation. It checks what must hold
after an hour of real trouble: no request lost while its broker lived, none answered
twice or with another's result, the broker's memory flat, every fault answered as
promised.

    python benchmarks/soak.py                                   # 60 minutes (~62 with set-up)
    python benchmarks/soak.py --duration-s 120 --fault-every-s 17 --warmup-s 15   # CI's run
    python benchmarks/soak.py --faults worker_sigkill,worker_sigstop,hung_batch   # one long-lived broker

The set-up is a deployment's: `batcher broker` and two `batcher worker` per model, each a
process of its own session on free loopback ports; like systemd, this script starts a
worker again when it exits. Faults, in rotation: SIGKILL of a worker; SIGSTOP of a worker
for 3 s (past its liveness), then SIGCONT; SIGKILL of the broker and a new one on the same
addresses; a request that hangs every worker it reaches (the batch time limit must stop
them and answer it `worker_failed`); a request over --max-message-bytes (`too_large`, then
a normal request on the same socket); 10,000 garbage messages (each `bad_request`).

A request is *lost* if it was never answered although it was sent while a broker was up,
not outstanding when that broker was killed, and not sent on a socket that had not yet
heard from the new broker. Writes benchmarks/results/soak.md and .json (soak_quick.* for
runs shorter than an hour) and exits 1 when any check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import faults
import msgpack
import psutil
import zmq
from common import environment, fmt, handle_sigterm, md_table, write_results
from zmq.utils.monitor import recv_monitor_message

from batcher.client.sync import BatcherError, Client
from batcher.serve.launcher import free_tcp_address
from workers.supervisor import child_environment

FAILURE_LOGS = Path(__file__).resolve().parent / "results" / "soak_failure_logs"
MODELS = ("a", "b")
MODEL_SPEC = "benchmarks.faults:soak_model"
FAULTS = (
    "worker_sigkill",
    "worker_sigstop",
    "broker_restart",
    "hung_batch",
    "oversized_request",
    "garbage_burst",
)
MIN_PAYLOAD, MAX_PAYLOAD = 16, 1 << 20
MAX_MESSAGE_BYTES = 2 << 20  # room for a 1 MiB payload; the oversized request is above it
GARBAGE_MESSAGES = 10_000
SIGSTOP_S = 3.0  # past the default liveness (500 ms x 3)
RSS_GROWTH_LIMIT = 0.10
KILL_EXCUSE_S = 10.0  # a request this much older than a broker kill was lost before it
RSS_WINDOW_S = 30  # RSS is the median of this many 1-s samples: large requests in flight move it
PID_IN_NAME = re.compile(r"/pid(\d+)/")


@dataclass(frozen=True)
class SoakSettings:
    """One soak run: how long, how hard, how often something breaks."""

    duration_s: float = 3600.0
    fault_every_s: float = 60.0
    warmup_s: float = 60.0
    load_fraction: float = 0.7
    workers_per_model: int = 2
    max_batch_size: int = 8
    calibrate_s: float = 10.0
    seed: int = 2026
    faults: tuple[str, ...] = FAULTS

    def __post_init__(self) -> None:
        if not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if not self.fault_every_s > 0:
            raise ValueError(f"fault_every_s must be > 0, got {self.fault_every_s}")
        if not 0 < self.load_fraction <= 1:
            raise ValueError(f"load_fraction must be in (0, 1], got {self.load_fraction}")
        if self.workers_per_model < 2:
            raise ValueError(f"workers_per_model must be >= 2, got {self.workers_per_model}")
        if not self.faults or set(self.faults) - set(FAULTS):
            raise ValueError(f"faults must be some of {', '.join(FAULTS)}, got {self.faults}")


# --- the processes ---------------------------------------------------------------------------------


class Fleet:
    """A standalone broker and its workers, each a process in a session of its own. A worker
    that exits is started again by `respawn_exited` (what systemd would do); `stop` leaves
    nothing behind."""

    def __init__(self, workdir: Path, settings: SoakSettings) -> None:
        self.workdir = workdir
        self.settings = settings
        self.frontend = free_tcp_address()
        self.backend = free_tcp_address()
        self.broker: subprocess.Popen[bytes] | None = None
        self.workers: dict[tuple[str, int], subprocess.Popen[bytes]] = {}
        self.worker_exits: Counter[int] = Counter()
        self.expected_exits: Counter[int] = Counter()  # codes a fault asked for
        self.broker_deaths: list[int] = []  # exit codes of brokers that died without being killed
        self._respawn_at: dict[tuple[str, int], float] = {}
        self._last_start: dict[tuple[str, int], float] = {}
        self._started = 0

    def _spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        self._started += 1
        with (self.workdir / f"{self._started:04d}-{name}.log").open("wb") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "batcher", *args],
                stdout=subprocess.DEVNULL,
                stderr=log,
                env=child_environment(),
                start_new_session=True,
            )

    def start_broker(self) -> None:
        models = [arg for m in MODELS for arg in ("--model", m)]
        self.broker = self._spawn(
            "broker",
            "broker",
            "--frontend",
            self.frontend,
            "--backend",
            self.backend,
            *models,
            "--max-batch-size",
            str(self.settings.max_batch_size),
            "--max-message-bytes",
            str(MAX_MESSAGE_BYTES),
        )

    def kill_broker(self) -> None:
        assert self.broker is not None
        self.broker.send_signal(signal.SIGKILL)
        self.broker.wait(10)
        self.broker = None

    def start_workers(self) -> None:
        for model in MODELS:
            for i in range(self.settings.workers_per_model):
                self._start_worker(model, i)

    def _start_worker(self, model: str, i: int) -> None:
        self._last_start[model, i] = time.monotonic()
        self.workers[model, i] = self._spawn(
            f"worker-{model}{i}",
            "worker",
            "--connect",
            self.backend,
            "--model",
            f"{model}={MODEL_SPEC}",
            "--gpu",
            str(i),
        )

    def respawn_exited(self) -> None:
        """Start again every worker that exited; note a broker that died on its own."""
        now = time.monotonic()
        for (model, i), proc in list(self.workers.items()):
            code = proc.poll()
            if code is None:
                continue
            if (model, i) not in self._respawn_at:
                self.worker_exits[code] += 1
                # again at once the first time, then no faster than once a second
                last = self._last_start.get((model, i), -math.inf)
                self._respawn_at[model, i] = max(now, last + 1.0)
            if now >= self._respawn_at[model, i]:
                del self._respawn_at[model, i]
                self._start_worker(model, i)
        if self.broker is not None and (code := self.broker.poll()) is not None:
            self.broker_deaths.append(code)  # not killed by a fault: it died (OOM killer, crash)
            self.start_broker()

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.workers.values() if p.poll() is None]

    def stop(self) -> None:
        procs = [p for p in [self.broker, *self.workers.values()] if p is not None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGCONT)
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()


# --- the load --------------------------------------------------------------------------------------


class Load:
    """Requests from a few DEALER sockets, open loop (Poisson arrivals) or closed loop, each a
    model of MODELS and a payload of log-uniform size in [16 B, 1 MiB]. Every request is
    recorded in arrays indexed by its id, so an hour of them costs a few tens of MB."""

    OK, WRONG = 0, 1

    def __init__(self, ctx: zmq.Context[Any], address: str, seed: int, sockets: int = 4) -> None:
        self.rng = random.Random(seed)
        self.payload = self.rng.randbytes(MAX_PAYLOAD)
        self.socks: list[zmq.Socket[Any]] = []
        self.poller = zmq.Poller()
        for _ in range(sockets):
            sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(address)
            self.socks.append(sock)
            self.poller.register(sock, zmq.POLLIN)
        # When each socket saw its connection drop: what it sent between a broker's death
        # and then went into a dead connection; what it sent after is queued for the next.
        self.monitors = [sock.get_monitor_socket(zmq.EVENT_DISCONNECTED) for sock in self.socks]
        for monitor in self.monitors:
            self.poller.register(monitor, zmq.POLLIN)
        self.disconnected_at: list[list[float]] = [[] for _ in self.socks]
        self.codes: list[str] = ["ok", "wrong result"]
        self.sent_at = array("d")
        self.answered_at = array("d")
        self.sock_of = array("B")
        self.size = array("l")
        self.outcome = array("B")
        self.replies = array("B")
        self.unknown_replies = 0
        self.outstanding = 0
        self.behind_s = 0.0  # how far the open loop's sends fell behind their schedule, at most

    def send(self) -> None:
        n = len(self.sent_at)
        size = int(MIN_PAYLOAD * (MAX_PAYLOAD / MIN_PAYLOAD) ** self.rng.random())
        body = msgpack.packb(
            {"id": n, "model": MODELS[n % len(MODELS)], "input": {"tag": n, "payload": self.payload[:size]}},
            use_bin_type=True,
        )
        i = n % len(self.socks)
        self.sent_at.append(time.monotonic())
        self.answered_at.append(0.0)
        self.sock_of.append(i)
        self.size.append(size)
        self.outcome.append(255)
        self.replies.append(0)
        self.outstanding += 1
        self.socks[i].send_multipart([b"", body], copy=size < 65536)

    def receive(self, timeout_ms: int) -> None:
        for sock, _ in self.poller.poll(timeout_ms):
            if sock in self.monitors:
                self._disconnected(self.monitors.index(sock))
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._record(frames[-1])

    def _disconnected(self, i: int) -> None:
        while True:
            try:
                recv_monitor_message(self.monitors[i], zmq.NOBLOCK)
            except zmq.Again:
                return
            self.disconnected_at[i].append(time.monotonic())

    def _record(self, body: bytes) -> None:
        now = time.monotonic()
        reply = msgpack.unpackb(body, raw=False, strict_map_key=False)
        n = reply.get("id")
        if not isinstance(n, int) or not 0 <= n < len(self.sent_at):
            self.unknown_replies += 1
            return
        self.replies[n] = min(255, self.replies[n] + 1)
        if self.replies[n] > 1:
            return
        self.outstanding -= 1
        self.answered_at[n] = now
        if reply.get("ok"):
            out = reply.get("output")
            right = isinstance(out, dict) and out.get("tag") == n and out.get("bytes") == self.size[n]
            self.outcome[n] = self.OK if right else self.WRONG
        else:
            code = str((reply.get("error") or {}).get("code"))
            if code not in self.codes:
                self.codes.append(code)
            self.outcome[n] = self.codes.index(code)

    def run_open(self, rate: float, until: float, tick: Callable[[], None]) -> None:
        """Poisson arrivals at `rate` per second until the monotonic time `until`."""
        next_send = time.monotonic()
        while (now := time.monotonic()) < until:
            while next_send <= now:
                self.behind_s = max(self.behind_s, now - next_send)
                self.send()
                next_send += self.rng.expovariate(rate)
            self.receive(max(0, min(50, math.ceil((next_send - time.monotonic()) * 1000))))
            tick()

    def run_closed(self, in_flight: int, seconds: float) -> float:
        """Keep `in_flight` outstanding for `seconds`; the rate answered ok per second."""
        start = time.monotonic()
        first = len(self.sent_at)
        while time.monotonic() - start < seconds:
            while self.outstanding < in_flight:
                self.send()
            self.receive(50)
        ok = sum(1 for n in range(first, len(self.sent_at)) if self.outcome[n] == self.OK)
        return ok / seconds

    def drain(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.outstanding > 0 and time.monotonic() < deadline:
            self.receive(100)

    def close(self) -> None:
        for sock, monitor in zip(self.socks, self.monitors, strict=True):
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)


# --- the faults ------------------------------------------------------------------------------------


@dataclass
class FaultRecord:
    """One fault: when (s since the load began), what, whether it ended as promised, how."""

    fault: str
    at_s: float
    ok: bool = False
    detail: dict[str, Any] = field(default_factory=dict)


class Faults:
    """Runs on a thread of its own with its own sockets: one fault every `fault_every_s` in
    rotation, worker respawns, and the broker's RSS sampled every second."""

    def __init__(
        self, ctx: zmq.Context[Any], fleet: Fleet, settings: SoakSettings, load_start: float
    ) -> None:
        self.ctx = ctx
        self.fleet = fleet
        self.settings = settings
        self.load_start = load_start
        self.end = load_start + settings.duration_s
        self.faults = settings.faults
        self.records: list[FaultRecord] = []
        self.rss: list[tuple[float, int, int]] = []  # (s since load start, broker pid, rss bytes)
        self.restarts: list[tuple[float, float]] = []  # (kill, new broker answering), monotonic
        self.broker_began: dict[int, float] = {}  # pid -> s since the load began (RSS warm-up)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self._rng = random.Random(settings.seed + 1)
        self._garbage = faults.malformed_frontend(random.Random(settings.seed + 2))
        self._next_rss = 0.0
        self._stats = Client(fleet.frontend, timeout_s=1.0, context=ctx)

    def run(self) -> None:
        try:
            k = 1
            half = self.settings.fault_every_s / 2
            while not self.stop.is_set():
                due = self.load_start + k * self.settings.fault_every_s
                self.housekeep_until(min(due, self.end))
                if self.stop.is_set() or max(due, time.monotonic()) + half > self.end:
                    break  # no time left for it to finish before the load stops
                name = self.faults[(k - 1) % len(self.faults)]
                record = FaultRecord(name, round(time.monotonic() - self.load_start, 1))
                self.records.append(record)
                getattr(self, name)(record)
                k += 1
            self.housekeep_until(self.end)  # respawns and RSS samples until the load stops
        except BaseException as e:  # reported, and fails the run
            self.error = e
        finally:
            self._stats.close()

    def housekeep_until(self, when: float) -> None:
        while not self.stop.is_set() and time.monotonic() < when:
            self.housekeep()
            self.stop.wait(0.2)

    def housekeep(self) -> None:
        self.fleet.respawn_exited()
        now = time.monotonic()
        if now >= self._next_rss and self.fleet.broker is not None:
            self._next_rss = now + 1.0
            pid = self.fleet.broker.pid
            self.broker_began.setdefault(pid, now - self.load_start)
            with contextlib.suppress(psutil.Error):
                self.rss.append((now - self.load_start, pid, psutil.Process(pid).memory_info().rss))

    def wait(self, predicate: Callable[[], Any], timeout_s: float) -> Any:
        """Poll `predicate` (respawning workers meanwhile) until truthy; None on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.stop.is_set():
            self.housekeep()
            if value := predicate():
                return value
            self.stop.wait(0.05)
        return None

    def worker_names(self) -> list[str]:
        """The broker's names of its workers (`model/gpuN/pidP/idHEX`); [] if it does not answer."""
        try:
            models = self._stats.control("stats")["models"]
        except BatcherError:
            return []
        return [w["worker"] for m in MODELS for w in models.get(m, {}).get("worker_list", [])]

    def all_workers_joined(self) -> bool:
        """Every worker process the fleet runs, and no other, is in the broker's pool."""
        pids = sorted(int(m.group(1)) for n in self.worker_names() if (m := PID_IN_NAME.search(n)))
        expected = self.settings.workers_per_model * len(MODELS)
        return len(pids) == expected and pids == sorted(self.fleet.worker_pids())

    def _absent(self, pid: int) -> bool:
        names = self.worker_names()
        return bool(names) and not any(f"/pid{pid}/" in n for n in names)

    def _victim(self) -> int:
        return self._rng.choice(self.fleet.worker_pids())

    def _timed_rejoin(self, record: FaultRecord, since: float) -> None:
        back = self.wait(self.all_workers_joined, 60)
        record.detail["all_workers_back_after_s"] = round(time.monotonic() - since, 2) if back else None
        record.ok = record.ok and bool(back)

    def worker_sigkill(self, record: FaultRecord) -> None:
        pid = self._victim()
        self.fleet.expected_exits[-signal.SIGKILL] += 1
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        record.ok = True
        self._timed_rejoin(record, killed)

    def worker_sigstop(self, record: FaultRecord) -> None:
        """Stopped past its liveness: the broker must drop it. After SIGCONT it rejoins, or,
        when it was stopped inside a batch that ran past the batch time limit (taken for
        hung, told to exit), it exits 75 and is replaced."""
        pid = self._victim()
        before = [n for n in self.worker_names() if f"/pid{pid}/" in n]
        exits_before = self.fleet.worker_exits[75]
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        dropped = self.wait(lambda: self._absent(pid) and time.monotonic(), SIGSTOP_S)
        self.stop.wait(max(0.0, stopped + SIGSTOP_S - time.monotonic()))
        os.kill(pid, signal.SIGCONT)

        def outcome() -> str | None:
            if any(f"/pid{pid}/" in n and n not in before for n in self.worker_names()):
                return "rejoined"
            if self.fleet.worker_exits[75] > exits_before:
                return "taken for hung: exited 75 and was replaced"
            return None

        after = self.wait(outcome, 30)
        if after is not None and after != "rejoined":
            self.fleet.expected_exits[75] += 1
        record.detail.update(
            dropped_after_s=round(dropped - stopped, 2) if dropped else None, after_sigcont=after
        )
        record.ok = bool(dropped) and after is not None
        self._timed_rejoin(record, stopped)

    def broker_restart(self, record: FaultRecord) -> None:
        killed = time.monotonic()
        self.fleet.kill_broker()
        self.fleet.start_broker()
        answering = self.wait(lambda: self._answers() and time.monotonic(), 30)
        record.ok = bool(answering)
        if answering:
            self.restarts.append((killed, answering))
            record.detail["new_broker_answering_after_s"] = round(answering - killed, 2)
        self._timed_rejoin(record, killed)

    def _answers(self) -> bool:
        try:
            self._stats.control("stats")
        except BatcherError:
            return False
        return True

    def _socket(self) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(self.fleet.frontend)
        return sock

    def _reply(self, sock: zmq.Socket[Any], timeout_s: float) -> dict[str, Any] | None:
        frames = self.wait(lambda: sock.poll(0) and sock.recv_multipart(), timeout_s)
        return None if frames is None else dict(msgpack.unpackb(frames[-1], raw=False, strict_map_key=False))

    def hung_batch(self, record: FaultRecord) -> None:
        """One request that hangs every worker it reaches, among the load's requests."""
        model = MODELS[len(self.records) // len(self.faults) % len(MODELS)]
        exits_before = self.fleet.worker_exits[75]
        started = time.monotonic()
        with contextlib.closing(self._socket()) as sock:
            body = {"id": f"hang-{len(self.records)}", "model": model, "input": {"tag": -1, "hang": True}}
            sock.send_multipart([b"", msgpack.packb(body, use_bin_type=True)])
            reply = self._reply(sock, 120)
        error = (reply or {}).get("error") or {}
        self.wait(lambda: self.fleet.worker_exits[75] >= exits_before + 2, 10)
        stopped = self.fleet.worker_exits[75] - exits_before
        self.fleet.expected_exits[75] += stopped
        record.detail.update(
            model=model,
            code=error.get("code"),
            message=error.get("message"),
            answered_after_s=round(time.monotonic() - started, 2),
            workers_stopped=stopped,
        )
        record.ok = error.get("code") == "worker_failed" and 1 <= stopped <= 2
        self._timed_rejoin(record, started)

    def oversized_request(self, record: FaultRecord) -> None:
        """A request over --max-message-bytes, then a normal one on the same socket."""
        rid = f"big-{len(self.records)}"
        with contextlib.closing(self._socket()) as sock:
            big = {"id": rid, "model": "a", "input": {"tag": -1, "payload": bytes(MAX_MESSAGE_BYTES + 65536)}}
            sock.send_multipart([b"", msgpack.packb(big, use_bin_type=True)])
            first = self._reply(sock, 30) or {}
            after = {"id": rid + "-after", "model": "a", "input": {"tag": -2, "payload": b"x"}}
            sock.send_multipart([b"", msgpack.packb(after, use_bin_type=True)])
            second = self._reply(sock, 30) or {}
        code = (first.get("error") or {}).get("code")
        record.detail.update(code=code, id=first.get("id"), next_request_ok=bool(second.get("ok")))
        record.ok = code == "too_large" and first.get("id") == rid and bool(second.get("ok"))

    def garbage_burst(self, record: FaultRecord) -> None:
        """10,000 malformed messages from one DEALER, at most 250 unanswered at a time."""
        codes: Counter[str] = Counter()
        started = time.monotonic()

        def take(sock: zmq.Socket[Any]) -> None:
            reply = msgpack.unpackb(sock.recv_multipart()[-1], raw=False, strict_map_key=False)
            codes["ok" if reply.get("ok") else str((reply.get("error") or {}).get("code"))] += 1

        with contextlib.closing(self._socket()) as sock:
            for n in range(GARBAGE_MESSAGES):
                sock.send_multipart(next(self._garbage)[1])
                while n - codes.total() >= 250:
                    if self.stop.is_set() or not sock.poll(5000):
                        break
                    take(sock)
                else:
                    continue
                break  # the broker stopped answering (or the run is over): counted below
            while codes.total() < GARBAGE_MESSAGES and not self.stop.is_set() and sock.poll(5000):
                take(sock)
        record.detail.update(replies=dict(codes), seconds=round(time.monotonic() - started, 2))
        record.ok = codes["bad_request"] == GARBAGE_MESSAGES


# --- the verdict -----------------------------------------------------------------------------------


def classify(load: Load, restarts: list[tuple[float, float]]) -> dict[str, Any]:
    """Unanswered requests by why. Excused: one sent at most KILL_EXCUSE_S before a broker
    kill (outstanding in it), or after the kill but before its socket saw the connection
    drop (it went into the dead connection). What a socket sends after that is queued for
    the new broker and must be answered. Anything else is lost, and so is the run if a
    socket never saw a killed broker's connection drop."""
    ends: list[list[float]] = []
    deaf = 0  # (restart, socket) pairs that never saw the killed broker's connection drop
    for killed, _ in restarts:
        drops = [min((t for t in times if t >= killed), default=math.inf) for times in load.disconnected_at]
        deaf += sum(1 for t in drops if t == math.inf)
        ends.append(drops)
    out = Counter[str]()
    oldest_at_kill = 0.0
    for n, at in enumerate(load.answered_at):
        if at:
            continue
        sent, why = load.sent_at[n], "lost"
        for (killed, _), drops in zip(restarts, ends, strict=True):
            if killed - KILL_EXCUSE_S <= sent <= killed:
                why = "outstanding at a broker kill"
                oldest_at_kill = max(oldest_at_kill, killed - sent)
            elif killed < sent <= drops[load.sock_of[n]]:
                why = "sent into the killed broker's connection"
        out[why] += 1
    return {
        **out,
        "oldest_outstanding_at_a_kill_ms": round(oldest_at_kill * 1000),
        "sockets_that_missed_a_broker_kill": deaf,
    }


def minutes(load: Load, start: float, records: list[FaultRecord]) -> list[dict[str, Any]]:
    """Per minute of sending: requests sent, ok, errors, and latency quantiles of the ok ones."""
    rows: dict[int, dict[str, Any]] = {}
    latencies: dict[int, list[float]] = {}
    for n, sent in enumerate(load.sent_at):
        if sent < start:
            continue
        m = int((sent - start) // 60)
        row = rows.setdefault(m, {"minute": m + 1, "sent": 0, "ok": 0, "errors": 0})
        row["sent"] += 1
        if load.outcome[n] == Load.OK:
            row["ok"] += 1
            latencies.setdefault(m, []).append((load.answered_at[n] - sent) * 1000)
        elif load.outcome[n] != 255:
            row["errors"] += 1
    for m, row in rows.items():
        lat = sorted(latencies.get(m, []))
        row.update(p50_ms=_quantile(lat, 0.5), p99_ms=_quantile(lat, 0.99), max_ms=lat[-1] if lat else None)
        row["faults"] = ", ".join(r.fault for r in records if int(r.at_s // 60) == m) or "-"
    return [rows[m] for m in sorted(rows)]


def _quantile(ordered: list[float], q: float) -> float | None:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def rss_report(
    samples: list[tuple[float, int, int]], began: dict[int, float], warmup_s: float
) -> dict[str, Any]:
    """Each broker's RSS after its warm-up and at its end, each the median of RSS_WINDOW_S
    one-second samples (`began`: s since the load began, by pid); and the first broker's
    after warm-up against the last one's at the end."""
    brokers: list[dict[str, Any]] = []
    for pid in dict.fromkeys(pid for _, pid, _ in samples):
        own = [(t, rss) for t, p, rss in samples if p == pid]
        start = began.get(pid, own[0][0])
        warm_window = [rss for t, rss in own if start + warmup_s <= t < start + warmup_s + RSS_WINDOW_S]
        end_window = [rss for t, rss in own[-RSS_WINDOW_S:] if t >= start + warmup_s]
        warm = statistics.median(warm_window) if warm_window else None
        end = statistics.median(end_window) if end_window else None
        brokers.append(
            {
                "pid": pid,
                "lived_s": round(own[-1][0] - start),
                "rss_after_warmup_mib": _mib(warm),
                "rss_at_end_mib": _mib(end),
                "growth": round(end / warm - 1, 3) if warm and end else None,
                "rss_mib_every_10_s": [_mib(rss) for t, rss in own[::10]],
            }
        )
    first, last = brokers[0], brokers[-1]
    warm_first, end_last = first["rss_after_warmup_mib"], last["rss_at_end_mib"]
    overall = round(end_last / warm_first - 1, 3) if warm_first and end_last else None
    peak = max(rss for _, _, rss in samples)
    return {"brokers": brokers, "first_after_warmup_to_last_at_end": overall, "peak_mib": _mib(peak)}


def _mib(n: float | None) -> float | None:
    return None if n is None else round(n / 2**20, 1)


# --- the run ---------------------------------------------------------------------------------------


def soak(settings: SoakSettings, workdir: Path) -> dict[str, Any]:
    ctx: zmq.Context[Any] = zmq.Context()
    fleet = Fleet(workdir, settings)
    load: Load | None = None
    faults_thread: threading.Thread | None = None
    runner: Faults | None = None
    try:
        fleet.start_broker()
        fleet.start_workers()
        with Client(fleet.frontend, timeout_s=1.0, context=ctx) as probe:
            deadline = time.monotonic() + 60
            while not _joined(probe, settings):
                if time.monotonic() > deadline:
                    raise TimeoutError("the workers did not join within 60 s")
                time.sleep(0.1)  # between probes of the condition
        load = Load(ctx, fleet.frontend, settings.seed)
        in_flight = 2 * settings.max_batch_size * settings.workers_per_model * len(MODELS)
        load.run_closed(in_flight, 3.0)  # warm-up: the broker learns the models' cost
        capacity = load.run_closed(in_flight, settings.calibrate_s)
        load.drain(30)
        rate = settings.load_fraction * capacity
        print(
            f"capacity {capacity:.0f} req/s; open loop at {rate:.0f} req/s for {settings.duration_s:.0f} s",
            flush=True,
        )
        calibration_sent = len(load.sent_at)
        start = time.monotonic()
        runner = Faults(ctx, fleet, settings, start)
        faults_thread = threading.Thread(target=runner.run, name="faults", daemon=True)
        faults_thread.start()
        next_report = start + 60
        progress = {"next": next_report}

        def tick() -> None:
            if time.monotonic() >= progress["next"]:
                progress["next"] += 60
                done = [r.fault + (" ok" if r.ok else " FAILED") for r in runner.records] if runner else []
                print(
                    f"{(time.monotonic() - start) / 60:.0f} min: {len(load.sent_at):,} sent, "
                    f"{load.outstanding:,} outstanding; faults: {', '.join(done[-3:]) or '-'}",
                    flush=True,
                )

        load.run_open(rate, start + settings.duration_s, tick)
        faults_thread.join(300)  # starts no fault it cannot finish; the one at hand ends by itself
        load.drain(30)
        fleet.respawn_exited()
        return verdict(settings, fleet, load, runner, start, capacity, rate, calibration_sent)
    finally:
        if runner is not None:
            runner.stop.set()
        if faults_thread is not None:
            faults_thread.join(180)
        if load is not None:
            load.close()
        fleet.stop()
        ctx.term()


def _joined(probe: Client, settings: SoakSettings) -> bool:
    try:
        models = probe.control("stats")["models"]
    except BatcherError:
        return False
    return all(models.get(m, {}).get("workers") == settings.workers_per_model for m in MODELS)


def verdict(
    settings: SoakSettings,
    fleet: Fleet,
    load: Load,
    runner: Faults,
    start: float,
    capacity: float,
    rate: float,
    calibration_sent: int,
) -> dict[str, Any]:
    unanswered = classify(load, runner.restarts)
    outcomes = Counter(load.codes[o] if o != 255 else "unanswered" for o in load.outcome)
    duplicated = sum(1 for r in load.replies if r > 1)
    rss = rss_report(runner.rss, runner.broker_began, settings.warmup_s)
    growths = [b["growth"] for b in rss["brokers"] if b["growth"] is not None]
    unexpected_exits = fleet.worker_exits - fleet.expected_exits
    checks = {
        "no request lost": unanswered.get("lost", 0) == 0,
        "none answered twice": duplicated == 0,
        "none answered with another's result": outcomes["wrong result"] == 0 and load.unknown_replies == 0,
        "every fault answered as promised": bool(runner.records)
        and all(r.ok for r in runner.records)
        and runner.error is None,
        "every client socket saw each broker kill": unanswered["sockets_that_missed_a_broker_kill"] == 0,
        "errors only worker_failed, under 0.1% of requests": set(outcomes)
        <= {"ok", "worker_failed", "unanswered"}
        and outcomes["worker_failed"] <= 0.001 * len(load.sent_at),
        "each broker's RSS grew under 10%": bool(growths) and all(g < RSS_GROWTH_LIMIT for g in growths),
        "no broker died on its own": not fleet.broker_deaths,
        "no worker exited unasked": not unexpected_exits,
        "open loop kept its schedule (behind < 1 s)": load.behind_s < 1.0,
    }
    return {
        "settings": asdict(settings),
        "capacity_per_s": round(capacity, 1),
        "offered_rate_per_s": round(rate, 1),
        "requests": {
            "sent": len(load.sent_at),
            "of_which_calibration": calibration_sent,
            "ok": outcomes.pop("ok", 0),
            "errors": {k: v for k, v in outcomes.items() if k != "unanswered"},
            "unanswered": unanswered,
            "duplicated": duplicated,
            "unknown_replies": load.unknown_replies,
            "mean_payload_kib": round(sum(load.size) / max(1, len(load.size)) / 1024, 1),
        },
        "faults": [asdict(r) for r in runner.records],
        "fault_thread_error": repr(runner.error) if runner.error else None,
        "worker_exits": {str(k): v for k, v in fleet.worker_exits.items()},
        "broker_deaths": fleet.broker_deaths,
        "rss": rss,
        "minutes": minutes(load, start, runner.records),
        "open_loop_max_behind_s": round(load.behind_s, 3),
        "checks": checks,
        "passed": all(checks.values()),
    }


def fault_summary(faults: list[dict[str, Any]]) -> str:
    """One row per kind of fault: how many, how many as promised, and how long until every
    worker was back in the pool (median and worst)."""
    rows = []
    for kind in FAULTS:
        runs = [f for f in faults if f["fault"] == kind]
        if not runs:
            continue
        back = sorted(b for f in runs if (b := f["detail"].get("all_workers_back_after_s")) is not None)
        rows.append(
            [
                f"`{kind}`",
                len(runs),
                sum(1 for f in runs if f["ok"]),
                statistics.median(back) if back else "-",
                back[-1] if back else "-",
                _fault_note(kind, runs),
            ]
        )
    headers = ["fault", "times", "as promised", "workers back (s, median)", "worst", "what happened"]
    return md_table(headers, rows)


def _fault_note(kind: str, runs: list[dict[str, Any]]) -> str:
    details = [f["detail"] for f in runs]
    if kind == "worker_sigstop":
        outcomes = Counter(str(d.get("after_sigcont")) for d in details)
        return "; ".join(f"{v}x {k}" for k, v in outcomes.items())
    if kind == "broker_restart":
        up = sorted(d["new_broker_answering_after_s"] for d in details if "new_broker_answering_after_s" in d)
        return f"new broker answering after {statistics.median(up)} s (median)" if up else "-"
    if kind == "hung_batch":
        codes = Counter(str(d.get("code")) for d in details)
        took = sorted(d["answered_after_s"] for d in details if "answered_after_s" in d)
        stopped = Counter(d.get("workers_stopped") for d in details)
        return (
            f"poison request answered {', '.join(f'`{c}` {n}x' for c, n in codes.items())} after "
            f"{statistics.median(took) if took else '-'} s (median); workers stopped per poison: "
            + ", ".join(f"{k} ({v}x)" for k, v in sorted(stopped.items(), key=str))
        )
    if kind == "oversized_request":
        codes = Counter(str(d.get("code")) for d in details)
        after = sum(1 for d in details if d.get("next_request_ok"))
        return f"{', '.join(f'`{c}` {n}x' for c, n in codes.items())}; next request on the socket ok {after}x"
    if kind == "garbage_burst":
        replies: Counter[str] = Counter()
        for d in details:
            replies.update(d.get("replies", {}))
        took = sorted(d["seconds"] for d in details if "seconds" in d)
        return f"replies {dict(replies)}; {statistics.median(took) if took else '-'} s a burst (median)"
    return ""


def markdown(result: dict[str, Any]) -> str:
    req = result["requests"]
    s = result["settings"]
    lines = [
        f"Open loop at {fmt(result['offered_rate_per_s'])} requests/s ({s['load_fraction']:.0%} of the "
        f"{fmt(result['capacity_per_s'])}/s measured closed-loop) for {s['duration_s'] / 60:.0f} min, "
        f"on two models (`benchmarks.faults:soak_model`, 20 ms + 2.5 ms per request, max batch "
        f"{s['max_batch_size']}, {s['workers_per_model']} `batcher worker` each), payloads log-uniform in "
        f"16 B to 1 MiB (mean {req['mean_payload_kib']} KiB); a fault every {fmt(s['fault_every_s'])} s.",
        "",
        md_table(
            [
                "sent",
                "ok",
                "errors by code",
                "lost",
                "answered twice",
                "wrong result",
                "died with a killed broker",
            ],
            [
                [
                    req["sent"],
                    req["ok"],
                    ", ".join(f"`{k}` {v:,}" for k, v in req["errors"].items() if k != "wrong result")
                    or "none",
                    req["unanswered"].get("lost", 0),
                    req["duplicated"],
                    req["errors"].get("wrong result", 0),
                    req["unanswered"].get("outstanding at a broker kill", 0)
                    + req["unanswered"].get("sent into the killed broker's connection", 0),
                ]
            ],
        ),
        "",
        "Broker RSS (MiB) per broker process, after its warm-up and at its end:",
        "",
        md_table(
            ["pid", "lived (s)", "after warm-up", "at end", "growth"],
            [
                [b["pid"], b["lived_s"], b["rss_after_warmup_mib"], b["rss_at_end_mib"], b["growth"]]
                for b in result["rss"]["brokers"]
            ],
        ),
        "",
        f"First broker after warm-up to last broker at the end: "
        f"{result['rss']['first_after_warmup_to_last_at_end']}; peak {result['rss']['peak_mib']} MiB.",
        "",
        fault_summary(result["faults"]),
        "",
        md_table(
            ["fault", "at (s)", "as promised", "detail"],
            [
                [r["fault"], r["at_s"], r["ok"], "; ".join(f"{k} {v}" for k, v in r["detail"].items())]
                for r in result["faults"]
            ],
        ),
        "",
        "Minute by minute (by the minute a request was sent; latency of the ok ones):",
        "",
        md_table(
            ["minute", "sent", "ok", "errors", "p50 ms", "p99 ms", "max ms", "faults"],
            [
                [
                    m["minute"],
                    m["sent"],
                    m["ok"],
                    m["errors"],
                    m["p50_ms"],
                    m["p99_ms"],
                    m["max_ms"],
                    m["faults"],
                ]
                for m in result["minutes"]
            ],
        ),
        "",
        "Checks: " + "; ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in result["checks"].items()) + ".",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = SoakSettings()
    p.add_argument("--duration-s", type=float, default=d.duration_s, help="seconds of open-loop load")
    p.add_argument("--fault-every-s", type=float, default=d.fault_every_s, help="seconds between faults")
    p.add_argument(
        "--warmup-s", type=float, default=d.warmup_s, help="a broker's RSS is taken this long after it starts"
    )
    p.add_argument("--load-fraction", type=float, default=d.load_fraction, help="of the measured capacity")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--faults", default=",".join(d.faults), help="the rotation, comma-separated")
    args = p.parse_args(argv)
    settings = SoakSettings(
        duration_s=args.duration_s,
        fault_every_s=args.fault_every_s,
        warmup_s=args.warmup_s,
        load_fraction=args.load_fraction,
        seed=args.seed,
        faults=tuple(f.strip() for f in args.faults.split(",") if f.strip()),
    )
    handle_sigterm()
    with tempfile.TemporaryDirectory(prefix="batcher-soak-") as tmp:
        result = soak(settings, Path(tmp))
        if not result["passed"]:  # keep every process's log for the post-mortem
            shutil.rmtree(FAILURE_LOGS, ignore_errors=True)
            shutil.copytree(tmp, FAILURE_LOGS)
            print(f"logs of every process kept in {FAILURE_LOGS}")
    quick = settings.duration_s < 3600
    name = "soak_quick" if quick else "soak"
    result["environment"] = environment()
    write_results(name, "Soak", markdown(result), result, quick)
    for check, passed in result["checks"].items():
        print(f"{'ok  ' if passed else 'FAIL'} {check}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
