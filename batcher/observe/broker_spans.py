"""What the broker's loop records (loaded only with tracing on): each traced request's
time in its queue (`batcher.queue`: model, priority, deadline, outcome) and each batch
(`batcher.batch`: model, size, cost, worker, attempt, padding), the batch span a child of
its first traced request's queue span and LINKED to every traced request's, so a
request's trace leads to its batch and the batch to all its requests. The batch span's
traceparent rides in the BATCH header: the worker's spans are its children. Re-dispatch
after a lost worker and hung-batch kills are events on the batch spans they end."""

from __future__ import annotations

from typing import Any

from opentelemetry.trace import Link, SpanKind

from batcher.observe.attributes import STREAM_FINE, batch_attributes, stream_attributes
from batcher.observe.spans import RequestTrace, Tracer, parent_of, span_context, traceparent_of

#: Open batch spans kept at most (a worker that never answers cannot grow the table).
MAX_OPEN_BATCHES = 100_000


class BrokerSpans:
    """The broker's spans, made from its loop's times (`now`, `arrived_at`)."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self._open: dict[int, Any] = {}  # batch id -> its open span
        #: Whether a request without context may be traced (ratio > 0): at ratio 0 only a
        #: request carrying a traceparent costs the broker anything.
        self.samples_roots = tracer.ratio > 0.0

    def flush(self) -> None:
        """Nothing to hand over: the SDK's processor queues each span as it ends."""

    def shutdown(self) -> None:
        """Export the spans still queued (within the export timeout) and stop exporting."""
        self.tracer.shutdown()

    def admit(self, traceparent: object, tracestate: object) -> RequestTrace | None:
        """A request's trace if it is sampled (None: it costs nothing more)."""
        _, parent, state = parent_of(traceparent, tracestate)
        if not self.tracer.sample(parent):
            return None
        return RequestTrace(None if parent is None else span_context(parent, state))

    def queue_ended(
        self, req: Any, model: str, outcome: str, now: float, code: str | None = None, batch: Any = None
    ) -> None:
        """A traced request left its queue (`outcome`: batched, expired, cancelled,
        refused, unavailable, ...): its queue span, from arrival to now, linked to the
        `batch` span it left for when that is not its own child (so a request's trace
        leads to its batch whichever request's trace the batch is in)."""
        rt: RequestTrace = req.trace
        if rt.queue is not None:
            return
        attributes: dict[str, Any] = {
            "batcher.model": model,
            "batcher.priority": float(req.priority),
            "batcher.outcome": outcome,
            "batcher.attempt": int(req.attempts) + 1,
        }
        if req.id is not None:
            attributes["batcher.request_id"] = str(req.id)
        if req.deadline_at is not None:
            attributes["batcher.deadline_ms"] = round((req.deadline_at - req.arrived_at) * 1000.0, 3)
        if code is not None:
            attributes["batcher.error_code"] = code
        links = () if batch is None else (Link(batch, {"batcher.link": "batch"}),)
        rt.queue = self.tracer.record(
            "batcher.queue", rt.parent, req.arrived_at, now, attributes, links, SpanKind.SERVER, code
        )

    def refused(self, rt: RequestTrace, req_id: object, model: str | None, code: str, now: float) -> None:
        """A traced request refused at the door: a queue span of no length, with its code."""
        attributes = {"batcher.model": model or "", "batcher.outcome": "refused"}
        if req_id is not None:
            attributes["batcher.request_id"] = str(req_id)
        attributes["batcher.error_code"] = code  # (a queue span's order: id, then code)
        self.tracer.record("batcher.queue", rt.parent, now, now, attributes, kind=SpanKind.SERVER, error=code)

    def batch_started(self, batch: Any, worker: str, cost: float, now: float) -> str | None:
        """The batch's span, begun at dispatch; its traceparent for the BATCH header
        (None when none of its requests is traced)."""
        traced = [r for r in batch.requests if r.trace is not None]
        if not traced:
            return None
        first = traced[0]
        if first.trace.queue is None:
            self.queue_ended(first, batch.model, "batched", now)
        attempt, attributes = batch_attributes(batch, cost, worker, len(traced))
        link = Link(first.trace.queue, {"batcher.request_id": str(first.id)})
        span = self.tracer.start("batcher.batch", first.trace.queue, now, attributes, [link])
        batch_ctx = span.get_span_context()
        for r in traced[1:]:  # each linked both ways: batch -> request, request -> batch
            if r.trace.queue is None:
                self.queue_ended(r, batch.model, "batched", now, batch=batch_ctx)
            span.add_link(r.trace.queue, {"batcher.request_id": str(r.id)})
        if attempt > 1:
            span.add_event("batcher.redispatch", {"batcher.attempt": attempt}, timestamp=self.tracer.ns(now))
        if len(self._open) >= MAX_OPEN_BATCHES:  # the oldest ends now, at the loop's time
            self.tracer.end(self._open.pop(next(iter(self._open))), now)
        self._open[batch.batch_id] = span
        return traceparent_of(batch_ctx)

    def stream_started(self, req: Any, model: str, worker: str, now: float) -> str:
        """A traced request given to a step-level worker's slot: its queue span ends
        (`started`) and its stream span begins, the queue span's child; the stream span's
        traceparent for the START header (the worker's span of the stream is its child)."""
        rt: RequestTrace = req.trace
        self.queue_ended(req, model, "started", now)
        span = self.tracer.start("batcher.stream", rt.queue, now, stream_attributes(req, model, worker))
        rt.stream = (span, now)
        return traceparent_of(span.get_span_context())

    def stream_chunk(self, rt: RequestTrace, now: float) -> None:
        """A traced stream's first chunk reached the broker."""
        if rt.stream is not None:
            span, begun = rt.stream
            span.set_attribute("batcher.first_chunk_ms", round((now - begun) * 1000.0, 3))

    def stream_ended(self, rt: RequestTrace, now: float, outcome: str, chunks: int, why: str | None) -> None:
        """A traced stream was answered (`outcome`: ok, cancelled, client_gone, or an error
        code; worker_lost when its worker was lost, `why`): its span ends."""
        if rt.stream is None:
            return
        span, rt.stream = rt.stream[0], None
        span.set_attribute("batcher.outcome", outcome)
        span.set_attribute("batcher.chunks", chunks)
        if why is not None:
            span.add_event("batcher.worker_lost", {"batcher.reason": why}, timestamp=self.tracer.ns(now))
        self.tracer.end(span, now, None if outcome in STREAM_FINE else why or outcome)

    def batch_answered(
        self, batch_id: int, now: float, infer_ms: float, wait_ms: float | None, padding: Any, errors: Any
    ) -> Any:
        """The worker's REPLY came: the batch span ends, with the worker's figures; its
        context (the batch's exemplar on the latency histograms), None when not traced."""
        span = self._open.pop(batch_id, None)
        if span is None:
            return None
        span.set_attribute("batcher.infer_ms", float(infer_ms))
        if wait_ms is not None:
            span.set_attribute("batcher.worker_wait_ms", float(wait_ms))
        if padding is not None:
            padded, real = padding
            span.set_attribute("batcher.padding_waste", padded / real if real else 0.0)
        failed = errors if isinstance(errors, int) else sum(errors.values())
        self.tracer.end(span, now, f"{failed} requests failed" if failed else None)
        return span.get_span_context()

    def batch_failed(self, batch_id: int, now: float, event: str, why: str) -> None:
        """The batch will not be answered (its worker was lost, hung, or broke the
        protocol): the span ends with `event` (batcher.worker_lost, batcher.hung_batch_killed)."""
        span = self._open.pop(batch_id, None)
        if span is None:
            return
        span.add_event(event, {"batcher.reason": why}, timestamp=self.tracer.ns(now))
        self.tracer.end(span, now, why)
