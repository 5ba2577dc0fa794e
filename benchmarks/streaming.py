"""Streamed replies: step-level (continuous) batching against request-level batching.

The simlm model (workers/models.py) streams one chunk per token; a step over n active
sequences takes step_base_ms + step_per_seq_ms * n and yields a chunk for each. With
`--batching-level step` a worker admits new sequences between any two steps; with
`--batching-level request` (the baseline, same model, same max batch `--max-active`)
only once every sequence it holds has ended, so a batch runs until its longest sequence
ends. Theoretical step-level capacity: W * N / (step_base_ms + step_per_seq_ms * N)
tokens per second, every worker always stepping N sequences.

Load: output lengths drawn from a geometric distribution (mean --mean-tokens, capped at
--max-tokens), requests `{"model": "simlm", "input": {"tokens": k}, "stream": true}`
sent open loop (Poisson arrivals drawn in advance, sent on schedule whatever the
replies) at fractions of the theoretical capacity; the same arrivals and lengths for
both levels. Per load: achieved tokens/s (chunks received per second inside the
measured window), time to first chunk (from a request's send to its first reply),
inter-chunk latency, requests completed / errored / lost (never finished within the
drain deadline). Saturation: a closed loop keeping --saturation-in-flight requests
outstanding (4 * N per worker by default), resubmitting as each one ends.

Goals: step/request tokens/s at saturation >= 2; step-level saturation >= 0.9 of the
theoretical capacity; step-level TTFC p99 below request-level TTFC p99 at every load
offered below the request-level saturation throughput.

    python benchmarks/streaming.py
    python benchmarks/streaming.py --quick --no-plot
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import zmq
from common import handle_sigterm, md_table, median_of, save_plot, write_results

from batcher.serve.launcher import ServeProcess

LEVELS = ("step", "request")
LOADS = (0.10, 0.20, 0.30, 0.45, 0.60, 0.75, 0.90)
QUICK_LOADS = (0.20, 0.60)
MODEL = "simlm"

#: Goals (the brief of this benchmark).
GOAL_RATIO = 2.0  # step / request tokens/s at saturation
GOAL_EFFICIENCY = 0.9  # step-level saturation / theoretical

#: Counts summed over runs (not medians) when --runs > 1.
SUMMED = ("sent", "completed", "errors", "lost", "bad_replies", "window_requests")


# --- settings ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a short smoke run: 2 loads, 3 s each")
    p.add_argument("--runs", type=int, default=1, help="runs per load and saturation point, median (1)")
    p.add_argument("--workers", type=int, default=1, help="simlm worker processes (1)")
    p.add_argument("--max-active", type=int, default=32, help="max sequences per worker, both levels (32)")
    p.add_argument("--step-base-ms", type=float, default=15.0, help="simlm step fixed cost (15)")
    p.add_argument("--step-per-seq-ms", type=float, default=0.5, help="simlm step cost per sequence (0.5)")
    p.add_argument("--mean-tokens", type=float, default=32.0, help="mean of the geometric lengths (32)")
    p.add_argument("--max-tokens", type=int, default=256, help="cap on a request's length (256)")
    p.add_argument(
        "--loads",
        type=lambda s: [float(x) for x in s.split(",") if x.strip()],
        default=None,
        help="comma-separated fractions of the theoretical step-level capacity "
        f"({','.join(f'{x:g}' for x in LOADS)}; quick {','.join(f'{x:g}' for x in QUICK_LOADS)})",
    )
    p.add_argument("--levels", default=",".join(LEVELS), help="comma-separated levels (step,request)")
    p.add_argument("--duration-s", type=float, default=None, help="measured seconds per point (15; quick 3)")
    p.add_argument("--warmup-s", type=float, default=None, help="unmeasured seconds first (2; quick 0.5)")
    p.add_argument(
        "--drain-s", type=float, default=None, help="longest wait for replies after a point (90; quick 20)"
    )
    p.add_argument(
        "--saturation-in-flight", type=int, default=None, help="closed-loop requests outstanding (4 * N * W)"
    )
    p.add_argument("--seed", type=int, default=1, help="seed of arrivals and lengths (1)")
    p.add_argument("--ready-timeout-s", type=float, default=60.0, help="longest wait for the workers (60)")
    p.add_argument("--no-plot", action="store_true", help="do not draw results/streaming.png")
    args = p.parse_args(argv)
    if min(args.runs, args.workers, args.max_active, args.max_tokens, args.mean_tokens) < 1:
        p.error("--runs, --workers, --max-active, --max-tokens and --mean-tokens must be >= 1")
    args.loads = args.loads or list(QUICK_LOADS if args.quick else LOADS)
    args.levels = [lv.strip() for lv in args.levels.split(",") if lv.strip()]
    if not args.levels or any(lv not in LEVELS for lv in args.levels):
        p.error(f"--levels takes a subset of {','.join(LEVELS)}")
    args.duration_s = args.duration_s or (3.0 if args.quick else 15.0)
    args.warmup_s = args.warmup_s if args.warmup_s is not None else (0.5 if args.quick else 2.0)
    args.drain_s = args.drain_s or (20.0 if args.quick else 90.0)
    args.saturation_in_flight = args.saturation_in_flight or 4 * args.max_active * args.workers
    return args


def step_ms(n: int, args: argparse.Namespace) -> float:
    return float(args.step_base_ms + args.step_per_seq_ms * n)


def theoretical_tps(args: argparse.Namespace) -> float:
    """W * N / t_step(N): every worker stepping N sequences all the time."""
    return float(args.workers * args.max_active * 1000.0 / step_ms(args.max_active, args))


def expected_length(args: argparse.Namespace) -> float:
    """E[min(X, cap)] for X geometric on 1, 2, ... with mean m: sum_{k<cap} (1 - 1/m)^k."""
    q = 1.0 - 1.0 / args.mean_tokens
    return float(args.mean_tokens * (1.0 - q**args.max_tokens))


def draw_lengths(rng: np.random.Generator, n: int, args: argparse.Namespace) -> list[int]:
    return [int(x) for x in np.minimum(rng.geometric(1.0 / args.mean_tokens, size=n), args.max_tokens)]


# --- serve -------------------------------------------------------------------------------------


class Serve(ServeProcess):
    """`batcher serve --model simlm` at one batching level, in its own process group."""

    def __init__(self, level: str, args: argparse.Namespace) -> None:
        super().__init__(
            [
                "--model", MODEL, "--workers", str(args.workers),
                "--max-active", str(args.max_active), "--batching-level", level,
                "--simlm-step-base-ms", repr(float(args.step_base_ms)),
                "--simlm-step-per-seq-ms", repr(float(args.step_per_seq_ms)), "--no-warmup",
            ]
        )  # fmt: skip
        self.level = level
        self.workers = args.workers

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_workers(self, ctl: Control, timeout_s: float) -> None:
        """Ask for stats until the model has all its workers (bounded by timeout_s)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                code = None if self.process is None else self.process.returncode
                raise RuntimeError(f"batcher serve exited with {code} before its workers were ready")
            stats = ctl.stats(timeout_s=0.5)
            if stats is not None and model_stats(stats).get("workers") == self.workers:
                return
            time.sleep(0.05)  # between readiness probes only
        raise TimeoutError(f"{self.workers} {MODEL} workers not ready within {timeout_s:g} s")


class Control:
    """A DEALER for `stats` requests, apart from the load's sockets."""

    def __init__(self, ctx: zmq.Context[Any], address: str) -> None:
        self.sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.next_id = 0
        self.pending: dict[str, float] = {}  # stats request id -> when sent

    def send_stats(self) -> str:
        self.next_id += 1
        rid = f"stats-{self.next_id}"
        self.sock.send_multipart([b"", msgpack.packb({"id": rid, "op": "stats"})], zmq.NOBLOCK)
        self.pending[rid] = time.perf_counter()
        return rid

    def read(self) -> tuple[str, dict[str, Any]] | None:
        """One stats reply that has come (None if none has)."""
        try:
            frames = self.sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None
        body = msgpack.unpackb(frames[-1])
        rid = body.get("id")
        if not isinstance(rid, str) or rid not in self.pending or not body.get("ok"):
            return None
        del self.pending[rid]
        out = body.get("output")
        return (rid, out) if isinstance(out, dict) else None

    def stats(self, timeout_s: float) -> dict[str, Any] | None:
        """A blocking stats request (between points only)."""
        rid = self.send_stats()
        deadline = time.perf_counter() + timeout_s
        while (left := deadline - time.perf_counter()) > 0:
            if self.sock.poll(max(1, math.ceil(left * 1000))):
                got = self.read()
                if got is not None and got[0] == rid:
                    return got[1]
        self.pending.pop(rid, None)
        return None

    def close(self) -> None:
        self.sock.close(0)


def model_stats(stats: dict[str, Any]) -> dict[str, Any]:
    entry = stats.get("models", {}).get(MODEL, {})
    return entry if isinstance(entry, dict) else {}


def worker_totals(stats: dict[str, Any] | None) -> dict[str, float]:
    """The workers' cumulative step and chunk counters, summed."""
    total = {"steps": 0.0, "chunks": 0.0}
    if stats is None:
        return total
    for w in model_stats(stats).get("worker_list", []):
        counters = w.get("counters") or {}
        for key in total:
            total[key] += float(counters.get(key, 0.0))
    return total


def broker_view(stats: dict[str, Any] | None) -> dict[str, Any]:
    """What the broker's stats say of the model (for the analysis)."""
    if stats is None:
        return {}
    m = model_stats(stats)
    keys = ("chunks_per_s", "first_chunk_ms_p50", "first_chunk_ms_p99", "active_sequences", "queued",
            "sequences", "chunks", "outcomes", "sequences_cancelled")  # fmt: skip
    out = {k: m.get(k) for k in keys}
    out["workers"] = [
        {"active_sequences": w.get("active_sequences"), "counters": w.get("counters")}
        for w in m.get("worker_list", [])
    ]
    out["undeliverable"] = stats.get("undeliverable")
    return out


@contextlib.contextmanager
def running_serve(
    level: str, args: argparse.Namespace, ctx: zmq.Context[Any]
) -> Iterator[tuple[Serve, Control]]:
    """A ready `batcher serve` and a stats socket to it; stopped on exit, always."""
    serve = Serve(level, args)
    ctl: Control | None = None
    try:
        serve.start()
        ctl = Control(ctx, serve.frontend)
        serve.wait_workers(ctl, args.ready_timeout_s)
        yield serve, ctl
    finally:
        if ctl is not None:
            ctl.close()
        serve.stop()


def wait_idle(ctl: Control, timeout_s: float) -> dict[str, Any] | None:
    """Stats once the broker holds no sequence and queues nothing (None: not within timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = ctl.stats(timeout_s=1.0)
        if stats is not None:
            m = model_stats(stats)
            if m.get("active_sequences") == 0 and m.get("queued") == 0:
                return stats
        time.sleep(0.1)
    return None


# --- the load ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Request:
    rid: int
    tokens: int
    due: float  # when it was to be sent (perf_counter)
    sent: float = math.nan
    first: float = math.nan
    last: float = math.nan
    chunks: int = 0
    done: bool = False
    error: str | None = None
    in_window: bool = False  # sent inside the measured window: its latencies count


@dataclass
class Point:
    """One measured point: requests and what came back."""

    window_start: float
    window_end: float
    requests: dict[int, Request] = field(default_factory=dict)
    gaps_ms: list[float] = field(default_factory=list)  # inter-chunk gaps of in-window requests
    window_chunks: int = 0  # ok chunks received inside the window
    bad_replies: int = 0  # a wrong index, a count that does not match, an unknown id, one past the end
    errors: Counter[str] = field(default_factory=Counter)
    stats_at: dict[str, tuple[float, dict[str, Any]]] = field(default_factory=dict)
    outstanding_at_end: int = 0
    open: int = 0  # requests sent and not answered in full yet


class Driver:
    """One DEALER socket sending load and reading replies in a single thread; the send
    schedule comes first (the poll waits no longer than until the next send is due)."""

    #: Most replies read in a row before the schedule is looked at again.
    BURST = 256

    def __init__(self, ctx: zmq.Context[Any], serve: Serve, ctl: Control, next_id: Callable[[], int]) -> None:
        self.serve = serve
        self.ctl = ctl
        self.sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # sends never block on the broker
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(serve.frontend)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(ctl.sock, zmq.POLLIN)
        self.next_id = next_id
        self.on_final: Callable[[float], None] | None = None  # the closed loop resubmits here

    def close(self) -> None:
        self.sock.close(0)

    def send(self, pt: Point, tokens: int, due: float) -> None:
        rid = self.next_id()
        body = msgpack.packb({"id": rid, "model": MODEL, "input": {"tokens": tokens}, "stream": True})
        req = Request(rid, tokens, due)
        req.sent = time.perf_counter()
        req.in_window = pt.window_start <= req.sent < pt.window_end
        pt.requests[rid] = req
        pt.open += 1
        self.sock.send_multipart([b"", body], zmq.NOBLOCK)

    def receive(self, pt: Point, until: float) -> None:
        """Read the replies that have come (at most BURST, and not past `until`)."""
        for _ in range(self.BURST):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            now = time.perf_counter()
            self.take(pt, frames[-1], now)
            if now >= until:
                return

    def take(self, pt: Point, frame: bytes, now: float) -> None:
        try:
            body = msgpack.unpackb(frame)
        except (ValueError, msgpack.ExtraData):
            pt.bad_replies += 1
            return
        rid = body.get("id") if isinstance(body, dict) else None
        req = pt.requests.get(rid) if isinstance(rid, int) else None
        if req is None or req.done:
            pt.bad_replies += 1
            return
        more = body.get("more")
        if not body.get("ok"):
            err = body.get("error") or {}
            req.error = str(err.get("code", "?")) if isinstance(err, dict) else "?"
            pt.errors[req.error] += 1
            req.done = True
            pt.open -= 1
            if more is not False:
                pt.bad_replies += 1
            self._finished(now)
            return
        if body.get("output") != req.chunks or more is not (req.chunks + 1 < req.tokens):
            pt.bad_replies += 1
        if req.chunks == 0:
            req.first = now
        elif req.in_window:
            pt.gaps_ms.append((now - req.last) * 1000.0)
        req.last = now
        req.chunks += 1
        if pt.window_start <= now < pt.window_end:
            pt.window_chunks += 1
        if more is not True:
            req.done = True
            pt.open -= 1
            self._finished(now)

    def _finished(self, now: float) -> None:
        if self.on_final is not None:
            self.on_final(now)

    def take_stats(self, pt: Point) -> None:
        while (got := self.ctl.read()) is not None:
            rid, stats = got
            pt.stats_at[rid] = (time.perf_counter(), stats)

    def run(
        self,
        pt: Point,
        schedule: Sequence[tuple[float, int]],
        drain_s: float,
        closed: Callable[[], None] | None = None,
    ) -> float:
        """Send `schedule` ((due, tokens), sorted) on time until the window ends, read
        every reply, ask for stats at the window's start and end, then wait for the
        outstanding replies until drain_s has passed. Returns the drain's seconds."""
        i, n = 0, len(schedule)
        asked: set[str] = set()
        while True:
            now = time.perf_counter()
            while i < n and schedule[i][0] <= now:
                self.send(pt, schedule[i][1], schedule[i][0])
                i += 1
            if closed is not None:
                closed()
            if "start" not in asked and now >= pt.window_start:
                self.ctl.send_stats()
                asked.add("start")
            if now >= pt.window_end:
                break
            if not self.serve.alive():
                raise RuntimeError("batcher serve exited during a measurement")
            next_at = min(schedule[i][0] if i < n else math.inf, pt.window_end)
            if "start" not in asked:
                next_at = min(next_at, pt.window_start)
            events = dict(self.poller.poll(max(0, math.ceil((next_at - now) * 1000))))
            if self.sock in events:
                self.receive(pt, next_at)
            if self.ctl.sock in events:
                self.take_stats(pt)
        self.ctl.send_stats()  # at the window's end
        pt.outstanding_at_end = pt.open
        t0 = time.perf_counter()
        deadline = t0 + drain_s
        while (pt.open or self.ctl.pending) and (left := deadline - time.perf_counter()) > 0:
            if not self.serve.alive():
                break
            events = dict(self.poller.poll(max(1, min(200, math.ceil(left * 1000)))))
            if self.sock in events:
                self.receive(pt, math.inf)
            if self.ctl.sock in events:
                self.take_stats(pt)
        return time.perf_counter() - t0


def pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def summarize_point(pt: Point, drain_s: float, duration_s: float) -> dict[str, Any]:
    reqs = list(pt.requests.values())
    window = [r for r in reqs if r.in_window]
    ttfc = [(r.first - r.sent) * 1000.0 for r in window if not math.isnan(r.first)]
    lag = [(r.sent - r.due) * 1000.0 for r in reqs if not math.isnan(r.due)]
    snaps = sorted(pt.stats_at.values(), key=lambda s: s[0])
    diag: dict[str, Any] = {}
    if len(snaps) >= 2:
        (t_a, s_a), (t_b, s_b) = snaps[0], snaps[-1]
        a, b = worker_totals(s_a), worker_totals(s_b)
        mb = model_stats(s_b)
        workers = len(mb.get("worker_list", []))
        waiting = int(mb.get("queued") or 0) + sum(
            int((w.get("counters") or {}).get("waiting", 0)) for w in mb.get("worker_list", [])
        )
        steps, chunks = b["steps"] - a["steps"], b["chunks"] - a["chunks"]
        diag = {
            "seconds": t_b - t_a,
            "worker_steps": steps,
            "worker_chunks": chunks,
            "chunks_per_step": chunks / steps if steps else None,
            # wall time per step and worker: the step time when the workers never idle (saturation)
            "wall_ms_per_step": (t_b - t_a) * 1000.0 * workers / steps if steps else None,
            "worker_chunks_per_s": chunks / (t_b - t_a) if t_b > t_a else None,
            "waiting_at_end": waiting,  # not started yet: in the broker's queue or a worker's
            "broker_at_end": broker_view(s_b),
        }
    return {
        "sent": len(reqs),
        "completed": sum(1 for r in reqs if r.done and r.error is None),
        "errors": sum(1 for r in reqs if r.error is not None),
        "error_codes": dict(pt.errors),
        "lost": sum(1 for r in reqs if not r.done),
        "bad_replies": pt.bad_replies,
        "window_requests": len(window),
        "achieved_tps": pt.window_chunks / duration_s,
        "window_offered_tps": sum(r.tokens for r in window) / duration_s,
        "mean_length": float(np.mean([r.tokens for r in window])) if window else None,
        "ttfc_p50_ms": pct(ttfc, 50),
        "ttfc_p99_ms": pct(ttfc, 99),
        "ttfc_max_ms": max(ttfc) if ttfc else None,
        "icl_p50_ms": pct(pt.gaps_ms, 50),
        "icl_p99_ms": pct(pt.gaps_ms, 99),
        "send_lag_p99_ms": pct(lag, 99),
        "send_lag_max_ms": max(lag) if lag else None,
        "outstanding_at_window_end": pt.outstanding_at_end,
        "drain_s": drain_s,
        "window_stats": diag,
    }


def open_loop_point(
    ctx: zmq.Context[Any], serve: Serve, ctl: Control, args: argparse.Namespace, rate: float,
    seed: Sequence[int], next_id: Callable[[], int],
) -> dict[str, Any]:  # fmt: skip
    """Poisson arrivals at `rate` req/s for warmup + duration, all drawn before the first send."""
    rng = np.random.default_rng(list(seed))
    span = args.warmup_s + args.duration_s
    offsets: list[float] = []
    t = float(rng.exponential(1.0 / rate))
    while t < span:
        offsets.append(t)
        t += float(rng.exponential(1.0 / rate))
    lengths = draw_lengths(rng, len(offsets), args)
    driver = Driver(ctx, serve, ctl, next_id)
    try:
        time.sleep(0.1)  # the socket connects before the clock starts (not measured)
        t0 = time.perf_counter()
        pt = Point(t0 + args.warmup_s, t0 + span)
        schedule = [(t0 + off, k) for off, k in zip(offsets, lengths, strict=True)]
        drained = driver.run(pt, schedule, args.drain_s)
    finally:
        driver.close()
    return summarize_point(pt, drained, args.duration_s)


def saturation_point(
    ctx: zmq.Context[Any], serve: Serve, ctl: Control, args: argparse.Namespace, seed: Sequence[int],
    next_id: Callable[[], int],
) -> dict[str, Any]:  # fmt: skip
    """A closed loop: saturation_in_flight requests outstanding, one more as each ends."""
    rng = np.random.default_rng(list(seed))
    driver = Driver(ctx, serve, ctl, next_id)
    due: list[float] = []  # one resubmission per final reply, sent from the loop

    def resubmit(now: float) -> None:
        if now < pt.window_end:
            due.append(now)

    def closed() -> None:
        while due:
            driver.send(pt, draw_lengths(rng, 1, args)[0], due.pop())

    try:
        time.sleep(0.1)
        t0 = time.perf_counter()
        pt = Point(t0 + args.warmup_s, t0 + args.warmup_s + args.duration_s)
        driver.on_final = resubmit
        schedule = [(t0, k) for k in draw_lengths(rng, args.saturation_in_flight, args)]
        drained = driver.run(pt, schedule, args.drain_s, closed=closed)
    finally:
        driver.close()
    out = summarize_point(pt, drained, args.duration_s)
    out["in_flight"] = args.saturation_in_flight
    out["send_lag_p99_ms"] = out["send_lag_max_ms"] = None  # no schedule: nothing is late
    return out


def merge_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over runs; counts summed."""
    if len(runs) == 1:
        return dict(runs[0])
    out: dict[str, Any] = median_of(
        [{k: v for k, v in r.items() if isinstance(v, int | float) and v is not None} for r in runs]
    )
    for key in SUMMED:
        out[key] = sum(int(r[key]) for r in runs)
    codes: Counter[str] = Counter()
    for r in runs:
        codes.update(r["error_codes"])
    out["error_codes"] = dict(codes)
    out["window_stats"] = runs[0]["window_stats"]
    for key, value in runs[0].items():
        out.setdefault(key, None if isinstance(value, int | float) else value)
    return out


# --- one level ---------------------------------------------------------------------------------


def measure_level(
    level: str, args: argparse.Namespace, ctx: zmq.Context[Any], theory: float, mean_len: float,
    next_id: Callable[[], int],
) -> dict[str, Any]:  # fmt: skip
    notes: list[str] = []
    points: list[dict[str, Any]] = []
    saturation: dict[str, Any] = {}
    stack = contextlib.ExitStack()
    with stack:
        serve, ctl = stack.enter_context(running_serve(level, args, ctx))

        def ensure_idle(what: str) -> tuple[Serve, Control]:
            """The broker idle before a point; restarted when it is not within 30 s."""
            nonlocal serve, ctl
            if wait_idle(ctl, 30.0) is not None:
                return serve, ctl
            notes.append(f"{level}: broker not idle before {what} within 30 s: serve restarted")
            print(notes[-1], flush=True)
            stack.close()
            serve, ctl = stack.enter_context(running_serve(level, args, ctx))
            return serve, ctl

        for li, load in enumerate(args.loads):
            rate = load * theory / mean_len
            runs = []
            for run in range(args.runs):
                serve, ctl = ensure_idle(f"load {load:g}")
                runs.append(open_loop_point(ctx, serve, ctl, args, rate, (args.seed, run, li), next_id))
            m = merge_runs(runs)
            point = {"load": load, "rate_rps": rate, "offered_tps": rate * mean_len, **m, "runs": runs}
            points.append(point)
            print(
                f"{level:>7}: load {load:4.0%} offered {point['offered_tps']:6.0f} tok/s: achieved "
                f"{m['achieved_tps']:6.0f} tok/s, TTFC p50 {fmt_ms(m['ttfc_p50_ms'])} "
                f"p99 {fmt_ms(m['ttfc_p99_ms'])}, "
                f"ICL p50 {fmt_ms(m['icl_p50_ms'])} p99 {fmt_ms(m['icl_p99_ms'])}, "
                f"sent {m['sent']} ok {m['completed']} err {m['errors']} lost {m['lost']}, "
                f"drain {m['drain_s']:.1f} s",
                flush=True,
            )
        runs = []
        for run in range(args.runs):
            serve, ctl = ensure_idle("saturation")
            runs.append(saturation_point(ctx, serve, ctl, args, (args.seed, run, 999), next_id))
        saturation = {**merge_runs(runs), "in_flight": args.saturation_in_flight, "runs": runs}
        ws = saturation.get("window_stats") or {}
        print(
            f"{level:>7}: saturation ({args.saturation_in_flight} in flight): "
            f"{saturation['achieved_tps']:.0f} tok/s = {saturation['achieved_tps'] / theory:.3f} of "
            f"theoretical {theory:.0f}; chunks/step {fmt_num(ws.get('chunks_per_step'))}, "
            f"wall ms/step {fmt_num(ws.get('wall_ms_per_step'))}; "
            f"lost {saturation['lost']}, errors {saturation['errors']}",
            flush=True,
        )
        final = wait_idle(ctl, 30.0)
        if final is None:
            notes.append(f"{level}: broker not idle within 30 s after the last point")
    return {
        "level": level,
        "points": points,
        "saturation": saturation,
        "final_stats": broker_view(final),
        "notes": notes,
    }


def fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} ms"


def fmt_num(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


# --- verdicts, tables, plot --------------------------------------------------------------------


def goals(results: dict[str, dict[str, Any]], theory: float) -> list[dict[str, Any]]:
    step, req = results.get("step"), results.get("request")
    out: list[dict[str, Any]] = []
    if step and req:
        s, r = step["saturation"]["achieved_tps"], req["saturation"]["achieved_tps"]
        ratio = s / r if r else math.inf
        out.append({
            "goal": "step / request tokens/s at saturation", "target": f">= {GOAL_RATIO:g}",
            "measured": f"{s:.0f} / {r:.0f} = {ratio:.2f}", "value": ratio, "pass": ratio >= GOAL_RATIO,
        })  # fmt: skip
    if step:
        eff = step["saturation"]["achieved_tps"] / theory
        out.append({
            "goal": "step-level saturation / theoretical", "target": f">= {GOAL_EFFICIENCY:g}",
            "measured": f"{step['saturation']['achieved_tps']:.0f} / {theory:.0f} = {eff:.3f}", "value": eff,
            "pass": eff >= GOAL_EFFICIENCY,
        })  # fmt: skip
    if step and req:
        limit = req["saturation"]["achieved_tps"]
        req_by_load = {p["load"]: p for p in req["points"]}
        checked = []
        for p in step["points"]:
            q = req_by_load.get(p["load"])
            if q is None or p["offered_tps"] >= limit:
                continue
            a, b = p["ttfc_p99_ms"], q["ttfc_p99_ms"]
            ok = a is not None and b is not None and a < b
            checked.append({"load": p["load"], "step_p99_ms": a, "request_p99_ms": b, "pass": ok})
        text = "; ".join(
            f"{c['load']:.0%}: {fmt_ms(c['step_p99_ms'])} vs {fmt_ms(c['request_p99_ms'])}" for c in checked
        )
        out.append({
            "goal": "step TTFC p99 < request TTFC p99 at every load below request-level saturation "
            f"({limit:.0f} tok/s)",
            "target": "every such load", "measured": text or "no load below it", "loads": checked,
            "pass": bool(checked) and all(c["pass"] for c in checked),
        })  # fmt: skip
    return out


def level_table(res: dict[str, Any], theory: float) -> str:
    rows = []
    sat = res["saturation"]["achieved_tps"]
    for p in res["points"]:
        rows.append([
            f"{p['load']:.0%}", p["offered_tps"], p["window_offered_tps"], p["achieved_tps"],
            fmt_num(p["ttfc_p50_ms"]),
            fmt_num(p["ttfc_p99_ms"]), fmt_num(p["icl_p50_ms"]), fmt_num(p["icl_p99_ms"]), p["sent"],
            p["completed"], p["errors"], p["lost"], fmt_num(p["mean_length"]), waiting_at_end(p),
            p["drain_s"], point_note(p, sat),
        ])  # fmt: skip
    s = res["saturation"]
    rows.append([
        f"saturation ({s['in_flight']} in flight)", "-", "-", s["achieved_tps"], fmt_num(s["ttfc_p50_ms"]),
        fmt_num(s["ttfc_p99_ms"]), fmt_num(s["icl_p50_ms"]), fmt_num(s["icl_p99_ms"]), s["sent"],
        s["completed"], s["errors"], s["lost"], fmt_num(s["mean_length"]), waiting_at_end(s), s["drain_s"],
        f"{s['achieved_tps'] / theory:.3f} of theoretical; TTFC is mostly queueing (closed loop)"
        + (f"; {point_note(s)}" if point_note(s) else ""),
    ])  # fmt: skip
    return md_table(
        ["load", "offered tok/s", "drawn tok/s", "achieved tok/s", "TTFC p50 ms", "TTFC p99 ms", "ICL p50 ms",
         "ICL p99 ms", "sent", "ok", "errors", "lost", "mean length", "waiting at end", "drain s", "notes"],
        rows,
    )  # fmt: skip


def waiting_at_end(p: dict[str, Any]) -> Any:
    """Requests not started at the window's end (broker queue + workers' waiting), from stats."""
    value = (p.get("window_stats") or {}).get("waiting_at_end")
    return "-" if value is None else value


def point_note(p: dict[str, Any], saturation_tps: float | None = None) -> str:
    notes = []
    if p.get("bad_replies"):
        notes.append(f"{p['bad_replies']} bad replies")
    if p.get("error_codes"):
        notes.append("errors: " + ", ".join(f"{k} {v}" for k, v in p["error_codes"].items()))
    lag = p.get("send_lag_p99_ms")
    if lag is not None and lag > 5.0:
        notes.append(f"sender late (p99 {lag:.1f} ms)")
    if saturation_tps is not None and p["offered_tps"] > saturation_tps:
        notes.append("offered above this level's saturation: backlog grows")
    return "; ".join(notes)


def plot(results: dict[str, dict[str, Any]], theory: float) -> str | None:
    """Two panels against offered tokens/s: achieved tokens/s, and TTFC p99 (log)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = {"step": "tab:blue", "request": "tab:orange"}
    top = 0.0
    for level, res in results.items():
        x = [p["offered_tps"] for p in res["points"]]
        c = colors.get(level)
        top = max([top, *x])
        ax1.plot(x, [p["achieved_tps"] for p in res["points"]], "-o", color=c, label=f"{level}-level")
        sat = res["saturation"]["achieved_tps"]
        ax1.axhline(sat, color=c, ls=":", label=f"{level}-level saturation ({sat:.0f})")
        for key, style in (("ttfc_p99_ms", "-o"), ("ttfc_p50_ms", "--.")):
            pts = [(xx, p[key]) for xx, p in zip(x, res["points"], strict=True) if p[key] is not None]
            if pts:
                ax2.plot(*zip(*pts, strict=True), style, color=c, label=f"{level}-level {key[5:8]}")
        if level == "request":
            ax2.axvline(sat, color=c, ls=":", label=f"request-level saturation ({sat:.0f} tok/s)")
    ax1.axhline(theory, color="grey", ls="--", label=f"theoretical ({theory:.0f})")
    ax1.plot([0, top], [0, top], color="lightgrey", lw=1, label="achieved = offered")
    ax1.set_xlabel("offered load, tokens/s")
    ax1.set_ylabel("achieved tokens/s (chunks received)")
    ax1.set_title("throughput")
    ax2.set_xlabel("offered load, tokens/s")
    ax2.set_ylabel("time to first chunk, ms")
    ax2.set_yscale("log")
    ax2.set_title("time to first chunk")
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return save_plot(fig, "streaming")


# --- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    handle_sigterm()
    args = parse_args(argv)
    theory = theoretical_tps(args)
    mean_len = expected_length(args)
    counter = iter(range(1, 1 << 62))

    def next_id() -> int:
        return next(counter)

    print(
        f"simlm, {args.workers} worker(s), max active {args.max_active}: theoretical "
        f"{theory:.0f} tok/s; lengths geometric mean {args.mean_tokens:g} capped at {args.max_tokens} "
        f"(expected {mean_len:.2f}); loads {', '.join(f'{x:g}' for x in args.loads)}",
        flush=True,
    )
    ctx: zmq.Context[Any] = zmq.Context()
    results: dict[str, dict[str, Any]] = {}
    try:
        for level in args.levels:
            results[level] = measure_level(level, args, ctx, theory, mean_len, next_id)
    finally:
        ctx.term()
    verdicts = goals(results, theory)
    png = None if args.no_plot else plot(results, theory)
    notes = [n for r in results.values() for n in r["notes"]]
    lost = sum(p["lost"] for r in results.values() for p in [*r["points"], r["saturation"]])
    bad = sum(p["bad_replies"] for r in results.values() for p in [*r["points"], r["saturation"]])
    body = (
        f"simlm model, {args.workers} worker(s), max active sequences N = {args.max_active} at both levels; "
        f"a step over n sequences takes {args.step_base_ms:g} + {args.step_per_seq_ms:g} * n ms: theoretical "
        f"step-level capacity W * N / t(N) = {theory:.0f} tokens/s. Output lengths geometric, mean "
        f"{args.mean_tokens:g}, capped at {args.max_tokens} (expected {mean_len:.2f}), seed {args.seed}; "
        f"open-loop Poisson arrivals at each fraction of the theoretical capacity, the same arrivals for "
        f"both levels, {args.warmup_s:g} s unmeasured then {args.duration_s:g} s measured, then a drain "
        f"of at most {args.drain_s:g} s; {args.runs} run(s) per point (median). Achieved tok/s: chunks "
        f"received inside the measured window per second; drawn tok/s: the tokens asked for by the "
        f"requests sent inside the window, per second (the offered load as actually drawn). TTFC: from a "
        f"request's send to its first chunk; ICL: gap between consecutive chunks of a request; both over "
        f"the requests sent inside the window. sent/ok/errors/lost count every request of the point "
        f"(lost: no final reply by the drain's end). Saturation: closed loop with "
        f"{args.saturation_in_flight} requests outstanding.\n\n"
    )
    for level, res in results.items():
        body += f"### {level}-level batching (`--batching-level {level}`)\n\n{level_table(res, theory)}\n\n"
    body += "### Goals\n\n" + md_table(
        ["goal", "target", "measured", "verdict"],
        [[g["goal"], g["target"], g["measured"], "pass" if g["pass"] else "MISS"] for g in verdicts],
    )
    body += f"\n\nLost requests: {lost}; malformed or unexpected replies: {bad}.\n"
    if notes:
        body += "\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    if png:
        body += "\nPlot: `benchmarks/results/streaming.png`.\n"
    settings = dict(vars(args))
    write_results(
        "streaming",
        "Streaming: step-level against request-level batching",
        body,
        {
            "settings": settings,
            "theoretical_tps": theory,
            "expected_length": mean_len,
            "results": results,
            "goals": verdicts,
            "lost": lost,
            "bad_replies": bad,
            "notes": notes,
            "plot": png,
        },
        args.quick,
    )
    print("goals:")
    for g in verdicts:
        print(f"  {'pass' if g['pass'] else 'MISS'}: {g['goal']} ({g['target']}): {g['measured']}")
    print(f"lost {lost}, bad replies {bad}", flush=True)


if __name__ == "__main__":
    main()
