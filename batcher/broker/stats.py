"""What the broker counts, in one object: per-model outcomes and recent latencies, the
broker-wide counters, and the `stats` control request's snapshot built from them and
from the scheduler's and the pool's read-only views. Prometheus (batcher.broker.metrics) is
fed from here too, so every count is made in one place."""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from batcher.broker.autoscale import Autoscale
from batcher.broker.metrics import Exemplar, NoMetrics, Recent, percentile
from batcher.core.pool import WorkerPool
from batcher.core.scaling import DEFAULT_TARGET_UTILIZATION
from batcher.core.scheduler import ModelView
from batcher.core.streams import Streams
from batcher.wire import protocol
from batcher.wire.protocol import ErrorCode

#: The window over which `stats` reports chunks per second.
CHUNK_RATE_WINDOW_S = 5.0
#: Workers whose last dropped-span count is kept (past it the table starts again).
MAX_WORKERS_COUNTED = 10_000
#: The largest count of a peer's numbers the stats keep (summed, they stop there): what
#: msgpack encodes (int64); a worker's REPLY says up to 2**63 - 1 padded elements each time.
MAX_COUNTED = 2**63 - 1


@dataclass
class Totals:
    """Cumulative counts and nanoseconds of a model's batches since the broker started, in
    the parts Triton's statistics extension reports them (the gateway serves them so:
    docs/gateway.md). Each part of a request's time in the broker, arrival to reply:
    `queue` in the broker's queue until its batch was sent; `compute_input` the worker's
    own count from reading the batch to the model starting (decoding and stacking the
    inputs, a prefetch hold); `compute_infer` the model's call; `compute_output` the rest
    of the batch's round trip (encoding the outputs, the trips between broker and worker,
    a wait the worker did not see). Per request each counts its batch's time, as Triton's
    do; per batch size, each batch once."""

    success: list[int] = field(default_factory=lambda: [0, 0])  # [requests, ns arrival to reply]
    fail: list[int] = field(default_factory=lambda: [0, 0])  # answered an error by the worker
    queue: list[int] = field(default_factory=lambda: [0, 0])
    compute_input: list[int] = field(default_factory=lambda: [0, 0])
    compute_infer: list[int] = field(default_factory=lambda: [0, 0])
    compute_output: list[int] = field(default_factory=lambda: [0, 0])
    #: batch size -> [batches, compute_input ns, compute_infer ns, compute_output ns]
    by_batch_size: dict[int, list[int]] = field(default_factory=dict)
    last_batch_at: float | None = None

    def add_batch(
        self,
        arrivals: list[float],
        sent_at: float,
        wait_ms: float | None,
        infer_ms: float,
        errors: int,
        now: float,
    ) -> None:
        """A batch answered at `now` (monotonic s): its requests' arrivals, when it was
        sent, the worker's wait before the model and the model's time (ms)."""
        n = len(arrivals)
        if not n:
            return
        round_trip_ns = max(0, round((now - sent_at) * 1e9))
        infer_ns = max(0, round(infer_ms * 1e6))
        input_ns = min(max(0, round((wait_ms or 0.0) * 1e6)), max(0, round_trip_ns - infer_ns))
        output_ns = max(0, round_trip_ns - input_ns - infer_ns)
        # Every arrival is at or before sent_at, itself before now (one monotonic clock): the
        # sums of the differences, without a call per request.
        arrived_s = sum(arrivals)
        durations_ns = max(0, round((n * now - arrived_s) * 1e9))
        queued_ns = max(0, round((n * sent_at - arrived_s) * 1e9))
        failed = min(max(errors, 0), n)
        fail_ns = durations_ns * failed // n  # the batch's mean time per failed request
        _add(self.success, n - failed, durations_ns - fail_ns)
        _add(self.fail, failed, fail_ns)
        _add(self.queue, n, queued_ns)
        _add(self.compute_input, n, n * input_ns)
        _add(self.compute_infer, n, n * infer_ns)
        _add(self.compute_output, n, n * output_ns)
        per_size = self.by_batch_size.setdefault(n, [0, 0, 0, 0])
        per_size[0] += 1
        per_size[1] += input_ns
        per_size[2] += infer_ns
        per_size[3] += output_ns
        self.last_batch_at = now

    def wire(self, now: float) -> dict[str, Any]:
        """As `stats` carries them (docs/protocol.md, 4.4)."""
        return {
            "success": list(self.success),
            "fail": list(self.fail),
            "queue": list(self.queue),
            "compute_input": list(self.compute_input),
            "compute_infer": list(self.compute_infer),
            "compute_output": list(self.compute_output),
            "by_batch_size": [[size, *v] for size, v in sorted(self.by_batch_size.items())],
            "last_batch_s_ago": None if self.last_batch_at is None else round(now - self.last_batch_at, 6),
        }


def _add(counter: list[int], count: int, ns: int) -> None:
    counter[0] += count
    counter[1] += ns


@dataclass
class ModelStats:
    """Counters the `stats` control request reports for one model."""

    batches: int = 0
    requests: int = 0  # in completed batches
    outcomes: Counter[str] = field(default_factory=Counter)  # "ok" or an error code -> replies
    recent: Recent = field(default_factory=Recent)
    padded_elements: int = 0  # of stacked batches' inputs, added to fit the longest
    real_elements: int = 0  # of stacked batches' inputs, the requests' own
    sequences: int = 0  # requests given to step-level workers
    chunks: int = 0  # chunks (and final replies) of those delivered to clients
    sequences_cancelled: Counter[str] = field(default_factory=Counter)  # reason -> sequences
    chunk_times: deque[tuple[float, int]] = field(default_factory=deque)  # (when, chunks) per CHUNK
    totals: Totals = field(default_factory=Totals)
    #: A multiplexed model's loads before a batch (count, ms), and unloads to make room.
    cold_loads: int = 0
    cold_load_ms_total: float = 0.0
    cold_load_ms_max: float = 0.0
    unloads: int = 0

    def chunks_per_s(self, now: float) -> float:
        """Chunks delivered per second over the last CHUNK_RATE_WINDOW_S."""
        times = self.chunk_times
        while times and times[0][0] < now - CHUNK_RATE_WINDOW_S:
            times.popleft()
        return sum(n for _, n in times) / CHUNK_RATE_WINDOW_S

    @property
    def padding_waste(self) -> float | None:
        """Padded elements / real elements of the stacked batches so far (None before any)."""
        return self.padded_elements / self.real_elements if self.real_elements else None


@dataclass
class BrokerStats:
    """Every counter of one broker, and the metrics it feeds."""

    metrics: NoMetrics = field(default_factory=NoMetrics)
    models: dict[str, ModelStats] = field(default_factory=dict)
    refused: Counter[str] = field(default_factory=Counter)  # refusals with no model to count them under
    undeliverable: int = 0
    dropped_backend: int = 0
    workers_lost: int = 0
    batches_retried: int = 0
    batches_timed_out: int = 0  # batches that ran past their time limit (their worker is stopped)
    #: Trace spans each model's workers dropped (their heartbeats' counts), and each
    #: worker's last count, so a count said again is added once.
    worker_spans_dropped: Counter[str] = field(default_factory=Counter)
    _worker_drops: dict[bytes, int] = field(default_factory=dict)
    #: The autoscaling signal (its target and the cell's worker counts come from the settings).
    autoscale: Autoscale = field(default_factory=lambda: Autoscale(DEFAULT_TARGET_UTILIZATION, {}))

    def model(self, name: str) -> ModelStats:
        st = self.models.get(name)
        if st is None:
            st = self.models[name] = ModelStats()
        return st

    def forget(self, model: str) -> None:
        """A model the scheduler forgot (one only workers announced, none serving it now:
        batcher.core.policy.forget_unserved): its counts and metrics go with it."""
        self.models.pop(model, None)
        self.worker_spans_dropped.pop(model, None)
        self.autoscale.forget(model)
        self.metrics.forget(model)

    def count(self, model: str | None, outcome: str, n: int = 1) -> None:
        """`n` replies of `outcome` ("ok" or an error code), under `model` if it has one."""
        if not n:
            return
        if model is None:
            self.refused[outcome] += n
            self.metrics.request_done("", outcome, n)
        else:
            self.model(model).outcomes[outcome] += n
            self.metrics.request_done(model, outcome, n)

    def sequences_started(self, model: str, queue_ms: list[float]) -> None:
        """Requests sent to a step-level worker, after these waits in the queue."""
        st = self.model(model)
        st.sequences += len(queue_ms)
        st.recent.queue_ms.extend(queue_ms)
        self.metrics.queue_waits_ms(model, queue_ms)

    def chunk(
        self, model: str, first: bool, since_arrival_s: float, now: float, exemplar: Exemplar = None
    ) -> None:
        """A chunk delivered; the first of its sequence, `since_arrival_s` after its request
        arrived, is the time to first chunk."""
        st = self.model(model)
        st.chunks += 1
        times = st.chunk_times
        tick = math.floor(now * 100.0) / 100.0  # 10 ms ticks: at most 500 entries a window
        if times and times[-1][0] == tick:
            times[-1] = (tick, times[-1][1] + 1)
        else:
            times.append((tick, 1))
            st.chunks_per_s(now)  # drop what left the window
        self.metrics.chunk(model)
        if first:
            st.recent.first_chunk_ms.append(since_arrival_s * 1000.0)
            self.metrics.first_chunk(model, since_arrival_s, exemplar)

    def worker_said(self, info: Any, worker_id: bytes, frames: list[bytes]) -> None:
        """A worker's HEARTBEAT with its counters (protocol.md 6.6): the spans it dropped
        since its last one are added to its model's (a malformed map is ignored)."""
        if not frames or info is None:
            return
        try:
            n = protocol.unpack(frames[0]).get("trace_spans_dropped")
        except Exception:  # msgpack raises several unrelated types; not a map
            return
        if type(n) is not int or n < 0:
            return
        drops = self._worker_drops
        if len(drops) > MAX_WORKERS_COUNTED and worker_id not in drops:
            drops.clear()  # workers come and go: the table stays bounded
        new = n - drops.get(worker_id, 0)
        drops[worker_id] = n
        if new > 0:
            self.worker_spans_dropped[info.model] = min(
                self.worker_spans_dropped[info.model] + new, MAX_COUNTED
            )
            self.metrics.worker_spans_dropped(info.model, new)

    def model_loaded(self, model: str, load_ms: float, unloaded: tuple[str, ...], info: Any) -> None:
        """A multiplexed worker loaded `model` before its batch, in `load_ms`, unloading
        `unloaded` to make room. Only what a multiplexed worker may do counts: a worker
        without a catalog, or a batch's model outside it, loads nothing; each model of the
        catalog other than `model` is unloaded once at most, however often a REPLY names it
        (a REPLY naming one 1000 times must not count 1000 unloads)."""
        catalog = getattr(info, "catalog", None)
        if catalog is None or model not in catalog.sizes_mb:
            return
        st = self.model(model)
        st.cold_loads += 1
        st.cold_load_ms_total += load_ms
        st.cold_load_ms_max = max(st.cold_load_ms_max, load_ms)
        self.metrics.model_loaded(model, load_ms / 1000.0)
        for name in dict.fromkeys(unloaded):
            if name != model and name in catalog.sizes_mb:
                self.model(name).unloads += 1
                self.metrics.model_unloaded(name)

    def sequence_cancelled(self, model: str, reason: str) -> None:
        """The broker ended a sequence early: `cancel`, `deadline`, `client_gone`, `shutting_down`."""
        self.model(model).sequences_cancelled[reason] += 1
        self.metrics.sequence_cancelled(model, reason)

    def batch_done(
        self,
        model: str,
        queue_ms: Iterable[float],
        infer_ms: float,
        wait_ms: float | None,
        size: int,
        padding: tuple[int, int] | None = None,
        exemplar: Exemplar = None,
    ) -> None:
        """A worker answered a batch: its requests' queue times (broker and worker), the
        worker's wait before the model began, its model time and, for a stacked batch,
        its (padded, real) input elements; `exemplar`: a traced batch's span."""
        st = self.model(model)
        if padding is not None:
            st.padded_elements = min(st.padded_elements + padding[0], MAX_COUNTED)
            st.real_elements = min(st.real_elements + padding[1], MAX_COUNTED)
            self.metrics.padding(model, padding[0], padding[1], st.padding_waste)
        st.batches += 1
        st.requests += size
        st.recent.infer_ms.append(infer_ms)
        st.recent.queue_ms.extend(queue_ms)
        self.metrics.batch_done(model, size, infer_ms / 1000.0, exemplar)
        if wait_ms is not None:
            st.recent.worker_wait_ms.append(wait_ms)
            self.metrics.worker_wait(model, wait_ms / 1000.0, exemplar)

    def batch_answered(
        self,
        model: str,
        arrivals: list[float],
        sent_at: float,
        wait_ms: float | None,
        infer_ms: float,
        in_worker_ms: float,
        errors: int,
        refused: int,
        padding: tuple[int, int] | None,
        now: float,
        exemplar: Exemplar = None,
    ) -> None:
        """A worker answered a batch sent at `sent_at` of requests that arrived at
        `arrivals`, `errors` of its replies errors (`refused` of them bad_request): every
        count of it, once per batch. A request's queue time is as its client lives it: in
        the broker's queue, then `in_worker_ms` in the worker until the model began."""
        queue_ms = [(sent_at - t) * 1000.0 + in_worker_ms for t in arrivals]  # (rounded when reported)
        self.batch_done(model, queue_ms, infer_ms, wait_ms, len(arrivals), padding, exemplar)
        self.model(model).totals.add_batch(arrivals, sent_at, wait_ms, infer_ms, errors, now)
        self.count(model, "ok", len(arrivals) - errors)
        self.count(model, ErrorCode.MODEL_ERROR, errors - refused)
        self.count(model, ErrorCode.BAD_REQUEST, refused)

    def snapshot(
        self,
        views: dict[str, ModelView],
        pool: WorkerPool,
        configured: frozenset[str],
        now: float,
        extra: dict[str, Any],
        redacted: bool = False,
    ) -> dict[str, Any]:
        """The `stats` control request's output (docs/protocol.md, 4.4); `redacted`: the
        workers named without their pids, for a client that is no admin (--curve-admins)."""
        models = {
            name: self._model_entry(name, view, pool, name in configured, now, redacted)
            for name, view in views.items()
        }
        return {
            "models": models,
            "refused_without_model": dict(self.refused),
            "workers_lost": self.workers_lost,
            "batches_retried": self.batches_retried,
            "batches_timed_out": self.batches_timed_out,
            "dropped_backend_messages": self.dropped_backend,
            "undeliverable": self.undeliverable,
            "worker_trace_spans_dropped": dict(self.worker_spans_dropped),
            **extra,
        }

    def _model_entry(
        self, name: str, view: ModelView, pool: WorkerPool, configured: bool, now: float, redacted: bool
    ) -> dict[str, Any]:
        st = self.models.get(name, ModelStats())
        recent, settings, cost = st.recent, view.settings, view.cost
        workers = []
        streams = pool.streams
        worker_name = pool.public_name if redacted else pool.name
        for w in view.workers:
            info = pool.info(w.worker_id)
            entry: dict[str, Any] = {
                "worker": worker_name(w.worker_id),
                "gpu": info.gpu if info else None,
                "batches_held": w.batches_held,
            }
            if w.holds is not None:  # a multiplexed worker: whether it holds the model now
                entry["holds_model"] = w.holds
            step = streams.worker(w.worker_id)
            if step is not None:
                entry.update(
                    max_active=step.max_active, active_sequences=len(step.held), counters=step.counters
                )
            workers.append(entry)
        return {
            "configured": configured,
            "ready": bool(view.workers),
            "no_worker_s": None if view.no_worker_since is None else round(now - view.no_worker_since, 3),
            "queued": view.queued,
            "workers": len(view.workers),
            "busy_workers": sum(1 for w in view.workers if w.batches_held),
            "batches_in_flight": view.batches_in_flight,
            "worker_list": workers,
            "batches": st.batches,
            "requests": st.requests,
            "mean_batch_size": st.requests / st.batches if st.batches else 0.0,
            "padded_elements": st.padded_elements,
            "real_elements": st.real_elements,
            "padding_waste": st.padding_waste,
            "outcomes": dict(st.outcomes),
            "queue_ms_p50": _ms(percentile(recent.queue_ms, 50)),
            "queue_ms_p99": _ms(percentile(recent.queue_ms, 99)),
            "worker_wait_ms_p50": percentile(recent.worker_wait_ms, 50),
            "worker_wait_ms_p99": percentile(recent.worker_wait_ms, 99),
            "infer_ms_p50": percentile(recent.infer_ms, 50),
            "infer_ms_p99": percentile(recent.infer_ms, 99),
            "max_batch_size": settings.max_batch_size,
            "max_wait_ms": settings.max_wait_ms,
            "batch_sizes": None if settings.batch_sizes is None else list(settings.batch_sizes),
            "policy": str(settings.policy),
            "max_queue": settings.max_queue,
            "max_batch_cost": settings.max_batch_cost,
            "priority_aging_ms": settings.priority_aging_ms,
            "bucket_by": settings.bucket_by,
            "length_buckets": None if settings.length_buckets is None else list(settings.length_buckets),
            "batch_cost_ms": None if cost is None else [cost[0] * 1000, cost[1] * 1000],
            "batch_cost_basis": view.cost_basis,
            "warmup": pool.warmup(name),
            "signature": None if (sig := pool.signature(name)) is None else sig.wire(),
            "active_sequences": streams.active(name),
            "sequences": st.sequences,
            "chunks": st.chunks,
            "chunks_per_s": round(st.chunks_per_s(now), 3),
            "first_chunk_ms_p50": percentile(recent.first_chunk_ms, 50),
            "first_chunk_ms_p99": percentile(recent.first_chunk_ms, 99),
            "sequences_cancelled": dict(st.sequences_cancelled),
            "totals": st.totals.wire(now),
            "multiplexed": any(w.holds is not None for w in view.workers) or st.cold_loads > 0,
            "held_by": sum(1 for w in view.workers if w.holds),
            "cold_loads": st.cold_loads,
            "cold_load_ms_total": round(st.cold_load_ms_total, 3),
            "cold_load_ms_max": round(st.cold_load_ms_max, 3),
            "unloads": st.unloads,
            "scaling": self.autoscale.wire(name),
        }


def gauges(
    views: dict[str, ModelView], streams: Streams, autoscale: Autoscale | None = None
) -> dict[str, dict[str, float]]:
    """Queue depth, workers, batches in flight and active sequences per model, for
    Prometheus at scrape time; with `autoscale`, the desired workers (and cells, where the
    cell's worker count is known) of each model whose batch time is learned."""
    out: dict[str, dict[str, float]] = {
        name: {
            "queue_depth": v.queued,
            "workers": len(v.workers),
            "batches_in_flight": v.batches_in_flight,
            "active_sequences": streams.active(name),
        }
        for name, v in views.items()
    }
    if autoscale is not None:
        for name, d in autoscale.desires.items():  # one dict, replaced whole at each tick
            if name in out and d.workers is not None:
                out[name]["desired_workers"] = d.workers
                if d.needed is not None:
                    out[name]["workers_needed"] = d.needed
                if d.cells is not None:
                    out[name]["desired_cells"] = d.cells
    return out


def _ms(value: float | None) -> float | None:
    """A reported time in ms, to the microsecond: a batch's queue times are kept unrounded
    (a call a request fewer), and rounded only here."""
    return None if value is None else round(value, 3)
