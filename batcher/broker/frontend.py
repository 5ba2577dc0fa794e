"""The broker's client side: requests read from the frontend socket, admitted or refused
(the core's `admit` decides), control requests answered, and every reply sent back on its
request's envelope. The loop (batcher.broker.loop) owns the sockets' lifetimes and the
turn's time; the backend side (batcher.broker.backend) sends batches and reads replies."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.backend import Frame

from batcher.broker.backend import DRAIN_BUDGET_S, DRAIN_LIMIT
from batcher.broker.control import MUTATING_OPS, Controls
from batcher.broker.stats import BrokerStats
from batcher.core.admission import Refusal, admit
from batcher.core.pool import WorkerPool
from batcher.core.scheduler import Batch, NoSuchModel, QueuedRequest, QueueFull, Scheduler
from batcher.core.streams import Sequence, Streams
from batcher.core.versions import VersionTable
from batcher.transport.security import CurveGate
from batcher.transport.stopping import StopSignals
from batcher.transport.zmqio import readable, recv_bounded, recv_bounded_from, send_replies, send_reply
from batcher.wire import protocol
from batcher.wire.protocol import ErrorCode, ProtocolError

log = logging.getLogger("batcher.broker")

# A drain of either socket takes at most DRAIN_LIMIT messages or DRAIN_BUDGET_S
# (batcher.broker.backend), whichever comes first: a burst of costly messages (huge bodies,
# floods of cancels) can never hold heartbeats, liveness checks and deadlines back.
#: Frames one client message may have: the routing id, proxy hops, a delimiter, the body.
MAX_FRAMES = 32
#: The control ops whose `model` (with its `version`) names one served version.
VERSIONED_OPS = frozenset({"metadata"})
#: The control ops that read fields of their own from the body (`split`'s `traffic`).
FIELD_OPS = frozenset({"split"})


class Frontend:
    """The frontend socket's requests and replies; `end_stream` (the backend's) ends a
    sequence a client cancelled, `on_stop(now)` begins the drain at a stop signal."""

    def __init__(
        self,
        sock: zmq.Socket[Any],
        max_message_bytes: int,
        scheduler: Scheduler,
        pool: WorkerPool,
        streams: Streams,
        stats: BrokerStats,
        signals: StopSignals,
        defaults: tuple[str, float],
        roles: CurveGate | None,
    ) -> None:
        self.sock = sock
        self.max_message_bytes = max_message_bytes
        self.scheduler = scheduler
        self.pool = pool
        self.streams = streams
        self.stats = stats
        self.signals = signals
        self.default_model, self._default_timeout_s = defaults  # the model of a request naming none
        # With --curve-admins the frontend is read keeping each message's first frame, whose
        # User-Id says whether a control request may change the service; without it,
        # nothing of that is paid for.
        self._roles = roles
        self._sender: Frame | None = None  # the first frame of the message being handled
        self._receive = recv_bounded if roles is None else self._recv_noting_sender
        #: The repository's versioned models (batcher.core.versions): `serve` fills it.
        self.versions = VersionTable()
        #: Set by the loop once its other sides exist.
        self.controls: Controls | None = None
        self.end_stream: Callable[[Sequence, ErrorCode, str, str], None] = lambda *args: None
        self.on_stop: Callable[[float], None] = lambda now: None
        #: The broker's spans when tracing is on (batcher.observe.broker_spans), else None.
        self.tracer: Any = None
        #: The response cache (batcher.broker.response_cache) when --cache-bytes is set, else None.
        self.cache: Any = None

    def drain(self, now: float) -> None:
        """Handle every request waiting on the frontend socket, within one budget."""
        sock, accept, receive = self.sock, self._accept, self._receive
        max_bytes = self.max_message_bytes
        budget_end = now + DRAIN_BUDGET_S
        for i in range(DRAIN_LIMIT):
            try:
                frames, fits = receive(sock, MAX_FRAMES, max_bytes)
            except zmq.Again:
                return
            try:
                if fits:
                    accept(frames, now)
                else:
                    self.refuse(*oversized(frames, max_bytes))
            except Exception:  # a bug of ours: the sender still hears back
                log.exception("unexpected error handling a request (the broker goes on)")
                envelope = frames[:2] if len(frames) > 2 and not frames[1] else frames[:1]
                self.refuse(envelope, None, ErrorCode.INTERNAL, "the broker failed to handle this request")
            # After the first message only, ask the socket whether another waits
            # (zmqio.readable): a lone request is not made to wait for a raised zmq.Again
            # (15-20 us of a cold CPU before its batch was cut), and a burst pays one
            # zmq.Again, not a ZMQ_EVENTS query (2 system calls) after each of its messages.
            if i == 0 and not readable(sock):
                return
            # The next message's arrival: the clock the budget reads anyway, not the turn's
            # start, as it may have come since (even in answer to a reply just sent: a
            # gateway's row after its control request's answer). Stamped with the turn's
            # time, its queue span began before its sender's span did.
            now = time.monotonic()
            if now >= budget_end:
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
                self.refuse(exc.envelope, None, exc.code, exc.message)
                return
        try:
            header = protocol.read_header(body)
        except ProtocolError as exc:
            stream = protocol.wants_stream(body)
            self.refuse(envelope, exc.req_id, exc.code, exc.message, None, stream)
            return
        if header.op != "infer":
            self._control(envelope, header, body)
            return
        model = header.model or self.default_model
        if self.versions.models or header.version is not None:  # batcher.core.versions
            resolved = self.versions.resolve(model, header.version)
            if not isinstance(resolved, str):
                self.refuse(envelope, header.id, resolved[0], resolved[1], None, header.stream)
                return
            model = resolved
        if self.signals.count:  # (a call per request otherwise, for a rare event)
            self.on_stop(now)
        stream = header.stream
        verdict = admit(
            header,
            model,
            body,
            now,
            draining=self.signals.count > 0,
            pool=self.pool,
            settings=self.scheduler.settings_of(model),
            default_timeout_s=self._default_timeout_s,
        )
        tracer = self.tracer
        trace = None
        if tracer is not None and (header.traceparent is not None or tracer.samples_roots):
            trace = tracer.admit(header.traceparent, header.tracestate)
        if isinstance(verdict, Refusal):
            if trace is not None:
                tracer.refused(trace, verdict.req_id, model, str(verdict.code), now)
            self.refuse(envelope, verdict.req_id, verdict.code, verdict.message, model, stream)
            return
        cache_key = None
        if self.cache is not None and not stream and self.cache.caches(model):
            hit, cache_key = self.cache.lookup(model, body, header.id)
            if hit is not None:
                self.stats.count(model, "ok")
                self.send_to_client(envelope, hit)
                return
        request = QueuedRequest(
            envelope, body, header.id, now, header.priority, verdict.deadline,
            cost=header.cost, stream=stream, bucket=verdict.bucket, trace=trace, cache_key=cache_key,
        )  # fmt: skip
        try:
            self.scheduler.enqueue(model, request)
        except NoSuchModel:
            served = ", ".join(sorted(self.scheduler.views())) or "none"
            message = f"no worker serves model {model!r} (models: {served})"
            self.refuse(envelope, header.id, ErrorCode.UNKNOWN_MODEL, message, None, stream)
        except QueueFull:
            queued = self.scheduler.queued(model)
            message = f"model {model!r} has {queued} requests queued, its limit"
            self.refuse(envelope, header.id, ErrorCode.OVERLOADED, message, model, stream)

    def model_failed(self, model: str, why: str) -> None:
        """No worker of `model` can start: answer its queued requests and refuse new ones
        with worker_failed, until a worker of it joins after all."""
        log.error("%s: its requests are answered with worker_failed", why)
        for name, req in self.pool.model_failed(model, why):
            self.reply_error(req, name, ErrorCode.WORKER_FAILED, why)

    def refuse(
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
        self.send_to_client(envelope, protocol.error_reply(req_id, code, message, stream))

    def _control(self, envelope: list[bytes], header: protocol.RequestHeader, body: bytes) -> None:
        req_id, op, model = header.id, header.op, header.model

        def reply(ok: bool, result: Any) -> None:
            body = protocol.ok_reply(req_id, result) if ok else protocol.error_reply(req_id, *result)
            self.send_to_client(envelope, body)

        if op == "cancel":  # only the sender's own requests: ids are per client
            for name, req in self.scheduler.cancel_id(envelope[0], req_id):
                self.reply_error(req, name, ErrorCode.CANCELLED, "cancelled by the client")
            for seq in self.streams.cancel_id(envelope[0], req_id):
                self.end_stream(seq, ErrorCode.CANCELLED, "cancel", "cancelled by the client")
        else:
            roles, sender = self._roles, self._sender  # (a sender is kept whenever roles are)
            admin = roles is None or (sender is not None and roles.is_admin(sender))
            if roles is not None and sender is not None and not admin and op in MUTATING_OPS:
                roles.note_forbidden(sender, op)
            assert self.controls is not None  # set by the loop before it reads a request
            if model is not None and op in VERSIONED_OPS and (self.versions or header.version is not None):
                resolved = self.versions.resolve(model, header.version, count=False)
                if not isinstance(resolved, str):
                    reply(False, resolved)
                    return
                model = resolved
            fields = protocol.parse_request(bytes(body))[1] if op in FIELD_OPS else {}
            self.controls.handle(op, model, reply, admin, fields)

    def send_to_client(self, envelope: list[bytes], body: bytes) -> bool:
        """Send a reply; False when it cannot go: the client is gone (EHOSTUNREACH), or
        not reading while REPLY_HWM replies wait for it."""
        try:
            send_reply(self.sock, envelope, body)
            return True
        except zmq.ZMQError as exc:
            self.stats.undeliverable += 1
            log.debug("reply to a vanished client dropped: %s", exc)
            return False

    def send_batch_replies(self, requests: list[QueuedRequest], replies: list[Any], errors: Any = 0) -> None:
        """Send a batch's replies, each to its client (one gone or not reading is counted);
        the response cache keeps those of a batch that counts no error."""
        failed = send_replies(self.sock, requests, replies)
        if self.cache is not None and not errors:
            self.cache.store(requests, replies)
        if failed:
            self.stats.undeliverable += failed
            log.debug("%d replies to vanished clients dropped", failed)

    def reply_error(self, req: QueuedRequest, model: str, code: ErrorCode, message: str) -> None:
        if req.trace is not None and self.tracer is not None:
            self.tracer.queue_ended(req, model, str(code), time.monotonic(), str(code))
        self.stats.count(model, code)
        self.send_to_client(req.envelope, protocol.error_reply(req.id, code, message, req.stream))

    def fail_batch(self, batch: Batch, code: ErrorCode, message: str) -> None:
        for req in batch.requests:
            self.reply_error(req, batch.model, code, message)


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
