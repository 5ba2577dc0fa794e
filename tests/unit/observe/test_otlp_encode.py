"""The SDK's spans (a worker's, the gateway's, a model's own) encoded in place
(batcher.observe.otlp_encode.SpanEncoder) against the SDK's own encoder: the same
request, field for field, whatever the spans carry (remote parents and links, events,
errors, every attribute type, limits that drop, several scopes and resources)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from batcher.observe.export import make_exporter
from batcher.observe.otlp_encode import Encoded, FastSpanExporter, SpanEncoder
from batcher.observe.settings import TraceSettings
from tests.otlp_collector import Collector


class Keep(SpanProcessor):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.spans.append(span)


def provider(keep: Keep, service: str, limits: SpanLimits | None = None) -> TracerProvider:
    p = TracerProvider(resource=Resource.create({"service.name": service, "k": [1, 2]}), span_limits=limits)
    p.add_span_processor(keep)
    return p


def remote(trace_id: int, span_id: int, state: str | None = None) -> SpanContext:
    ts = TraceState.from_header([state]) if state else None
    return SpanContext(trace_id, span_id, True, TraceFlags(1), ts)


def spans_of_every_kind() -> list[ReadableSpan]:
    keep = Keep()
    a = provider(keep, "batcher-worker")
    b = provider(keep, "batcher-gateway", SpanLimits(max_span_attributes=2, max_links=1, max_events=1))
    t1 = a.get_tracer("batcher")
    t2 = a.get_tracer("a-model", "1.2", schema_url="https://opentelemetry.io/schemas/1.21.0",
                      attributes={"lib": "x"})  # fmt: skip
    t3 = b.get_tracer("batcher")
    parent = trace.set_span_in_context(NonRecordingSpan(remote(0xABC, 0xDEF, "v=1,w=2")))
    with t1.start_as_current_span("batcher.worker.model", context=parent, kind=SpanKind.SERVER) as s:
        s.set_attributes({"s": "x", "i": 3, "f": 0.5, "b": False, "seq": ["a", "b"], "e": ()})
        s.add_event("ev", {"n": 1}, timestamp=123)
        s.add_link(remote(0x1, 0x2), {"batcher.request_id": "7"})
        s.set_status(Status(StatusCode.ERROR, "boom"))
        with t2.start_as_current_span("model.inner", links=[Link(s.get_span_context())]) as inner:
            inner.set_status(Status(StatusCode.OK))
    with t3.start_as_current_span("POST /v2/models/{model}/infer", kind=SpanKind.CLIENT) as g:
        g.set_attributes({"a": 1, "b": 2, "c": 3})  # one dropped
        g.add_event("one")
        g.add_event("two")  # dropped
        g.add_link(remote(0x5, 0x6))
        g.add_link(remote(0x7, 0x8))  # dropped
    t1.start_span("producer", kind=SpanKind.PRODUCER).end()
    t2.start_span("consumer", kind=SpanKind.CONSUMER).end()
    return keep.spans


def test_the_sdks_spans_encode_as_its_encoder_encodes_them() -> None:
    spans = spans_of_every_kind()
    mine = SpanEncoder().encode(spans)
    assert mine == encode_spans(spans)
    assert len(mine.resource_spans) == 2 and len(mine.resource_spans[0].scope_spans) == 2
    again = SpanEncoder()
    for i in range(len(spans)):  # every order and subset groups as the SDK groups it
        subset = spans[i:] + spans[:i]
        assert again.encode(subset) == encode_spans(subset)


def test_equal_resources_of_distinct_objects_are_one_group_as_in_the_sdk() -> None:
    spans = spans_of_every_kind()
    first = spans[0]
    twin = ReadableSpan(
        "twin", context=first.context, resource=Resource(dict(first.resource.attributes)),
        instrumentation_scope=first.instrumentation_scope,
    )  # fmt: skip
    batch = [*spans, twin]
    assert SpanEncoder().encode(batch) == encode_spans(batch)


def test_an_attribute_that_cannot_be_encoded_is_left_out_as_the_sdk_leaves_it() -> None:
    span = spans_of_every_kind()[0]
    odd = ReadableSpan(
        "odd", context=span.context, resource=span.resource, attributes={"ok": 1, "bad": object()}
    )
    assert SpanEncoder().encode([odd]) == encode_spans([odd])


def test_the_fast_exporter_posts_what_the_sdk_exporter_posts() -> None:
    c = Collector()
    try:
        settings = TraceSettings(endpoint=c.endpoint, export_timeout_ms=2000.0)
        spans = spans_of_every_kind()
        fast = FastSpanExporter(make_exporter(settings))
        assert fast.direct
        assert fast.export(spans) is SpanExportResult.SUCCESS
        got_fast = c.wait_for(lambda s: len(s) == len(spans))
        sdk = make_exporter(settings)
        assert sdk.export(spans) is SpanExportResult.SUCCESS
        got = c.wait_for(lambda s: len(s) == 2 * len(spans))
        assert got_fast == got[len(spans) :]
        fast.shutdown()
        sdk.shutdown()
    finally:
        c.close()


def test_an_encoded_request_never_reaches_an_encoder_unnoticed() -> None:
    encoded: Any = Encoded(SpanEncoder().encode([]), 3)
    assert len(encoded) == 3
    with pytest.raises(TypeError):
        encode_spans(encoded)


def test_an_exporter_that_does_not_call_its_modules_encoder_is_not_bypassed() -> None:
    class Own(SpanExporter):  # encodes its own way: handing it an Encoded would lose spans
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    own = FastSpanExporter(Own())
    assert not own.direct
    assert own.export(spans_of_every_kind()) is SpanExportResult.SUCCESS
