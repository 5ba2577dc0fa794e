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
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import random
import resource
import select
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import IO, Any

import msgpack
import msgspec
import zmq
from hdrh.histogram import HdrHistogram

from batcher.errors import BatcherError
from batcher.transport.allocator import heap_trimmer, keep_freed_memory
from batcher.transport.security import load_keypair, load_public_key, secure_client
from batcher.transport.zmqio import recv_frames, send_frames
from batcher.wire import protocol
from workers.supervisor import child_environment

#: Latencies are recorded in microseconds, from 1 us to 10 minutes, 3 significant digits.
HIST_MAX_US = 600_000_000
PERCENTILES = (50.0, 90.0, 99.0, 99.9)
#: Beyond this share of one core, the load generator itself may be what is measured.
CLIENT_BUSY_LIMIT = 0.9
#: How long the load processes may take to start and connect before the run is abandoned.
START_TIMEOUT_S = 60.0
#: How often a load process reports how many replies it has had (for a progress bar).
PROGRESS_INTERVAL_S = 0.1


def new_histogram() -> HdrHistogram:
    """An empty latency histogram in microseconds."""
    return HdrHistogram(1, HIST_MAX_US, 3)


def noise_allowance(expected: float) -> float:
    """How far a count of Poisson events may stray from `expected` before it means something:
    3 sigma, and never less than 2% (rates drift a little on a busy machine)."""
    return max(3.0 * math.sqrt(max(expected, 1.0)), 0.02 * expected)


def _finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")


@dataclass(frozen=True)
class LoadSettings:
    """What load to offer: closed loop (`concurrency`) or open loop (`rate`).

    `curve_server_key` (the broker's public key file) turns CurveZMQ on; with it,
    `curve_secret_key` is this client's own key pair (else a throwaway one, which only
    a broker without a client allow-list admits). `no_reply_timeout_s`: a run that
    gets no reply at all this long after its first request gives up."""

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
    curve_server_key: str | None = None
    curve_secret_key: str | None = None
    no_reply_timeout_s: float = 10.0
    #: Each request's input (None: `payload_bytes` bytes), and whether it asks for streamed
    #: replies: then time to first chunk, chunks/s and the time between chunks are measured.
    input: Any = None
    stream: bool = False

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of concurrency (closed loop) or rate (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None:
            _finite("rate", self.rate)
            if not self.rate > 0:
                raise ValueError(f"rate must be > 0, got {self.rate}")
        if (self.duration_s is None) == (self.requests is None):
            raise ValueError("give exactly one of duration_s or requests")
        if self.duration_s is not None:
            _finite("duration_s", self.duration_s)
            if not self.duration_s > 0:
                raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.requests}")
        if self.payload_bytes < 0:
            raise ValueError(f"payload_bytes must be >= 0, got {self.payload_bytes}")
        if self.processes < 1:
            raise ValueError(f"processes must be >= 1, got {self.processes}")
        if self.concurrency is not None and self.concurrency < self.processes:
            raise ValueError(f"concurrency ({self.concurrency}) must be >= processes ({self.processes})")
        if self.requests is not None and self.requests < self.processes:
            raise ValueError(f"requests ({self.requests}) must be >= processes ({self.processes})")
        _finite("warmup_s", self.warmup_s)
        if self.warmup_s < 0:
            raise ValueError(f"warmup_s must be >= 0, got {self.warmup_s}")
        _finite("drain_timeout_s", self.drain_timeout_s)
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        _finite("no_reply_timeout_s", self.no_reply_timeout_s)
        if not self.no_reply_timeout_s > 0:
            raise ValueError(f"no_reply_timeout_s must be > 0, got {self.no_reply_timeout_s}")
        if self.curve_secret_key is not None and self.curve_server_key is None:
            raise ValueError(
                "curve_secret_key needs curve_server_key (the broker's public key file): "
                "without it the connection is not encrypted"
            )

    @property
    def mode(self) -> str:
        return "closed" if self.concurrency is not None else "open"

    def shard(self, index: int) -> LoadSettings:
        """This load split across `processes`: shard `index` gets its share."""
        p = self.processes

        def share(total: int) -> int:
            return total // p + (1 if index < total % p else 0)

        return replace(
            self,
            concurrency=share(self.concurrency) if self.concurrency is not None else None,
            rate=self.rate / p if self.rate is not None else None,
            requests=share(self.requests) if self.requests is not None else None,
            processes=1,
            seed=None if self.seed is None else self.seed + index,
        )


@dataclass
class ShardResult:
    """What one load process measured; merged by `merge`. Times are seconds from the
    shard's start (all shards start together), so windows can be compared."""

    sent: int = 0
    sent_in_window: int = 0  # requests due inside the window: those whose latency is measured
    ok: int = 0  # successful replies to requests sent in the window (whenever they arrived)
    errors: Counter[str] = field(default_factory=Counter)  # error replies to those, by code
    batch_sizes: Counter[int] = field(default_factory=Counter)  # requests seen in batches of size k
    histogram: bytes = b""
    replies: int = 0  # every reply to a request of this run
    replies_before_window: int = 0
    replies_in_window: int = 0  # arrived inside the window, whatever was sent when
    ok_in_window: int = 0
    in_flight_at_start: int = 0
    in_flight_at_end: int = 0  # unanswered when the window closed: late + lost
    in_flight_at_stop: int = 0  # unanswered when sending ended
    late: int = 0  # answered after the window closed
    lost: int = 0  # never answered (drain_timeout_s after sending ended)
    window_s: float = 0.0
    last_reply_s: float = 0.0
    first_send_s: float | None = None
    gave_up_s: float | None = None  # no reply at all within no_reply_timeout_s: stopped here
    cpu_s: float = 0.0
    wall_s: float = 0.0
    max_send_lag_ms: float = 0.0
    late_sends: int = 0
    chunks_in_window: int = 0  # streamed chunks (finals included) arriving inside the window
    chunks: int = 0  # every ok streamed chunk of this run, whenever it arrived
    first_chunk_histogram: bytes = b""  # time from a request's due time to its first chunk
    inter_chunk_histogram: bytes = b""  # time between two chunks of one request

    @property
    def backlog_growth(self) -> int:
        """How many more requests were unanswered when sending ended than when the window began."""
        return self.in_flight_at_stop - self.in_flight_at_start


def _body_prefix(settings: LoadSettings) -> bytes:
    """A request body without its id value: ids are appended per request, so a request
    costs one small msgpack int instead of encoding the whole map again."""
    fields: dict[str, Any] = {
        "input": b"x" * settings.payload_bytes if settings.input is None else settings.input
    }
    if settings.model is not None:
        fields["model"] = settings.model
    if settings.stream:
        fields["stream"] = True
    parts = [bytes((0x80 | (len(fields) + 1),))]  # a fixmap header: the fields, then "id"
    for k, v in fields.items():
        parts += [protocol.pack(k), protocol.pack(v)]
    parts.append(protocol.pack("id"))
    return b"".join(parts)


class ReplyHead(msgspec.Struct):
    """What the load generator reads of a reply: its output is skipped, never decoded."""

    id: Any = None
    ok: Any = None
    batch_size: Any = None
    error: Any = None
    more: Any = None


_read_reply_head = msgspec.msgpack.Decoder(ReplyHead).decode


def read_head(body: Any) -> ReplyHead:
    """A reply's head; a reply msgspec cannot read as a map of str keys is decoded whole."""
    try:
        return _read_reply_head(body)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        pass
    try:
        reply = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception:  # msgpack raises several unrelated types
        return ReplyHead()
    if not isinstance(reply, dict):
        return ReplyHead()
    return ReplyHead(
        reply.get("id"), reply.get("ok"), reply.get("batch_size"), reply.get("error"), reply.get("more")
    )


def run_shard(
    settings: LoadSettings,
    progress: Callable[[int], None] | None = None,
    start: Callable[[], None] | None = None,
) -> ShardResult:
    """Offer the load from this process over one DEALER socket; returns what it measured.

    `start()` is called once connected and returns when the load may begin (so that all
    shards begin together); `progress(replies)` is called every PROGRESS_INTERVAL_S or so."""
    trim = heap_trimmer() if keep_freed_memory() else None  # large payloads: batcher.transport.allocator
    ctx: zmq.Context[Any] = zmq.Context()
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if settings.curve_server_key:
        secure_client(sock, settings.curve_server_key, settings.curve_secret_key)
    sock.connect(settings.connect)
    try:
        if start is not None:
            start()
        return _Generator(settings, sock, progress).run()
    finally:
        sock.close(0)
        ctx.term()
        if trim is not None:
            trim()


class _Generator:
    """The load loop of one process."""

    def __init__(
        self, settings: LoadSettings, sock: zmq.Socket[Any], progress: Callable[[int], None] | None
    ) -> None:
        self.s = settings
        self.sock = sock
        self.progress = progress
        self.progress_due = 0.0
        self.prefix = _body_prefix(settings)
        self.pack_id = msgpack.Packer().pack
        self.hist = new_histogram()
        self.first_chunk_hist = new_histogram()
        self.inter_chunk_hist = new_histogram()
        self.result = ShardResult()
        self.due: dict[int, float] = {}  # request id -> time it was due to be sent
        self.last_chunk: dict[int, float] = {}  # streamed request id -> when its last chunk came
        self.heard = False  # a reply or a chunk came: the broker answers (a long stream's first
        # final reply may come long after)
        self.next_id = 0
        self.t0 = 0.0
        self.window_from = 0.0
        self.window_to = math.inf  # finite with a duration; with `requests`, the last reply ends it
        self.first_send: float | None = None
        self.rng = random.Random(settings.seed)

    def send(self, due_at: float) -> None:
        self.next_id += 1
        rid = self.next_id
        self.due[rid] = due_at
        # No pipe to the broker this instant (libzmq drops it after a refused CURVE
        # handshake, until it reconnects): the request stays due and counts as lost unless
        # answered, as one the broker never heard would.
        with contextlib.suppress(zmq.Again):
            send_frames(self.sock, [b"", self.prefix + self.pack_id(rid)])
        res = self.result
        res.sent += 1
        if due_at >= self.window_from:
            res.sent_in_window += 1
        if self.first_send is None:
            self.first_send = due_at

    def receive_ready(self) -> int:
        """Take every reply waiting on the socket; returns how many."""
        got = 0
        sock = self.sock
        hist, res = self.hist, self.result
        window_from, window_to = self.window_from, self.window_to
        now = 0.0
        while True:
            try:
                frames = recv_frames(sock, copied=1)  # a large reply stays a zmq.Frame
            except zmq.Again:
                break
            now = time.perf_counter()
            reply = read_head(frames[-1])
            if self.s.stream and type(reply.id) is int and reply.id in self.due:
                self.heard = True
                self._chunk(reply.id, reply, now)
                if reply.more is True:
                    continue  # the request is answered by its last reply
            due_at = self.due.pop(reply.id, None)
            if due_at is None:
                continue  # not a request of this run
            got += 1
            ok = reply.ok is True
            if now < window_from:
                res.replies_before_window += 1
            elif now < window_to:
                res.replies_in_window += 1
                res.ok_in_window += ok
            else:
                res.late += 1
            if due_at < window_from:
                continue  # a warm-up request: counted above, not measured
            if ok:
                res.ok += 1
                hist.record_value(max(1, int((now - due_at) * 1e6)))
                size = reply.batch_size
                if isinstance(size, int):
                    res.batch_sizes[size] += 1
            else:
                error = reply.error if isinstance(reply.error, dict) else {}
                res.errors[str(error.get("code", "unknown"))] += 1
        if got:
            res.replies += got
            res.last_reply_s = now - self.t0
            if self.progress is not None and now >= self.progress_due:
                self.progress(res.replies)
                self.progress_due = now + PROGRESS_INTERVAL_S
        return got

    def _chunk(self, rid: int, reply: ReplyHead, now: float) -> None:
        """A streamed reply: the first of a request gives its time to first chunk, the
        next ones the time between chunks (an error reply ends the stream uncounted)."""
        last = self.last_chunk.pop(rid, None)
        if reply.ok is not True:
            return
        if reply.more is True:
            self.last_chunk[rid] = now
        self.result.chunks += 1
        if self.window_from <= now < self.window_to:
            self.result.chunks_in_window += 1
        if last is not None:
            self.inter_chunk_hist.record_value(max(1, int((now - last) * 1e6)))
        elif self.due[rid] >= self.window_from:
            self.first_chunk_hist.record_value(max(1, int((now - self.due[rid]) * 1e6)))

    def run(self) -> ShardResult:
        s, res = self.s, self.result
        cpu0 = _cpu_s()
        self.t0 = start = time.perf_counter()
        self.window_from = start + s.warmup_s
        stop_sending = math.inf
        if s.duration_s is not None:
            self.window_to = stop_sending = self.window_from + s.duration_s
        if s.concurrency is not None:
            self._closed_loop(s.concurrency, stop_sending, s.requests)
        else:
            assert s.rate is not None
            self._open_loop(s.rate, stop_sending, s.requests)
        res.in_flight_at_stop = len(self.due)
        if res.gave_up_s is None:
            self._drain(time.perf_counter() + s.drain_timeout_s)
        res.lost = len(self.due)
        res.in_flight_at_start = (res.sent - res.sent_in_window) - res.replies_before_window
        if s.duration_s is not None:
            res.window_s = s.duration_s
            res.in_flight_at_end = res.late + res.lost
            # sending ended at the window's end: count exactly, not from a late look at `due`
            res.in_flight_at_stop = res.in_flight_at_start + res.sent_in_window - res.replies_in_window
        else:
            res.window_s = max(0.0, res.last_reply_s - s.warmup_s)
            res.in_flight_at_end = res.lost
        res.first_send_s = None if self.first_send is None else self.first_send - start
        res.histogram = self.hist.encode()
        if s.stream:
            res.first_chunk_histogram = self.first_chunk_hist.encode()
            res.inter_chunk_histogram = self.inter_chunk_hist.encode()
        res.wall_s = time.perf_counter() - start
        res.cpu_s = _cpu_s() - cpu0
        return res

    def _budget_left(self, limit: int | None) -> bool:
        return limit is None or self.result.sent < limit

    def _no_reply_deadline(self) -> float:
        """When to give up if nothing has answered yet (inf once something has)."""
        if self.result.replies or self.heard or self.first_send is None:
            return math.inf
        return self.first_send + self.s.no_reply_timeout_s

    def _give_up(self, now: float) -> bool:
        """True (and noted) when no_reply_timeout_s passed since the first send without a reply."""
        if now < self._no_reply_deadline():
            return False
        self.result.gave_up_s = now - self.t0
        return True

    def _poll_ms(self, until: float, now: float) -> int:
        """Milliseconds to poll: up to `until`, the no-reply deadline, and at most 1 s."""
        left = min(until, self._no_reply_deadline(), now + 1.0) - now
        return max(0, int(left * 1000))

    def _closed_loop(self, concurrency: int, stop_sending: float, limit: int | None) -> None:
        poll = self.sock.poll
        clock = time.perf_counter
        for _ in range(concurrency):
            if self._budget_left(limit):
                self.send(clock())
        while True:
            now = clock()
            if now >= stop_sending or not self._budget_left(limit) or self._give_up(now):
                return
            if poll(self._poll_ms(stop_sending, now)):
                for _ in range(self.receive_ready()):
                    now = clock()
                    if now >= stop_sending or not self._budget_left(limit):
                        break
                    self.send(now)

    def _open_loop(self, rate: float, stop_sending: float, limit: int | None) -> None:
        poll = self.sock.poll
        res = self.result
        next_due = time.perf_counter()
        while self._budget_left(limit):
            now = time.perf_counter()
            if self._give_up(now):
                return
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
            if poll(self._poll_ms(next_due, time.perf_counter())):
                self.receive_ready()

    def _drain(self, deadline: float) -> None:
        while self.due:
            now = time.perf_counter()
            if now >= deadline or self._give_up(now):
                return
            if self.sock.poll(max(1, self._poll_ms(deadline, now))):
                self.receive_ready()


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


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


class BenchFailed(BatcherError, RuntimeError):
    """A run that measured nothing worth reporting (see LoadResult.failure)."""


@dataclass
class LoadResult:
    """The merged result of a run, as printed and as written by --json.

    `throughput_rps` (= `achieved_rate`) is `ok_in_window / window_s`; `latency_ms`
    covers the `ok` replies to the `sent_in_window` requests, late ones included.
    `offered_rate` is the open loop's asked rate (None in a closed loop), `sent_rate`
    what was actually sent in the window. `fell_behind` (open loop only, else None):
    the broker's backlog grew beyond noise, or it refused requests; `broker_notes` say
    how. `failure` is set when the run got no reply, or no successful one."""

    settings: dict[str, Any]
    mode: str
    sent: int
    sent_in_window: int
    ok: int
    errors: dict[str, int]
    window_s: float
    window: str  # what the window is, in words
    replies_in_window: int
    ok_in_window: int
    throughput_rps: float
    offered_rate: float | None
    sent_rate: float
    achieved_rate: float
    in_flight_at_start: int
    in_flight_at_end: int
    late: int
    lost: int
    fell_behind: bool | None
    broker_notes: list[str]
    latency_ms: dict[str, float]
    batch_sizes: dict[int, int]  # batch size -> number of batches
    mean_batch_size: float
    wall_s: float
    client: dict[str, Any]
    failure: str | None
    #: Streamed requests only (else None): chunks arriving in the window per second, the
    #: time from a request's due time to its first chunk, and between two of its chunks.
    chunks_per_s: float | None = None
    first_chunk_ms: dict[str, float] | None = None
    inter_chunk_ms: dict[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["batch_sizes"] = {str(k): v for k, v in sorted(self.batch_sizes.items())}
        return data

    def check(self) -> LoadResult:
        """This result, or BenchFailed when it measured nothing (for scripts that must not
        go on with zeros)."""
        if self.failure is not None:
            raise BenchFailed(self.failure)
        return self


def _failure(settings: LoadSettings, shards: list[ShardResult], ok: int, errors: Counter[str]) -> str | None:
    replies = sum(sh.replies for sh in shards)
    if settings.stream:  # a chunk is an answer too: a stream may outlast the run
        chunks = sum(sh.chunks for sh in shards)
        replies, ok = replies + chunks, ok + chunks
    if replies == 0:
        waited = max(
            ((sh.gave_up_s or sh.wall_s) - (sh.first_send_s or 0.0) for sh in shards),
            default=0.0,
        )
        hint = (
            " (and, with CURVE, is the server key the broker's, and this client's key allowed?)"
            if settings.curve_server_key
            else ""
        )
        return f"no reply from {settings.connect} within {waited:.1f} s: is a broker running there?{hint}"
    if sum(sh.sent_in_window for sh in shards) == 0:
        if settings.stream and settings.concurrency is not None:
            return (
                "no request was sent after the warm-up: a closed loop sends one only when one "
                "ends, and no stream ended; give shorter streams or no warm-up"
            )
        return "no request was sent after the warm-up: give more requests or a shorter warm-up"
    if ok == 0:
        if errors:
            codes = ", ".join(f"{k}: {v}" for k, v in sorted(errors.items()))
            return f"no successful reply from {settings.connect}: every reply was an error ({codes})"
        return f"no reply from {settings.connect} to the requests sent after the warm-up"
    return None


def merge(settings: LoadSettings, shards: list[ShardResult]) -> LoadResult:
    """Add the shards' counts and histograms into one result, and judge it."""
    hist = new_histogram()
    errors: Counter[str] = Counter()
    per_size: Counter[int] = Counter()
    for sh in shards:
        if sh.histogram:
            hist.decode_and_add(sh.histogram)
        errors.update(sh.errors)
        per_size.update(sh.batch_sizes)
    if settings.duration_s is not None:
        window_s = settings.duration_s
        window = f"{window_s:g} s after {settings.warmup_s:g} s of warm-up"
    else:
        window_s = max((sh.window_s for sh in shards), default=0.0)
        start = f"the end of {settings.warmup_s:g} s of warm-up" if settings.warmup_s else "the first send"
        window = f"{window_s:.2f} s from {start} to the last reply"
    ok = sum(sh.ok for sh in shards)
    ok_in_window = sum(sh.ok_in_window for sh in shards)
    sent = sum(sh.sent for sh in shards)
    sent_in_window = sum(sh.sent_in_window for sh in shards)
    throughput = ok_in_window / window_s if window_s > 0 else 0.0
    sent_rate = sent_in_window / window_s if window_s > 0 else 0.0
    latency = _percentiles_ms(hist)
    batches = {k: max(1, round(v / k)) for k, v in per_size.items() if k > 0}
    n_batches = sum(batches.values())
    busy = max((sh.cpu_s / sh.wall_s for sh in shards if sh.wall_s > 0), default=0.0)
    in_flight_at_start = sum(sh.in_flight_at_start for sh in shards)
    failure = _failure(settings, shards, ok, errors)

    client_notes = []
    if settings.rate is not None and window_s > 0:
        expected = settings.rate * window_s
        if settings.duration_s is not None and sent_in_window < expected - noise_allowance(expected):
            client_notes.append(
                f"sent {sent_in_window} requests in the window of the {expected:.0f} asked "
                f"({settings.rate:g}/s)"
            )
        late_sends = sum(sh.late_sends for sh in shards)
        if late_sends > 0.01 * max(sent, 1):
            client_notes.append(f"{late_sends} sends were more than 1 ms late")
    if busy > CLIENT_BUSY_LIMIT:
        client_notes.append(f"a load process used {busy:.0%} of a core: add --processes")

    streamed: dict[str, Any] = {}
    if settings.stream:
        streamed["chunks_per_s"] = (
            sum(sh.chunks_in_window for sh in shards) / window_s if window_s > 0 else 0.0
        )
        for key, attr in (
            ("first_chunk_ms", "first_chunk_histogram"),
            ("inter_chunk_ms", "inter_chunk_histogram"),
        ):
            h = new_histogram()
            for sh in shards:
                if getattr(sh, attr):
                    h.decode_and_add(getattr(sh, attr))
            streamed[key] = _percentiles_ms(h)
    fell_behind: bool | None = None
    broker_notes: list[str] = []
    if settings.rate is not None and failure is None:
        growth = sum(sh.backlog_growth for sh in shards)
        allowance = noise_allowance(sent_in_window)
        if growth > allowance:
            broker_notes.append(
                f"requests in flight grew from {in_flight_at_start} to {in_flight_at_start + growth} "
                f"while it sent (more than the {allowance:.0f} that noise explains)"
            )
        refused = sum(errors.values())
        if refused > allowance:
            codes = ", ".join(f"{k}: {v}" for k, v in sorted(errors.items()))
            broker_notes.append(f"{refused} of the requests sent in the window got errors ({codes})")
        fell_behind = bool(broker_notes)
    return LoadResult(
        settings=asdict(settings),
        mode=settings.mode,
        sent=sent,
        sent_in_window=sent_in_window,
        ok=ok,
        errors=dict(errors),
        window_s=window_s,
        window=window,
        replies_in_window=sum(sh.replies_in_window for sh in shards),
        ok_in_window=ok_in_window,
        throughput_rps=throughput,
        offered_rate=settings.rate,
        sent_rate=sent_rate,
        achieved_rate=throughput,
        in_flight_at_start=in_flight_at_start,
        in_flight_at_end=sum(sh.in_flight_at_end for sh in shards),
        late=sum(sh.late for sh in shards),
        lost=sum(sh.lost for sh in shards),
        fell_behind=fell_behind,
        broker_notes=broker_notes,
        latency_ms=latency,
        batch_sizes=dict(sorted(batches.items())),
        mean_batch_size=sum(per_size.values()) / n_batches if n_batches else 0.0,
        wall_s=max((sh.wall_s for sh in shards), default=0.0),
        client={
            "processes": settings.processes,
            "max_cpu_share": round(busy, 3),
            "max_send_lag_ms": max((sh.max_send_lag_ms for sh in shards), default=0.0),
            "kept_up": not client_notes,
            "notes": client_notes,
        },
        failure=failure,
        **streamed,
    )


def _percentiles_ms(hist: HdrHistogram) -> dict[str, float]:
    """A microsecond histogram's percentiles, max and mean, in milliseconds."""
    out = {f"p{p:g}": hist.get_value_at_percentile(p) / 1000.0 for p in PERCENTILES}
    out["max"] = hist.get_max_value() / 1000.0
    out["mean"] = hist.get_mean_value() / 1000.0
    return out


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


def format_report(result: LoadResult) -> str:
    """The human-readable summary `batcher bench` prints."""
    s = result.settings
    mode = (
        f"closed loop, {s['concurrency']} in flight"
        if s["concurrency"] is not None
        else f"open loop, {s['rate']:g} requests/s offered (Poisson)"
    )
    lines = [
        f"load: {mode}, {s['processes']} process(es), payload {s['payload_bytes']} B, "
        f"model {s['model'] or '(default)'}",
    ]
    if result.failure is not None:
        lines.append(f"requests: {result.sent} sent, {result.ok} ok, {sum(result.errors.values())} errors")
        lines.append(f"FAILED: {result.failure}")
        return "\n".join(lines)
    lines += [
        f"window: {result.window}; {result.wall_s:.2f} s in all with the drain",
        f"requests: {result.sent} sent ({result.sent_in_window} in the window), "
        f"{result.ok} ok, {sum(result.errors.values())} errors",
        f"throughput: {result.throughput_rps:,.1f} requests/s = {result.ok_in_window} ok replies "
        f"arriving in the window / {result.window_s:.2f} s",
    ]
    if result.offered_rate is not None:
        lines.append(
            f"rate: offered {result.offered_rate:,.1f} requests/s (sent {result.sent_rate:,.1f}/s), "
            f"achieved {result.achieved_rate:,.1f} requests/s"
        )
    if s["duration_s"] is not None:
        lines.append(
            f"in flight: {result.in_flight_at_start} at the window's start, {result.in_flight_at_end} at "
            f"its end: {result.late} answered late (after the window), {result.lost} lost"
        )
    elif result.lost:
        lines.append(f"in flight: {result.lost} never answered (lost)")
    lat = result.latency_ms
    lines.append(
        f"latency ms of the {result.ok} ok replies to requests sent in the window (late ones included): "
        + "  ".join(f"{k}={v:.3f}" for k, v in lat.items() if k != "mean")
        + f"  mean={lat['mean']:.3f}"
    )
    if result.chunks_per_s is not None:
        lines.append(f"chunks: {result.chunks_per_s:,.1f} chunks/s arriving in the window")
        for label, values in (
            ("time to first chunk", result.first_chunk_ms),
            ("between chunks", result.inter_chunk_ms),
        ):
            if values:
                lines.append(
                    f"{label} ms: "
                    + "  ".join(f"{k}={v:.3f}" for k, v in values.items() if k != "mean")
                    + f"  mean={values['mean']:.3f}"
                )
    if result.batch_sizes:
        dist = ", ".join(f"{k}: {v}" for k, v in sorted(result.batch_sizes.items()))
        lines.append(f"batches by size: {dist} (mean {result.mean_batch_size:.2f})")
    if result.errors:
        lines.append("errors: " + ", ".join(f"{k}: {v}" for k, v in sorted(result.errors.items())))
    if result.fell_behind:
        lines.append(
            "WARNING, the broker fell behind the offered load: "
            + "; ".join(result.broker_notes)
            + ". Latency grows with the run's length: this is overload, not a steady state"
        )
    elif result.fell_behind is False:
        lines.append("the broker kept up with the offered load")
    client = result.client
    busiest = f"busiest process used {client['max_cpu_share']:.0%} of a core"
    if not client["kept_up"]:
        lines.append("WARNING, load generator could not keep up: " + "; ".join(client["notes"]))
    elif result.fell_behind:  # never "kept up" next to a broker that did not
        lines.append(f"load generator sent on schedule ({busiest})")
    else:
        lines.append(f"load generator kept up ({busiest})")
    return "\n".join(lines)
