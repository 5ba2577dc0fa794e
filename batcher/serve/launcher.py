"""Start a `batcher serve` on free loopback ports and stop it by process group.

Used by `batcher demo`, `batcher bench --spawn`, the benchmarks and the tests, so all
of them wait for readiness the same way (asking the broker, never sleeping) and
leave no process behind.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from batcher.client.sync import BatcherError, Client
from workers.supervisor import child_environment

#: How many ports below the kernel's ephemeral range free_tcp_address draws from.
PICKED_PORTS = 12_000
_PICK = random.SystemRandom()  # unaffected by random.seed, and different in every process
_handed_out: set[int] = set()


def free_tcp_address() -> str:
    """A loopback TCP address whose port was free a moment ago, drawn from below the
    kernel's ephemeral range: a port found by binding to 0 lies inside that range, where
    any process's outgoing connection may take it before the process we start binds it
    (seen as `Address already in use` when tests ran beside a busy load)."""
    low = _ephemeral_low()
    if low - PICKED_PORTS >= 1024:
        for _ in range(100):
            port = _PICK.randrange(low - PICKED_PORTS, low)
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)  # not twice from one process: the first may not be bound yet
                return f"tcp://127.0.0.1:{port}"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _ephemeral_low() -> int:
    """The lowest port the kernel gives outgoing connections (Linux; 0 where unknown)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class ServeProcess:
    """A `batcher serve` subprocess in its own process group."""

    def __init__(self, args: list[str], *, log_level: str = "WARNING", stderr: Any = None) -> None:
        self.frontend = free_tcp_address()
        self.backend = free_tcp_address()
        self.args = args
        self.log_level = log_level
        self.stderr = stderr
        self.process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "batcher",
            "serve",
            "--frontend",
            self.frontend,
            "--backend",
            self.backend,
            "--log-level",
            self.log_level,
            *self.args,
        ]

    def start(self) -> ServeProcess:
        self.process = subprocess.Popen(
            self.command(), start_new_session=True, stderr=self.stderr, env=child_environment()
        )
        return self

    def wait_ready(self, workers: int, timeout_s: float = 30.0) -> dict[str, Any]:
        """Block until the broker reports `workers` workers in all (or raise TimeoutError)."""
        deadline = time.monotonic() + timeout_s
        with Client(self.frontend, timeout_s=1.0) as client:
            while True:
                if self.process is not None and self.process.poll() is not None:
                    raise RuntimeError(f"batcher serve exited with {self.process.returncode}")
                try:
                    stats: dict[str, Any] = client.control("stats")
                    if sum(m["workers"] for m in stats["models"].values()) >= workers:
                        return stats
                except BatcherError:
                    pass  # not up yet: the control request timed out
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{workers} workers not ready within {timeout_s}s")
                time.sleep(0.05)  # between readiness probes only

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM the process group, then SIGKILL it if it lingers; returns serve's exit code."""
        p = self.process
        if p is None:
            return None
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
            try:
                p.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        _kill_group(p.pid)  # anything of the group still up
        return p.returncode

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
