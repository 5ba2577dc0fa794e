"""`batcher bench`: a load generator for a running broker, as perf_analyzer is for Triton.

Load comes from separate processes (`spawn`), each with one DEALER socket, so the
measuring process never competes with them for the GIL. Closed loop keeps N requests
in flight; open loop sends at Poisson-distributed times fixed in advance, and
latency is counted from the time a request was due to be sent, so a slow server
cannot slow the load down and hide its queueing (no coordinated omission).
Latencies go into an HDR histogram, never a list.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import random
import resource
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack
import zmq
from hdrh.histogram import HdrHistogram

from batcher import protocol
from batcher.security import secure_client
from batcher.zmqio import recv_frames, send_frames

#: Latencies are recorded in microseconds, from 1 us to 10 minutes, 3 significant digits.
HIST_MAX_US = 600_000_000
PERCENTILES = (50.0, 90.0, 99.0, 99.9)
#: Beyond this share of one core, the load generator itself may be what is measured.
CLIENT_BUSY_LIMIT = 0.9


def new_histogram() -> HdrHistogram:
    """An empty latency histogram in microseconds."""
    return HdrHistogram(1, HIST_MAX_US, 3)


@dataclass(frozen=True)
class LoadSettings:
    """What load to offer: closed loop (`concurrency`) or open loop (`rate`)."""

    connect: str
    concurrency: int | None = None
    rate: float | None = None
    duration_s: float | None = 10.0
    requests: int | None = None
    payload_bytes: int = 16
    model: str | None = None
    processes: int = 1
    warmup_s: float = 0.0
    drain_timeout_s: float = 10.0
    seed: int | None = None
    curve_key: str | None = None  # a key pair file usable as both server key and own key

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of concurrency (closed loop) or rate (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if (self.duration_s is None) == (self.requests is None):
            raise ValueError("give exactly one of duration_s or requests")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.requests}")
        if self.payload_bytes < 0:
            raise ValueError(f"payload_bytes must be >= 0, got {self.payload_bytes}")
        if self.processes < 1:
            raise ValueError(f"processes must be >= 1, got {self.processes}")
        if self.concurrency is not None and self.concurrency < self.processes:
            raise ValueError(f"concurrency ({self.concurrency}) must be >= processes ({self.processes})")
        if self.warmup_s < 0:
            raise ValueError(f"warmup_s must be >= 0, got {self.warmup_s}")

    @property
    def mode(self) -> str:
        return "closed" if self.concurrency is not None else "open"

    def shard(self, index: int) -> LoadSettings:
        """This load split across `processes`: shard `index` gets its share."""
        p = self.processes

        def share(total: int) -> int:
            return total // p + (1 if index < total % p else 0)

        return LoadSettings(
            connect=self.connect,
            concurrency=share(self.concurrency) if self.concurrency is not None else None,
            rate=self.rate / p if self.rate is not None else None,
            duration_s=self.duration_s,
            requests=share(self.requests) if self.requests is not None else None,
            payload_bytes=self.payload_bytes,
            model=self.model,
            processes=1,
            warmup_s=self.warmup_s,
            drain_timeout_s=self.drain_timeout_s,
            seed=None if self.seed is None else self.seed + index,
            curve_key=self.curve_key,
        )


@dataclass
class ShardResult:
    """What one load process measured; merged by `merge`."""

    sent: int = 0
    ok: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    lost: int = 0
    batch_sizes: Counter[int] = field(default_factory=Counter)  # requests seen in batches of size k
    histogram: bytes = b""
    measured_s: float = 0.0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    max_send_lag_ms: float = 0.0
    late_sends: int = 0


def _body_prefix(settings: LoadSettings) -> bytes:
    """A request body without its id value: ids are appended per request, so a request
    costs one small msgpack int instead of encoding the whole map again."""
    fields: dict[str, Any] = {"input": b"x" * settings.payload_bytes}
    if settings.model is not None:
        fields["model"] = settings.model
    parts = [bytes((0x80 | (len(fields) + 1),))]  # a fixmap header: the fields, then "id"
    for k, v in fields.items():
        parts += [protocol.pack(k), protocol.pack(v)]
    parts.append(protocol.pack("id"))
    return b"".join(parts)


def run_shard(settings: LoadSettings, progress: Any = None) -> ShardResult:
    """Offer the load from this process over one DEALER socket; returns what it measured."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if settings.curve_key:
        secure_client(sock, settings.curve_key, settings.curve_key)
    sock.connect(settings.connect)
    try:
        return _Generator(settings, sock, progress).run()
    finally:
        sock.close(0)
        ctx.term()


class _Generator:
    """The load loop of one process."""

    def __init__(self, settings: LoadSettings, sock: zmq.Socket[Any], progress: Any) -> None:
        self.s = settings
        self.sock = sock
        self.progress = progress  # a shared counter (mp.Value) or None
        self.prefix = _body_prefix(settings)
        self.pack_id = msgpack.Packer().pack
        self.hist = new_histogram()
        self.result = ShardResult()
        self.due: dict[int, float] = {}  # request id -> time it was due to be sent
        self.next_id = 0
        self.measure_from = 0.0
        self.rng = random.Random(settings.seed)

    def send(self, due_at: float) -> None:
        self.next_id += 1
        rid = self.next_id
        self.due[rid] = due_at
        send_frames(self.sock, [b"", self.prefix + self.pack_id(rid)])
        self.result.sent += 1

    def receive_ready(self) -> int:
        """Take every reply waiting on the socket; returns how many."""
        got = 0
        sock = self.sock
        hist, res = self.hist, self.result
        unpackb = msgpack.unpackb
        while True:
            try:
                frames = recv_frames(sock)
            except zmq.Again:
                break
            now = time.perf_counter()
            reply = unpackb(frames[-1], raw=False)
            due_at = self.due.pop(reply.get("id"), None)
            if due_at is None:
                continue
            got += 1
            if due_at < self.measure_from:
                continue  # warm-up
            hist.record_value(max(1, int((now - due_at) * 1e6)))
            if reply.get("ok"):
                res.ok += 1
                size = reply.get("batch_size")
                if isinstance(size, int):
                    res.batch_sizes[size] += 1
            else:
                res.errors[str((reply.get("error") or {}).get("code", "unknown"))] += 1
        if got and self.progress is not None:
            with self.progress.get_lock():
                self.progress.value += got
        return got

    def run(self) -> ShardResult:
        s = self.s
        cpu0 = _cpu_s()
        start = time.perf_counter()
        self.measure_from = start + s.warmup_s
        stop_sending = start + s.warmup_s + s.duration_s if s.duration_s is not None else float("inf")
        if s.concurrency is not None:
            self._closed_loop(s.concurrency, stop_sending, s.requests)
        else:
            assert s.rate is not None
            self._open_loop(s.rate, stop_sending, s.requests)
        sending_ended = time.perf_counter()
        self._drain(sending_ended + s.drain_timeout_s)
        res = self.result
        res.lost = len(self.due)
        res.histogram = self.hist.encode()
        res.measured_s = sending_ended - max(self.measure_from, start)
        res.wall_s = time.perf_counter() - start
        res.cpu_s = _cpu_s() - cpu0
        return res

    def _budget_left(self, limit: int | None) -> bool:
        return limit is None or self.result.sent < limit

    def _closed_loop(self, concurrency: int, stop_sending: float, limit: int | None) -> None:
        poll = self.sock.poll
        for _ in range(concurrency):
            if self._budget_left(limit):
                self.send(time.perf_counter())
        while True:
            now = time.perf_counter()
            if now >= stop_sending or not self._budget_left(limit):
                return
            if poll(max(1, int((stop_sending - now) * 1000)) if stop_sending < float("inf") else 1000):
                for _ in range(self.receive_ready()):
                    if not self._budget_left(limit):
                        break
                    self.send(time.perf_counter())

    def _open_loop(self, rate: float, stop_sending: float, limit: int | None) -> None:
        poll = self.sock.poll
        res = self.result
        next_due = time.perf_counter()
        while self._budget_left(limit):
            now = time.perf_counter()
            while next_due <= now and next_due < stop_sending and self._budget_left(limit):
                lag_ms = (now - next_due) * 1000.0
                if lag_ms > res.max_send_lag_ms:
                    res.max_send_lag_ms = lag_ms
                if lag_ms > 1.0:
                    res.late_sends += 1
                self.send(next_due)
                next_due += self.rng.expovariate(rate)
            if next_due >= stop_sending:
                return
            wait_ms = int((next_due - time.perf_counter()) * 1000)
            if poll(max(0, wait_ms)):
                self.receive_ready()

    def _drain(self, deadline: float) -> None:
        while self.due:
            left_ms = int((deadline - time.perf_counter()) * 1000)
            if left_ms <= 0:
                return
            if self.sock.poll(left_ms):
                self.receive_ready()


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _shard_main(settings: LoadSettings, progress: Any, out: Any) -> None:
    try:
        out.send(run_shard(settings, progress))
    except Exception as exc:  # reported to the parent, which raises it
        out.send(f"{type(exc).__name__}: {exc}")
    finally:
        out.close()


@dataclass
class LoadResult:
    """The merged result of a run, as printed and as written by --json."""

    settings: dict[str, Any]
    sent: int
    ok: int
    errors: dict[str, int]
    lost: int
    duration_s: float
    throughput_rps: float
    latency_ms: dict[str, float]
    batch_sizes: dict[int, int]  # batch size -> number of batches
    mean_batch_size: float
    client: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["batch_sizes"] = {str(k): v for k, v in sorted(self.batch_sizes.items())}
        return data


def merge(settings: LoadSettings, shards: list[ShardResult]) -> LoadResult:
    """Add the shards' counts and histograms into one result."""
    hist = new_histogram()
    errors: Counter[str] = Counter()
    per_size: Counter[int] = Counter()
    for sh in shards:
        if sh.histogram:
            hist.decode_and_add(sh.histogram)
        errors.update(sh.errors)
        per_size.update(sh.batch_sizes)
    duration = max((sh.measured_s for sh in shards), default=0.0)
    completed = hist.get_total_count()
    latency = {f"p{p:g}": hist.get_value_at_percentile(p) / 1000.0 for p in PERCENTILES}
    latency["max"] = hist.get_max_value() / 1000.0
    latency["mean"] = hist.get_mean_value() / 1000.0
    batches = {k: max(1, round(v / k)) for k, v in per_size.items() if k > 0}
    n_batches = sum(batches.values())
    busy = max((sh.cpu_s / sh.wall_s for sh in shards if sh.wall_s > 0), default=0.0)
    sent = sum(sh.sent for sh in shards)
    notes = []
    if settings.rate is not None and duration > 0:
        # Poisson arrivals vary by sqrt(expected): only a shortfall beyond 3 sigma and 3%
        # says the generator fell behind.
        expected = settings.rate * (duration + settings.warmup_s)
        if sent < expected - max(3 * math.sqrt(expected), 0.03 * expected):
            notes.append(f"sent {sent} requests of the {expected:.0f} asked ({settings.rate:g}/s)")
        late = sum(sh.late_sends for sh in shards)
        if late > 0.01 * max(sent, 1):
            notes.append(f"{late} sends were more than 1 ms late")
    if busy > CLIENT_BUSY_LIMIT:
        notes.append(f"a load process used {busy:.0%} of a core: add --processes")
    return LoadResult(
        settings=asdict(settings),
        sent=sent,
        ok=sum(sh.ok for sh in shards),
        errors=dict(errors),
        lost=sum(sh.lost for sh in shards),
        duration_s=duration,
        throughput_rps=completed / duration if duration > 0 else 0.0,
        latency_ms=latency,
        batch_sizes=dict(sorted(batches.items())),
        mean_batch_size=sum(per_size.values()) / n_batches if n_batches else 0.0,
        client={
            "processes": settings.processes,
            "max_cpu_share": round(busy, 3),
            "max_send_lag_ms": max((sh.max_send_lag_ms for sh in shards), default=0.0),
            "kept_up": not notes,
            "notes": notes,
        },
    )


def run_load(settings: LoadSettings, on_progress: Callable[[int], None] | None = None) -> LoadResult:
    """Run the load from `settings.processes` spawned processes and merge their results.

    `on_progress(completed)` is called about ten times a second while it runs.
    """
    ctx = mp.get_context("spawn")
    counter = ctx.Value("q", 0)
    procs, pipes = [], []
    for i in range(settings.processes):
        recv_end, send_end = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_shard_main, args=(settings.shard(i), counter, send_end), daemon=True)
        p.start()
        send_end.close()
        procs.append(p)
        pipes.append(recv_end)
    shards: list[ShardResult] = []
    try:
        for conn in pipes:
            while not conn.poll(0.1):
                if on_progress is not None:
                    on_progress(counter.value)
                if not any(p.is_alive() for p in procs) and not conn.poll(0):
                    raise RuntimeError("a load process died without a result")
            try:
                data = conn.recv()
            except EOFError:
                raise RuntimeError("a load process died without a result") from None
            if not isinstance(data, ShardResult):
                raise RuntimeError(f"load process failed: {data}")
            shards.append(data)
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
    if on_progress is not None:
        on_progress(counter.value)
    return merge(settings, shards)


def format_report(result: LoadResult) -> str:
    """The human-readable summary `batcher bench` prints."""
    s = result.settings
    mode = (
        f"closed loop, {s['concurrency']} in flight"
        if s["concurrency"] is not None
        else f"open loop, {s['rate']:g} requests/s (Poisson)"
    )
    lat = result.latency_ms
    lines = [
        f"load: {mode}, {s['processes']} process(es), payload {s['payload_bytes']} B, "
        f"model {s['model'] or '(default)'}",
        f"requests: {result.sent} sent, {result.ok} ok, "
        f"{sum(result.errors.values())} errors, {result.lost} without reply",
        f"throughput: {result.throughput_rps:,.1f} requests/s over {result.duration_s:.2f} s",
        "latency ms: "
        + "  ".join(f"{k}={v:.3f}" for k, v in lat.items() if k != "mean")
        + f"  mean={lat['mean']:.3f}",
    ]
    if result.batch_sizes:
        dist = ", ".join(f"{k}: {v}" for k, v in sorted(result.batch_sizes.items()))
        lines.append(f"batches by size: {dist} (mean {result.mean_batch_size:.2f})")
    if result.errors:
        lines.append("errors: " + ", ".join(f"{k}: {v}" for k, v in sorted(result.errors.items())))
    client = result.client
    if client["kept_up"]:
        lines.append(f"load generator kept up (busiest process used {client['max_cpu_share']:.0%} of a core)")
    else:
        lines.append("WARNING, load generator could not keep up: " + "; ".join(client["notes"]))
    return "\n".join(lines)
