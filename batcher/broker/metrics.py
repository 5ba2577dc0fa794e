"""What the broker counts: Prometheus metrics (prometheus_client) and recent samples.

Recent samples (a bounded ring per model) feed the `stats` control request's
p50/p99; they cost an append per request. The Prometheus histograms cost about
0.5 us per observation, so they exist only when --metrics-port is given; without
it the broker uses `NoMetrics`, whose methods do nothing.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batcher.observe.counters import DroppedSpans
from batcher.wire.codes import ErrorCode

#: A traced request's (or batch's) `trace_id` and `span_id` on a histogram's observation
#: (shown in the OpenMetrics exposition), None for an untraced one.
Exemplar = dict[str, str] | None


def exemplar_of(ctx: Any) -> Exemplar:
    """The exemplar of a span context the broker keeps (trace_id and span_id as ints)."""
    return None if ctx is None else {"trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}"}


#: Recent samples kept per model for the stats percentiles.
RECENT = 2048

#: What the broker counts of a model's workers in batcher_worker_events (serve adds its own
#: of the models it runs), and why it ends a sequence early (batcher_sequences_cancelled).
WORKER_EVENTS = ("joined", "died", "left")
CANCEL_REASONS = ("cancel", "deadline", "client_gone", "shutting_down")

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class Recent:
    """The last RECENT queue waits and inference times of one model, in milliseconds."""

    queue_ms: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))  # broker + worker
    worker_wait_ms: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))  # per batch
    infer_ms: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    first_chunk_ms: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))  # per sequence


def percentile(values: deque[float] | list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by nearest rank, None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


class NoMetrics:
    """The broker's metrics when no --metrics-port is given: every call is a no-op."""

    def request_done(self, model: str, outcome: str, count: int = 1) -> None:
        pass

    def batch_done(self, model: str, size: int, infer_s: float, exemplar: Exemplar = None) -> None:
        pass

    def queue_waits_ms(self, model: str, waits_ms: list[float], spans: list[Any] | None = None) -> None:
        pass

    def worker_wait(self, model: str, wait_s: float, exemplar: Exemplar = None) -> None:
        pass

    def model_loaded(self, model: str, load_s: float) -> None:
        pass

    def model_unloaded(self, model: str) -> None:
        pass

    def worker_event(self, model: str, event: str) -> None:
        pass

    def padding(self, model: str, padded: int, real: int, waste: float | None) -> None:
        pass

    def chunk(self, model: str) -> None:
        pass

    def first_chunk(self, model: str, seconds: float, exemplar: Exemplar = None) -> None:
        pass

    def sequence_cancelled(self, model: str, reason: str) -> None:
        pass

    def worker_spans_dropped(self, model: str, n: int) -> None:
        pass

    def forget(self, model: str) -> None:
        """The model is gone (BrokerStats.forget): its series go."""


class PrometheusMetrics(NoMetrics):
    """Prometheus metrics in a registry of their own, served over HTTP by
    prometheus_client's server thread; gauges are read from the broker at scrape time."""

    def __init__(self, gauges: Callable[[], dict[str, dict[str, float]]]) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
        from prometheus_client.core import GaugeMetricFamily

        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # the broker's own CPU and memory
        self.requests = Counter(
            "batcher_requests",
            "Requests answered, by model and outcome (ok or error code)",
            ["model", "outcome"],
            registry=self.registry,
        )
        self.batch_size = Histogram(
            "batcher_batch_size",
            "Requests per batch sent to a worker",
            ["model"],
            buckets=BATCH_SIZE_BUCKETS,
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "batcher_queue_wait_seconds",
            "Time from arrival at the broker to dispatch",
            ["model"],
            buckets=SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.worker_wait_hist = Histogram(
            "batcher_worker_wait_seconds",
            "Time a batch waited in its worker (prefetch) before the model began",
            ["model"],
            buckets=SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.inference = Histogram(
            "batcher_inference_seconds",
            "Model time per batch, as the worker reports it",
            ["model"],
            buckets=SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.worker_events = Counter(
            "batcher_worker_events",
            "Workers that joined, left, died or were respawned",
            ["model", "event"],
            registry=self.registry,
        )
        self.elements = Counter(
            "batcher_stacked_elements",
            "Elements of stacked batches' inputs: padded (added to fit the longest) or real",
            ["model", "kind"],
            registry=self.registry,
        )
        self.padding_waste = Gauge(
            "batcher_padding_waste_ratio",
            "Padded elements / real elements of the stacked batches so far",
            ["model"],
            registry=self.registry,
        )

        self.chunks = Counter(
            "batcher_chunks",
            "Chunks of streamed replies delivered to clients (rate(): chunks per second)",
            ["model"],
            registry=self.registry,
        )
        self.first_chunk_hist = Histogram(
            "batcher_time_to_first_chunk_seconds",
            "Time from a sequence's arrival at the broker to its first chunk's delivery",
            ["model"],
            buckets=SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.worker_dropped = Counter(
            "batcher_worker_trace_spans_dropped",
            "Trace spans the workers of a model dropped, as their heartbeats report them",
            ["model"],
            registry=self.registry,
        )
        self.cold_loads = Counter(
            "batcher_model_loads",
            "Loads of a multiplexed model by a worker that did not hold it, before its batch",
            ["model"],
            registry=self.registry,
        )
        self.cold_load_seconds = Counter(
            "batcher_model_load_seconds",
            "Time multiplexed workers spent loading the model before its batches",
            ["model"],
            registry=self.registry,
        )
        self.unloads = Counter(
            "batcher_model_unloads",
            "Unloads of a multiplexed model by a worker making room for another",
            ["model"],
            registry=self.registry,
        )
        self.cancelled = Counter(
            "batcher_sequences_cancelled",
            "Sequences the broker ended early, by reason (cancel, deadline, client_gone, shutting_down)",
            ["model", "reason"],
            registry=self.registry,
        )

        class Gauges:
            def collect(self) -> Any:
                snapshot = gauges()
                for name, help_text in (
                    ("queue_depth", "Requests waiting for a batch"),
                    ("workers", "Workers alive"),
                    ("batches_in_flight", "Batches held by workers"),
                    ("active_sequences", "Sequences held by step-level workers"),
                ):
                    family = GaugeMetricFamily(f"batcher_{name}", help_text, labels=["model"])
                    for model, values in snapshot.items():
                        family.add_metric([model], values[name])
                    yield family
                for name, help_text in (
                    (
                        "desired_workers",
                        "Workers the offered load needs at --target-utilization (docs/kubernetes.md)",
                    ),
                    (
                        "workers_needed",
                        "desired_workers before rounding up: sum() it over cells to scale a deployment",
                    ),
                    ("desired_cells", "Cells (serve processes) the offered load needs at that target"),
                ):
                    family = GaugeMetricFamily(f"batcher_{name}", help_text, labels=["model"])
                    for model, values in snapshot.items():
                        if name in values:
                            family.add_metric([model], values[name])
                    yield family

        self.registry.register(Gauges())

        self.registry.register(DroppedSpans())

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        """Start the HTTP endpoint (/metrics) in prometheus_client's thread."""
        from prometheus_client import start_http_server

        start_http_server(port, addr=addr, registry=self.registry)

    def request_done(self, model: str, outcome: str, count: int = 1) -> None:
        if count:
            self.requests.labels(model, outcome).inc(count)

    def batch_done(self, model: str, size: int, infer_s: float, exemplar: Exemplar = None) -> None:
        """A batch's size, and its model time (with its batch span's trace as an exemplar)."""
        self.batch_size.labels(model).observe(size)
        self.inference.labels(model).observe(infer_s, exemplar)

    def queue_waits_ms(self, model: str, waits_ms: list[float], spans: list[Any] | None = None) -> None:
        """Each request's wait; a traced one's carries its queue span's trace and span id
        (`spans`: each request's span context, None for an untraced one) as an exemplar
        (shown in the OpenMetrics exposition), so a slow bucket leads to a trace. A bucket
        keeps the last exemplar it was given, so only the last traced request of each
        bucket here is given one (the others' would be replaced within this call)."""
        observe = self.queue_wait.labels(model).observe
        if spans is None:
            for w in waits_ms:
                observe(w / 1000.0)
            return
        last = {
            bisect_left(SECONDS_BUCKETS, w / 1000.0): i
            for i, (w, ctx) in enumerate(zip(waits_ms, spans, strict=True))
            if ctx is not None
        }
        given = set(last.values())
        for i, w in enumerate(waits_ms):
            observe(w / 1000.0, exemplar_of(spans[i]) if i in given else None)

    def worker_wait(self, model: str, wait_s: float, exemplar: Exemplar = None) -> None:
        self.worker_wait_hist.labels(model).observe(wait_s, exemplar)

    def worker_event(self, model: str, event: str) -> None:
        self.worker_events.labels(model, event).inc()

    def padding(self, model: str, padded: int, real: int, waste: float | None) -> None:
        self.elements.labels(model, "padded").inc(padded)
        self.elements.labels(model, "real").inc(real)
        if waste is not None:
            self.padding_waste.labels(model).set(waste)

    def chunk(self, model: str) -> None:
        self.chunks.labels(model).inc()

    def first_chunk(self, model: str, seconds: float, exemplar: Exemplar = None) -> None:
        self.first_chunk_hist.labels(model).observe(seconds, exemplar)

    def sequence_cancelled(self, model: str, reason: str) -> None:
        self.cancelled.labels(model, reason).inc()

    def worker_spans_dropped(self, model: str, n: int) -> None:
        self.worker_dropped.labels(model).inc(n)

    def model_loaded(self, model: str, load_s: float) -> None:
        self.cold_loads.labels(model).inc()
        self.cold_load_seconds.labels(model).inc(load_s)

    def model_unloaded(self, model: str) -> None:
        self.unloads.labels(model).inc()

    def forget(self, model: str) -> None:
        """The model is gone (BrokerStats.forget): every series labelled with it goes, so
        that models announced and gone do not grow the registry without bound."""
        for family in (
            self.batch_size, self.queue_wait, self.worker_wait_hist, self.inference, self.padding_waste,
            self.chunks, self.first_chunk_hist, self.worker_dropped, self.cold_loads,
            self.cold_load_seconds, self.unloads,
        ):  # fmt: skip
            family.remove(model)
        for family, values in (
            (self.requests, ("ok", *(str(code) for code in ErrorCode))),
            (self.worker_events, WORKER_EVENTS),
            (self.elements, ("padded", "real")),
            (self.cancelled, CANCEL_REASONS),
        ):
            for value in values:
                family.remove(model, value)
