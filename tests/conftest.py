"""Fixtures that own their processes and sockets, and a check that nothing outlives a test.

Every process a fixture starts runs in a process group of its own and is killed by
that group at teardown, whether the test passed or not. After every test, any process
still running below the test process, or in one of those groups, fails the test loudly
(and is killed, by PID, so the next test starts clean).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq
from hypothesis import settings

from batcher.client.sync import Client
from batcher.serve.launcher import ServeProcess
from tests.helpers import Answer, FakeBroker, fake_brokers
from workers.supervisor import child_environment

# Hypothesis profiles. "dev" (the default) draws fresh examples on every run, so local runs
# keep searching; "ci" is derandomized, so a CI run can never go red on a new draw (it is
# chosen when CI is set); "search" is benchmarks/property_search.py's, with many more
# examples per seed. Tests do not set max_examples themselves, so a profile decides.
settings.register_profile("dev", max_examples=150, deadline=None)
settings.register_profile("ci", max_examples=150, deadline=None, derandomize=True, database=None)
settings.register_profile("search", max_examples=1500, deadline=None, database=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")  # --hypothesis-profile overrides

#: Process groups started by the fixtures of the current test; checked after each test.
_GROUPS: set[int] = set()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Keep each phase's report on the item, so fixtures can tell whether the test failed."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


def _failed(request: pytest.FixtureRequest) -> bool:
    node = request.node
    return any(getattr(getattr(node, f"rep_{w}", None), "failed", False) for w in ("setup", "call"))


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid}: {' '.join(p.cmdline())}"
    except psutil.Error:
        return f"pid {p.pid}"


def _group_members(pgids: set[int]) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) in pgids and _alive(p):
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            continue
    return out


def kill_group(pgid: int, timeout_s: float = 5.0) -> None:
    """SIGTERM a process group, then SIGKILL whatever of it is still up after `timeout_s`."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _group_members({pgid}) and time.monotonic() < deadline:
        psutil.wait_procs(_group_members({pgid}), timeout=0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@pytest.fixture(autouse=True)
def no_leftover_processes() -> Iterator[None]:
    """Fail any test after which a process it started (directly or not) is still running."""
    _GROUPS.clear()
    yield
    me = psutil.Process()
    leftovers = {p.pid: p for p in me.children(recursive=True) if _alive(p)}
    leftovers.update({p.pid: p for p in _group_members(_GROUPS)})
    _GROUPS.clear()
    if not leftovers:
        return
    described = [_describe(p) for p in leftovers.values()]
    for p in leftovers.values():
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(list(leftovers.values()), timeout=5)
    pytest.fail("processes left running after the test (now killed):\n  " + "\n  ".join(described))


# --- batcher serve ----------------------------------------------------------------------------


@pytest.fixture
def serve(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., ServeProcess]]:
    """Factory: `serve(*args, workers=N)` starts `batcher serve ARGS` on free loopback ports,
    waits until N workers have joined and returns the ServeProcess. Teardown stops it by
    process group (SIGTERM, then SIGKILL after `stop_timeout_s`); on failure its stderr
    is printed."""
    started: list[tuple[ServeProcess, Any, Path]] = []
    stop_timeouts: dict[int, float] = {}

    def start(*args: str, workers: int, timeout_s: float = 20.0, stop_timeout_s: float = 5.0) -> ServeProcess:
        path = tmp_path / f"serve-{len(started)}.stderr"
        stderr = path.open("wb")
        sp = ServeProcess(list(args), log_level="INFO", stderr=stderr)
        started.append((sp, stderr, path))
        stop_timeouts[id(sp)] = stop_timeout_s
        sp.start()
        assert sp.process is not None
        _GROUPS.add(sp.process.pid)
        sp.wait_ready(workers, timeout_s=timeout_s)
        return sp

    yield start
    for sp, stderr, _ in started:
        try:
            sp.stop(timeout_s=stop_timeouts[id(sp)])
        finally:
            stderr.close()
    if _failed(request):
        for sp, _, path in started:
            print(f"----- stderr of {' '.join(sp.command())}")
            print(path.read_text(errors="replace"))


# --- other batcher processes --------------------------------------------------------------------


@dataclass
class Spawned:
    """A batcher process started by the `spawn` fixture."""

    args: list[str]
    process: subprocess.Popen[bytes]
    stderr_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid


@pytest.fixture
def spawn(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., Spawned]]:
    """Factory: `spawn("broker", ...)` starts `python -m batcher ...` in a new session with
    the checkout importable; teardown kills its process group. `env` adds (or, with a
    None value, removes) environment variables."""
    started: list[tuple[Spawned, Any]] = []

    def start(*args: str, env: Mapping[str, str | None] | None = None) -> Spawned:
        environ = child_environment()
        for key, value in (env or {}).items():
            if value is None:
                environ.pop(key, None)
            else:
                environ[key] = value
        path = tmp_path / f"spawn-{len(started)}-{args[0]}.stderr"
        stderr = path.open("wb")
        cmd = [sys.executable, "-m", "batcher", *args]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=stderr, env=environ, start_new_session=True
        )
        _GROUPS.add(proc.pid)
        spawned = Spawned(cmd, proc, path)
        started.append((spawned, stderr))
        return spawned

    yield start
    for spawned, stderr in reversed(started):
        try:
            kill_group(spawned.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                spawned.process.wait(5)
        finally:
            stderr.close()
    if _failed(request):
        for spawned, _ in started:
            print(f"----- stderr of {' '.join(spawned.args)}")
            print(spawned.stderr_path.read_text(errors="replace"))


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli() -> Callable[..., CliResult]:
    """Run `python -m batcher ARGS` to completion within `timeout_s`; on timeout kill it and
    everything it started (by group and by PID) and fail."""

    def run(*args: str, timeout_s: float = 20.0, stdin: str | None = None) -> CliResult:
        cmd = [sys.executable, "-m", "batcher", *args]
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=child_environment(),
            start_new_session=True,
            text=True,
        )
        _GROUPS.add(proc.pid)
        try:
            out, err = proc.communicate(stdin, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            descendants = []
            with contextlib.suppress(psutil.Error):
                descendants = psutil.Process(proc.pid).children(recursive=True)
            kill_group(proc.pid, timeout_s=0)
            for p in descendants:  # e.g. the `serve` that `demo` runs in a group of its own
                with contextlib.suppress(psutil.Error):
                    p.kill()
            psutil.wait_procs(descendants, timeout=5)
            out, err = proc.communicate()
            pytest.fail(f"{' '.join(cmd)} did not finish within {timeout_s}s\nstdout:\n{out}\nstderr:\n{err}")
        return CliResult(proc.returncode, out, err)

    return run


# --- sockets ----------------------------------------------------------------------------------


@pytest.fixture
def zctx() -> Iterator[zmq.Context[Any]]:
    """A zmq context of the test's own; all its sockets are closed with linger 0 at teardown."""
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def connect(zctx: zmq.Context[Any]) -> Callable[[int, str], zmq.Socket[Any]]:
    """Factory: `connect(zmq.DEALER, address)`, a socket with linger 0, closed at teardown."""

    def make(kind: int, address: str) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = zctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        return sock

    return make


@pytest.fixture
def client(zctx: zmq.Context[Any]) -> Iterator[Callable[..., Client]]:
    """Factory: `client(address, timeout_s=...)`, a batcher Client closed at teardown."""
    made: list[Client] = []

    def make(address: str, timeout_s: float = 10.0) -> Client:
        c = Client(address, timeout_s=timeout_s, context=zctx)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture
def fake_broker() -> Iterator[Callable[[Answer], FakeBroker]]:
    """Factory: `fake_broker(answer)`, a scripted stand-in broker (tests/helpers.py), stopped
    at teardown."""
    with fake_brokers() as make:
        yield make


# --- the integration mark ----------------------------------------------------------------------

#: Fixtures that start processes or whose tests depend on time: a test using one must be
#: marked `integration`, so `-m "not integration"` leaves only fast, time-free unit tests.
PROCESS_FIXTURES = frozenset({"serve", "spawn", "cli", "fake_broker"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse to run a test that starts processes (or a fake broker thread) unmarked."""
    unmarked = [
        item.nodeid
        for item in items
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ()))
        and item.get_closest_marker("integration") is None
    ]
    if unmarked:
        raise pytest.UsageError(
            "tests that start processes must be marked integration:\n  " + "\n  ".join(unmarked)
        )
