"""A model that releases the GIL runs on the worker's model thread (workers/overlap.py):
the thread itself, then a worker serving such a model through a scripted backend, where
the batch at hand, the next one (queued with the thread) and the rest (pending) must each
be answered, or handed back to the broker, exactly as on the main thread."""

from __future__ import annotations

import gc
import select
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest

from batcher.wire import protocol
from tests.helpers import pack, unpack, wait_until
from workers.overlap import ModelThread

NOGIL = "nogil=tests.fixture_models:NoGil"


def readable(fd: int, timeout_s: float) -> bool:
    return bool(select.select([fd], [], [], timeout_s)[0])


# --- the thread ------------------------------------------------------------------------------


def test_jobs_run_in_order_on_their_thread_and_the_fd_says_when_one_is_done() -> None:
    gate = threading.Event()
    ran: list[tuple[int, str]] = []

    def run(job: int) -> int:
        gate.wait(10)
        ran.append((job, threading.current_thread().name))
        return job * 10

    runner: ModelThread[int, int] = ModelThread(run)
    try:
        for job in (1, 2, 3):
            runner.put(job)
        assert runner.in_flight == 3
        assert not readable(runner.fd, 0.05) and runner.take() == []
        gate.set()
        assert readable(runner.fd, 10)
        assert runner.wait() == [(1, 10), (2, 20), (3, 30)]
        assert runner.in_flight == 0 and runner.take() == []
        assert ran == [(1, "model"), (2, "model"), (3, "model")]
    finally:
        gate.set()
        runner.close(timeout_s=10)


def test_jobs_not_started_are_taken_back() -> None:
    started, gate = threading.Event(), threading.Event()

    def run(job: int) -> int:
        started.set()
        gate.wait(10)
        return job

    runner: ModelThread[int, int] = ModelThread(run)
    try:
        runner.put(1)
        assert started.wait(10)
        runner.put(2)
        runner.put(3)
        assert runner.retract() == [2, 3]
        assert runner.in_flight == 1
        gate.set()
        assert runner.wait() == [(1, 1)]
    finally:
        gate.set()
        runner.close(timeout_s=10)


def test_what_escapes_a_job_is_raised_by_take() -> None:
    def run(job: int) -> int:
        raise SystemExit(job)

    runner: ModelThread[int, int] = ModelThread(run)
    runner.put(7)
    assert readable(runner.fd, 10)
    with pytest.raises(SystemExit):
        runner.take()
    runner.close(timeout_s=10)


def test_close_gives_up_on_a_job_that_does_not_end() -> None:
    gate = threading.Event()
    runner: ModelThread[int, bool] = ModelThread(lambda job: gate.wait(10))
    runner.put(1)
    runner.close(timeout_s=0.05)  # returns; the thread is a daemon and ends with its job
    gate.set()


# --- a worker with a model thread, through a scripted backend ---------------------------------------


def batch(batch_id: int, *ids: int, sleep: float = 0.0) -> tuple[bytes, list[bytes]]:
    bodies = [pack({"id": i, "input": {"i": i, "sleep": sleep}}) for i in ids]
    return pack([batch_id, [0.0] * len(ids), [len(b) for b in bodies]]), bodies


def reply_of(frames: list[bytes]) -> tuple[int, list[dict[str, Any]]]:
    batch_id, _, lengths, *_ = unpack(frames[3])
    return batch_id, [unpack(r) for r in protocol.split_bodies(lengths, frames[4:])]


def runs(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_a_job_is_not_kept_once_it_is_done() -> None:
    """The thread waits for the next job without holding the last (a whole batch)."""

    class Job:
        pass

    runner: ModelThread[Job, int] = ModelThread(lambda job: 1)
    try:
        job = Job()
        alive = weakref.ref(job)
        runner.put(job)
        del job
        assert runner.wait()[0][1] == 1
        wait_until(lambda: gc.collect() >= 0 and alive() is None, 5, "the job let go")
    finally:
        runner.close(timeout_s=10)
