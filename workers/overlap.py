"""The model on a thread of its own, for a model that releases the GIL while it computes
(ONNX Runtime's `session.run` does): the worker's main thread decodes the next batch,
and encodes and sends the last one's replies, while the model runs, instead of the
model waiting for them (on one thread they took 8% of a served ONNX worker's time,
docs/benchmarks-history.md). The next batch waits, decoded, in the thread's queue: the thread
goes from one batch to the next without waiting for the main thread, which would
otherwise have to hand it the GIL first. The main loop polls `fd`, readable when a
batch is done.
"""

from __future__ import annotations

import contextlib
import os
import queue
import select
import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

J = TypeVar("J")
T = TypeVar("T")


class ModelThread(Generic[J, T]):
    """Runs `run(job)` on its thread for each job put, in order; `take` gives the results."""

    def __init__(self, run: Callable[[J], T]) -> None:
        self._run = run
        self._todo: queue.SimpleQueue[J | None] = queue.SimpleQueue()  # None: stop
        self._done: deque[tuple[J, T]] = deque()
        self._crash: BaseException | None = None  # what escaped `run`, raised by `take`
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self.in_flight = 0  # put and not taken yet (only the main thread counts)
        self._thread = threading.Thread(target=self._loop, name="model", daemon=True)
        self._thread.start()

    @property
    def fd(self) -> int:
        """Readable once a job is done."""
        return self._read_fd

    def put(self, job: J) -> None:
        self.in_flight += 1
        self._todo.put(job)

    def retract(self) -> list[J]:
        """The jobs not started yet, taken back."""
        jobs: list[J] = []
        while True:
            try:
                job = self._todo.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                jobs.append(job)
        self.in_flight -= len(jobs)
        return jobs

    def take(self) -> list[tuple[J, T]]:
        """The jobs done since the last call, with their results, in order."""
        with contextlib.suppress(BlockingIOError):
            os.read(self._read_fd, 4096)
        if self._crash is not None:
            raise self._crash
        done: list[tuple[J, T]] = []
        while self._done:
            done.append(self._done.popleft())
        self.in_flight -= len(done)
        return done

    def wait(self) -> list[tuple[J, T]]:
        """Block until every job put is done; their results, in order."""
        done = self.take()
        while self.in_flight > 0:
            select.select([self._read_fd], [], [])
            done += self.take()
        return done

    def _loop(self) -> None:
        while True:
            job: J | None = self._todo.get()
            if job is None:
                return
            try:
                self._done.append((job, self._run(job)))
            except BaseException as exc:  # for the main thread to raise
                self._crash = exc
            job = None  # not kept (a whole batch, its inputs) while the next is awaited
            with contextlib.suppress(BlockingIOError):  # a wake-up is pending already
                os.write(self._write_fd, b"\0")

    def close(self, timeout_s: float | None = None) -> None:
        """End the thread once the job at hand (if any) is done, and close the pipe (left
        open if the thread is still in a job after `timeout_s`: it would write to it)."""
        self._todo.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return
        for fd in (self._read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
