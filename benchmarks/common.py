"""Helpers shared by the benchmark scripts: servers, load, medians, capacity, RSS, results.

The scripts import this module by name (`from common import ...`): run them as
`python benchmarks/NAME.py`, which puts this folder first on sys.path.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgpack
import zmq

from batcher.cli.bench import LoadResult, LoadSettings, run_load
from batcher.serve.launcher import ServeProcess, free_tcp_address

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
ECHO_LOOP = BENCH_DIR / "echo_loop.py"
FORWARDER = BENCH_DIR / "forwarder.py"

#: The sim model's cost (workers/models.py): a batch of n takes 20 ms + 2.5 ms * n.
SIM_BASE_MS = 20.0
SIM_PER_ITEM_MS = 2.5


# --- the model's arithmetic --------------------------------------------------------------------


def sim_batch_ms(n: int, base_ms: float = SIM_BASE_MS, per_item_ms: float = SIM_PER_ITEM_MS) -> float:
    """t(n): how long the sim model takes for a batch of n."""
    return base_ms + per_item_ms * n


def theoretical_capacity(
    workers: int, max_batch: int, base_ms: float = SIM_BASE_MS, per_item_ms: float = SIM_PER_ITEM_MS
) -> float:
    """W * B / t(B) in requests per second: every worker always busy with full batches."""
    return workers * max_batch * 1000.0 / sim_batch_ms(max_batch, base_ms, per_item_ms)


# --- medians -----------------------------------------------------------------------------------


def median_of(runs: Sequence[Any]) -> Any:
    """The median of several runs.

    Numbers give their median; mappings give a mapping of per-key medians (recursively,
    over the keys present in every run); booleans give True only when all runs were
    True (e.g. "the client kept up"); anything else is taken from the first run.
    """
    if not runs:
        raise ValueError("median_of needs at least one run")
    first = runs[0]
    if isinstance(first, bool):
        return all(bool(r) for r in runs)
    if isinstance(first, int | float):
        return statistics.median(float(r) for r in runs)
    if isinstance(first, Mapping):
        keys = [k for k in first if all(isinstance(r, Mapping) and k in r for r in runs)]
        return {k: median_of([r[k] for r in runs]) for k in keys}
    return first


def summarize(result: LoadResult) -> dict[str, Any]:
    """The numbers of one load run that the tables use, flat, in milliseconds and req/s.

    throughput_rps counts the ok replies that arrived inside the measured window only;
    the percentiles cover the requests sent in it, late replies included (batcher.cli.bench)."""
    lat = result.latency_ms
    return {
        "throughput_rps": result.throughput_rps,
        "window_s": result.window_s,
        "offered_rate": result.offered_rate,
        "achieved_rate": result.achieved_rate,
        "fell_behind": result.fell_behind,
        "broker_notes": list(result.broker_notes),
        "in_flight_at_end": result.in_flight_at_end,
        "late": result.late,
        "p50_ms": lat["p50"],
        "p90_ms": lat["p90"],
        "p99_ms": lat["p99"],
        "p99.9_ms": lat["p99.9"],
        "max_ms": lat["max"],
        "mean_ms": lat["mean"],
        "mean_batch_size": result.mean_batch_size,
        "ok": result.ok,
        "errors": sum(result.errors.values()),
        "lost": result.lost,
        "client_cpu_share": result.client["max_cpu_share"],
        "client_kept_up": bool(result.client["kept_up"]),
        "client_notes": list(result.client["notes"]),
    }


def median_summary(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """median_of over summarize() dicts, keeping every run's client notes and error counts."""
    out: dict[str, Any] = median_of(runs)
    out["runs"] = len(runs)
    out["errors"] = sum(int(r["errors"]) for r in runs)
    out["lost"] = sum(int(r["lost"]) for r in runs)
    out["client_notes"] = sorted({n for r in runs for n in r.get("client_notes", [])})
    behind = [r.get("fell_behind") for r in runs]
    out["fell_behind"] = None if all(b is None for b in behind) else any(bool(b) for b in behind)
    out["broker_notes"] = sorted({n for r in runs for n in r.get("broker_notes", [])})
    return out


# --- load --------------------------------------------------------------------------------------


def closed_loop(
    address: str,
    concurrency: int,
    duration_s: float,
    warmup_s: float,
    *,
    model: str | None = None,
    processes: int = 1,
    payload_bytes: int = 16,
) -> LoadResult:
    """Keep `concurrency` requests in flight for warmup_s + duration_s (batcher.cli.bench);
    BenchFailed when nothing answered, rather than a table row of zeros."""
    return run_load(
        LoadSettings(
            connect=address,
            concurrency=concurrency,
            duration_s=duration_s,
            warmup_s=warmup_s,
            model=model,
            processes=processes,
            payload_bytes=payload_bytes,
        )
    ).check()


def open_loop(
    address: str,
    rate: float,
    duration_s: float,
    warmup_s: float,
    *,
    model: str | None = None,
    processes: int = 1,
    payload_bytes: int = 16,
    seed: int | None = None,
) -> LoadResult:
    """Poisson arrivals at `rate` per second for warmup_s + duration_s (batcher.cli.bench);
    BenchFailed when nothing answered."""
    return run_load(
        LoadSettings(
            connect=address,
            rate=rate,
            duration_s=duration_s,
            warmup_s=warmup_s,
            model=model,
            processes=processes,
            payload_bytes=payload_bytes,
            seed=seed,
        )
    ).check()


# --- servers -----------------------------------------------------------------------------------


def serve_args(
    *,
    workers: int,
    model: str = "sim",
    max_batch_size: int,
    max_wait_ms: float,
    extra: Sequence[str] = (),
) -> list[str]:
    """The `batcher serve` arguments the benchmarks use."""
    return [
        "--workers",
        str(workers),
        "--model",
        model,
        "--max-batch-size",
        str(max_batch_size),
        "--max-wait-ms",
        repr(float(max_wait_ms)),
        *extra,
    ]


class ServeFrom(ServeProcess):
    """`batcher serve` run from another source tree (its `batcher` and `workers` imported
    from there, e.g. `git archive main | tar -x -C /tmp/base`): a same-run before/after."""

    def __init__(self, args: list[str], source: Path) -> None:
        super().__init__(args)
        self.source = source

    def start(self) -> ServeFrom:
        env = {**os.environ, "PYTHONPATH": str(self.source)}
        self.process = subprocess.Popen(self.command(), start_new_session=True, cwd=self.source, env=env)
        return self


@contextlib.contextmanager
def running_serve(
    args: list[str], workers: int, timeout_s: float = 60.0, source: Path | None = None
) -> Iterator[ServeProcess]:
    """A started `batcher serve` with all its workers joined (run from `source`, another
    source tree, when given); stopped on exit, always."""
    proc = ServeProcess(args) if source is None else ServeFrom(args, source)
    try:
        proc.start()
        proc.wait_ready(workers, timeout_s=timeout_s)
        yield proc
    finally:
        proc.stop()


@functools.cache
def serve_help() -> str:
    """The text of `batcher serve --help` for this checkout."""
    out = subprocess.run(
        [sys.executable, "-m", "batcher", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO_ROOT,
    )
    return out.stdout + out.stderr


def policy_option(help_text: str) -> tuple[bool, list[str], str | None]:
    """Whether `serve --help` lists a --policy option, its choices and its default (when shown)."""
    lines = help_text.splitlines()
    for i, line in enumerate(lines):
        match = re.match(r"\s*--policy(?=[\s=,]|$)(.*)$", line)
        if match is None:
            continue
        block = [match.group(1)]  # the option's help runs on until the next option
        for nxt in lines[i + 1 :]:
            if re.match(r"\s*-", nxt):
                break
            block.append(nxt)
        text = " ".join(b.strip() for b in block)
        choices = re.match(r"\s*\[([^\]]+)\]", text)
        default = re.search(r"default:\s*([\w.-]+)", text)
        return (
            True,
            [c.strip() for c in choices.group(1).split("|")] if choices else [],
            default.group(1) if default else None,
        )
    return False, [], None


def default_policy_note() -> str:
    """A sentence naming serve's default scheduling policy, when serve has a --policy option."""
    supported, _, default = policy_option(serve_help())
    if not supported:
        return ""
    return f" `batcher serve` ran with its default scheduling policy ({default or 'not shown in --help'})."


class EchoLoop:
    """benchmarks/echo_loop.py in a subprocess: the ceiling for one Python process (or
    another floor script speaking the frontend protocol, given its extra arguments)."""

    def __init__(
        self,
        address: str | None = None,
        script: Path = ECHO_LOOP,
        extra: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.address = address or free_tcp_address()
        self.script = script
        self.extra = list(extra)
        self.env = None if env is None else {**os.environ, **env}
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def frontend(self) -> str:
        return self.address

    def start(self, timeout_s: float = 30.0) -> EchoLoop:
        self.process = subprocess.Popen(
            [sys.executable, str(self.script), self.address, *self.extra],
            start_new_session=True,
            cwd=REPO_ROOT,
            env=self.env,
        )
        try:
            self._wait_ready(timeout_s)
        except BaseException:  # not answering: stopped here, as no `with` will stop it
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        """Ping it until it answers (a request, never a sleep-and-hope)."""
        ctx: zmq.Context[Any] = zmq.Context()
        sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.process is not None and self.process.poll() is not None:
                    raise RuntimeError(f"{self.script.name} exited with {self.process.returncode}")
                sock.send_multipart([b"", msgpack.packb({"id": 0, "input": b""})])
                if sock.poll(200):
                    sock.recv_multipart()
                    return
            raise TimeoutError(f"{self.script.name} not answering at {self.address} within {timeout_s}s")
        finally:
            sock.close(0)
            ctx.term()

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """SIGTERM to its process group, then SIGKILL if it lingers; returns its exit code."""
        p = self.process
        if p is None:
            return None
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        with contextlib.suppress(ProcessLookupError):  # a child it left behind
            os.killpg(p.pid, signal.SIGKILL)
        return p.returncode

    def __enter__(self) -> EchoLoop:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running_echo_loop() -> Iterator[EchoLoop]:
    """A started echo loop, stopped on exit, always."""
    loop = EchoLoop()
    try:
        loop.start()
        yield loop
    finally:
        loop.stop()


def handle_sigterm() -> None:
    """Make SIGTERM raise KeyboardInterrupt, so a stopped benchmark still runs its finally
    blocks and stops the servers it started (run_all.py stops a script that way)."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)


# --- memory ------------------------------------------------------------------------------------


def broker_rss_bytes(serve: ServeProcess) -> int:
    """Resident memory of the broker: the `serve` process itself (workers are its children)."""
    import psutil

    if serve.process is None:
        raise RuntimeError("serve is not running")
    return int(psutil.Process(serve.process.pid).memory_info().rss)


# --- results -----------------------------------------------------------------------------------


def _git(*args: str) -> str:
    try:
        out = subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=10, check=False, cwd=REPO_ROOT
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip()


def environment() -> dict[str, Any]:
    """Where and when a result was measured (read-only git queries)."""
    commit = _git("rev-parse", "--short", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit + ("+dirty" if dirty and commit else ""),
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "cpus": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table; floats keep what fmt() gives them."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: Any, digits: int = 2) -> str:
    """A table cell: big numbers rounded with thousands separators, small ones with a digit more."""
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 1:
            return f"{value:.{digits}f}"
        return f"{value:.{digits + 1}f}"
    return str(value)


def command_line() -> str:
    """The command that ran this benchmark, as a user would type it from the repo root."""
    return " ".join(["python", f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])


def save_plot(fig: Any, name: str) -> str:
    """Write a matplotlib figure to results/NAME.png, close it, and return the path."""
    import matplotlib.pyplot as plt

    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def write_results(name: str, title: str, body_md: str, data: Mapping[str, Any], quick: bool) -> Path:
    """Write benchmarks/results/<name>.md (a `## title` section) and <name>.json."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    env = environment()
    mode = "quick mode (short runs: indicative only)" if quick else "full mode"
    header = (
        f"## {title}\n\n"
        f"_{env['date']}, commit {env['commit'] or '?'}, {env['cpus']} CPUs, Python {env['python']}, "
        f"load average {env['loadavg_1m']} at the end; {mode}; "
        f"`{command_line()}`._\n\n"
    )
    md_path = RESULTS_DIR / f"{name}.md"
    md_path.write_text(header + body_md.strip() + "\n")
    payload = {"name": name, "title": title, "quick": quick, "environment": env, **data}
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"wrote {md_path.relative_to(REPO_ROOT)} and {name}.json")
    return md_path


def client_note(summary: Mapping[str, Any]) -> str:
    """'' when the load generator kept up, else why not (for a table's notes)."""
    if summary.get("client_kept_up", True):
        return ""
    return "; ".join(summary.get("client_notes", [])) or "load generator did not keep up"


def load_note(summary: Mapping[str, Any]) -> str:
    """An open-loop row's verdict: whether the broker fell behind the offered load (then the
    row describes overload, not a steady state), and the client's own notes."""
    notes = ["broker fell behind"] if summary.get("fell_behind") else []
    if client := client_note(summary):
        notes.append(client)
    return "; ".join(notes) or "kept up"


async def serve_v2_grpc(port: int, methods: dict[str, tuple[Any, Any, Any]]) -> None:
    """A grpc.aio server of the v2 `GRPCInferenceService` on 127.0.0.1:`port`, until
    killed: `methods` maps a method's name to (handler, request class, response class),
    so that each gRPC floor of the benchmarks is only its handlers."""
    import grpc

    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            fn, request_deserializer=req.FromString, response_serializer=resp.SerializeToString
        )
        for name, (fn, req, resp) in methods.items()
    }
    server = grpc.aio.server()
    service = grpc.method_handlers_generic_handler("inference.GRPCInferenceService", handlers)
    server.add_generic_rpc_handlers((service,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def wait_http_200(request: Any, timeout_s: float = 30.0) -> None:
    """Until `request` (a URL or a urllib Request) is answered 200: a starting server's
    readiness, probed every 50 ms, the last error raised past the deadline."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(request, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:  # urllib.error.HTTPError (a 503 while starting) is one
            if time.monotonic() > deadline:
                raise
        time.sleep(0.05)  # between probes of a starting process
