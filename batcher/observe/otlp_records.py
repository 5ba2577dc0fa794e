"""The broker's span records (batcher.observe.relay) straight to OTLP's protobuf messages,
in its exporter process: the generated classes of opentelemetry-proto
(ExportTraceServiceRequest, ResourceSpans, ScopeSpans, Span) filled in place
(batcher.observe.otlp_encode), the same messages the SDK's encoder makes from its span
objects but without those objects: about 10 us a span where records -> SDK spans -> the
SDK's encoder took about 85 (docs/benchmarks.md, "Tracing"). They leave through the SDK's
own OTLP exporter (otlp_encode.hook_encoder); where its encoder cannot be bypassed,
records are built into SDK spans (`build`) and encoded by the SDK, as before.

Records, as relay.RelaySpans makes them (msgpack turns tuples into lists):
  a span:  (name, kind, trace_id: 16 bytes, span_id, parent_id or 0, start_ns, end_ns,
            attributes, [(trace_id, span_id, attributes) links], [(name, ns, attributes)
            events], error or None, tracestate or None)
  a queue span (QUEUE, its first item): (QUEUE, trace_id, span_id, parent_id, start_ns,
            end_ns, model, priority, outcome, attempt, request_id, deadline_ms, error code,
            link trace_id or None, link span_id, tracestate): its attributes and its link
            to its batch are made here, in BrokerSpans's order
  a batch span (BATCH): (BATCH, trace_id, span_id, parent_id, start_ns, end_ns,
            attributes, [(trace_id, span_id, request_id) links], events, error, tracestate)

The SDK's span limits (SpanLimits: OTEL_SPAN_LINK_COUNT_LIMIT, 128 links by default, and
the event, attribute and value-length limits) hold here as the SDK's spans apply them: a
batch of 200 traced requests exports its last 128 links and `dropped_links_count` 72.
A record within the limits (nearly all) takes the fast path; one past them, or any record
when a value-length limit is set, is built as the SDK's bounded span (`build`) and encoded
from it (otlp_encode.encode_sdk_span): the same message either way, field for field.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace import Status as SdkStatus
from opentelemetry.trace import StatusCode as SdkStatusCode
from opentelemetry.trace.span import TraceState

from batcher.observe.counters import count_dropped
from batcher.observe.otlp_encode import (
    LOCAL,
    REMOTE,
    Encoded,
    encode_resource,
    encode_sdk_span,
    hook_encoder,
    set_attributes,
    set_value,
)
from batcher.observe.relay import BATCH, QUEUE

log = logging.getLogger("batcher.tracing")

#: The instrumentation scope of the broker's spans.
SCOPE = "batcher"
#: SpanKind values (opentelemetry.trace.SpanKind) as records carry them, as OTLP's.
_KINDS = {0: Span.SPAN_KIND_INTERNAL, 1: Span.SPAN_KIND_SERVER, 2: Span.SPAN_KIND_CLIENT}
_SDK_KINDS = {0: SpanKind.INTERNAL, 1: SpanKind.SERVER, 2: SpanKind.CLIENT}
_SAMPLED = TraceFlags(1)
_ERROR = Status.STATUS_CODE_ERROR
#: Tracestate headers as the SDK writes them back, kept at most this many.
_MAX_STATES = 1024
#: Queue span templates kept at most (one per model, priority, outcome, attempt, ...).
_MAX_TEMPLATES = 1024


def queue_head(model: str, priority: Any, outcome: str, attempt: Any) -> dict[str, Any]:
    """A queue span's first attributes, in BrokerSpans's order; a request refused at the
    door has no priority or attempt (None: left out)."""
    head: dict[str, Any] = {"batcher.model": model}
    if priority is not None:
        head["batcher.priority"] = priority
    head["batcher.outcome"] = outcome
    if attempt is not None:
        head["batcher.attempt"] = attempt
    return head


def expand(record: Sequence[Any]) -> tuple[Any, ...]:
    """Any record as a span record (name, kind, ..., tracestate): the queue span's and the
    batch span's attributes and links spelled out as the SDK path takes them."""
    tag = record[0]
    if tag == QUEUE:
        (_, trace_id, span_id, parent_id, start_ns, end_ns, model, priority, outcome, attempt,
         request_id, deadline_ms, code, link_trace, link_span, state) = record  # fmt: skip
        attributes = queue_head(model, priority, outcome, attempt)
        if request_id is not None:
            attributes["batcher.request_id"] = request_id
        if deadline_ms is not None:
            attributes["batcher.deadline_ms"] = deadline_ms
        if code is not None:
            attributes["batcher.error_code"] = code
        links = [] if link_trace is None else [(link_trace, link_span, {"batcher.link": "batch"})]
        return ("batcher.queue", 1, trace_id, span_id, parent_id, start_ns, end_ns, attributes, links,
                [], code, state)  # fmt: skip
    if tag == BATCH:
        _, trace_id, span_id, parent_id, start_ns, end_ns, attributes, links, events, error, state = record
        links = [(t, s, {"batcher.request_id": rid}) for t, s, rid in links]
        return ("batcher.batch", 0, trace_id, span_id, parent_id, start_ns, end_ns, attributes, links,
                events, error, state)  # fmt: skip
    return tuple(record)


def build(record: Sequence[Any], resource: Resource, limits: SpanLimits | None = None) -> ReadableSpan:
    """One record as the SDK's finished span under the SDK's `limits` (default: the
    OTEL_*_LIMIT variables), bounded as the SDK's own Span bounds itself (its containers:
    the newest links, events and attributes kept, the rest counted as dropped): the SDK
    path (`RecordExporter` where the exporter's encoder cannot be bypassed), the path of a
    record past the limits, and the reference the tests compare with."""
    name, kind, trace_id, span_id, parent_id, start_ns, end_ns, attributes, links, events, error, state = (
        expand(record)
    )
    lim = limits or SpanLimits()
    length = lim.max_attribute_length

    def bounded(most: int | None, attrs: Any, longest: int | None = length) -> BoundedAttributes:
        return BoundedAttributes(most, attrs, immutable=True, max_value_len=longest)

    span_events = [Event(n, bounded(lim.max_event_attributes, a), timestamp=t) for n, t, a in events]
    span_links = [
        Link(SpanContext(int.from_bytes(t, "big"), s, False, _SAMPLED), bounded(lim.max_link_attributes, a))
        for t, s, a in links
    ]
    trace_id = int.from_bytes(trace_id, "big")
    trace_state = TraceState.from_header([state]) if state else None
    ctx = SpanContext(trace_id, span_id, False, _SAMPLED, trace_state)
    # A queue span's parent is its caller's span, from another process (the request's
    # traceparent): remote, as the SDK's span made in the broker says (OTLP's span flags).
    remote = record[0] == QUEUE
    parent = SpanContext(trace_id, parent_id, remote, _SAMPLED, trace_state) if parent_id else None
    return ReadableSpan(
        name,
        context=ctx,
        parent=parent,
        resource=resource,
        attributes=bounded(lim.max_span_attributes, attributes, lim.max_span_attribute_length),
        events=BoundedList.from_seq(lim.max_events, span_events),
        links=BoundedList.from_seq(lim.max_links, span_links),
        kind=_SDK_KINDS.get(kind, SpanKind.INTERNAL),
        status=SdkStatus(SdkStatusCode.ERROR, error) if error else SdkStatus(SdkStatusCode.UNSET),
        start_time=start_ns,
        end_time=end_ns,
        instrumentation_scope=InstrumentationScope(SCOPE),
    )


def _within(most: int | None, count: int) -> bool:
    """Whether `count` items fit a limit (None: no limit)."""
    return most is None or count <= most


class Encoder:
    """Records to one ExportTraceServiceRequest of the process's resource and scope, under
    the SDK's span `limits` (default: the OTEL_*_LIMIT variables)."""

    def __init__(self, resource: Resource, limits: SpanLimits | None = None) -> None:
        self._sdk_resource = resource
        lim = self._limits = limits or SpanLimits()
        #: Every record built as the SDK's span first: a value-length limit truncates values.
        self._exact = lim.max_attribute_length is not None or lim.max_span_attribute_length is not None
        #: Whether a queue span (at most 7 attributes, a link of 1) always fits the limits.
        self._queue_fits = (
            _within(lim.max_span_attributes, 7)
            and _within(lim.max_links, 1)
            and _within(lim.max_link_attributes, 1)
        )
        self._resource = encode_resource(resource)
        self._schema_url = resource.schema_url or ""
        self._states: dict[str, str] = {}
        self._templates: dict[tuple[Any, ...], bytes] = {}

    def encode(self, records: Sequence[Sequence[Any]]) -> tuple[ExportTraceServiceRequest, int]:
        """(the request, how many records it holds); a record that cannot be encoded is
        left out (logged), as one bad record was never worth the others."""
        request = ExportTraceServiceRequest()
        rs = request.resource_spans.add()
        rs.resource.CopyFrom(self._resource)
        if self._schema_url:
            rs.schema_url = self._schema_url
        ss = rs.scope_spans.add()
        ss.scope.name = SCOPE
        spans = ss.spans
        for record in records:
            try:
                tag = record[0]
                if not self._fits(record):
                    encode_sdk_span(spans.add(), build(record, self._sdk_resource, self._limits))
                elif tag == QUEUE:
                    self._queue_span(spans.add(), record)
                elif tag == BATCH:
                    self._batch_span(spans.add(), record)
                else:
                    self._span(spans.add(), record)
            except Exception as exc:  # a bug's record: the others still go
                log.debug("span record not encoded: %s", exc)
                del spans[len(spans) - 1 :]
        return request, len(spans)

    def _fits(self, record: Sequence[Any]) -> bool:
        """Whether a record is within the span limits (then the fast path encodes it as the
        SDK's bounded span would be: nothing to drop)."""
        if self._exact:
            return False
        tag = record[0]
        if tag == QUEUE:
            return self._queue_fits
        lim = self._limits
        if tag == BATCH:
            attributes, links, events = record[6], record[7], record[8]
            link_attributes = 1 if links else 0
        else:
            attributes, links, events = record[7], record[8], record[9]
            link_attributes = max((len(a) for _, _, a in links), default=0)
        return (
            _within(lim.max_links, len(links))
            and _within(lim.max_events, len(events))
            and _within(lim.max_span_attributes, len(attributes))
            and _within(lim.max_link_attributes, link_attributes)
            and _within(lim.max_event_attributes, max((len(a) for _, _, a in events), default=0))
        )

    def _state(self, state: str) -> str:
        """A tracestate as the SDK's encoder writes it (what TraceState keeps of it)."""
        out = self._states.get(state)
        if out is None:
            out = ",".join(f"{k}={v}" for k, v in TraceState.from_header([state]).items())
            if len(self._states) < _MAX_STATES:
                self._states[state] = out
        return out

    def _head(self, sp: Any, trace_id: bytes, span_id: int, parent_id: int, state: Any) -> None:
        """A span's ids and trace state (its flags are the caller's: LOCAL, or a template's)."""
        sp.trace_id = trace_id
        sp.span_id = span_id.to_bytes(8, "big")
        if state:
            sp.trace_state = self._state(state)
        if parent_id:
            sp.parent_span_id = parent_id.to_bytes(8, "big")

    def _queue_template(self, key: tuple[Any, ...]) -> bytes:
        """A queue span's fields that many share (name, kind, flags, the first attributes,
        placeholders of the others, its link's attributes, its status), made once and kept
        serialized: upb parses them into a new span in 1.7 us, where MergeFrom of the
        message copied them in 2.7."""
        model, priority, _, outcome, attempt, _, has_id, has_deadline, code, has_link, has_parent = key
        # its parent, the caller's span, is remote (another process's): flags say so, as the SDK's do
        t = Span(name="batcher.queue", kind=Span.SPAN_KIND_SERVER, flags=REMOTE if has_parent else LOCAL)
        attributes = queue_head(model, priority, outcome, attempt)
        if has_id:
            attributes["batcher.request_id"] = ""  # (each span's own, set over it)
        if has_deadline:
            attributes["batcher.deadline_ms"] = 0.0
        if code is not None:
            attributes["batcher.error_code"] = code
        set_attributes(t.attributes, attributes)
        if has_link:
            ln = t.links.add()
            ln.flags = LOCAL
            set_attributes(ln.attributes, {"batcher.link": "batch"})
        self._status(t, code)
        if len(self._templates) >= _MAX_TEMPLATES:
            self._templates.clear()
        serialized: bytes = t.SerializeToString()
        self._templates[key] = serialized
        return serialized

    def _queue_span(self, sp: Any, record: Sequence[Any]) -> None:
        """A queue span: its template merged in, then what is its own (ids, times, request
        id, deadline, link target)."""
        (_, trace_id, span_id, parent_id, start_ns, end_ns, model, priority, outcome, attempt,
         request_id, deadline_ms, code, link_trace, link_span, state) = record  # fmt: skip
        key = (model, priority, type(priority), outcome, attempt, type(attempt), request_id is not None,
               deadline_ms is not None, code, link_trace is not None, parent_id != 0)  # fmt: skip
        sp.MergeFromString(self._templates.get(key) or self._queue_template(key))
        self._head(sp, trace_id, span_id, parent_id, state)
        sp.start_time_unix_nano = start_ns
        sp.end_time_unix_nano = end_ns
        own = 2 + (priority is not None) + (attempt is not None)  # where its own attributes begin
        if request_id is not None:
            sp.attributes[own].value.string_value = request_id
            own += 1
        if deadline_ms is not None:
            set_value(sp.attributes[own].value, deadline_ms)
        if link_trace is not None:
            ln = sp.links[0]
            ln.trace_id = link_trace
            ln.span_id = link_span.to_bytes(8, "big")

    def _batch_span(self, sp: Any, record: Sequence[Any]) -> None:
        _, trace_id, span_id, parent_id, start_ns, end_ns, attributes, links, events, error, state = record
        self._head(sp, trace_id, span_id, parent_id, state)
        sp.flags = LOCAL
        sp.name = "batcher.batch"
        sp.kind = Span.SPAN_KIND_INTERNAL
        sp.start_time_unix_nano = start_ns
        sp.end_time_unix_nano = end_ns
        set_attributes(sp.attributes, attributes)
        self._events(sp, events)
        add = sp.links.add
        for t, s, request_id in links:
            ln = add()
            ln.trace_id = t
            ln.span_id = s.to_bytes(8, "big")
            ln.flags = LOCAL
            kv = ln.attributes.add()
            kv.key = "batcher.request_id"
            kv.value.string_value = request_id
        self._status(sp, error)

    def _span(self, sp: Any, record: Sequence[Any]) -> None:
        (name, kind, trace_id, span_id, parent_id, start_ns, end_ns, attributes, links, events, error,
         state) = record  # fmt: skip
        self._head(sp, trace_id, span_id, parent_id, state)
        sp.flags = LOCAL
        sp.name = name
        sp.kind = _KINDS.get(kind, Span.SPAN_KIND_INTERNAL)
        sp.start_time_unix_nano = start_ns
        sp.end_time_unix_nano = end_ns
        set_attributes(sp.attributes, attributes)
        self._events(sp, events)
        for t, s, a in links:
            ln = sp.links.add()
            ln.trace_id = t
            ln.span_id = s.to_bytes(8, "big")
            ln.flags = LOCAL
            set_attributes(ln.attributes, a)
        self._status(sp, error)

    @staticmethod
    def _events(sp: Any, events: Sequence[Any]) -> None:
        for name, ns, attributes in events:
            ev = sp.events.add()
            ev.name = name
            ev.time_unix_nano = ns
            set_attributes(ev.attributes, attributes)

    @staticmethod
    def _status(sp: Any, error: str | None) -> None:
        if error:
            sp.status.code = _ERROR
            sp.status.message = error
        else:
            sp.status.SetInParent()  # UNSET, present: as the SDK's encoder leaves it


class RecordExporter(SpanExporter):
    """An exporter of span records for batcher.observe.export.BoundedExporter: each batch
    encoded here (`Encoder`) and posted by `exporter`, the SDK's OTLP exporter; through
    SDK spans instead when that exporter's encoder cannot be bypassed (or `direct` is False)."""

    def __init__(self, exporter: SpanExporter, resource: Resource, direct: bool = True) -> None:
        self._exporter = exporter
        self._resource = resource
        self._limits = SpanLimits()  # the OTEL_*_LIMIT variables, read once
        self._encoder = Encoder(resource, self._limits)
        self.direct = direct and hook_encoder(exporter)

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        """Export a batch of records (SUCCESS only if the collector took them)."""
        if self.direct:
            request, count = self._encoder.encode(spans)
            if count < len(spans):
                count_dropped(len(spans) - count)
            result: SpanExportResult = self._exporter.export(Encoded(request, count))  # type: ignore[arg-type]
            return result
        built = []
        for record in spans:
            try:
                built.append(build(record, self._resource, self._limits))
            except Exception as exc:  # a bug's record: the others still go
                log.debug("span record not built: %s", exc)
                count_dropped(1)
        return self._exporter.export(built)

    def shutdown(self) -> None:
        """Shut the OTLP exporter down."""
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Nothing is buffered here."""
        return True
