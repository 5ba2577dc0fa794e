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

from batcher.broker.autoscale import Autoscale
from batcher.broker.backend import Backend
from batcher.broker.control import Controls
from batcher.broker.frontend import Frontend
from batcher.broker.metrics import PrometheusMetrics
from batcher.broker.response_cache import BrokerCache, CacheCollector
from batcher.broker.stats import BrokerStats, gauges
from batcher.core.admission import SHUTTING_DOWN_MESSAGE
from batcher.core.drain import Drain, DrainVerdict
from batcher.core.pool import WorkerPool
from batcher.core.scaling import DEFAULT_TARGET_UTILIZATION, SCALING_TICK_S, check_target_utilization
from batcher.core.scheduler import BatchSettings, Scheduler
from batcher.core.stalls import STALL_MIN_S, overslept
from batcher.core.streams import Streams
from batcher.errors import BindError as BindError  # its older home
from batcher.errors import SettingsError
from batcher.observe.settings import TraceSettings
from batcher.observe.tracer import start_broker_tracing
from batcher.settings import (
    MAX_MESSAGE_BYTES,
    MAX_PORT,
    MAX_PREFETCH,
    MAX_RETRIES,
    MAX_TIMEOUT_MS,
    check,
    setting,
)
from batcher.transport.allocator import TRIM_INTERVAL_S, heap_trimmer, keep_freed_memory
from batcher.transport.security import CurveGate, CurveServerKeys, HandshakeWatch, secure_server
from batcher.transport.stopping import StopSignals
from batcher.wire import protocol
from batcher.wire.protocol import ErrorCode, Heartbeat

log = logging.getLogger("batcher.broker")

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
    default_timeout_ms: float = setting(
        0.0, min=0, max=MAX_TIMEOUT_MS, help="Deadline for requests that carry no timeout_ms (0: none)."
    )
    worker_prefetch: int = setting(
        2,
        kind=int,
        min=1,
        max=MAX_PREFETCH,
        help="Batches a worker may hold at once (the next one waits on the worker).",
    )
    heartbeat: Heartbeat = field(default_factory=Heartbeat)
    max_retries: int = setting(
        1,
        kind=int,
        min=0,
        max=MAX_RETRIES,
        help="Re-dispatches of a batch whose worker died, before its requests get worker_failed.",
    )
    max_message_bytes: int = setting(
        16 * 1024 * 1024,
        kind=int,
        min=1024,
        max=MAX_MESSAGE_BYTES,
        help="Largest request accepted: a bigger one is answered too_large; a frame over "
        "4 x this (the hard limit) makes libzmq drop its sender's connection.",
    )
    curve: CurveServerKeys | None = None
    metrics_port: int | None = setting(
        None,
        kind=int,
        min=1,
        max=MAX_PORT,
        optional=True,
        help="Serve Prometheus metrics at http://HOST:PORT/metrics (HOST: --metrics-host).",
    )
    #: A batch running longer than this is taken for hung (its worker stopped, its requests
    #: retried); None: 10 x n x the learned t(1), at least 1 s (60 s for a model's first batch).
    batch_timeout_ms: float | None = setting(
        None,
        min=0,
        min_exclusive=True,
        max=MAX_TIMEOUT_MS,
        optional=True,
        noun="a finite number",
        help="A batch running longer is taken for hung: its worker is stopped (serve kills and "
        "respawns its own) and its requests are retried within --max-retries. Default: "
        "10 x n x the model's learned time for one request, at least 1 s (60 s before its "
        "first batch was answered).",
    )
    #: Where the metrics endpoint listens: loopback unless asked (it has no authentication).
    metrics_host: str = "127.0.0.1"
    shutdown_grace_s: float = setting(10.0, min=0)
    #: A request for a model that has had no worker this long is answered `unavailable`
    #: (and so is every later one, until a worker joins); 0 waits forever.
    no_worker_timeout_ms: float = setting(
        10_000.0,
        min=0,
        max=MAX_TIMEOUT_MS,
        noun="a finite number",
        help="A request for a configured model that has had no worker this long is answered "
        "unavailable (0: wait forever for a worker).",
    )
    #: OpenTelemetry traces (docs/tracing.md): off unless an endpoint is given.
    trace: TraceSettings = field(default_factory=TraceSettings)
    #: The share of the full-batch capacity the autoscaling signal lets the load take
    #: (batcher.core.scaling): batcher_desired_workers is sized for it.
    target_utilization: float = DEFAULT_TARGET_UTILIZATION
    #: Workers of each model in this cell (serve knows them; a plain broker does not, and
    #: then exports no batcher_desired_cells).
    cell_workers: dict[str, int] = field(default_factory=dict)
    #: The response cache's bound (docs/operations.md, "Response cache"): 0 keeps none.
    cache_bytes: int = setting(
        0,
        kind=int,
        min=0,
        max=MAX_MESSAGE_BYTES * 64,
        help="Bytes of replies the broker keeps for models with cache = true (0: no cache).",
    )
    #: The models whose ok replies are cached (`cache = true`, --cache-model).
    cache_models: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.models:
            raise SettingsError("models must name at least one model, got none")
        for name in self.models:
            if not name:
                raise SettingsError("model names must be non-empty")
        check(self)
        if problem := check_target_utilization(self.target_utilization):
            raise SettingsError(problem)
        for name, count in self.cell_workers.items():
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise SettingsError(f"cell_workers of model {name!r} must be an int >= 0, got {count!r}")

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
        self.stats.autoscale = Autoscale(settings.target_utilization, settings.cell_workers)
        self._configured = frozenset([*settings.models, *settings.per_model])
        self._drain: Drain | None = None  # set at the first stop signal
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
                where = (settings.metrics_host, settings.metrics_port)
                self.stats.metrics = serve_metrics(*where, self.scheduler, self.streams, self.stats.autoscale)
        except BaseException:
            self.close()
            raise
        roles = self._auth if self._auth is not None and self._auth.admins is not None else None
        self.clients = Frontend(
            self.frontend,
            settings.max_message_bytes,
            self.scheduler,
            self.pool,
            self.streams,
            self.stats,
            self.signals,
            (settings.default_model, settings.default_timeout_ms / 1000.0),
            roles,
        )
        clients = self.clients
        self.workers = Backend(
            self.backend,
            self.scheduler,
            self.pool,
            self.stats,
            clients.send_to_client,
            clients.reply_error,
            clients.fail_batch,
            clients.send_batch_replies,
        )
        limits = {
            "max_message_bytes": settings.max_message_bytes,
            "max_frame_bytes": hard_limit(settings.max_message_bytes),
        }
        self.controls = Controls(self.scheduler, self.pool, self.stats, self._configured, self._state, limits)
        self.controls.versions = clients.versions
        clients.controls = self.controls
        clients.end_stream = self.workers.end_stream
        clients.on_stop = self._note_stop
        self.tracer = clients.tracer = self.workers.tracer = start_broker_tracing(settings)
        self.cache = clients.cache = self.workers.cache = response_cache(settings, self.stats.metrics)
        self._limit_s = None if settings.batch_timeout_ms is None else settings.batch_timeout_ms / 1000.0
        self._limits_armed = False  # whether the time-limit check is on the timer heap
        self._start_timers()

    def _start_timers(self) -> None:
        """The loop's periodic work: heartbeats, the autoscaling signal's samples and, where
        the allocator allows, giving freed memory back."""
        self.call_every(self.settings.heartbeat.interval_s, self.workers.heartbeat)
        autoscale, scheduler = self.stats.autoscale, self.scheduler
        self.call_every(SCALING_TICK_S, lambda now: autoscale.tick(now, scheduler.views()))
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
            "stopping": self._drain is not None,
            "cache": None if self.cache is None else self.cache.lru.stats(),
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
        """Close the sockets (and the context, when the broker made it); the spans still
        queued are exported (within the export timeout)."""
        tracer = getattr(self, "tracer", None)  # (none yet when a bind failed)
        if tracer is not None:
            tracer.shutdown()
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
        looked_at = time.monotonic()  # the loop's last look at the clock outside its poll
        while True:
            now = time.monotonic()
            # The loop's work between two looks is no wait: past STALL_MIN_S, it did not run
            # (stopped there, not in its poll), and its workers' silence skips that too.
            if now - looked_at > STALL_MIN_S:
                skip_stall(self.pool, (looked_at, now))
            if self._drain is not None and self._finished_stopping(now):
                break
            timeout_ms = self._poll_timeout_ms(now)
            events = dict(poller.poll(timeout_ms))
            woke_at = time.monotonic()  # the turn's time, for everything read in it
            if woke_at - now > STALL_MIN_S and (stall := overslept(now, timeout_ms / 1000.0, woke_at)):
                skip_stall(self.pool, stall)
            now = looked_at = woke_at
            if self.signals.fd in events:
                self.signals.clear()
                self._note_stop(now)
            if self.backend in events:
                self._guard(self.workers.drain, now)
            if self.frontend in events:
                self._guard(self.clients.drain, now)
            if watch is not None and events:
                for monitor in watch.monitors:
                    if monitor in events:
                        self._guard(functools.partial(watch.handle, monitor, now))
            for fn in self.timers.due(time.monotonic()):  # a judge of silence among them
                if (now := time.monotonic()) - looked_at > STALL_MIN_S:
                    skip_stall(self.pool, (looked_at, now))
                self._guard(functools.partial(fn, now))
                looked_at = now
            self._guard(self._dispatch)
        log.info("broker stopped")

    def _note_stop(self, now: float) -> None:
        """Begin draining once a stop signal came (its handler counts it as soon as the
        loop runs Python code again: a request read after that is refused)."""
        if self.signals.count and self._drain is None:
            self._drain = Drain(now, self.settings.shutdown_grace_s)
            log.info("draining: new requests are refused, queued ones finished")

    def _guard(self, step: Callable[..., Any], *args: Any) -> None:
        """Run one loop step; an exception is logged, never allowed to end the loop."""
        try:
            step(*args)
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
        if self._drain is not None:
            grace_end = self._drain.grace_end
            wake = grace_end if wake is None else min(wake, grace_end)
        return -1 if wake is None else max(0, math.ceil((wake - now) * 1000))

    def _finished_stopping(self, now: float) -> bool:
        assert self._drain is not None
        busy = self.scheduler.busy() or self.streams.busy()
        verdict = self._drain.verdict(now, busy=busy, forced=self.signals.count > 1)
        if verdict is DrainVerdict.DONE:
            return True
        if verdict is DrainVerdict.ANSWER_ALL:
            message = SHUTTING_DOWN_MESSAGE
            for name, req in self.scheduler.cancel(lambda r: True):
                self.clients.reply_error(req, name, ErrorCode.SHUTTING_DOWN, message)
            for seq in self.streams.unanswered():
                self.workers.end_stream(seq, ErrorCode.SHUTTING_DOWN, "shutting_down", message)
            for batch in self.scheduler.remove_all_workers():
                self.clients.fail_batch(batch, ErrorCode.SHUTTING_DOWN, message)
            return True
        return False

    def model_failed(self, model: str, why: str) -> None:
        """No worker of `model` can start: answer its queued requests and refuse new ones
        (until one of its workers joins)."""
        self.clients.model_failed(model, why)

    # --- dispatch ---------------------------------------------------------------------------

    def _dispatch(self) -> None:
        now = time.monotonic()
        for name, req in self.scheduler.expire(now):
            self.clients.reply_error(req, name, ErrorCode.DEADLINE_EXCEEDED, "deadline passed while queued")
        without_workers(self, now)
        tracer = self.tracer
        batches = self.scheduler.due_batches(now)
        for i, batch in enumerate(batches):
            if batch.unsent:
                continue  # its worker was lost with an earlier batch of this turn
            # Unrounded (round(x, 3) cost 0.46 us a request): the worker rounds each reply's.
            queue_ms = [(now - r.arrived_at) * 1000.0 for r in batch.requests]
            if tracer is None or all(r.trace is None for r in batch.requests):
                self.stats.metrics.queue_waits_ms(batch.model, queue_ms)
                bodies = [r.body for r in batch.requests]
                if batch.multiplexed:  # the worker is told which of its models runs it
                    frames = protocol.batch_frames(batch.batch_id, queue_ms, bodies, None, batch.model)
                else:
                    frames = protocol.batch_frames(batch.batch_id, queue_ms, bodies)
            else:
                frames = traced_batch(tracer, batch, queue_ms, now, self.pool.name(batch.worker), self.stats)
            if not self.workers.send(batch.worker, frames):
                log.warning("worker %s unreachable; its batches go to another", self.pool.name(batch.worker))
                for later in batches[i:]:  # this one and the next ones cut for that worker
                    if later.worker == batch.worker:
                        later.unsent = True  # it goes back free: it never reached the worker
                self.workers.lost(batch.worker, "worker unreachable")
        if self.streams:
            dispatch_sequences(self, now)
        if not self._limits_armed and (self.scheduler.running() or self.streams.busy()):
            self._arm_time_limits()


def dispatch_sequences(broker: Broker, now: float) -> None:
    """Step-level workers: end the sequences past their deadline, then fill every free
    slot from its model's queue (the worker admits them at its next step)."""
    for seq in broker.streams.expire(now):
        broker.workers.end_stream(
            seq, ErrorCode.DEADLINE_EXCEEDED, "deadline", "deadline passed while generating"
        )
    for w in broker.streams.free_slots():
        if not broker.scheduler.queued(w.model):
            continue
        requests = broker.scheduler.take(w.model, w.free)
        sequences = broker.streams.start(w.worker_id, requests, now)
        queue_ms = [round((now - r.arrived_at) * 1000.0, 3) for r in requests]
        broker.stats.sequences_started(w.model, queue_ms)
        remaining_ms = [
            None if r.deadline_at is None else round(max(0.0, r.deadline_at - now) * 1000.0, 3)
            for r in requests
        ]
        parents = None
        if broker.tracer is not None:
            parents = traced_start(broker.tracer, w.model, requests, broker.pool.name(w.worker_id), now)
        frames = protocol.start_frames(
            [s.seq_id for s in sequences], remaining_ms, [r.body for r in requests], parents
        )
        if not broker.workers.send(w.worker_id, frames):
            log.warning("worker %s unreachable; its sequences go to another", broker.pool.name(w.worker_id))
            for seq in sequences:  # they go back free: they never reached the worker
                seq.unsent = True
            broker.workers.lost(w.worker_id, "worker unreachable")


def skip_stall(pool: WorkerPool, stall: tuple[float, float]) -> None:
    """The broker did not run for a while (batcher.core.stalls): its workers' silence and
    their batches' time limits skip that time. (`Broker.run` tests a poll's overshoot
    only past STALL_MIN_S of poll: 0.14 us a turn saved.)"""
    by_s = stall[1] - stall[0]
    log.warning(
        "the broker did not run for %.1f s (stopped, or starved of CPU): "
        "its workers' silence and time limits skip that time", by_s,
    )  # fmt: skip
    pool.stalled(by_s)


def without_workers(broker: Broker, now: float) -> None:
    """Each turn: the queued requests of a model that has had no worker for
    --no-worker-timeout-ms answered `unavailable`, then the models only workers announced,
    none serving them now, forgotten (batcher.core.policy.forget_unserved)."""
    for name, req, without_s in broker.scheduler.unavailable(now):
        message = broker.pool.unavailable_message(name, without_s)
        broker.clients.reply_error(req, name, ErrorCode.UNAVAILABLE, message)
    for name in broker.scheduler.forget_unserved(now):
        broker.stats.forget(name)


def traced_batch(
    tracer: Any, batch: Any, queue_ms: list[float], now: float, worker: str, stats: BrokerStats
) -> list[Any]:
    """A BATCH whose span begins now (its traceparent in the header when any of its
    requests is traced); the queue waits observed with their trace ids as exemplars."""
    cost = sum(r.cost for r in batch.requests)
    traceparent = tracer.batch_started(batch, worker, cost, now)
    spans = [None if r.trace is None else r.trace.queue for r in batch.requests]
    stats.metrics.queue_waits_ms(batch.model, queue_ms, spans)
    bodies = [r.body for r in batch.requests]
    return protocol.batch_frames(
        batch.batch_id, queue_ms, bodies, traceparent, batch.model if batch.multiplexed else None
    )


def traced_start(
    tracer: Any, model: str, requests: list[Any], worker: str, now: float
) -> list[str | None] | None:
    """The traced requests given to a step-level worker now leave their queue (queue
    span, outcome `started`) and begin their stream span (the broker's delivery of the
    stream, to its end); each one's traceparent for the START header (its stream span:
    the parent of the worker's span of the stream), None when none is traced."""
    if all(r.trace is None for r in requests):
        return None
    out: list[str | None] = []
    for r in requests:
        if r.trace is None:
            out.append(None)
            continue
        out.append(tracer.stream_started(r, model, worker, now))
    return out


def response_cache(settings: BrokerSettings, metrics: Any) -> BrokerCache | None:
    """The response cache, when --cache-bytes bounds one and a model asks for it (its
    metrics on the Prometheus endpoint when there is one)."""
    if not (settings.cache_bytes and settings.cache_models):
        return None
    cache = BrokerCache(settings.cache_bytes, frozenset(settings.cache_models))
    if isinstance(metrics, PrometheusMetrics):
        metrics.registry.register(CacheCollector(cache))
    return cache


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


def serve_metrics(
    host: str, port: int, scheduler: Scheduler, streams: Streams, autoscale: Autoscale | None = None
) -> PrometheusMetrics:
    """Prometheus metrics on `host`:`port`, gauges read from the scheduler's views at
    scrape time (from prometheus_client's thread: retried if the loop changed a dict
    under it)."""

    def read_gauges() -> dict[str, dict[str, float]]:
        for _ in range(5):
            try:
                return gauges(scheduler.views(), streams, autoscale)
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
