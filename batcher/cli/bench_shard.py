"""One load process's loop (run_shard): one DEALER socket, closed or open loop, each
request's body built from a prefix and its id, each reply's head read without its output."""

from __future__ import annotations

import contextlib
import math
import random
import resource
import time
from collections.abc import Callable
from typing import Any

import msgpack
import msgspec
import zmq

from batcher.cli.bench_settings import PROGRESS_INTERVAL_S, LoadSettings, ShardResult, new_histogram
from batcher.core.replies import ReplyTable
from batcher.transport.allocator import heap_trimmer, keep_freed_memory
from batcher.transport.security import secure_client
from batcher.transport.zmqio import recv_frames, send_frames
from batcher.wire import protocol


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
        #: The requests not answered yet, by id: each one's waiter is the time it was due.
        self.due: ReplyTable[float] = ReplyTable()
        self.last_chunk: dict[int, float] = {}  # streamed request id -> when its last chunk came
        self.heard = False  # a reply or a chunk came: the broker answers (a long stream's first
        # final reply may come long after)
        self.t0 = 0.0
        self.window_from = 0.0
        self.window_to = math.inf  # finite with a duration; with `requests`, the last reply ends it
        self.first_send: float | None = None
        self.rng = random.Random(settings.seed)

    def send(self, due_at: float) -> None:
        rid = self.due.open(due_at)
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
        due, stream = self.due, self.s.stream
        match = due.match
        now = 0.0
        while True:
            try:
                frames = recv_frames(sock, copied=1)  # a large reply stays a zmq.Frame
            except zmq.Again:
                break
            now = time.perf_counter()
            reply = read_head(frames[-1])
            if stream and type(reply.id) is int and (due_at := due.get(reply.id)) is not None:
                self.heard = True
                self._chunk(reply.id, due_at, reply, now)
                if reply.more is True:
                    continue  # the request is answered by its last reply
            due_at = match(reply.id)
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

    def _chunk(self, rid: int, due_at: float, reply: ReplyHead, now: float) -> None:
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
        elif due_at >= self.window_from:
            self.first_chunk_hist.record_value(max(1, int((now - due_at) * 1e6)))

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
