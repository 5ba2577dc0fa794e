"""Spans from timestamps: each process keeps monotonic times on its hot path and makes
its spans from them here, with the OpenTelemetry SDK (imported at the top: this module
is loaded only when tracing is on). `Tracer` is one process's; `BrokerSpans` is what the
broker's loop records of a request's queue and of each batch, the batch span LINKED to
the queue span of every request it carries (docs/tracing.md)."""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from batcher.observe.clock import wall_offset_ns
from batcher.observe.counters import spans_dropped
from batcher.observe.export import make_provider
from batcher.observe.settings import TraceSettings
from batcher.wire.tracecontext import (
    TraceParent,
    format_traceparent,
    parse_traceparent,
    parse_tracestate,
    should_sample,
)

Attributes = Mapping[str, Any]
#: The W3C trace flag saying a trace id is random (0 where the API predates it).
_RANDOM = getattr(TraceFlags, "RANDOM_TRACE_ID", 0)
_UNSET = Status(StatusCode.UNSET)
#: A child span's flags, by its parent's RANDOM_TRACE_ID bit: sampled, that bit kept.
_CHILD_FLAGS = {bit: TraceFlags(TraceFlags.SAMPLED | bit) for bit in {0, _RANDOM}}
#: Attribute values kept as they are by the SDK's limits (but for a str's length).
_SCALARS = (int, float, bool)
#: The types of an `events` argument that can be seen to be empty without consuming it.
_EMPTY_TYPES = (tuple, list)


def span_context(parent: TraceParent, tracestate: str | None = None) -> SpanContext:
    """A remote parent's SpanContext from its traceparent (and tracestate)."""
    state = TraceState.from_header([tracestate]) if tracestate else None
    return SpanContext(
        int(parent.trace_id, 16), int(parent.span_id, 16), True, TraceFlags(parent.flags & 0xFF), state
    )


def traceparent_of(ctx: SpanContext) -> str:
    """The traceparent that makes `ctx` the parent of the next hop's spans."""
    return format_traceparent(ctx.trace_id, ctx.span_id, int(ctx.trace_flags))


def tracestate_of(ctx: SpanContext) -> str | None:
    """`ctx`'s tracestate as a header, None when it has none."""
    return ctx.trace_state.to_header() or None if ctx.trace_state else None


class Tracer:
    """One process's tracer: its sampling rule (parent-based ratio), the SDK's tracer,
    and monotonic times turned into the epoch nanoseconds spans carry."""

    def __init__(
        self,
        settings: TraceSettings,
        service: str,
        attributes: Attributes | None = None,
        exporter: Any = None,
    ) -> None:
        self.settings = settings
        self.provider, self.processor = make_provider(settings, service, attributes, exporter)
        self.sdk = self.provider.get_tracer("batcher")
        self.ratio = settings.sample_ratio
        self.parent_based = settings.parent_based
        self._offset_ns = wall_offset_ns()
        self._random = random.random
        self._ids = self.provider.id_generator
        random_ids = getattr(self._ids, "is_trace_id_random", lambda: False)()  # (as the SDK's Tracer)
        self._root_flags = TraceFlags(TraceFlags.SAMPLED | (_RANDOM if random_ids else 0))
        self._limits = SpanLimits()  # the OTEL_*_LIMIT variables, as the SDK's spans read them
        self._resource = self.provider.resource
        self._scope = getattr(self.sdk, "instrumentation_scope", None) or InstrumentationScope("batcher")

    def ns(self, monotonic_s: float) -> int:
        """A time.monotonic() reading as epoch nanoseconds."""
        return int(monotonic_s * 1e9) + self._offset_ns

    def sample(self, parent: TraceParent | None) -> bool:
        """Whether a request with this parent (None: none or a malformed one) is traced."""
        ratio = self.ratio
        if parent is None and (ratio <= 0.0 or ratio >= 1.0):
            return ratio >= 1.0  # no random draw at the extremes
        return should_sample(parent, ratio, self._random(), self.parent_based)

    def start(
        self,
        name: str,
        parent: SpanContext | None,
        start_s: float,
        attributes: Attributes | None = None,
        links: Sequence[Link] = (),
        kind: SpanKind = SpanKind.INTERNAL,
    ) -> Any:
        """An open span begun at `start_s` (monotonic), child of `parent` (None: a root)."""
        context = trace.set_span_in_context(NonRecordingSpan(parent)) if parent is not None else None
        return self.sdk.start_span(
            name, context=context, kind=kind, attributes=attributes, links=links, start_time=self.ns(start_s)
        )

    def end(self, span: Any, end_s: float, error: str | None = None) -> None:
        """End `span` at `end_s` (monotonic), with an error status when `error` says one."""
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=self.ns(end_s))

    def record(
        self,
        name: str,
        parent: SpanContext | None,
        start_s: float,
        end_s: float,
        attributes: Attributes | None = None,
        links: Sequence[Link] = (),
        kind: SpanKind = SpanKind.INTERNAL,
        error: str | None = None,
        events: Iterable[tuple[str, float, Attributes]] = (),
    ) -> SpanContext:
        """A span made after the fact from its two times; its context (for children and
        links). Made as the SDK's finished span at once (a ReadableSpan under the SDK's
        limits, as its Span would end), not started and ended: a fifth of the cost (the
        workers make three a batch); handed to this process's export queue."""
        limits, ns = self._limits, self.ns
        ids = self._ids
        if parent is None:
            ctx = SpanContext(ids.generate_trace_id(), ids.generate_span_id(), False, self._root_flags, None)
        else:
            flags = _CHILD_FLAGS[parent.trace_flags & _RANDOM]
            ctx = SpanContext(parent.trace_id, ids.generate_span_id(), False, flags, parent.trace_state)
        span_attributes: Any
        span_events: Any
        span_links: Any
        if not links and type(events) in _EMPTY_TYPES and not events and self._as_they_are(attributes):
            # What the SDK's bounded collections would hold, without them (a third of the cost)
            span_attributes, span_events, span_links = (dict(attributes) if attributes else None), (), ()
        else:
            length = limits.max_attribute_length

            def bounded(most: int | None, attrs: Attributes | None, longest: int | None = length) -> Any:
                return BoundedAttributes(most, attrs, immutable=True, max_value_len=longest)

            most, longest = limits.max_span_attributes, limits.max_span_attribute_length
            span_attributes = bounded(most, attributes, longest)
            span_events = BoundedList.from_seq(
                limits.max_events,
                [Event(e, bounded(limits.max_event_attributes, a), ns(at_s)) for e, at_s, a in events],
            )
            span_links = BoundedList.from_seq(
                limits.max_links,
                [Link(x.context, bounded(limits.max_link_attributes, x.attributes)) for x in links],
            )
        span = ReadableSpan(
            name,
            context=ctx,
            parent=parent,
            resource=self._resource,
            attributes=span_attributes,
            events=span_events,
            links=span_links,
            kind=kind,
            status=Status(StatusCode.ERROR, error) if error is not None else _UNSET,
            start_time=ns(start_s),
            end_time=ns(end_s),
            instrumentation_scope=self._scope,
        )
        self.processor.on_end(span)
        return ctx

    def _as_they_are(self, attributes: Attributes | None) -> bool:
        """Whether the SDK's limits (SpanLimits: the OTEL_*_LIMIT variables) keep a span's
        `attributes` as they are: few enough, str keys, each value a str no longer than
        the limit, an int, a float or a bool (anything else is left to BoundedAttributes)."""
        if not attributes:
            return True
        limits = self._limits
        most, longest = limits.max_span_attributes, limits.max_span_attribute_length
        if most is not None and len(attributes) > most:
            return False
        for key, value in attributes.items():
            if type(key) is not str or not key:
                return False
            t = type(value)
            if t is str:
                if longest is not None and len(value) > longest:
                    return False
            elif t not in _SCALARS:
                return False
        return True

    def dropped(self) -> int:
        """Spans this process dropped (queue full, or a failed export)."""
        return spans_dropped()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Export what is queued now (tests, a process's exit)."""
        return self.processor.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Export what is left and stop the export thread."""
        self.provider.shutdown()


class RequestTrace:
    """A traced request's context at the broker: its caller's span (None: a new trace),
    then its queue span once that ended (the batch spans link to it)."""

    __slots__ = ("parent", "queue", "stream")

    def __init__(self, parent: SpanContext | None) -> None:
        self.parent = parent
        self.queue: SpanContext | None = None
        self.stream: Any = None  # a stream's open delivery span (broker_spans.BrokerSpans)


def parent_of(traceparent: object, tracestate: object) -> tuple[bool, TraceParent | None, str | None]:
    """(valid, parent, tracestate) of a request's context fields: bad ones read as none."""
    parent = parse_traceparent(traceparent)
    return parent is not None, parent, parse_tracestate(tracestate) if parent is not None else None
