"""The OpenTelemetry SDK as batcher uses it: one TracerProvider per process, named for
the process (`batcher-broker`, `batcher-worker`, `batcher-gateway`), whose finished spans
leave from a background thread (`BoundedExporter`), never from the loop that made them.
A collector that is down, slow or answering errors costs queued spans, never a wait:
past `max_queue_size` spans are dropped, and every span dropped (queue full, or its
export failed) is counted in `spans_dropped()` (the broker's
`batcher_trace_spans_dropped_total`, stats' `trace_spans_dropped`).

Imported only when tracing is on: this module imports opentelemetry at its top."""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_ON

from batcher.extras import MissingExtra, install_command
from batcher.observe.counters import count_dropped
from batcher.observe.otlp_encode import FastSpanExporter
from batcher.observe.settings import TraceSettings

log = logging.getLogger("batcher.tracing")


class BoundedExporter(SpanProcessor):
    """Finished spans queued (at most `max_queue_size`: past it they are dropped and
    counted) and exported by one daemon thread, `max_export_batch_size` at a time, every
    `schedule_delay_s` or as soon as a batch is full. `on_end` is an append under a
    lock: the loop that ends a span never waits for the network."""

    def __init__(self, exporter: SpanExporter, settings: TraceSettings) -> None:
        self._exporter = exporter
        self._max_queue = settings.max_queue_size
        self._batch = settings.max_export_batch_size
        self._delay_s = settings.schedule_delay_ms / 1000.0
        self._queue: collections.deque[ReadableSpan] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._flushing = 0  # callers waiting in force_flush
        self._exported = 0  # spans the collector took, for tests and force_flush
        self._exporting = 0  # spans being exported now
        self._thread = threading.Thread(target=self._run, name="batcher-trace-export", daemon=True)
        self._thread.start()

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        """Nothing: spans are exported once they end."""

    def on_end(self, span: ReadableSpan) -> None:
        """Queue a finished span (or drop it, counted, when the queue is full)."""
        if not span.context.trace_flags.sampled:
            return
        cond = self._cond
        with cond:
            if len(self._queue) >= self._max_queue:
                count_dropped(1)
                return
            self._queue.append(span)
            if len(self._queue) >= self._batch:
                cond.notify()

    def put_many(self, items: list[Any]) -> None:
        """Queue many finished spans at once, as the exporter's `export` takes them (the
        broker's exporter process: its span records), under one lock; those past the
        queue's room are dropped, counted."""
        cond = self._cond
        with cond:
            room = self._max_queue - len(self._queue)
            if len(items) > room:
                count_dropped(len(items) - max(room, 0))
                items = items[: max(room, 0)]
            self._queue.extend(items)
            if len(self._queue) >= self._batch:
                cond.notify()

    def _take(self) -> list[ReadableSpan]:
        queue, n = self._queue, min(self._batch, len(self._queue))
        return [queue.popleft() for _ in range(n)]

    def _run(self) -> None:
        cond = self._cond
        while True:
            with cond:
                if len(self._queue) < self._batch and not self._stopping and not self._flushing:
                    cond.wait(self._delay_s)
                spans = self._take()
                if not spans and self._stopping:
                    return
                self._exporting = len(spans)
            if spans:
                self._export(spans)
            with cond:
                self._exporting = 0
                cond.notify_all()  # for force_flush
                if self._flushing and not self._queue:
                    cond.wait(self._delay_s)  # (not a busy loop while a flush waits)

    def _export(self, spans: list[ReadableSpan]) -> None:
        try:
            result = self._exporter.export(spans)
        except Exception as exc:  # the exporter's bug or the network's: counted, logged once in a while
            log.debug("span export failed: %s", exc)
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self._exported += len(spans)
        else:
            count_dropped(len(spans))

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Export what is queued now; True once the queue is empty within the timeout."""
        end = time.monotonic() + timeout_millis / 1000.0
        with self._cond:
            self._flushing += 1
            try:
                self._cond.notify_all()
                while (self._queue or self._exporting) and time.monotonic() < end:
                    self._cond.wait(min(0.05, max(0.0, end - time.monotonic())))
                return not self._queue and not self._exporting
            finally:
                self._flushing -= 1

    def shutdown(self) -> None:
        """Export what is left (within the export timeout) and stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=5.0)
        self._exporter.shutdown()


def make_exporter(settings: TraceSettings) -> SpanExporter:
    """The OTLP exporter of `settings.protocol` (MissingExtra naming the extra if absent)."""
    timeout_s = settings.export_timeout_ms / 1000.0
    if settings.protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
        except ImportError:
            raise MissingExtra(
                f"OTLP over gRPC needs its exporter: {install_command('tracing-grpc')}"
            ) from None
        insecure = (settings.endpoint or "").startswith("http://")
        exporter: SpanExporter = Grpc(endpoint=settings.traces_url, insecure=insecure, timeout=timeout_s)
        return exporter
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http
    except ImportError:
        raise MissingExtra(f"OTLP over HTTP needs its exporter: {install_command('tracing')}") from None
    return Http(endpoint=settings.traces_url, timeout=timeout_s, session=http_session())


#: The SDK's variables naming a plug-in that makes the exporter's HTTP session (its own
#: credentials): where one is set, the SDK's session is used, as it is.
CREDENTIAL_PROVIDERS = (
    "OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER",
    "OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER",
)


def http_session() -> Any:
    """The session the OTLP/HTTP exporter posts with: requests' Session reading the
    environment (proxies, CA bundle, netrc) once rather than on every post
    (batcher.observe.http_session); None (the SDK makes its own) where a credential
    provider plug-in is configured, or requests cannot be imported."""
    if any(os.environ.get(name) for name in CREDENTIAL_PROVIDERS):
        return None
    try:
        from batcher.observe.http_session import EnvironmentOnceSession
    except ImportError:
        return None
    return EnvironmentOnceSession()


def make_provider(
    settings: TraceSettings,
    service: str,
    attributes: Mapping[str, Any] | None = None,
    exporter: SpanExporter | None = None,
) -> tuple[TracerProvider, BoundedExporter]:
    """A TracerProvider for this process, installed as OpenTelemetry's global one (so a
    model's own spans join ours), and its processor. The sampler is ALWAYS_ON: batcher
    decides sampling itself before it makes a span (batcher.wire.tracecontext.should_sample),
    so an unsampled request costs no SDK call at all."""
    resource = Resource.create({"service.name": settings.service_name or service, **(attributes or {})})
    provider = TracerProvider(resource=resource, sampler=ALWAYS_ON)
    if exporter is None:
        exporter = FastSpanExporter(make_exporter(settings))
    processor = BoundedExporter(exporter, settings)
    provider.add_span_processor(processor)
    try:
        trace.set_tracer_provider(provider)
    except Exception:  # set once per process: a second one (tests) stays local
        log.debug("a tracer provider was already installed")
    return provider, processor


def exported_count(processor: BoundedExporter) -> int:
    """Spans `processor` has had taken by the collector (tests, benchmarks)."""
    return processor._exported
