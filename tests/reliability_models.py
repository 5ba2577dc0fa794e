"""Fixtures for the reliability tests: a worker model that reports which requests it
holds (`tests.reliability_models:Sleepy`), and the fault helpers that
benchmarks/reliability.py uses too, which live in benchmarks/faults.py (benchmarks/
imports nothing from tests/; the tests import from there) and are re-exported here.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil

from benchmarks.faults import (
    BATCH,
    DISCONNECT,
    HEARTBEAT,
    NAN,
    REPLY,
    WORKER_PROTOCOL,
    CrashAtStartup,
    DealerLoad,
    LoggedServe,
    _reply_header,
    bad_ready_info,
    malformed_backend_unknown,
    malformed_frontend,
    pack,
    rare_frontend,
)

__all__ = [
    "DISCONNECT",
    "HEARTBEAT",
    "MARKS_ENV",
    "NAN",
    "WORKER_PROTOCOL",
    "CrashAtStartup",
    "DealerLoad",
    "LoggedServe",
    "Sleepy",
    "bad_ready_info",
    "in_flight_on",
    "malformed_backend_known",
    "malformed_backend_unknown",
    "malformed_frontend",
    "pack",
    "rare_frontend",
    "read_marks",
    "stop_inside_a_batch",
]

#: When set in a worker's environment, `Sleepy` appends one JSON line per batch start and
#: end to this file: {"event": "start"|"end", "pid": ..., "tags": [...], "t": unix time}.
MARKS_ENV = "RELIABILITY_MARKS_FILE"


class Sleepy:
    """Sleeps as long as the longest `sleep` of its batch's inputs (dicts such as
    {"tag": "c0-1", "sleep": 0.05}), then echoes each input with the worker's pid.
    With RELIABILITY_MARKS_FILE set, logs when each batch starts and ends, so a test
    knows which worker holds which requests at a given moment."""

    def __init__(self, gpu: int | None) -> None:
        self.gpu = gpu
        self.marks = os.environ.get(MARKS_ENV)

    def _mark(self, event: str, inputs: list[Any]) -> None:
        if not self.marks:
            return
        tags = [x.get("tag") if isinstance(x, dict) else None for x in inputs]
        line = json.dumps({"event": event, "pid": os.getpid(), "tags": tags, "t": time.time()})
        fd = os.open(self.marks, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())  # one write: lines of concurrent workers never mix
        finally:
            os.close(fd)

    def __call__(self, inputs: list[Any]) -> list[Any]:
        self._mark("start", inputs)
        delay = max((float(x.get("sleep", 0)) for x in inputs if isinstance(x, dict)), default=0.0)
        time.sleep(delay)
        self._mark("end", inputs)
        return [{"input": x, "pid": os.getpid()} for x in inputs]


def read_marks(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The marks `Sleepy` wrote so far (a line still being written is skipped)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def in_flight_on(path: str | os.PathLike[str], pid: int) -> dict[str, Any] | None:
    """The batch worker `pid` is running now (its last mark is a start), per Sleepy's marks;
    None when it is between batches."""
    own = [m for m in read_marks(path) if m["pid"] == pid]
    return own[-1] if own and own[-1]["event"] == "start" else None


def stop_inside_a_batch(
    path: str | os.PathLike[str],
    pid: int,
    timeout_s: float,
    keep_going: Callable[[], object] = lambda: time.sleep(0.005),
) -> dict[str, Any]:
    """SIGSTOP worker `pid` (a Sleepy one) while it runs a batch; returns that batch's start
    mark. The marks are read again once the process is stopped, so the batch cannot have
    ended, nor its reply gone out, before the fault lands: if it had, the worker is
    SIGCONTed and its next batch awaited. `keep_going()` runs between looks (a load's
    `step`, or a short pause). The caller SIGKILLs or SIGCONTs the worker."""
    proc = psutil.Process(pid)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if in_flight_on(path, pid):
            os.kill(pid, signal.SIGSTOP)
            while proc.status() != psutil.STATUS_STOPPED:  # kill() returns before it lands
                if time.monotonic() > deadline:
                    raise TimeoutError(f"worker {pid} not stopped within {timeout_s}s")
                time.sleep(0.001)  # polling the process state
            held = in_flight_on(path, pid)
            if held:
                return held
            os.kill(pid, signal.SIGCONT)  # the batch ended just before: wait for the next
        keep_going()
    raise TimeoutError(f"worker {pid} not stopped inside a batch within {timeout_s}s")


def malformed_backend_known(rng: random.Random) -> Iterator[tuple[str, list[bytes]]]:
    """Messages from a peer that did announce itself (a registered, misbehaving worker):
    replies for batches never sent, malformed replies, unknown commands."""
    while True:
        kind = rng.randrange(4)
        if kind == 0:
            yield "reply for a batch never sent", [WORKER_PROTOCOL, REPLY, _reply_header(rng), b"x" * 3]
        elif kind == 1:
            frames = [WORKER_PROTOCOL, REPLY, *[rng.randbytes(4)] * rng.choice([0, 1, 3])]
            yield "reply with wrong frame count", frames
        elif kind == 2:
            yield "unknown command", [WORKER_PROTOCOL, rng.choice([BATCH, b"\x00", b"\x07"]), b"x"]
        else:
            yield "random frames", [rng.randbytes(rng.randint(0, 16)) for _ in range(rng.randint(1, 3))]
