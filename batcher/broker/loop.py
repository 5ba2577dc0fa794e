"""The broker: one thread, one zmq.Poller, the scheduler's rules applied to real sockets.

Frontend: a ROUTER that clients (REQ or DEALER) talk to. Backend: a ROUTER that
worker DEALERs connect to. A request's body is decoded once, to read its header,
and then forwarded byte for byte; a worker's reply bytes go back to the client
untouched.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.backend import Frame

from batcher.broker.backend import DRAIN_BUDGET_S, DRAIN_LIMIT, Backend
from batcher.broker.control import MUTATING_OPS, Controls
from batcher.broker.metrics import PrometheusMetrics
from batcher.broker.stats import BrokerStats, gauges
from batcher.core.pool import WorkerPool
from batcher.core.scheduler import Batch, BatchSettings, NoSuchModel, QueuedRequest, QueueFull, Scheduler
from batcher.core.streams import Streams
from batcher.errors import BindError as BindError  # its older home
from batcher.errors import SettingsError
from batcher.transport.allocator import TRIM_INTERVAL_S, heap_trimmer, keep_freed_memory
from batcher.transport.security import CurveGate, CurveServerKeys, HandshakeWatch, secure_server
from batcher.transport.stopping import StopSignals
from batcher.transport.zmqio import readable, recv_bounded, recv_bounded_from, send_replies, send_reply
from batcher.wire import protocol
from batcher.wire.protocol import ErrorCode, Heartbeat, ProtocolError

log = logging.getLogger("batcher.broker")

# A drain of either socket takes at most DRAIN_LIMIT messages or DRAIN_BUDGET_S
# (batcher.broker.backend), whichever comes first: a burst of costly messages (huge bodies,
# floods of cancels) can never hold heartbeats, liveness checks and deadlines back.
#: Frames one client message may have: the routing id, proxy hops, a delimiter, the body.
MAX_FRAMES = 32
#: Replies queued for one client (or batches for one worker) before sends fail.
REPLY_HWM = 100_000
#: How long a closing broker lets its last replies leave (a client that is gone or not
#: reading costs at most this much at exit).
FLUSH_LINGER_MS = 1000


@dataclass(frozen=True)
class BrokerSettings:
    """Where the broker listens and how it batches; the CLI builds one of these."""

    frontend: str = "tcp://127.0.0.1:5555"
    backend: str = "tcp://127.0.0.1:5556"
    models: tuple[str, ...] = ("sim",)
    batch: BatchSettings = field(default_factory=BatchSettings)
    per_model: dict[str, BatchSettings] = field(default_factory=dict)
    default_timeout_ms: float = 0.0
    worker_prefetch: int = 2
    heartbeat: Heartbeat = field(default_factory=Heartbeat)
    max_retries: int = 1
    max_message_bytes: int = 16 * 1024 * 1024
    curve: CurveServerKeys | None = None
    metrics_port: int | None = None
    #: A batch running longer than this is taken for hung (its worker stopped, its requests
    #: retried); None: 10 x n x the learned t(1), at least 1 s (60 s for a model's first batch).
    batch_timeout_ms: float | None = None
    #: Where the metrics endpoint listens: loopback unless asked (it has no authentication).
    metrics_host: str = "127.0.0.1"
    shutdown_grace_s: float = 10.0
    #: A request for a model that has had no worker this long is answered `unavailable`
    #: (and so is every later one, until a worker joins); 0 waits forever.
    no_worker_timeout_ms: float = 10_000.0

    def __post_init__(self) -> None:
        if not self.models:
            raise SettingsError("models must name at least one model, got none")
        for name in self.models:
            if not name:
                raise SettingsError("model names must be non-empty")
        if not self.default_timeout_ms >= 0:
            raise SettingsError(f"default_timeout_ms must be >= 0, got {self.default_timeout_ms}")
        if not isinstance(self.worker_prefetch, int) or self.worker_prefetch < 1:
            raise SettingsError(f"worker_prefetch must be >= 1, got {self.worker_prefetch}")
        if not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise SettingsError(f"max_retries must be >= 0, got {self.max_retries}")
        if not isinstance(self.max_message_bytes, int) or self.max_message_bytes < 1024:
            raise SettingsError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if not self.shutdown_grace_s >= 0:
            raise SettingsError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if self.batch_timeout_ms is not None and not 0 < self.batch_timeout_ms < math.inf:
            raise SettingsError(f"batch_timeout_ms must be a finite number > 0, got {self.batch_timeout_ms}")
        if not 0 <= self.no_worker_timeout_ms < math.inf:
            raise SettingsError(
                f"no_worker_timeout_ms must be a finite number >= 0, got {self.no_worker_timeout_ms}"
            )

    @property
    def default_model(self) -> str:
        """The model a request without `model` goes to: the first one named."""
        return self.models[0]


class TimerHeap:
    """`fn(now)` calls due at given times, run by the loop between polls."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()

    def call_at(self, when: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), fn))

    def next_at(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def due(self, now: float) -> list[Callable[[float], None]]:
        """Pop every call due at `now`."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            out.append(heapq.heappop(self._heap)[2])
        return out


class Broker:
    """Sockets, the timer heap and sending: every decision is the scheduler's or the
    worker pool's (sans-I/O), every count the stats'."""

    def __init__(self, settings: BrokerSettings, context: zmq.Context[Any] | None = None) -> None:
        self.settings = settings
        self._own_context = context is None
        self.ctx: zmq.Context[Any] = context or zmq.Context()
        now = time.monotonic()
        self.scheduler = Scheduler(
            settings.batch,
            settings.per_model,
            list(settings.models),
            settings.worker_prefetch,
            # Batch ids differ across broker restarts, so a reply meant for a previous
            # broker can never be taken for one of ours.
            first_batch_id=random.getrandbits(62),
            no_worker_timeout_s=settings.no_worker_timeout_ms / 1000.0,
        )
        # Sequence ids, like batch ids, differ across broker restarts.
        self.streams = Streams(first_seq_id=random.getrandbits(62))
        self.pool = WorkerPool(self.scheduler, settings.heartbeat, settings.max_retries, now, self.streams)
        self.stats = BrokerStats()
        self._configured = frozenset([*settings.models, *settings.per_model])
        self._default_timeout_s = settings.default_timeout_ms / 1000.0
        self._default_model = settings.default_model
        self._stopping_since: float | None = None
        self.signals = StopSignals()
        self.timers = TimerHeap()
        # libzmq drops a sender's connection past the hard limit; between the two limits
        # the broker reads the message's head and answers too_large.
        self.frontend = router(self.ctx, hard_limit(settings.max_message_bytes))
        self.backend = router(self.ctx, -1)
        self._auth: CurveGate | None = None
        self._handshakes: HandshakeWatch | None = None
        try:
            if settings.curve is not None:
                self._auth = secure_server(self.ctx, settings.curve, self.frontend, self.backend)
                self._handshakes = HandshakeWatch({"frontend": self.frontend, "backend": self.backend})
            bind(self.frontend, settings.frontend)
            bind(self.backend, settings.backend)
            if settings.metrics_port is not None:
                self.stats.metrics = serve_metrics(
                    settings.metrics_host, settings.metrics_port, self.scheduler, self.streams
                )
        except BaseException:
            self.close()
            raise
        self.workers = Backend(
            self.backend,
            self.scheduler,
            self.pool,
            self.stats,
            self._send_to_client,
            self._reply_error,
            self._fail_batch,
            self._send_batch_replies,
        )
        limits = {
            "max_message_bytes": settings.max_message_bytes,
            "max_frame_bytes": hard_limit(settings.max_message_bytes),
        }
        self.controls = Controls(self.scheduler, self.pool, self.stats, self._configured, self._state, limits)
        # With --curve-admins the frontend is read keeping each message's first frame, whose
        # User-Id says whether a control request may change the service; without it,
        # nothing of that is paid for.
        self._roles = self._auth if self._auth is not None and self._auth.admins is not None else None
        self._sender: Frame | None = None  # the first frame of the message being handled
        self._receive = recv_bounded if self._roles is None else self._recv_noting_sender
        self.call_every(settings.heartbeat.interval_s, self.workers.heartbeat)
        self._limit_s = None if settings.batch_timeout_ms is None else settings.batch_timeout_ms / 1000.0
        self._limits_armed = False  # whether the time-limit check is on the timer heap
        if (trim := heap_trimmer()) is not None:
            keep_freed_memory()
            self.call_every(TRIM_INTERVAL_S, lambda now: trim())

    def reload_allow_lists(self) -> None:
        """SIGHUP: the CURVE allow-lists read again (nothing to do without them)."""
        if self._auth is not None:
            self._auth.reload()
        else:
            log.info("SIGHUP: no CURVE allow-list to read again")

    def _state(self) -> dict[str, Any]:
        """What `stats` reports of the loop itself."""
        watch = self._handshakes
        return {
            "handshakes_refused": dict(watch.refused) if watch else {},
            "stopping": self._stopping_since is not None,
        }

    # --- lifecycle --------------------------------------------------------------------------

    def call_every(self, interval_s: float, fn: Callable[[float], None]) -> None:
        """Run `fn(now)` every `interval_s` on the loop's timer heap (heartbeats, supervision)."""

        def tick(now: float) -> None:
            self.timers.call_at(now + interval_s, tick)
            fn(now)

        self.timers.call_at(time.monotonic() + interval_s, tick)

    def _arm_time_limits(self) -> None:
        """Check running batches against their time limit every TIME_LIMIT_CHECK_S while any
        runs, from the first dispatch on; an idle broker is not woken for it (it was, ten
        times a second)."""
        self._limits_armed = True
        self.timers.call_at(time.monotonic() + TIME_LIMIT_CHECK_S, self._check_time_limits)

    def _check_time_limits(self, now: float) -> None:
        self._limits_armed = False
        self.workers.check_time_limits(now, self._limit_s)
        if self.scheduler.running() or self.streams.busy():
            self._arm_time_limits()

    def stop(self, now: bool = False) -> None:
        """now=False: drain (finish queued and running work), as a first SIGTERM does;
        now=True: answer everything `shutting_down` and exit, as a second one does."""
        self.signals.trigger()
        if now and self.signals.count < 2:
            self.signals.trigger()

    def close(self) -> None:
        """Close the sockets (and the context, when the broker made it)."""
        if self._auth is not None:
            self._auth.stop()
        if self._handshakes is not None:
            self._handshakes.close()
        # The last replies of a drain may still be in the frontend's queue: give them
        # FLUSH_LINGER_MS to leave (libzmq drops them at close with linger 0), unless a
        # second signal asked for an exit at once.
        self.frontend.close(0 if self.signals.count > 1 else FLUSH_LINGER_MS)
        self.backend.close(0)
        self.signals.close()
        if self._own_context:
            self.ctx.term()

    def run(self) -> None:
        """The event loop; returns once stopped and every accepted request is answered."""
        poller = zmq.Poller()
        for sock in (self.frontend, self.backend, self.signals.fd):
            poller.register(sock, zmq.POLLIN)
        watch = self._handshakes
        for monitor in watch.monitors if watch is not None else ():
            poller.register(monitor, zmq.POLLIN)
        s = self.settings
        log.info(
            "broker listening: frontend %s, backend %s, models %s (pid %d)",
            s.frontend, s.backend, ",".join(s.models), os.getpid(),
        )  # fmt: skip
        while True:
            now = time.monotonic()
            if self._stopping_since is not None and self._finished_stopping(now):
                break
            events = dict(poller.poll(self._poll_timeout_ms(now)))
            if self.signals.fd in events:
                self.signals.clear()
                self._note_stop()
            if self.backend in events:
                self._guard(self.workers.drain)
            if self.frontend in events:
                self._guard(self._drain_frontend)
            if watch is not None and events:
                for monitor in watch.monitors:
                    if monitor in events:
                        self._guard(functools.partial(watch.handle, monitor, now))
            for fn in self.timers.due(time.monotonic()):
                self._guard(functools.partial(fn, time.monotonic()))
            self._guard(self._dispatch)
        log.info("broker stopped")

    def _note_stop(self) -> None:
        """Begin draining once a stop signal came (its handler counts it as soon as the
        loop runs Python code again: a request read after that is refused)."""
        if self.signals.count and self._stopping_since is None:
            self._stopping_since = time.monotonic()
            log.info("draining: new requests are refused, queued ones finished")

    def _guard(self, step: Callable[[], Any]) -> None:
        """Run one loop step; an exception is logged, never allowed to end the loop."""
        try:
            step()
        except Exception:
            log.exception("unexpected error in the broker loop (the broker goes on)")

    def _poll_timeout_ms(self, now: float) -> int:
        # Twice a lone request: no list, no generator (1.0 -> 0.4 us a turn, hot).
        wake = self.scheduler.next_wakeup()
        timer = self.timers.next_at()
        if timer is not None and (wake is None or timer < wake):
            wake = timer
        deadline = self.streams.next_deadline()
        if deadline is not None and (wake is None or deadline < wake):
            wake = deadline
        if self._stopping_since is not None:
            grace_end = self._stopping_since + self.settings.shutdown_grace_s
            wake = grace_end if wake is None else min(wake, grace_end)
        return -1 if wake is None else max(0, math.ceil((wake - now) * 1000))

    def _finished_stopping(self, now: float) -> bool:
        if not self.scheduler.busy() and not self.streams.busy():
            return True
        assert self._stopping_since is not None
        if self.signals.count > 1 or now >= self._stopping_since + self.settings.shutdown_grace_s:
            message = "the broker is shutting down"
            for name, req in self.scheduler.cancel(lambda r: True):
                self._reply_error(req, name, ErrorCode.SHUTTING_DOWN, message)
            for seq in self.streams.unanswered():
                self.workers.end_stream(seq, ErrorCode.SHUTTING_DOWN, "shutting_down", message)
            for batch in self.scheduler.remove_all_workers():
                self._fail_batch(batch, ErrorCode.SHUTTING_DOWN, message)
            return True
        return False

    # --- frontend ---------------------------------------------------------------------------

    def _drain_frontend(self) -> None:
        sock, accept, receive = self.frontend, self._accept, self._receive
        max_bytes = self.settings.max_message_bytes
        now = time.monotonic()
        budget_end = now + DRAIN_BUDGET_S
        for _ in range(DRAIN_LIMIT):
            try:
                frames, fits = receive(sock, MAX_FRAMES, max_bytes)
            except zmq.Again:
                return
            try:
                if fits:
                    accept(frames, now)
                else:
                    self._refuse(*oversized(frames, max_bytes))
            except Exception:  # a bug of ours: the sender still hears back
                log.exception("unexpected error handling a request (the broker goes on)")
                envelope = frames[:2] if len(frames) > 2 and not frames[1] else frames[:1]
                self._refuse(envelope, None, ErrorCode.INTERNAL, "the broker failed to handle this request")
            # Done once the socket says none waits, rather than once a read raises
            # zmq.Again: that exception cost a lone request 15-20 us of a cold CPU before
            # its batch was cut.
            if not readable(sock) or time.monotonic() >= budget_end:
                return

    def _recv_noting_sender(
        self, sock: zmq.Socket[Any], max_frames: int, max_bytes: int
    ) -> tuple[list[Any], bool]:
        """recv_bounded, keeping the message's first frame for `_control` (--curve-admins)."""
        frames, fits, self._sender = recv_bounded_from(sock, max_frames, max_bytes)
        return frames, fits

    def _accept(self, frames: list[bytes], now: float) -> None:
        if len(frames) == 3 and not frames[1]:
            envelope, body = frames[:2], frames[2]
        else:
            try:
                envelope, body = protocol.split_envelope(frames)
            except protocol.EnvelopeError as exc:
                self._refuse(exc.envelope, None, exc.code, exc.message)
                return
        try:
            header = protocol.read_header(body)
        except ProtocolError as exc:
            stream = protocol.wants_stream(body)
            self._refuse(envelope, exc.req_id, exc.code, exc.message, None, stream)
            return
        if header.op != "infer":
            self._control(envelope, header.id, header.op, header.model)
            return
        model = header.model or self._default_model
        if self.signals.count:  # (a call per request otherwise, for a rare event)
            self._note_stop()
        refusal: tuple[ErrorCode, str] | None
        if self._stopping_since is not None:
            refusal, signature = (ErrorCode.SHUTTING_DOWN, "the broker is shutting down"), None
        else:
            refusal, signature = self.pool.admission(model, now)
        stream = header.stream
        if refusal is not None:
            self._refuse(envelope, header.id, *refusal, model, stream)
            return
        timeout_s = header.timeout_ms / 1000.0 if header.timeout_ms else self._default_timeout_s
        request = QueuedRequest(
            envelope, body, header.id, now, header.priority, now + timeout_s if timeout_s else None
        )
        request.cost = header.cost
        request.stream = stream
        if signature is not None and (why := signature.misfit(body)) is not None:
            self._refuse(envelope, header.id, ErrorCode.BAD_REQUEST, why, model, stream)
            return
        settings = self.scheduler.settings_of(model)
        if settings is not None and settings.bucket_by is not None:
            try:
                request.bucket = settings.bucket(protocol.input_length(body, header.id))
            except ProtocolError as exc:
                self._refuse(envelope, exc.req_id, exc.code, exc.message, model, stream)
                return
        try:
            self.scheduler.enqueue(model, request)
        except NoSuchModel:
            served = ", ".join(sorted(self.scheduler.views())) or "none"
            message = f"no worker serves model {model!r} (models: {served})"
            self._refuse(envelope, header.id, ErrorCode.UNKNOWN_MODEL, message, None, stream)
        except QueueFull:
            queued = self.scheduler.queued(model)
            message = f"model {model!r} has {queued} requests queued, its limit"
            self._refuse(envelope, header.id, ErrorCode.OVERLOADED, message, model, stream)

    def model_failed(self, model: str, why: str) -> None:
        """No worker of `model` can start: answer its queued requests and refuse new ones
        with worker_failed, until a worker of it joins after all."""
        log.error("%s: its requests are answered with worker_failed", why)
        for name, req in self.pool.model_failed(model, why):
            self._reply_error(req, name, ErrorCode.WORKER_FAILED, why)

    def _refuse(
        self,
        envelope: list[bytes],
        req_id: object,
        code: ErrorCode,
        message: str,
        model: str | None = None,
        stream: bool = False,
    ) -> None:
        """Answer a request that was never queued (counted under its model when it has one)."""
        self.stats.count(model, code)
        self._send_to_client(envelope, protocol.error_reply(req_id, code, message, stream))

    def _control(self, envelope: list[bytes], req_id: object, op: str, model: str | None) -> None:
        def reply(ok: bool, result: Any) -> None:
            body = protocol.ok_reply(req_id, result) if ok else protocol.error_reply(req_id, *result)
            self._send_to_client(envelope, body)

        if op == "cancel":  # only the sender's own requests: ids are per client
            for name, req in self.scheduler.cancel_id(envelope[0], req_id):
                self._reply_error(req, name, ErrorCode.CANCELLED, "cancelled by the client")
            for seq in self.streams.cancel_id(envelope[0], req_id):
                self.workers.end_stream(seq, ErrorCode.CANCELLED, "cancel", "cancelled by the client")
        else:
            roles, sender = self._roles, self._sender  # (a sender is kept whenever roles are)
            admin = roles is None or (sender is not None and roles.is_admin(sender))
            if roles is not None and sender is not None and not admin and op in MUTATING_OPS:
                roles.note_forbidden(sender, op)
            self.controls.handle(op, model, reply, admin)

    def _send_to_client(self, envelope: list[bytes], body: bytes) -> bool:
        """Send a reply; False when it cannot go: the client is gone (EHOSTUNREACH), or
        not reading while REPLY_HWM replies wait for it."""
        try:
            send_reply(self.frontend, envelope, body)
            return True
        except zmq.ZMQError as exc:
            self.stats.undeliverable += 1
            log.debug("reply to a vanished client dropped: %s", exc)
            return False

    def _send_batch_replies(self, requests: list[QueuedRequest], replies: list[Any]) -> None:
        """Send a batch's replies, each to its client (one gone or not reading is counted)."""
        failed = send_replies(self.frontend, requests, replies)
        if failed:
            self.stats.undeliverable += failed
            log.debug("%d replies to vanished clients dropped", failed)

    def _reply_error(self, req: QueuedRequest, model: str, code: ErrorCode, message: str) -> None:
        self.stats.count(model, code)
        self._send_to_client(req.envelope, protocol.error_reply(req.id, code, message, req.stream))

    def _fail_batch(self, batch: Batch, code: ErrorCode, message: str) -> None:
        for req in batch.requests:
            self._reply_error(req, batch.model, code, message)

    # --- dispatch ---------------------------------------------------------------------------

    def _dispatch(self) -> None:
        now = time.monotonic()
        for name, req in self.scheduler.expire(now):
            self._reply_error(req, name, ErrorCode.DEADLINE_EXCEEDED, "deadline passed while queued")
        for name, req, without_s in self.scheduler.unavailable(now):
            self._reply_error(
                req, name, ErrorCode.UNAVAILABLE, self.pool.unavailable_message(name, without_s)
            )
        for batch in self.scheduler.due_batches(now):
            queue_ms = [round((now - r.arrived_at) * 1000.0, 3) for r in batch.requests]
            self.stats.metrics.queue_waits_ms(batch.model, queue_ms)
            frames = protocol.batch_frames(batch.batch_id, queue_ms, [r.body for r in batch.requests])
            if not self.workers.send(batch.worker, frames):
                log.warning("worker %s unreachable; its batches go to another", self.pool.name(batch.worker))
                self.workers.lost(batch.worker, "worker unreachable")
        if self.streams:
            self._dispatch_sequences(now)
        if not self._limits_armed and (self.scheduler.running() or self.streams.busy()):
            self._arm_time_limits()

    def _dispatch_sequences(self, now: float) -> None:
        """Step-level workers: end the sequences past their deadline, then fill every free
        slot from its model's queue (the worker admits them at its next step)."""
        for seq in self.streams.expire(now):
            self.workers.end_stream(
                seq, ErrorCode.DEADLINE_EXCEEDED, "deadline", "deadline passed while generating"
            )
        for w in self.streams.free_slots():
            if not self.scheduler.queued(w.model):
                continue
            requests = self.scheduler.take(w.model, w.free)
            sequences = self.streams.start(w.worker_id, requests, now)
            queue_ms = [round((now - r.arrived_at) * 1000.0, 3) for r in requests]
            self.stats.sequences_started(w.model, queue_ms)
            remaining_ms = [
                None if r.deadline_at is None else round(max(0.0, r.deadline_at - now) * 1000.0, 3)
                for r in requests
            ]
            frames = protocol.start_frames(
                [s.seq_id for s in sequences], remaining_ms, [r.body for r in requests]
            )
            if not self.workers.send(w.worker_id, frames):
                log.warning("worker %s unreachable; its sequences go to another", self.pool.name(w.worker_id))
                self.workers.lost(w.worker_id, "worker unreachable")


def router(ctx: zmq.Context[Any], max_message_bytes: int) -> zmq.Socket[Any]:
    """One of the broker's two ROUTER sockets, with its safety options."""
    sock: zmq.Socket[Any] = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    # A reply to a peer that is gone raises (and is counted) instead of vanishing.
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    # Bounded per-peer queues: replies past this raise zmq.Again and are counted.
    sock.setsockopt(zmq.SNDHWM, REPLY_HWM)
    # A peer sending a bigger frame is disconnected by libzmq before we see it.
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    return sock


def bind(sock: zmq.Socket[Any], address: str) -> None:
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        raise BindError(f"cannot bind {address}: {exc.strerror}") from None


def serve_metrics(host: str, port: int, scheduler: Scheduler, streams: Streams) -> PrometheusMetrics:
    """Prometheus metrics on `host`:`port`, gauges read from the scheduler's views at
    scrape time (from prometheus_client's thread: retried if the loop changed a dict
    under it)."""

    def read_gauges() -> dict[str, dict[str, float]]:
        for _ in range(5):
            try:
                return gauges(scheduler.views(), streams)
            except (RuntimeError, KeyError):
                continue
        return {}

    prom = PrometheusMetrics(read_gauges)
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        prom.serve(port, host)
    except (OSError, UnicodeError) as exc:  # a name that does not resolve, or cannot be one
        raise BindError(f"cannot serve metrics on {where}: {getattr(exc, 'strerror', None) or exc}") from None
    log.info("metrics at http://%s/metrics", where)
    return prom


#: How often batches are checked against their time limit.
TIME_LIMIT_CHECK_S = 0.1
#: How often a plain broker looks for a SIGHUP (serve looks on its supervision tick).
HANGUP_CHECK_S = 0.2

#: libzmq's own limit on a frontend frame, as a multiple of --max-message-bytes: past it
#: the sender's connection is dropped unanswered (protection against abuse); below it an
#: oversized request is answered too_large.
HARD_LIMIT_FACTOR = 4


def hard_limit(max_message_bytes: int) -> int:
    """The frame size past which libzmq itself drops a frontend connection."""
    return max_message_bytes * HARD_LIMIT_FACTOR


def oversized(frames: list[bytes], max_bytes: int) -> tuple[list[bytes], int | str | None, ErrorCode, str]:
    """The refusal of a message over MAX_FRAMES frames (bad_request) or over `max_bytes`
    in all (too_large, with the body's id when its head holds one): on its envelope as far
    as it was kept, never parsed past the id."""
    try:
        end = frames.index(b"", 1) + 1
    except ValueError:
        end = 1
    if len(frames) >= MAX_FRAMES:
        return frames[:end], None, ErrorCode.BAD_REQUEST, f"message too large: more than {MAX_FRAMES} frames"
    req_id = protocol.id_of_refused(frames[end]) if len(frames) > end else None
    message = f"request too large: more than {max_bytes} bytes (the broker's --max-message-bytes)"
    return frames[:end], req_id, ErrorCode.TOO_LARGE, message


def run_broker(settings: BrokerSettings) -> None:
    """Bind, serve until SIGINT/SIGTERM, then drain and close: the `batcher broker` body.
    SIGHUP reads the CURVE allow-lists again."""
    broker = Broker(settings)
    broker.signals.install()
    broker.signals.install_hangup()
    seen = [0]

    def on_tick(now: float) -> None:
        if broker.signals.hangups != seen[0]:
            seen[0] = broker.signals.hangups
            broker.reload_allow_lists()

    broker.call_every(HANGUP_CHECK_S, on_tick)
    try:
        broker.run()
    finally:
        broker.close()
