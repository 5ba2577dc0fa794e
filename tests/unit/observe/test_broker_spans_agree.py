"""The broker's two span makers against each other: the exporter-process design
(batcher.observe.relay.RelaySpans: records, encoded by batcher.observe.otlp_records) and
the in-process one it replaced (batcher.observe.broker_spans.BrokerSpans: the SDK's spans,
the SDK's encoder), kept for comparison (BATCHER_TRACE_IN_PROCESS=1). Driven through the
same broker events, they export the same spans: names, kinds, span flags, parents,
attributes, links and their attributes, events, status, trace state and durations; only
the random ids differ, so spans are compared by where they sit in the traces."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.common")

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from batcher.observe.broker_spans import BrokerSpans
from batcher.observe.otlp_records import Encoder
from batcher.observe.settings import trace_settings
from batcher.observe.spans import Tracer
from tests.unit.observe.test_relay import spans as relay_spans

NOW = 1000.0
CALLER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class Kept(SpanExporter):
    """The SDK's finished spans, kept."""

    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS


def request(maker: Any, i: int, traceparent: str | None, tracestate: str | None) -> Any:
    return SimpleNamespace(
        id=[f"r{i}", i, None, 2.5][i % 4],
        priority=[0.0, 3, -1.5][i % 3],
        attempts=i % 2,
        handbacks=0,
        deadline_at=None if i % 4 == 0 else NOW + 0.25 * i,
        arrived_at=NOW - 0.001 * (i + 1),
        trace=maker.admit(traceparent, tracestate),
        cost=1.0,
    )


def scenario(maker: Any) -> None:
    """Broker events of every kind the spans record: batches answered and failed (a
    re-dispatch among them), a refusal at the door, a request expired in its queue, and
    a stream from its start to its end."""
    contexts = [(CALLER, None), (None, None), (CALLER, "vendor=abc,k=v"), (None, None)]
    reqs = [request(maker, i, *contexts[i % 4]) for i in range(6)]
    batch = SimpleNamespace(requests=reqs[:4], model="echo", batch_id=1, multiplexed=False)
    maker.batch_started(batch, "w-1", 4.0, NOW)
    maker.batch_answered(1, NOW + 0.02, 1.5, 0.25, (16, 12), 0)
    again = SimpleNamespace(requests=reqs[4:], model="echo", batch_id=2, multiplexed=False)
    maker.batch_started(again, "w-2", 2.0, NOW + 0.001)
    maker.batch_failed(2, NOW + 0.03, "batcher.worker_lost", "worker lost")
    again.batch_id = 3
    for r in again.requests:
        r.handbacks = 1
    maker.batch_started(again, "w-1", 2.0, NOW + 0.031)
    maker.batch_answered(3, NOW + 0.05, 2.0, None, None, {"model_error": 1})
    maker.refused(maker.admit(CALLER, None), "x", "sim", "overloaded", NOW + 0.002)
    late = request(maker, 9, CALLER, None)
    maker.queue_ended(late, "sim", "deadline_exceeded", NOW + 0.004, "deadline_exceeded")
    streamed = request(maker, 10, None, None)
    maker.stream_started(streamed, "simlm", "w-3", NOW + 0.005)
    maker.stream_chunk(streamed.trace, NOW + 0.007)
    maker.stream_ended(streamed.trace, NOW + 0.009, "worker_lost", 2, "worker gone")


def in_process(events: Callable[[Any], None] = scenario) -> ExportTraceServiceRequest:
    kept = Kept()
    tracer = Tracer(trace_settings("http://127.0.0.1:9", 1.0, {}), "batcher-broker", None, exporter=kept)
    spans = BrokerSpans(tracer)
    events(spans)
    tracer.flush()
    tracer.shutdown()
    request: ExportTraceServiceRequest = encode_spans(kept.spans)
    return request


def relayed(events: Callable[[Any], None] = scenario) -> ExportTraceServiceRequest:
    spans = relay_spans(3)
    events(spans)
    return Encoder(Resource.create({"service.name": "batcher-broker"})).encode(spans._records)[0]


def shape(request: ExportTraceServiceRequest) -> list[tuple[Any, ...]]:
    """Each span as what a collector reads of it, ids replaced by their order of first
    appearance (the caller's own ids kept), sorted (the two designs export in other orders)."""
    spans = [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
    label: dict[bytes, str] = {}

    def named(raw: bytes) -> str:
        if not raw:
            return "-"
        if raw.hex() in CALLER:
            return "caller:" + raw.hex()
        return label.setdefault(raw, f"#{len(label)}")

    def attrs(kvs: Any) -> tuple[Any, ...]:
        return tuple((kv.key, str(kv.value).strip()) for kv in kvs)

    for s in sorted(spans, key=lambda s: (s.start_time_unix_nano, s.name, s.end_time_unix_nano)):
        named(s.trace_id), named(s.span_id)
    out = []
    for s in spans:
        links = tuple((named(x.trace_id), named(x.span_id), x.flags, attrs(x.attributes)) for x in s.links)
        start = s.start_time_unix_nano
        events = tuple((e.name, e.time_unix_nano - start, attrs(e.attributes)) for e in s.events)
        out.append(
            (
                s.name, s.kind, s.flags, named(s.trace_id), named(s.parent_span_id), s.trace_state,
                s.end_time_unix_nano - start, attrs(s.attributes), links, events, s.status.code,
                s.status.message,
            )
        )  # fmt: skip
    return sorted(out, key=repr)


def test_the_exporter_process_design_exports_what_the_sdk_in_the_broker_did() -> None:
    theirs, mine = shape(in_process()), shape(relayed())
    assert len(mine) == len(theirs) == 13  # 6 + 1 + 1 queue spans, 3 batch spans, ..., a stream's
    assert mine == theirs


def test_past_the_open_batch_spans_bound_both_end_the_oldest_and_export_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker that never answers cannot grow the open batch spans past their bound: the
    oldest is ended (and exported) when another begins, in both designs alike."""
    from batcher.observe import broker_spans, relay

    def unanswered(maker: Any) -> None:
        for batch_id in (1, 2, 3):
            reqs = [request(maker, i, CALLER if i % 2 else None, None) for i in range(2)]
            batch = SimpleNamespace(requests=reqs, model="echo", batch_id=batch_id, multiplexed=False)
            maker.batch_started(batch, "w-1", 2.0, NOW + 0.01 * batch_id)

    monkeypatch.setattr(broker_spans, "MAX_OPEN_BATCHES", 2)
    monkeypatch.setattr(relay, "MAX_OPEN_BATCHES", 2)
    theirs, mine = shape(in_process(unanswered)), shape(relayed(unanswered))
    assert [s[0] for s in mine].count("batcher.batch") == 1  # the first, ended at the third's start
    assert mine == theirs
