"""`batcher bench`: a load generator for a running broker, as perf_analyzer is for Triton.

Load comes from separate processes, each with one DEALER socket, so the measuring
process never competes with them for the GIL; they start together (each connects,
then waits for the word "go"), so their windows coincide. Closed loop keeps N requests in flight; open
loop sends at Poisson-distributed times fixed in advance, and latency is counted from
the time a request was due to be sent, so a slow server cannot slow the load down and
hide its queueing (no coordinated omission). Latencies go into an HDR histogram.

What is counted, and why (a bench that flatters the broker is worse than none):

- The measured window is `duration_s` after `warmup_s`. Throughput is the successful
  replies that *arrive* inside it divided by its length: replies drained after it
  would inflate the rate, dividing by the time spent sending alone even more so.
  With `requests` instead of a duration, the window runs from the end of warm-up
  (the first send) to the last reply, and is labelled so.
- Latency percentiles cover the successful replies to the requests *sent* in the
  window, whenever they arrive: those still unanswered at the window's end are
  counted "in flight at the end", then either answered late (their latency is in
  the percentiles: under overload those are the slowest) or lost (no latency).
- An open loop reports the offered and achieved rates side by side, and says the
  broker fell behind when its backlog grew over the window beyond Poisson noise.
- A run that got no reply at all, or no successful one, carries a `failure` message;
  `batcher bench` exits non-zero on it.

The parts: `bench_settings` (LoadSettings, ShardResult), `bench_shard` (one process's
load loop), `bench_report` (merging and judging the shards, the printed summary); this
module starts the load processes and gathers their results (run_load), and re-exports
the parts' names.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import IO, Any

from batcher.cli.bench_report import BenchFailed, LoadResult, format_report, merge
from batcher.cli.bench_settings import (
    CLIENT_BUSY_LIMIT,
    HIST_MAX_US,
    PERCENTILES,
    PROGRESS_INTERVAL_S,
    START_TIMEOUT_S,
    LoadSettings,
    ShardResult,
    new_histogram,
    noise_allowance,
)
from batcher.cli.bench_shard import ReplyHead, read_head, run_shard
from batcher.transport.security import load_keypair, load_public_key
from workers.supervisor import child_environment

#: Everything here, and the names of the modules the load generator is made of
#: (bench_settings, bench_shard, bench_report), as they were when it was one module.
__all__ = [
    "CLIENT_BUSY_LIMIT",
    "HIST_MAX_US",
    "PERCENTILES",
    "PROGRESS_INTERVAL_S",
    "START_TIMEOUT_S",
    "BenchFailed",
    "LoadResult",
    "LoadSettings",
    "ReplyHead",
    "ShardResult",
    "check_keys",
    "format_report",
    "merge",
    "new_histogram",
    "noise_allowance",
    "read_head",
    "run_load",
    "run_shard",
]


# --- load processes ------------------------------------------------------------------------------
# Each is `python -c` (not multiprocessing, whose helper process, the resource tracker,
# outlives the run, and whose "spawn" re-imports the caller's main module). Messages are
# pickled frames: settings and then "go" on its stdin; "ready", progress counts and the
# result (or an error) on a pipe of its own, so nothing it prints can be taken for one.

_CHILD_CODE = "from batcher.cli.bench import _load_process_main; _load_process_main()"


def _write_frame(f: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj)
    f.write(len(data).to_bytes(4, "big") + data)
    f.flush()


def _read_exact(f: IO[bytes], size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = f.read(left)  # an unbuffered pipe may return less
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_frame(f: IO[bytes]) -> Any:
    """One frame; EOFError when the other side closed (or died)."""
    return pickle.loads(_read_exact(f, int.from_bytes(_read_exact(f, 4), "big")))


def _load_process_main() -> None:
    """A load process: run one shard as the parent (run_load) says, report back to it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # on Ctrl-C the parent stops us itself
    commands = sys.stdin.buffer
    with os.fdopen(int(sys.argv[1]), "wb") as out:

        def start() -> None:
            _write_frame(out, ("ready",))
            _read_frame(commands)  # "go"

        try:
            settings = _read_frame(commands)
            result = run_shard(settings, lambda n: _write_frame(out, ("progress", n)), start)
        except Exception as exc:  # reported to the parent, which raises it
            _write_frame(out, ("error", f"{type(exc).__name__}: {exc}"))
        else:
            _write_frame(out, ("result", result))


class _LoadProcess:
    """One load process, seen from run_load."""

    def __init__(self, settings: LoadSettings) -> None:
        read_fd, write_fd = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD_CODE, str(write_fd)],
                stdin=subprocess.PIPE,
                pass_fds=(write_fd,),
                env=child_environment(),
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        # unbuffered: select() on the pipe must see every message not yet read
        self.messages = os.fdopen(read_fd, "rb", buffering=0)
        self.ready = False
        self.replies = 0
        self.result: ShardResult | None = None
        assert self.proc.stdin is not None
        self.commands = self.proc.stdin
        _write_frame(self.commands, settings)

    def fileno(self) -> int:
        return self.messages.fileno()

    def take(self) -> None:
        """Read one message (written whole, so this does not wait on a half)."""
        try:
            kind, *rest = _read_frame(self.messages)
        except EOFError:
            code = self.proc.wait(5)
            raise RuntimeError(f"a load process died without a result (exit code {code})") from None
        if kind == "ready":
            self.ready = True
        elif kind == "progress":
            self.replies = rest[0]
        elif kind == "result":
            self.result = rest[0]
        else:
            raise RuntimeError(f"load process failed: {rest[0]}")

    def go(self) -> None:
        with contextlib.suppress(BrokenPipeError):  # it died: its message pipe will say so
            _write_frame(self.commands, "go")
            self.commands.close()

    def close(self, kill: bool) -> None:
        """Reap the process; `kill` when the run is abandoned and its load must stop now."""
        if kill and self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.messages.close()
        with contextlib.suppress(BrokenPipeError):
            self.commands.close()


def _take_messages(procs: list[_LoadProcess], timeout_s: float) -> None:
    """Read the messages that are waiting, up to `timeout_s` for the first."""
    pending = [p for p in procs if p.result is None]
    readable, _, _ = select.select(pending, [], [], timeout_s)
    for p in readable:
        p.take()


def check_keys(settings: LoadSettings) -> None:
    """Load the CURVE key files here, so a bad one fails before any process starts
    (KeyFileError, a ValueError, naming the file)."""
    if settings.curve_server_key is not None:
        load_public_key(settings.curve_server_key)
    if settings.curve_secret_key is not None:
        load_keypair(settings.curve_secret_key)


def run_load(settings: LoadSettings, on_progress: Callable[[int], None] | None = None) -> LoadResult:
    """Run the load from `settings.processes` spawned processes and merge their results.

    `on_progress(completed)` is called about ten times a second while it runs. A run
    without any reply returns normally, with `failure` set (`.check()` raises it)."""
    check_keys(settings)
    procs: list[_LoadProcess] = []
    finished = False
    try:
        for i in range(settings.processes):
            procs.append(_LoadProcess(settings.shard(i)))
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(p.ready for p in procs):  # all connected: then all start at once
            if time.monotonic() > deadline:
                raise RuntimeError(f"load processes not started within {START_TIMEOUT_S:g} s")
            _take_messages(procs, 0.1)
        for p in procs:
            p.go()
        while any(p.result is None for p in procs):
            _take_messages(procs, 0.1)
            if on_progress is not None:
                on_progress(sum(p.replies for p in procs))
        finished = True
    finally:
        for p in procs:
            p.close(kill=not finished)
    shards = [p.result for p in procs if p.result is not None]
    if on_progress is not None:
        on_progress(sum(sh.replies for sh in shards))
    return merge(settings, shards)
