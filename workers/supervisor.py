"""Starting and stopping worker processes for `batcher serve`.

Workers are fresh interpreters (subprocesses running `python -m batcher worker`),
never forks of a process that holds a zmq context. Each gets its GPU id and
CUDA_VISIBLE_DEVICES before its model loads, and watches its parent so that no
worker outlives the `serve` that started it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from workers.models import SimSettings

log = logging.getLogger("batcher.supervisor")


@dataclass(frozen=True)
class PoolSettings:
    """Which workers `serve` runs: `workers_per_model` of each model, GPU ids 0, 1, ..."""

    backend: str
    models: tuple[str, ...]
    workers_per_model: int
    sim: SimSettings = field(default_factory=SimSettings)
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if self.workers_per_model < 0:
            raise ValueError(f"workers must be >= 0, got {self.workers_per_model}")


@dataclass
class WorkerProcess:
    """One started worker: what it runs and its process."""

    model: str
    gpu: int
    process: subprocess.Popen[bytes]


def child_environment(**extra: str) -> dict[str, str]:
    """os.environ plus `extra`, with this checkout on PYTHONPATH so `python -m batcher`
    works in the child even when batcher is run from a checkout (bin/batcher)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=root + (os.pathsep + path if path else ""), **extra)


class Supervisor:
    """Owns the worker processes of one `serve`."""

    def __init__(self, settings: PoolSettings) -> None:
        self.settings = settings
        self.workers: list[WorkerProcess] = []

    def command(self, model: str, gpu: int) -> list[str]:
        """The command line of one worker process."""
        s = self.settings
        return [
            sys.executable,
            "-m",
            "batcher",
            "worker",
            "--connect",
            s.backend,
            "--model",
            model,
            "--gpu",
            str(gpu),
            "--sim-base-ms",
            repr(s.sim.base_ms),
            "--sim-per-item-ms",
            repr(s.sim.per_item_ms),
            "--log-level",
            s.log_level,
            "--parent-pid",
            str(os.getpid()),
        ]

    def start(self) -> None:
        """Start every worker; worker i gets GPU id i."""
        gpu = 0
        for model in self.settings.models:
            for _ in range(self.settings.workers_per_model):
                self.workers.append(self._spawn(model, gpu))
                gpu += 1

    def _spawn(self, model: str, gpu: int) -> WorkerProcess:
        env = child_environment(CUDA_VISIBLE_DEVICES=str(gpu))
        # Same process group as `serve` (so killing the group leaves nothing behind); the
        # worker ignores SIGINT, so a terminal's Ctrl-C lets `serve` drain first.
        proc = subprocess.Popen(self.command(model, gpu), env=env)
        log.info("started worker for model %s on gpu %d (pid %d)", model, gpu, proc.pid)
        return WorkerProcess(model, gpu, proc)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM every worker (each finishes its batch), SIGKILL those still up after
        `timeout_s`, and reap them all."""
        for w in self.workers:
            if w.process.poll() is None:
                w.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            try:
                w.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker pid %d did not stop in %.1fs; killing it", w.process.pid, timeout_s)
                w.process.kill()
                w.process.wait()
        self.workers.clear()
