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
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from batcher import protocol
from batcher.metrics import NoMetrics, PrometheusMetrics, Recent, percentile
from batcher.protocol import ErrorCode, Heartbeat, ProtocolError, WorkerProtocolError
from batcher.scheduler import (
    Batch,
    BatchSettings,
    Overloaded,
    QueuedRequest,
    Scheduler,
    UnknownModel,
)
from batcher.security import CurveServerKeys, HandshakeWatch, secure_server
from batcher.stopping import StopSignals
from batcher.zmqio import recv_bounded, recv_frames, send_frames, send_reply

log = logging.getLogger("batcher.broker")

#: Messages taken from one socket before the loop looks at the other one and the timers...
DRAIN_LIMIT = 2000
#: ...or this much time, whichever comes first: a burst of costly messages (huge bodies,
#: floods of cancels) can never hold heartbeats, liveness checks and deadlines back.
DRAIN_BUDGET_S = 0.005
#: Frames one client message may have: the routing id, proxy hops, a delimiter, the body.
MAX_FRAMES = 32
#: Replies queued for one client (or batches for one worker) before sends fail.
REPLY_HWM = 100_000


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
    shutdown_grace_s: float = 10.0
    #: A request for a model that has had no worker this long is answered `unavailable`
    #: (and so is every later one, until a worker joins); 0 waits forever.
    no_worker_timeout_ms: float = 10_000.0

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("models must name at least one model, got none")
        for name in self.models:
            if not name:
                raise ValueError("model names must be non-empty")
        if not self.default_timeout_ms >= 0:
            raise ValueError(f"default_timeout_ms must be >= 0, got {self.default_timeout_ms}")
        if not isinstance(self.worker_prefetch, int) or self.worker_prefetch < 1:
            raise ValueError(f"worker_prefetch must be >= 1, got {self.worker_prefetch}")
        if not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if not isinstance(self.max_message_bytes, int) or self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if not self.shutdown_grace_s >= 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if not 0 <= self.no_worker_timeout_ms < math.inf:
            raise ValueError(
                f"no_worker_timeout_ms must be a finite number >= 0, got {self.no_worker_timeout_ms}"
            )

    @property
    def default_model(self) -> str:
        """The model a request without `model` goes to: the first one named."""
        return self.models[0]


class BindError(OSError):
    """An address the broker was told to listen on is taken or invalid."""


@dataclass
class ModelStats:
    """Counters the `stats` control request reports for one model."""

    batches: int = 0
    requests: int = 0  # in completed batches
    outcomes: Counter[str] = field(default_factory=Counter)  # "ok" or an error code -> replies
    recent: Recent = field(default_factory=Recent)


class Broker:
    """Accepts requests, batches them per model and routes worker replies back."""

    def __init__(self, settings: BrokerSettings, context: zmq.Context[Any] | None = None) -> None:
        self.settings = settings
        self._own_context = context is None
        self.ctx: zmq.Context[Any] = context or zmq.Context()
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
        self._configured = frozenset([*settings.models, *settings.per_model])
        self._default_timeout_s = settings.default_timeout_ms / 1000.0
        self.stats: dict[str, ModelStats] = {}
        self._failed_models: dict[str, str] = {}  # model -> why no worker can serve it
        self.refused: Counter[str] = Counter()  # requests without a model to count them under
        self.metrics: NoMetrics = NoMetrics()
        self.undeliverable = 0
        self.dropped_backend = 0
        self._stopping_since: float | None = None
        self.signals = StopSignals()
        #: Set by `serve`: starts a rolling reload of a model and answers through `reply`
        #: when it ends (a plain broker has no workers of its own to replace).
        self.on_reload: Callable[[str, Callable[[bool, Any], None]], None] | None = None
        self.workers_lost = 0
        self.batches_retried = 0
        self._heard_from: dict[bytes, float] = {}  # worker -> when it last said anything
        # When the backend was last read to the end: every worker message that arrived
        # before then has been seen, so silence is judged up to here (not up to now,
        # which a busy loop could reach with heartbeats still unread in the socket).
        self._backend_read_at = time.monotonic()
        self._worker_names: dict[bytes, str] = {}  # worker -> "model/gpuN/pidP/idHEX", for logs
        self._worker_gpus: dict[bytes, object] = {}  # worker -> the GPU id its READY named
        self._worker_pids: dict[bytes, object] = {}  # worker -> the pid its READY named
        self._timers: list[tuple[float, int, Callable[[float], None]]] = []
        self._timer_seq = itertools.count()
        self.frontend = self._router(settings.max_message_bytes)
        self.backend = self._router(-1)
        self._auth = None
        self._handshakes: HandshakeWatch | None = None
        try:
            if settings.curve is not None:
                self._auth = secure_server(self.ctx, settings.curve, self.frontend, self.backend)
                self._handshakes = HandshakeWatch({"frontend": self.frontend, "backend": self.backend})
            self._bind(self.frontend, settings.frontend)
            self._bind(self.backend, settings.backend)
            if settings.metrics_port is not None:
                self.metrics = self._serve_metrics(settings.metrics_port)
        except BaseException:
            self.close()
            raise
        self.call_every(settings.heartbeat.interval_s, self._heartbeat)

    def _serve_metrics(self, port: int) -> PrometheusMetrics:
        prom = PrometheusMetrics(self._gauges)
        try:
            prom.serve(port)
        except OSError as exc:
            raise BindError(f"cannot serve metrics on 127.0.0.1:{port}: {exc.strerror or exc}") from None
        log.info("metrics at http://127.0.0.1:%d/metrics", port)
        return prom

    def _gauges(self) -> dict[str, dict[str, float]]:
        """Queue depth, workers and batches in flight per model (read at scrape time)."""
        out: dict[str, dict[str, float]] = {}
        for name, mq in list(self.scheduler.models.items()):
            workers = [self.scheduler.workers[w] for w in list(mq.workers) if w in self.scheduler.workers]
            out[name] = {
                "queue_depth": mq.size,
                "workers": len(workers),
                "batches_in_flight": sum(len(w.in_flight) for w in workers),
            }
        return out

    def _router(self, max_message_bytes: int) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # A reply to a peer that is gone raises (and is counted) instead of vanishing.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Bounded per-peer queues: a client that stops reading cannot grow the broker
        # without bound; replies past this raise zmq.Again and are counted.
        sock.setsockopt(zmq.SNDHWM, REPLY_HWM)
        # A peer sending a bigger message is disconnected by libzmq before we see it.
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        return sock

    @staticmethod
    def _bind(sock: zmq.Socket[Any], address: str) -> None:
        try:
            sock.bind(address)
        except zmq.ZMQError as exc:
            raise BindError(f"cannot bind {address}: {exc.strerror}") from None

    # --- lifecycle --------------------------------------------------------------------------

    def call_every(self, interval_s: float, fn: Callable[[float], None]) -> None:
        """Run `fn(now)` every `interval_s` on the loop's timer heap (heartbeats, supervision)."""

        def tick(now: float) -> None:
            self._call_at(now + interval_s, tick)
            fn(now)

        self._call_at(time.monotonic() + interval_s, tick)

    def _call_at(self, when: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self._timers, (when, next(self._timer_seq), fn))

    def _run_timers(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, fn = heapq.heappop(self._timers)
            self._guard(functools.partial(fn, now))

    def request_stop(self) -> None:
        """First call: drain (finish queued and in-flight work). Second call: exit now."""
        self.signals.trigger()

    def close(self) -> None:
        """Close the sockets (and the context, when the broker made it)."""
        if self._auth is not None:
            self._auth.stop()
        if self._handshakes is not None:
            self._handshakes.close()
        self.frontend.close(0)
        self.backend.close(0)
        self.signals.close()
        if self._own_context:
            self.ctx.term()

    def run(self) -> None:
        """The event loop; returns once stopped and every accepted request is answered."""
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.backend, zmq.POLLIN)
        poller.register(self.signals.fd, zmq.POLLIN)
        watch = self._handshakes
        for monitor in watch.monitors if watch is not None else ():
            poller.register(monitor, zmq.POLLIN)
        log.info(
            "broker listening: frontend %s, backend %s, models %s (pid %d)",
            self.settings.frontend,
            self.settings.backend,
            ",".join(self.settings.models),
            os.getpid(),
        )
        while True:
            now = time.monotonic()
            if self._stopping_since is not None and self._finished_stopping(now):
                break
            events = dict(poller.poll(self._poll_timeout_ms(now)))
            if self.backend in events:
                self._guard(self._drain_backend)
            if self.frontend in events:
                self._guard(self._drain_frontend)
            if self.signals.fd in events:
                self.signals.clear()
                if self.signals.count and self._stopping_since is None:
                    self._stopping_since = time.monotonic()
                    log.info("draining: new requests are refused, queued ones finished")
            if watch is not None and len(events) > 0:
                for monitor in watch.monitors:
                    if monitor in events:
                        self._guard(functools.partial(watch.handle, monitor, now))
            self._run_timers()
            self._guard(self._dispatch)
        log.info("broker stopped")

    def _guard(self, step: Any) -> None:
        """Run one loop step; an exception is logged, never allowed to end the loop."""
        try:
            step()
        except Exception:
            log.exception("unexpected error in the broker loop (the broker goes on)")

    def _poll_timeout_ms(self, now: float) -> int:
        wake = self.scheduler.next_wakeup()
        if self._timers:
            wake = self._timers[0][0] if wake is None else min(wake, self._timers[0][0])
        if self._stopping_since is not None:
            deadline = self._stopping_since + self.settings.shutdown_grace_s
            wake = deadline if wake is None else min(wake, deadline)
        if wake is None:
            return -1
        return max(0, math.ceil((wake - now) * 1000))

    def _finished_stopping(self, now: float) -> bool:
        pending = any(mq.size for mq in self.scheduler.models.values())
        busy = any(True for _ in self.scheduler.in_flight())
        if not pending and not busy:
            return True
        assert self._stopping_since is not None
        if self.signals.count > 1 or now >= self._stopping_since + self.settings.shutdown_grace_s:
            self._answer_everything(ErrorCode.SHUTTING_DOWN, "the broker is shutting down")
            return True
        return False

    def _answer_everything(self, code: ErrorCode, message: str) -> None:
        for name, req in self.scheduler.cancel(lambda r: True):
            self._reply_error(req, name, code, message)
        for worker_id in list(self.scheduler.workers):
            for batch in self.scheduler.remove_worker(worker_id):
                self._fail_batch(batch, code, message)

    # --- frontend ---------------------------------------------------------------------------

    def _drain_frontend(self) -> None:
        sock, accept = self.frontend, self._accept
        max_bytes = self.settings.max_message_bytes
        now = time.monotonic()
        budget_end = now + DRAIN_BUDGET_S
        for _ in range(DRAIN_LIMIT):
            try:
                frames, fits = recv_bounded(sock, MAX_FRAMES, max_bytes)
            except zmq.Again:
                return
            try:
                if fits:
                    accept(frames, now)
                else:
                    self._refuse_oversized(frames)
            except Exception:  # a bug of ours: the sender still hears back
                log.exception("unexpected error handling a request (the broker goes on)")
                envelope = frames[:2] if len(frames) > 2 and not frames[1] else frames[:1]
                self._refuse(envelope, None, ErrorCode.INTERNAL, "the broker failed to handle this request")
            if time.monotonic() >= budget_end:
                return

    def _refuse_oversized(self, frames: list[bytes]) -> None:
        """A message over MAX_FRAMES frames or --max-message-bytes in all: answered on its
        envelope as far as it was kept, never parsed."""
        try:
            end = frames.index(b"", 1) + 1
        except ValueError:
            end = 1
        max_bytes = self.settings.max_message_bytes
        limit = (
            f"more than {MAX_FRAMES} frames"
            if len(frames) >= MAX_FRAMES
            else f"more than {max_bytes} bytes in all (the broker's --max-message-bytes)"
        )
        self._refuse(frames[:end], None, ErrorCode.BAD_REQUEST, f"message too large: {limit}")

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
            header, _ = protocol.parse_request(body)
        except ProtocolError as exc:
            self._refuse(envelope, exc.req_id, exc.code, exc.message)
            return
        if header.op != "infer":
            self._control(envelope, header.id, header.op, header.model)
            return
        model = header.model or self.settings.default_model
        if self._stopping_since is not None:
            self._refuse(envelope, header.id, ErrorCode.SHUTTING_DOWN, "the broker is shutting down", model)
            return
        if model in self._failed_models and not self.scheduler.models[model].workers:
            self._refuse(envelope, header.id, ErrorCode.WORKER_FAILED, self._failed_models[model], model)
            return
        without_s = self.scheduler.without_worker_s(model, now)
        if without_s is not None:
            self._refuse(
                envelope, header.id, ErrorCode.UNAVAILABLE, self._unavailable(model, without_s), model
            )
            return
        timeout_s = header.timeout_ms / 1000.0 if header.timeout_ms else self._default_timeout_s
        request = QueuedRequest(
            envelope, body, header.id, now, header.priority, now + timeout_s if timeout_s else None
        )
        try:
            self.scheduler.enqueue(model, request)
        except UnknownModel:
            served = ", ".join(sorted(self.scheduler.models)) or "none"
            message = f"no worker serves model {model!r} (models: {served})"
            self._refuse(envelope, header.id, ErrorCode.UNKNOWN_MODEL, message)
        except Overloaded:
            self._refuse(
                envelope,
                header.id,
                ErrorCode.OVERLOADED,
                f"model {model!r} has {self.scheduler.queued(model)} requests queued, its limit",
                model,
            )

    def _unavailable(self, model: str, without_s: float) -> str:
        limit_ms = self.settings.no_worker_timeout_ms
        return f"model {model!r} has had no worker for {without_s:.1f}s (--no-worker-timeout-ms {limit_ms:g})"

    def model_failed(self, model: str, why: str) -> None:
        """No worker of `model` can start: answer its queued requests and refuse new ones
        with worker_failed, until a worker of it joins after all."""
        log.error("%s: its requests are answered with worker_failed", why)
        self._failed_models[model] = why
        for name, req in self.scheduler.cancel(lambda r: True, model):
            self._reply_error(req, name, ErrorCode.WORKER_FAILED, why)

    def _refuse(
        self, envelope: list[bytes], req_id: object, code: ErrorCode, message: str, model: str | None = None
    ) -> None:
        """Answer a request that was never queued (counted under its model when it has one)."""
        if model is not None:
            self._count(model, code)
        else:
            self.refused[code] += 1
            self.metrics.request_done("", code)
        self._send_to_client(envelope, protocol.error_reply(req_id, code, message))

    def _count(self, model: str, outcome: str, n: int = 1) -> None:
        if not n:
            return
        self._model_stats(model).outcomes[outcome] += n
        self.metrics.request_done(model, outcome, n)

    def _control(self, envelope: list[bytes], req_id: object, op: str, model: str | None) -> None:
        if op == "stats":
            self._send_to_client(envelope, protocol.ok_reply(req_id, self.snapshot()))
        elif op == "cancel":
            # Only the sender's own requests: ids are per client, so match the identity too.
            for name, req in self.scheduler.cancel_id(envelope[0], req_id):
                self._reply_error(req, name, ErrorCode.CANCELLED, "cancelled by the client")
        elif op == "reload":
            self._reload(envelope, req_id, model)
        else:
            self._send_to_client(
                envelope,
                protocol.error_reply(req_id, ErrorCode.BAD_REQUEST, f"unknown op {op!r}"),
            )

    def _reload(self, envelope: list[bytes], req_id: object, model: str | None) -> None:
        def reply(ok: bool, result: Any) -> None:
            body = protocol.ok_reply(req_id, result) if ok else protocol.error_reply(req_id, *result)
            self._send_to_client(envelope, body)

        if model is None:
            reply(False, (ErrorCode.BAD_REQUEST, "reload needs a 'model'"))
        elif not self.scheduler.knows_model(model):
            served = ", ".join(sorted(self.scheduler.models))
            reply(False, (ErrorCode.UNKNOWN_MODEL, f"no model {model!r} to reload (models: {served})"))
        elif self.on_reload is None:
            message = "reload needs `batcher serve`: this broker starts no workers (restart them by hand)"
            reply(False, (ErrorCode.BAD_REQUEST, message))
        else:
            self.on_reload(model, reply)

    def apply_model_settings(self, per_model: dict[str, BatchSettings]) -> None:
        """Batching settings re-read from the config file (SIGHUP to serve)."""
        for model, settings in per_model.items():
            self.scheduler.set_settings(model, settings)
            log.info("model %s: batching settings now %s", model, settings)

    def workers_of(self, model: str) -> list[tuple[bytes, object, int]]:
        """(worker id, pid from its READY, batches it holds) of each live worker of `model`."""
        mq = self.scheduler.models.get(model)
        if mq is None:
            return []
        workers = self.scheduler.workers
        return [(w, self._worker_pids.get(w), len(workers[w].in_flight)) for w in mq.workers]

    def drain_worker(self, worker_id: bytes) -> int:
        """Dispatch nothing more to a worker (it is being replaced); returns the batches it
        still holds."""
        return self.scheduler.drain_worker(worker_id)

    def snapshot(self) -> dict[str, Any]:
        """The broker's state for the `stats` control request."""
        now = time.monotonic()
        models: dict[str, Any] = {}
        for name, mq in self.scheduler.models.items():
            st = self.stats.get(name, ModelStats())
            workers = [self.scheduler.workers[w] for w in mq.workers]
            cost = self.scheduler.cost(name)
            recent = st.recent
            models[name] = {
                "configured": name in self._configured,
                "ready": bool(workers),
                "no_worker_s": None if mq.no_worker_since is None else round(now - mq.no_worker_since, 3),
                "queued": mq.size,
                "workers": len(workers),
                "busy_workers": sum(1 for w in workers if w.in_flight),
                "batches_in_flight": sum(len(w.in_flight) for w in workers),
                "worker_list": [
                    {
                        "worker": self._name(w.worker_id),
                        "gpu": self._worker_gpus.get(w.worker_id),
                        "batches_held": len(w.in_flight),
                    }
                    for w in workers
                ],
                "batches": st.batches,
                "requests": st.requests,
                "mean_batch_size": st.requests / st.batches if st.batches else 0.0,
                "outcomes": dict(st.outcomes),
                "queue_ms_p50": percentile(recent.queue_ms, 50),
                "queue_ms_p99": percentile(recent.queue_ms, 99),
                "worker_wait_ms_p50": percentile(recent.worker_wait_ms, 50),
                "worker_wait_ms_p99": percentile(recent.worker_wait_ms, 99),
                "infer_ms_p50": percentile(recent.infer_ms, 50),
                "infer_ms_p99": percentile(recent.infer_ms, 99),
                "max_batch_size": mq.settings.max_batch_size,
                "max_wait_ms": mq.settings.max_wait_ms,
                "policy": mq.settings.policy,
                "max_queue": mq.settings.max_queue,
                "batch_cost_ms": None if cost is None else [cost[0] * 1000, cost[1] * 1000],
            }
        return {
            "models": models,
            "refused_without_model": dict(self.refused),
            "workers_lost": self.workers_lost,
            "batches_retried": self.batches_retried,
            "dropped_backend_messages": self.dropped_backend,
            "undeliverable": self.undeliverable,
            "handshakes_refused": dict(self._handshakes.refused) if self._handshakes else {},
            "stopping": self._stopping_since is not None,
        }

    def _send_to_client(self, envelope: list[bytes], body: bytes) -> None:
        try:
            send_reply(self.frontend, envelope, body)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the client went away
            self.undeliverable += 1
            log.debug("reply to a vanished client dropped: %s", exc)

    def _reply_error(self, req: QueuedRequest, model: str, code: ErrorCode, message: str) -> None:
        self._count(model, code)
        self._send_to_client(req.envelope, protocol.error_reply(req.id, code, message))

    def _model_stats(self, model: str) -> ModelStats:
        st = self.stats.get(model)
        if st is None:
            st = self.stats[model] = ModelStats()
        return st

    # --- dispatch ---------------------------------------------------------------------------

    def _dispatch(self) -> None:
        now = time.monotonic()
        for name, req in self.scheduler.expire(now):
            self._reply_error(req, name, ErrorCode.DEADLINE_EXCEEDED, "deadline passed while queued")
        for name, req, without_s in self.scheduler.unavailable(now):
            self._reply_error(req, name, ErrorCode.UNAVAILABLE, self._unavailable(name, without_s))
        for batch in self.scheduler.due_batches(now):
            queue_ms = [round((now - r.arrived_at) * 1000.0, 3) for r in batch.requests]
            self.metrics.queue_waits_ms(batch.model, queue_ms)
            frames = protocol.batch_frames(batch.batch_id, queue_ms, [r.body for r in batch.requests])
            if not self._send_to_worker(batch.worker, frames):
                log.warning("worker %s unreachable; its batches go to another", self._name(batch.worker))
                self._worker_lost(batch.worker, "worker unreachable")

    # --- backend ----------------------------------------------------------------------------

    def _drain_backend(self) -> None:
        sock = self.backend
        start = time.monotonic()
        budget_end = start + DRAIN_BUDGET_S
        for _ in range(DRAIN_LIMIT):
            try:
                frames = recv_frames(sock)
            except zmq.Again:
                self._backend_read_at = start
                return
            try:
                self._on_worker_message(frames)
            except WorkerProtocolError as exc:  # a peer that is not a worker, or a broken one
                self.dropped_backend += 1
                log.warning("dropped a malformed backend message (%d frames): %s", len(frames), exc)
            except Exception:  # a bug of ours, not the worker's
                self.dropped_backend += 1
                log.exception("unexpected error handling a backend message (the broker goes on)")
            if time.monotonic() >= budget_end:
                return

    def _on_worker_message(self, frames: list[bytes]) -> None:
        if len(frames) < 3 or frames[1] != protocol.WORKER_PROTOCOL:
            raise WorkerProtocolError("not a batcher worker message")
        worker_id, command = frames[0], frames[2]
        if command == protocol.CMD_READY and len(frames) == 4:
            self._on_ready(worker_id, frames[3])
            return
        if worker_id not in self._heard_from:
            # Not a worker of ours (we restarted, or declared it dead): make it announce
            # itself again; whatever it sent is dropped.
            self.dropped_backend += 1
            if command != protocol.CMD_DISCONNECT:
                self._send_to_worker(worker_id, [protocol.WORKER_PROTOCOL, protocol.CMD_DISCONNECT])
            return
        self._heard_from[worker_id] = time.monotonic()
        if command == protocol.CMD_REPLY:
            if len(frames) != 5:
                exc = WorkerProtocolError(f"REPLY must have 5 frames, got {len(frames)}")
                self._bad_reply(worker_id, exc)
                raise exc
            self._on_reply(worker_id, frames[3], frames[4])
        elif command == protocol.CMD_DISCONNECT:
            log.info("worker %s left", self._name(worker_id))
            self._worker_lost(worker_id, "worker left", failed=False)
        elif command != protocol.CMD_HEARTBEAT:
            raise WorkerProtocolError(f"unknown command {command!r} with {len(frames)} frames")

    def _on_ready(self, worker_id: bytes, info_frame: bytes) -> None:
        try:
            info = protocol.unpack(info_frame)
        except Exception as exc:  # msgpack raises several unrelated types
            raise WorkerProtocolError(f"READY info is not valid msgpack: {exc!r}") from None
        if not isinstance(info, dict):
            raise WorkerProtocolError(f"READY info must be a map, got {info!r}")
        model, slots = info.get("model"), info.get("slots")
        if not isinstance(model, str) or not model or not (slots is None or type(slots) is int):
            raise WorkerProtocolError(f"bad READY info {info!r}")
        if worker_id in self._heard_from:  # announced again: whatever it held is lost
            self._worker_lost(worker_id, "worker restarted during the batch")
        self.scheduler.add_worker(worker_id, model, slots)
        self._heard_from[worker_id] = time.monotonic()
        self._worker_gpus[worker_id] = info.get("gpu")
        self._worker_pids[worker_id] = info.get("pid")
        self._failed_models.pop(model, None)
        self.metrics.worker_event(model, "joined")
        gpu = info.get("gpu")
        self._worker_names[worker_id] = (
            f"{model}/gpu{'-' if gpu is None else gpu}/pid{info.get('pid')}/id{worker_id.hex()}"
        )
        log.info("worker joined: %s", self._name(worker_id))

    def _on_reply(self, worker_id: bytes, header_frame: bytes, blob: bytes) -> None:
        try:
            header = protocol.parse_reply_header(header_frame)
        except WorkerProtocolError as exc:
            self._bad_reply(worker_id, exc)
            raise
        batch_id, infer_ms, lengths, model_errors, wait_ms = header
        batch = self.scheduler.complete(worker_id, batch_id, infer_ms / 1000.0)
        if batch is None:
            self.dropped_backend += 1
            log.warning("dropped a reply for unknown batch %r from %s", batch_id, self._name(worker_id))
            return
        st = self._model_stats(batch.model)
        st.batches += 1
        st.requests += len(batch.requests)
        st.recent.infer_ms.append(infer_ms)
        # Queue time as the client lives it: in the broker's queue, then in the worker's
        # prefetch until the model began (the worker's wait also kept on its own).
        in_worker_ms = wait_ms or 0.0
        if wait_ms is not None:
            st.recent.worker_wait_ms.append(wait_ms)
            self.metrics.worker_wait(batch.model, wait_ms / 1000.0)
        sent_at = batch.dispatched_at
        st.recent.queue_ms.extend(
            round((sent_at - r.arrived_at) * 1000.0 + in_worker_ms, 3) for r in batch.requests
        )
        self.metrics.batch_done(batch.model, len(batch.requests), infer_ms / 1000.0)
        try:
            if len(lengths) != len(batch.requests):
                raise ValueError(f"{len(lengths)} replies for {len(batch.requests)} requests")
            replies = protocol.split_replies(lengths, blob)
        except ValueError as exc:
            log.warning("malformed reply from worker %s: %s", self._name(worker_id), exc)
            self._fail_batch(batch, ErrorCode.WORKER_FAILED, f"the worker sent a malformed reply: {exc}")
            return
        self._count(batch.model, "ok", len(replies) - model_errors)
        self._count(batch.model, ErrorCode.MODEL_ERROR, model_errors)
        frontend = self.frontend
        for req, reply in zip(batch.requests, replies, strict=True):
            try:
                send_reply(frontend, req.envelope, reply)
            except zmq.ZMQError:
                self.undeliverable += 1

    def _bad_reply(self, worker_id: bytes, exc: WorkerProtocolError) -> None:
        """A REPLY that breaks the protocol fails the batch it names, if that is one of this
        worker's. One that names none can be matched to nothing: if the worker holds
        batches, it is taken for broken and they go elsewhere (their clients are never left
        waiting); a worker holding none has nothing to lose, and only the message is dropped."""
        batch = None if exc.batch_id is None else self.scheduler.complete(worker_id, exc.batch_id)
        if batch is not None:
            self._fail_batch(batch, ErrorCode.WORKER_FAILED, f"the worker sent a malformed reply: {exc}")
            return
        state = self.scheduler.workers.get(worker_id)
        if exc.batch_id is None and state is not None and state.in_flight:
            log.warning("worker %s sent a reply naming no batch: taken for broken", self._name(worker_id))
            self._worker_lost(worker_id, f"the worker sent a malformed reply: {exc}")

    def _name(self, worker_id: bytes) -> str:
        return self._worker_names.get(worker_id, f"id{worker_id.hex()}")

    def _heartbeat(self, now: float) -> None:
        """Tell every worker we live; take those silent past their liveness for dead.

        Silence counts up to when the backend was last read to its end, after reading it
        now: a worker whose heartbeat arrived while the loop was busy is not silent."""
        self._drain_backend()
        expiry = self.settings.heartbeat.expiry_s
        read_at = self._backend_read_at
        for worker_id, heard_at in list(self._heard_from.items()):
            silent_s = read_at - heard_at
            if silent_s > expiry:
                log.warning("worker %s silent for %.1fs: taken for dead", self._name(worker_id), silent_s)
                self._worker_lost(worker_id, f"worker silent for {silent_s:.1f}s")
            elif not self._send_to_worker(worker_id, [protocol.WORKER_PROTOCOL, protocol.CMD_HEARTBEAT]):
                # ROUTER_MANDATORY: the connection is gone, so the process is (a crash)
                log.warning("worker %s disconnected: taken for dead", self._name(worker_id))
                self._worker_lost(worker_id, "worker disconnected")

    def _send_to_worker(self, worker_id: bytes, frames: list[bytes]) -> bool:
        try:
            send_frames(self.backend, [worker_id, *frames])
            return True
        except zmq.ZMQError:
            return False

    def _worker_lost(self, worker_id: bytes, why: str, failed: bool = True) -> None:
        """Forget a worker. Its batches go back to the queue, except requests that have
        used up their `max_retries` attempts: those are answered with worker_failed.

        A failed worker costs each of its requests an attempt. A worker that leaves on
        its own (DISCONNECT) hands its batches back for free the first time only, so a
        peer that keeps taking batches and leaving cannot bounce a request forever."""
        self._heard_from.pop(worker_id, None)
        self._worker_names.pop(worker_id, None)
        self._worker_gpus.pop(worker_id, None)
        self._worker_pids.pop(worker_id, None)
        state = self.scheduler.workers.get(worker_id)
        if state is not None:
            self.metrics.worker_event(state.model, "died" if failed else "left")
        if failed:
            self.workers_lost += 1
        max_retries = self.settings.max_retries
        for batch in self.scheduler.remove_worker(worker_id):
            retry: list[QueuedRequest] = []
            for req in batch.requests:
                costs_attempt = failed or req.handbacks > 0
                req.handbacks += not failed
                if costs_attempt and req.attempts >= max_retries:
                    self._reply_error(req, batch.model, ErrorCode.WORKER_FAILED, why)
                    continue
                req.attempts += costs_attempt
                retry.append(req)
            if retry:
                self.batches_retried += 1
                self.scheduler.requeue(batch.model, retry, count_attempt=False)

    def _fail_batch(self, batch: Batch, code: ErrorCode, message: str) -> None:
        for req in batch.requests:
            self._reply_error(req, batch.model, code, message)


def run_broker(settings: BrokerSettings) -> None:
    """Bind, serve until SIGINT/SIGTERM, then drain and close: the `batcher broker` body."""
    broker = Broker(settings)
    broker.signals.install()
    try:
        broker.run()
    finally:
        broker.close()
