"""OTLP's protobuf messages filled in place, faster than the SDK's encoder builds them,
and handed to the SDK's own OTLP exporters already encoded.

The SDK's encoder (opentelemetry-exporter-otlp-proto-common) builds each message from
lists given to its constructor, which copies them: about 80 us a span on the 2-core VM.
Here the generated classes of opentelemetry-proto are filled in place (`add()` and field
assignment), the same messages field for field (tests/unit/observe), about a quarter of
the cost. `encode_sdk_spans` does it for the SDK's spans (the workers', the gateway's:
`FastSpanExporter`); batcher.observe.otlp_records for the broker's span records.

The requests leave through the SDK's own OTLP exporter (HTTP or gRPC), so its endpoint,
headers, timeout, compression, TLS files, retries and every OTEL_EXPORTER_OTLP_*
variable hold as they do for SDK spans: its `export` is handed an `Encoded` request,
which its module's `encode_spans`, wrapped once (`hook_encoder`), passes through. Where
that module has no `encode_spans` to wrap, the SDK encodes, as before.

Imported only when tracing is on: this module imports opentelemetry at its top."""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as ResourcePb
from opentelemetry.proto.trace.v1.trace_pb2 import SpanFlags
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = logging.getLogger("batcher.tracing")

#: The flags the SDK's encoder gives a span or a link: whether its parent's (its) context
#: is remote is known, and whether it is.
LOCAL = SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
REMOTE = LOCAL | SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK
#: Encoded resources kept (a process has one; the cache is a bound, not a need).
_MAX_RESOURCES = 16


def set_value(value: AnyValue, v: Any) -> None:
    """`v` into `value` as the SDK's encoder types it (bool before int: a bool is an int)."""
    t = type(v)
    if t is str:
        value.string_value = v
    elif t is float:
        value.double_value = v
    elif t is int:
        value.int_value = v
    elif isinstance(v, bool):
        value.bool_value = v
    elif isinstance(v, str):
        value.string_value = v
    elif isinstance(v, int):
        value.int_value = v
    elif isinstance(v, float):
        value.double_value = v
    elif isinstance(v, bytes):
        value.bytes_value = v
    elif v is None:
        value.SetInParent()  # present, empty: as the SDK's encoder leaves it
    elif isinstance(v, Sequence):
        value.array_value.SetInParent()
        values = value.array_value.values
        for item in v:
            set_value(values.add(), item)
    elif isinstance(v, Mapping):
        value.kvlist_value.SetInParent()
        kvs = value.kvlist_value.values
        for key, item in v.items():
            kv = kvs.add()
            kv.key = str(key)
            set_value(kv.value, item)
    else:
        raise TypeError(f"invalid type {type(v)} of value {v!r}")


def set_attributes(kvs: Any, attributes: Mapping[str, Any] | None) -> None:
    """`attributes` appended to the repeated KeyValue field `kvs`; one whose value cannot
    be encoded is left out, logged (as the SDK's encoder does)."""
    if not attributes:
        return
    for key, v in attributes.items():
        kv = kvs.add()
        try:
            kv.key = key
            set_value(kv.value, v)
        except Exception as exc:
            log.debug("attribute %s not encoded: %s", key, exc)
            del kvs[len(kvs) - 1 :]


class Encoded:
    """A request already encoded, handed to the SDK exporter's `export` in place of its
    spans: its length is the spans' count (the exporter's own metrics); iterating it is
    an error, so an exporter whose encoder was not bypassed fails (counted) rather than
    export nothing."""

    __slots__ = ("count", "request")

    def __init__(self, request: ExportTraceServiceRequest, count: int) -> None:
        self.request = request
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Any]:
        raise TypeError("an Encoded request reached an encoder that was not bypassed")


def calls_module_encoder(cls: type) -> bool:
    """Whether the exporter class `cls` encodes by calling its module's `encode_spans` (as
    the SDK's OTLP exporters have since 1.2x); False where its source cannot tell."""
    try:
        return "encode_spans(" in inspect.getsource(cls)
    except (OSError, TypeError):
        return False


def hook_encoder(exporter: SpanExporter) -> bool:
    """Make `exporter`'s module pass an `Encoded` request through its `encode_spans`
    (every other argument still encoded by the SDK); False when it has none to wrap, or
    its class does not call it (then the SDK encodes, as before)."""
    module = sys.modules.get(type(exporter).__module__)
    original = getattr(module, "encode_spans", None)
    if module is None or not callable(original) or not calls_module_encoder(type(exporter)):
        return False
    if getattr(original, "batcher_passes_encoded", False):
        return True

    def encode_spans(spans: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(spans, Encoded):
            return spans.request
        return original(spans, *args, **kwargs)

    encode_spans.batcher_passes_encoded = True  # type: ignore[attr-defined]
    setattr(module, "encode_spans", encode_spans)  # noqa: B010 (a module's global, replaced)
    return True


def encode_resource(resource: Resource) -> ResourcePb:
    """A resource's message (its attributes)."""
    out = ResourcePb()
    set_attributes(out.attributes, resource.attributes)
    return out


class SpanEncoder:
    """The SDK's spans to one ExportTraceServiceRequest, as its encoder groups them: by
    resource, then by instrumentation scope, each in the order first seen."""

    def __init__(self) -> None:
        self._resources: dict[int, tuple[Resource, ResourcePb]] = {}

    def encode(self, spans: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
        """The request of `spans`."""
        groups: dict[tuple[int, int], list[ReadableSpan]] = {}
        for span in spans:  # grouped by identity first: equal resources hash slowly
            key = (id(span.resource), id(span.instrumentation_scope))
            group = groups.get(key)
            if group is None:
                groups[key] = group = []
            group.append(span)
        tree: list[tuple[Resource, list[tuple[Any, list[ReadableSpan]]]]] = []
        for group in groups.values():
            resource, scope = group[0].resource, group[0].instrumentation_scope or None
            scopes = next((s for r, s in tree if r is resource or r == resource), None)
            if scopes is None:
                scopes = []
                tree.append((resource, scopes))
            members = next((m for sc, m in scopes if sc is scope or sc == scope), None)
            if members is None:
                scopes.append((scope, group))
            else:
                members.extend(group)
        request = ExportTraceServiceRequest()
        for resource, scopes in tree:
            rs = request.resource_spans.add()
            rs.resource.CopyFrom(self._resource(resource))
            if resource.schema_url:
                rs.schema_url = resource.schema_url
            for scope, members in scopes:
                ss = rs.scope_spans.add()
                ss.scope.SetInParent()
                if scope is not None:
                    ss.scope.name = scope.name
                    if scope.version is not None:
                        ss.scope.version = scope.version
                    set_attributes(ss.scope.attributes, scope.attributes)
                    if scope.schema_url:
                        ss.schema_url = scope.schema_url
                add = ss.spans.add
                for span in members:
                    encode_sdk_span(add(), span)
        return request

    def _resource(self, resource: Resource) -> ResourcePb:
        held = self._resources.get(id(resource))
        if held is not None and held[0] is resource:
            return held[1]
        encoded = encode_resource(resource)
        if len(self._resources) >= _MAX_RESOURCES:
            self._resources.clear()
        self._resources[id(resource)] = (resource, encoded)
        return encoded


def encode_sdk_span(sp: Any, span: ReadableSpan) -> None:
    """One SDK span into the Span message `sp`, as the SDK's encoder writes it."""
    ctx = span.context
    sp.trace_id = ctx.trace_id.to_bytes(16, "big")
    sp.span_id = ctx.span_id.to_bytes(8, "big")
    if ctx.trace_state is not None:
        sp.trace_state = ",".join(f"{k}={v}" for k, v in ctx.trace_state.items())
    parent = span.parent
    if parent:
        sp.parent_span_id = parent.span_id.to_bytes(8, "big")
    sp.name = span.name
    sp.kind = span.kind.value + 1  # SpanKind INTERNAL (0) .. CONSUMER (4): OTLP's 1 .. 5
    if span.start_time is not None:
        sp.start_time_unix_nano = span.start_time
    if span.end_time is not None:
        sp.end_time_unix_nano = span.end_time
    set_attributes(sp.attributes, span.attributes)
    for event in span.events:
        ev = sp.events.add()
        ev.name = event.name
        ev.time_unix_nano = event.timestamp
        set_attributes(ev.attributes, event.attributes)
        ev.dropped_attributes_count = event.dropped_attributes
    for link in span.links:
        ln = sp.links.add()
        lctx = link.context
        ln.trace_id = lctx.trace_id.to_bytes(16, "big")
        ln.span_id = lctx.span_id.to_bytes(8, "big")
        set_attributes(ln.attributes, link.attributes)
        ln.dropped_attributes_count = link.dropped_attributes
        ln.flags = REMOTE if lctx.is_remote else LOCAL
    status = span.status
    if status is not None:
        sp.status.SetInParent()
        sp.status.code = status.status_code.value
        if status.description is not None:
            sp.status.message = status.description
    sp.dropped_attributes_count = span.dropped_attributes
    sp.dropped_events_count = span.dropped_events
    sp.dropped_links_count = span.dropped_links
    sp.flags = REMOTE if parent and parent.is_remote else LOCAL


class FastSpanExporter(SpanExporter):
    """The SDK's spans encoded here (`SpanEncoder`) and posted by `exporter`, the SDK's
    OTLP exporter (batcher.observe.export.make_exporter); encoded by the SDK instead when
    that exporter's encoder cannot be bypassed."""

    def __init__(self, exporter: SpanExporter) -> None:
        self._exporter = exporter
        self._encoder = SpanEncoder()
        self.direct = hook_encoder(exporter)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Export a batch of spans (SUCCESS only if the collector took them)."""
        if not self.direct:
            return self._exporter.export(spans)
        result: SpanExportResult = self._exporter.export(
            Encoded(self._encoder.encode(spans), len(spans))  # type: ignore[arg-type]
        )
        return result

    def shutdown(self) -> None:
        """Shut the OTLP exporter down."""
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Nothing is buffered here."""
        return True
