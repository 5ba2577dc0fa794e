"""Reliability figures: each fault scenario once, with the default heartbeat (500 ms x 3),
counted from the clients' side: requests sent, answered ok, answered with which error
code, lost, duplicated; time to detect a dead worker, to respawn it, to recover.

    python benchmarks/reliability.py                      # every scenario, ~1.5 minutes
    python benchmarks/reliability.py --only worker_sigkill,broker_restart

Writes benchmarks/results/reliability.md and .json (docs/reliability.md explains them).
Scenarios: worker_sigkill, worker_sigstop, worker_startup_crash, broker_restart,
graceful_shutdown, second_sigterm, malformed_input. Every process runs on free loopback
ports in a process group of its own and is stopped at the end, even on errors or Ctrl-C.

Times come from serve's own log (ms timestamps) against the wall clock at the moment the
signal was sent, or from the broker's `stats` polled every 50 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import faults
import msgpack
import psutil
import zmq
from faults import CRASHING

from batcher.client.sync import BatcherError, Client
from batcher.serve.launcher import free_tcp_address
from workers.supervisor import child_environment

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

SCENARIOS = (
    "worker_sigkill",
    "worker_sigstop",
    "worker_startup_crash",
    "broker_restart",
    "graceful_shutdown",
    "second_sigterm",
    "malformed_input",
)
LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\w+) ([\w.]+)\[(\d+)\]: (.*)$")


# --- logs and stats -------------------------------------------------------------------------------


def log_events(text: str) -> list[tuple[float, str]]:
    """(unix time, message) of each line of a batcher text log."""
    out = []
    for line in text.splitlines():
        m = LOG_LINE.match(line)
        if m:
            when = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((when, m.group(5)))
    return out


def first_event(text: str, pattern: str, after: float = 0.0) -> tuple[float, re.Match[str]] | None:
    """The first log line at or after `after` whose message matches `pattern`."""
    for when, message in log_events(text):
        m = re.search(pattern, message)
        if m and when >= after - 0.001:
            return when, m
    return None


def worker_ids_by_pid(text: str) -> dict[int, list[str]]:
    """The broker-side ids each worker pid joined with, in order (a rejoin adds one)."""
    out: dict[int, list[str]] = {}
    for _, message in log_events(text):
        m = re.search(r"worker joined: \S+/pid(\d+)/id([0-9a-f]+)", message)
        if m:
            out.setdefault(int(m.group(1)), []).append(m.group(2))
    return out


class StatsPoller:
    """Asks the broker for `stats` at most every `every_s`, recording (time, stats)."""

    def __init__(self, address: str, ctx: zmq.Context[Any], every_s: float = 0.05) -> None:
        self.client = Client(address, timeout_s=0.25, context=ctx)
        self.every_s = every_s
        self.samples: list[tuple[float, dict[str, Any]]] = []
        self._next = 0.0

    def poll(self) -> dict[str, Any] | None:
        now = time.time()
        if now < self._next:
            return self.samples[-1][1] if self.samples else None
        self._next = now + self.every_s
        try:
            stats = dict(self.client.control("stats"))
        except BatcherError:
            return None
        self.samples.append((time.time(), stats))
        return stats

    def close(self) -> None:
        self.client.close()


def worker_ids(stats: dict[str, Any], model: str) -> set[str]:
    return {w["worker"] for w in stats["models"].get(model, {}).get("worker_list", [])}


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 1)


@contextlib.contextmanager
def serve(args: list[str], workdir: Path, name: str, workers: int) -> Iterator[faults.LoggedServe]:
    s = faults.LoggedServe(args, workdir / f"{name}.log")
    try:
        yield s.start(workers=workers)
    finally:
        s.stop(timeout_s=10)


# --- scenarios ------------------------------------------------------------------------------------


def worker_fault(ctx: zmq.Context[Any], workdir: Path, sig: str, stop_s: float) -> dict[str, Any]:
    """SIGKILL, or SIGSTOP for `stop_s` then SIGCONT, one of 2 sim workers under steady load.

    detect_ms: signal -> the broker's "taken for dead" (or "unreachable") line for the victim;
    respawn_*: SIGKILL -> the new worker's READY in the log / its id first seen in `stats`;
    rejoin_*: SIGCONT -> the stopped worker's new READY; recover_ms: signal -> the last of the
    requests outstanding at the signal answered."""
    with serve(["--workers", "2", "--model", "sim"], workdir, f"worker_{sig}", workers=2) as s:
        load = faults.DealerLoad(ctx, s.frontend, clients=4, depth=8)
        stats = StatsPoller(s.frontend, ctx)
        try:
            load.run_for(2.0)
            before_pids = s.worker_pids()
            before_ids = worker_ids(stats.poll() or {}, "sim")
            victim = min(before_pids)
            victim_id = worker_ids_by_pid(s.log())[victim][-1]
            outstanding = load.outstanding()
            signalled, signalled_mono = time.time(), time.monotonic()
            os.kill(victim, signal.SIGKILL if sig == "sigkill" else signal.SIGSTOP)
            resumed = None
            detected = first_seen_new = None

            def progress() -> bool:
                nonlocal resumed, detected, first_seen_new
                now = time.time()
                st = stats.poll()
                if st is not None and first_seen_new is None and worker_ids(st, "sim") - before_ids:
                    first_seen_new = now
                if sig == "sigstop" and resumed is None and now - signalled >= stop_s:
                    os.kill(victim, signal.SIGCONT)
                    resumed = time.time()
                if detected is None:
                    died = "silent for .*taken for dead|unreachable|disconnected"
                    pattern = rf"worker \S*/id{victim_id} ({died})"
                    hit = first_event(s.log(), pattern, signalled)
                    detected = hit[0] if hit else None
                back = first_seen_new is not None and (sig == "sigkill" or resumed is not None)
                return back and detected is not None and not (outstanding - set(load.answered_at))

            load.run_until(progress, 60, "recovery")
            load.run_for(1.0)
            drained = load.drain(20)
        finally:
            if sig == "sigstop":
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGCONT)
            load.close()
            stats.close()
        log = s.log()
        recovered = max((load.answered_at[t] for t in outstanding), default=None)
        out: dict[str, Any] = {
            "scenario": f"worker_{sig}",
            "setup": "serve --workers 2 --model sim (defaults: heartbeat 500 ms x 3, max-retries 1); "
            "4 DEALER clients keeping 8 requests each in flight",
            **load.summary(),
            "drained": drained,
            "in_flight_at_fault": len(outstanding),
            "detect_ms": ms(detected - signalled) if detected else None,
            # until every request outstanding at the fault was answered
            "recover_ms": ms(recovered - signalled_mono) if recovered else None,
        }
        joined = worker_ids_by_pid(log)
        if sig == "sigkill":
            new_pids = [p for p in joined if p not in before_pids]
            respawn_log = first_event(log, rf"worker joined: \S*/pid{new_pids[0]}/id") if new_pids else None
            out["respawn_ready_in_log_ms"] = ms(respawn_log[0] - signalled) if respawn_log else None
            out["respawn_seen_in_stats_ms"] = ms(first_seen_new - signalled) if first_seen_new else None
            out["new_worker_pid"] = new_pids[0] if new_pids else None
        else:
            rejoin = first_event(log, rf"worker joined: \S*/pid{victim}/id(?!{victim_id})", resumed or 0)
            out["stopped_for_ms"] = ms((resumed or signalled) - signalled)
            out["rejoin_after_sigcont_ms"] = ms(rejoin[0] - resumed) if rejoin and resumed else None
            out["rejoin_seen_in_stats_after_sigcont_ms"] = (
                ms(first_seen_new - resumed) if first_seen_new and resumed else None
            )
            with Client(s.frontend, timeout_s=5, context=ctx) as c:
                final = dict(c.control("stats"))
            # the stopped worker's late reply (when it sent one) and heartbeats on its old connection
            out["backend_messages_dropped"] = final.get("dropped_backend_messages")
        return out


def worker_startup_crash(ctx: zmq.Context[Any], workdir: Path) -> dict[str, Any]:
    """A model whose worker crashes at every start, next to a healthy sim model."""
    args = ["--workers", "1", "--model", "sim", "--model", CRASHING]
    started = time.time()
    with serve(args, workdir, "worker_startup_crash", workers=1) as s:
        load = faults.DealerLoad(ctx, s.frontend, clients=2, depth=4)
        doomed = ctx.socket(zmq.DEALER)
        doomed.setsockopt(zmq.LINGER, 0)
        doomed.connect(s.frontend)
        try:
            for i in range(5):  # queued for the crashing model before serve gives up on it
                doomed.send_multipart([b"", faults.pack({"id": f"early-{i}", "input": i, "model": CRASHING})])
            load.run_until(lambda: "giving up" in s.log(), 60, "serve gave up")
            gave_up = time.time()
            for i in range(5):  # sent after it gave up
                doomed.send_multipart([b"", faults.pack({"id": f"late-{i}", "input": i, "model": CRASHING})])
            load.run_for(1.0)
            drained = load.drain(20)
            codes: Counter[str] = Counter()
            deadline = time.monotonic() + 3.0  # the broker answers these at once, or never
            while sum(codes.values()) < 10 and doomed.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                reply = msgpack.unpackb(doomed.recv_multipart()[-1], raw=False)
                codes["ok" if reply.get("ok") else reply["error"]["code"]] += 1
            alive = s.process.poll() is None
        finally:
            load.close()
            doomed.close(0)
        log = s.log()
        starts = log.count(f"started worker for model {CRASHING}")
        give_up = first_event(log, r"giving up on it")
        first_start = first_event(log, rf"started worker for model {re.escape(CRASHING)}")
        return {
            "scenario": "worker_startup_crash",
            "setup": f"serve --workers 1 --model sim --model {CRASHING} (its constructor kills the "
            "process); load on sim throughout",
            **load.summary(),
            "drained": drained,
            "serve_alive": alive,
            "crashing_worker_starts": starts,
            "give_up_after_ms": ms(give_up[0] - first_start[0]) if give_up and first_start else None,
            "serve_start_to_give_up_ms": ms(gave_up - started),
            "crashing_model_requests": 10,
            "crashing_model_replies": dict(codes),
            "crashing_model_unanswered": 10 - sum(codes.values()),
        }


def broker_restart(ctx: zmq.Context[Any], workdir: Path) -> dict[str, Any]:
    """SIGKILL a standalone broker under load and start a new one on the same addresses."""
    frontend, backend = free_tcp_address(), free_tcp_address()
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Any] = []

    def start(name: str, *args: str) -> subprocess.Popen[bytes]:
        f = (workdir / f"broker_restart-{name}.log").open("wb")
        logs.append(f)
        p = subprocess.Popen(
            [sys.executable, "-m", "batcher", *args],
            stderr=f,
            stdout=subprocess.DEVNULL,
            env=child_environment(),
            start_new_session=True,
        )
        procs.append(p)
        return p

    broker_args = ("broker", "--frontend", frontend, "--backend", backend, "--model", "sim")
    stats = StatsPoller(frontend, ctx)
    client = Client(frontend, timeout_s=2.0, retries=3, context=ctx)
    try:
        first = start("broker-1", *broker_args)
        worker_pids = [
            start(f"worker-{i}", "worker", "--connect", backend, "--gpu", str(i)).pid for i in (0, 1)
        ]
        wait_for(lambda: (st := stats.poll()) and st["models"]["sim"]["workers"] == 2, 30, "workers joined")
        inflight: list[Any] = []
        results = Counter[str]()
        wrong = retried = sent = 0

        def pump(until: Callable[[], bool], timeout_s: float) -> None:
            nonlocal wrong, sent, retried
            deadline = time.monotonic() + timeout_s
            while not until():
                if time.monotonic() > deadline:
                    raise TimeoutError("broker_restart: condition not met")
                while len(inflight) < 16:
                    inflight.append((sent, client.submit({"tag": sent})))
                    sent += 1
                n, p = inflight.pop(0)
                reply = p.wait()
                retried += p.attempts > 1
                if reply.get("ok"):
                    wrong += reply["output"]["echo"] != {"tag": n}
                    results["ok"] += 1
                else:
                    results[reply["error"]["code"]] += 1

        t0 = time.monotonic()
        pump(lambda: time.monotonic() - t0 > 2.0, 30)
        killed = time.time()
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        start("broker-2", *broker_args)
        restarted = time.time()

        def back() -> bool:
            st = stats.poll()
            return st is not None and st["models"]["sim"]["workers"] == 2

        pump(back, 60)
        t1 = time.monotonic()
        pump(lambda: time.monotonic() - t1 > 2.0, 30)
        while inflight:  # drain
            n, p = inflight.pop(0)
            reply = p.wait()
            retried += p.attempts > 1
            if reply.get("ok"):
                wrong += reply["output"]["echo"] != {"tag": n}
                results["ok"] += 1
            else:
                results[reply["error"]["code"]] += 1
        workers_survived = all(psutil.pid_exists(p) for p in worker_pids)
    finally:
        client.close()
        stats.close()
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for f in logs:
            f.close()
    timeouts = results.pop("timeout", 0)
    log = (workdir / "broker_restart-broker-2.log").read_text(errors="replace")
    listening = first_event(log, r"broker listening")
    joins = [when for when, message in log_events(log) if message.startswith("worker joined")]
    rejoined_at = joins[1] if len(joins) >= 2 else None
    return {
        "scenario": "broker_restart",
        "setup": "batcher broker + 2 batcher worker (defaults); SIGKILL the broker, start a new one on "
        "the same addresses at once; Client(timeout_s=2, retries=3) keeping 16 requests in flight",
        "sent": sent,
        "ok": results.pop("ok", 0),
        "errors": dict(results),
        "wrong": wrong,
        "lost": timeouts,  # no reply after every retry
        "duplicated": 0,  # the Client delivers one reply per request by construction
        "requests_resent_by_client": retried,
        "duplicate_replies_dropped_by_client": client.duplicates_dropped,
        "workers_restarted": not workers_survived,
        "new_broker_listening_after_ms": ms(listening[0] - restarted) if listening else None,
        "workers_rejoined_after_restart_ms": ms(rejoined_at - restarted) if rejoined_at else None,
        "kill_to_workers_back_ms": ms(rejoined_at - killed) if rejoined_at else None,
    }


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s}s")
        time.sleep(0.02)  # between probes of the condition


def graceful_shutdown(ctx: zmq.Context[Any], workdir: Path) -> dict[str, Any]:
    """SIGTERM to serve with 400 requests queued or running, then 20 more after the signal."""
    with serve(["--workers", "2", "--model", "sim"], workdir, "graceful_shutdown", workers=2) as s:
        load = faults.DealerLoad(ctx, s.frontend, clients=4, depth=100)
        late = faults.DealerLoad(ctx, s.frontend, clients=1, depth=20)
        late.sending = False
        stats = StatsPoller(s.frontend, ctx, every_s=0.0)
        try:
            load.burst()
            at_signal = wait_for(
                lambda: (st := stats.poll()) and st["models"]["sim"]["queued"] > 0 and st,
                10,
                "requests queued",
            )["models"]["sim"]
            pids = s.worker_pids()
            signalled = time.monotonic()
            os.kill(s.pid, signal.SIGTERM)
            wait_for(lambda: (st := stats.poll()) and st["stopping"], 10, "draining")
            late.burst()
            drained = load.drain(30) and late.drain(10)
            code = s.process.wait(30)
            took = time.monotonic() - signalled
        finally:
            load.close()
            late.close()
            stats.close()
        left = s.group_alive()
        main, after = load.summary(), late.summary()
        return {
            "scenario": "graceful_shutdown",
            "setup": "serve --workers 2 --model sim; 400 requests sent at once (4 DEALERs), SIGTERM while "
            "they are queued, then 20 requests after the signal",
            "sent": main["sent"] + after["sent"],
            "ok": main["ok"] + after["ok"],
            "errors": dict(Counter(main["errors"]) + Counter(after["errors"])),
            "wrong": main["wrong"] + after["wrong"],
            "lost": main["lost"] + after["lost"],
            "duplicated": main["duplicated"] + after["duplicated"],
            "sent_after_signal": after["sent"],
            "queued_when_signalled": at_signal["queued"],
            "batches_in_flight_when_signalled": at_signal["batches_in_flight"],
            "drained": drained,
            "exit_code": code,
            "sigterm_to_exit_ms": ms(took),
            "processes_left": len(left),
            "worker_pids_were": sorted(pids),
        }


def second_sigterm(ctx: zmq.Context[Any], workdir: Path) -> dict[str, Any]:
    """A second SIGTERM while a long batch runs: everything answered, and how soon serve exits."""
    args = ["--workers", "1", "--model", "sim", "--sim-base-ms", "30000", "--max-batch-size", "2"]
    with serve(args, workdir, "second_sigterm", workers=1) as s:
        load = faults.DealerLoad(ctx, s.frontend, clients=1, depth=6)
        stats = StatsPoller(s.frontend, ctx, every_s=0.0)
        try:
            load.burst()
            wait_for(lambda: (st := stats.poll()) and st["models"]["sim"]["batches_in_flight"], 10, "running")
            os.kill(s.pid, signal.SIGTERM)
            wait_for(lambda: (st := stats.poll()) and st["stopping"], 10, "draining")
            signalled = time.monotonic()
            os.kill(s.pid, signal.SIGTERM)
            drained = load.drain(10)
            answered = time.monotonic() - signalled
            code = s.process.wait(30)
            took = time.monotonic() - signalled
        finally:
            load.close()
            stats.close()
        return {
            "scenario": "second_sigterm",
            "setup": "serve --workers 1 --model sim --sim-base-ms 30000 --max-batch-size 2; 6 requests "
            "(a 30 s batch running), SIGTERM, then a second SIGTERM",
            **load.summary(),
            "drained": drained,
            "all_answered_after_ms": ms(answered),
            "second_sigterm_to_exit_ms": ms(took),
            "exit_code": code,
        }


def malformed_input(ctx: zmq.Context[Any], workdir: Path, count: int) -> dict[str, Any]:
    """`count` malformed messages at the frontend and as many at the backend (seeded)."""
    limit = 1 << 20
    args = ["--workers", "1", "--model", "echo", "--max-message-bytes", str(limit)]
    with serve(args, workdir, "malformed_input", workers=1) as s:
        with Client(s.frontend, timeout_s=10, context=ctx) as c:
            c.request_many(range(200))
            rss_before = psutil.Process(s.pid).memory_info().rss
            rng = random.Random(2026)
            stream = faults.malformed_frontend(rng)
            messages = [next(stream) for _ in range(count)] + [
                m for m in faults.rare_frontend() for _ in range(3)
            ]
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.connect(s.frontend)
            codes: Counter[str] = Counter()
            started = time.monotonic()
            try:
                for n, (_, frames) in enumerate(messages):
                    sock.send_multipart(frames)
                    while n - sum(codes.values()) >= 250 and sock.poll(5000):
                        reply = msgpack.unpackb(sock.recv_multipart()[-1], raw=False, strict_map_key=False)
                        codes["ok" if reply.get("ok") else reply["error"]["code"]] += 1
                while sum(codes.values()) < len(messages) and sock.poll(5000):
                    reply = msgpack.unpackb(sock.recv_multipart()[-1], raw=False, strict_map_key=False)
                    codes["ok" if reply.get("ok") else reply["error"]["code"]] += 1
            finally:
                sock.close(0)
            frontend_s = time.monotonic() - started
            backend_sent = 0
            peers = [ctx.socket(zmq.DEALER) for _ in range(2)]
            try:
                for p in peers:
                    p.setsockopt(zmq.LINGER, 0)
                    p.setsockopt(zmq.RCVHWM, 0)
                    p.connect(s.sp.backend)
                unknown = faults.malformed_backend_unknown(rng)
                for n in range(count):
                    peers[n % 2].send_multipart(next(unknown)[1])
                    backend_sent += 1
                wait_for(
                    lambda: c.control("stats")["dropped_backend_messages"] >= backend_sent,
                    30,
                    "backend drained",
                )
            finally:
                for p in peers:
                    p.close(0)
            oversized = ctx.socket(zmq.DEALER)
            oversized.setsockopt(zmq.LINGER, 0)
            monitor = oversized.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            oversized.connect(s.frontend)
            try:
                # over the hard limit (4 x --max-message-bytes): libzmq drops the sender
                oversized.send_multipart([b"", b"x" * (4 * limit + 1)])
                disconnected = bool(monitor.poll(10_000))
            finally:
                oversized.disable_monitor()
                monitor.close(0)
                oversized.close(0)
            valid_ok = c.request_many(list(range(100))) == list(range(100))
            stats = dict(c.control("stats"))
            rss_after = psutil.Process(s.pid).memory_info().rss
        alive = s.process.poll() is None
        return {
            "scenario": "malformed_input",
            "setup": f"serve --workers 1 --model echo --max-message-bytes {limit}; {count} malformed "
            f"messages (+21 large ones) at the frontend from one DEALER, {count} at the backend "
            "from 2 unregistered peers, one message over the hard size limit",
            "sent": len(messages) + backend_sent + 1,
            "frontend_sent": len(messages),
            "frontend_replies": dict(codes),
            "frontend_unanswered": len(messages) - sum(codes.values()),
            "frontend_seconds": round(frontend_s, 2),
            "backend_sent": backend_sent,
            "backend_dropped_by_broker": stats["dropped_backend_messages"],
            "oversized_sender_disconnected": disconnected,
            "valid_requests_after_ok": valid_ok,
            "broker_alive": alive,
            "rss_before_mib": round(rss_before / 2**20, 1),
            "rss_after_mib": round(rss_after / 2**20, 1),
            "ok": None,
            "errors": {f"{k} (frontend)": v for k, v in codes.items()},
            "lost": len(messages) - sum(codes.values()),
            "duplicated": max(0, sum(codes.values()) - len(messages)),
        }


# --- output ---------------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    commit = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit + ("+local changes" if dirty else ""),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load_average": round(os.getloadavg()[0], 2),
    }


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in sorted(value.items())) or "none"
    if isinstance(value, float):
        return f"{value:,.0f}" if value >= 100 else f"{value:g}"
    return str(value)


def key_figure(name: str, r: dict[str, Any]) -> str:
    """The one number of a scenario that the table's other columns do not show."""
    if name == "worker_sigkill":
        return f"all in flight at the kill answered {fmt(r.get('recover_ms'))} ms after it"
    if name == "worker_sigstop":
        stopped, recovered = fmt(r.get("stopped_for_ms")), fmt(r.get("recover_ms"))
        return f"stopped {stopped} ms; all in flight at the stop answered after {recovered} ms"
    if name == "worker_startup_crash":
        return (
            f"{r.get('crashing_worker_starts')} starts, given up {fmt(r.get('give_up_after_ms'))} ms "
            f"after the first; its model's requests: {fmt(r.get('crashing_model_replies'))}"
        )
    if name == "broker_restart":
        return f"{r.get('requests_resent_by_client')} requests re-sent by the client; workers never restarted"
    if name == "graceful_shutdown":
        return (
            f"{r.get('queued_when_signalled')} queued at SIGTERM; exit {r.get('exit_code')} after "
            f"{fmt(r.get('sigterm_to_exit_ms'))} ms, {r.get('processes_left')} processes left"
        )
    if name == "second_sigterm":
        return (
            f"all answered {fmt(r.get('all_answered_after_ms'))} ms after the 2nd SIGTERM, "
            f"exit after {fmt(r.get('second_sigterm_to_exit_ms'))} ms"
        )
    if name == "malformed_input":
        growth = r["rss_after_mib"] - r["rss_before_mib"]
        return (
            f"{fmt(r.get('backend_sent'))} backend messages dropped; broker alive: {r.get('broker_alive')}, "
            f"RSS +{growth:.1f} MiB"
        )
    return ""


def markdown(results: dict[str, dict[str, Any]], env: dict[str, Any], argv: list[str]) -> str:
    command = "python benchmarks/reliability.py" + ("" if not argv else " " + " ".join(argv))
    lines = [
        "## Reliability under faults",
        "",
        f"_{env['date']}, commit {env['commit']}, {env['cpus']} CPUs, Python {env['python']}, load "
        f"average {env['load_average']} at the end; `{command}`. Each scenario once, defaults "
        "(heartbeat 500 ms x 3 liveness, max-retries 1)._",
        "",
        "| fault | sent | ok | errors | wrong result | lost | duplicated | detect ms | respawn / rejoin ms "
        "| also | reproduce |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for name, r in results.items():
        if "error" in r and "scenario" not in r:
            lines.append(f"| {name} | failed: {r['error']} | | | | | | | | | |")
            continue
        respawn = r.get("respawn_seen_in_stats_ms", r.get("rejoin_seen_in_stats_after_sigcont_ms"))
        if name == "broker_restart":
            respawn = r.get("workers_rejoined_after_restart_ms")
        lines.append(
            f"| {name} | {fmt(r.get('sent'))} | {fmt(r.get('ok'))} | {fmt(r.get('errors'))} | "
            f"{fmt(r.get('wrong'))} | {fmt(r.get('lost'))} | {fmt(r.get('duplicated'))} | "
            f"{fmt(r.get('detect_ms'))} | {fmt(respawn)} | {key_figure(name, r)} | "
            f"`python benchmarks/reliability.py --only {name}` |"
        )
    lines += ["", "Everything each scenario recorded (times in ms):", ""]
    skip = {"scenario", "sent", "ok", "errors", "wrong", "lost", "duplicated"}
    for name, r in results.items():
        extra = "; ".join(f"{k} {fmt(v)}" for k, v in r.items() if k not in skip)
        lines.append(f"- **{name}**: {extra}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help=f"comma-separated subset of {', '.join(SCENARIOS)}")
    p.add_argument(
        "--stop-s", type=float, default=3.0, help="how long worker_sigstop keeps the worker stopped"
    )
    p.add_argument("--malformed", type=int, default=20_000, help="malformed messages per socket side")
    p.add_argument("--out", default=str(RESULTS_DIR / "reliability"), help="output path without extension")
    args = p.parse_args(argv)
    chosen = [s.strip() for s in args.only.split(",") if s.strip()] or list(SCENARIOS)
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    ctx: zmq.Context[Any] = zmq.Context()
    results: dict[str, dict[str, Any]] = {}
    runners: dict[str, Callable[[Path], dict[str, Any]]] = {
        "worker_sigkill": lambda d: worker_fault(ctx, d, "sigkill", 0.0),
        "worker_sigstop": lambda d: worker_fault(ctx, d, "sigstop", args.stop_s),
        "worker_startup_crash": lambda d: worker_startup_crash(ctx, d),
        "broker_restart": lambda d: broker_restart(ctx, d),
        "graceful_shutdown": lambda d: graceful_shutdown(ctx, d),
        "second_sigterm": lambda d: second_sigterm(ctx, d),
        "malformed_input": lambda d: malformed_input(ctx, d, args.malformed),
    }
    try:
        with tempfile.TemporaryDirectory(prefix="batcher-reliability-") as tmp:
            for name in chosen:
                print(f"running {name} ...", file=sys.stderr, flush=True)
                t0 = time.monotonic()
                try:
                    results[name] = runners[name](Path(tmp))
                except Exception as exc:  # report it and go on with the other scenarios
                    results[name] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"  {time.monotonic() - t0:.1f}s: {results[name]}", file=sys.stderr, flush=True)
    finally:
        ctx.destroy(linger=0)
    env = environment()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"environment": env, "results": results}, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(results, env, sys.argv[1:] if argv is None else argv))
    print(out.with_suffix(".md").read_text())
    return 1 if any("error" in r and "scenario" not in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
