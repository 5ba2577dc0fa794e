"""The broker's span records encoded straight into OTLP's protobuf messages
(batcher.observe.otlp_records) against the SDK's own path for the same records (records
-> SDK spans -> the OTLP exporter's encoder): the same request, field for field; then
posted through the SDK's OTLP/HTTP exporter to the tests' collector, and over gRPC to a
TraceService of the proto package's, as the SDK path posts them; a collector that
errors is a failed export, counted as dropped."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.trace import SpanContext, TraceFlags

from batcher.observe.counters import spans_dropped
from batcher.observe.export import BoundedExporter, make_exporter
from batcher.observe.otlp_encode import LOCAL, REMOTE
from batcher.observe.otlp_records import BATCH, QUEUE, Encoder, RecordExporter, build, expand
from batcher.observe.settings import TraceSettings
from batcher.observe.spans import parent_of, span_context
from tests.otlp_collector import Collector

T0 = 1_780_000_000_000_000_000


def tid(rng: random.Random) -> bytes:
    return rng.getrandbits(128).to_bytes(16, "big")


def records(seed: int = 7) -> list[tuple[Any, ...]]:
    """Records of every kind and field the broker fills: queue spans with and without a
    caller's parent, tracestate, link, deadline and error, and one refused at the door;
    batch spans with links, events, an error and figures of every type; a span in the
    general form."""
    rng = random.Random(seed)
    batch_trace, batch_span = tid(rng), rng.getrandbits(64)
    out: list[tuple[Any, ...]] = [
        (QUEUE, batch_trace, rng.getrandbits(64), 0, T0, T0 + 1500, "echo", 0.0, "batched", 1,
         "17", None, None, None, 0, None),
        (QUEUE, tid(rng), rng.getrandbits(64), rng.getrandbits(64), T0 + 3, T0 + 1500, "echo", 2.5,
         "batched", 2, "req-b", 250.0, None, batch_trace, batch_span, "vendor=abc,other=x:y"),
        (QUEUE, tid(rng), rng.getrandbits(64), 0, T0 + 9, T0 + 9, "", 0.0, "refused", 1, None, None,
         "model_not_found", None, 0, None),
        (QUEUE, tid(rng), rng.getrandbits(64), rng.getrandbits(64), T0 + 4, T0 + 90_000, "sim", -1.0,
         "expired", 1, "42", 12.345, "deadline_exceeded", None, 0, "k=v"),
        (BATCH, batch_trace, batch_span, rng.getrandbits(64), T0 + 1500, T0 + 2_000_000,
         {"batcher.model": "echo", "batcher.batch_id": "9", "batcher.batch_size": 2,
          "batcher.batch_cost": 2.0, "batcher.worker": "w-1", "batcher.attempt": 2,
          "batcher.traced_requests": 2,
          "batcher.infer_ms": 0.25, "batcher.worker_wait_ms": 0.01, "batcher.padding_waste": 0.0},
         [(batch_trace, rng.getrandbits(64), "17"), (tid(rng), rng.getrandbits(64), "req-b")],
         [("batcher.redispatch", T0 + 1500, {"batcher.attempt": 2}),
          ("batcher.worker_lost", T0 + 2_000_000, {"batcher.reason": "worker lost"})],
         "worker lost", None),
        (BATCH, tid(rng), rng.getrandbits(64), rng.getrandbits(64), T0, T0 + 5, {"batcher.model": "m"}, [],
         [], None, "a=b"),
        ("batcher.other", 2, tid(rng), rng.getrandbits(64), 0, T0, T0 + 1,
         {"s": "x", "i": -3, "f": 1.5, "b": True, "bytes": b"\x00\x01", "seq": [1, "2"], "none": None,
          "empty": [], "map": {"a": 1}},
         [(tid(rng), rng.getrandbits(64), {"k": False})], [("e", T0, {})], "", None),
        # refused at the door: no priority, no attempt
        (QUEUE, tid(rng), rng.getrandbits(64), rng.getrandbits(64), T0 + 5, T0 + 5, "sim", None, "refused",
         None, "q", None, "overloaded", None, 0, None),
    ]  # fmt: skip
    return out


def sdk_request(recs: list[tuple[Any, ...]], resource: Resource) -> ExportTraceServiceRequest:
    """What the exporter process sent before: each record as an SDK span, the SDK's encoder."""
    request: ExportTraceServiceRequest = encode_spans([build(r, resource) for r in recs])
    return request


def resource() -> Resource:
    return Resource.create({"service.name": "batcher-broker", "batcher.models": "echo,sim"})


def test_the_encoder_makes_the_sdks_request_field_for_field() -> None:
    res = resource()
    recs = records()
    mine, count = Encoder(res).encode(recs)
    theirs = sdk_request(recs, res)
    assert count == len(recs)
    assert mine == theirs
    assert mine.SerializeToString(deterministic=True) == theirs.SerializeToString(deterministic=True)
    # and what a collector reads of it: names, parents, links and their attributes, status
    spans = mine.resource_spans[0].scope_spans[0].spans
    assert [s.name for s in spans][:5] == ["batcher.queue"] * 4 + ["batcher.batch"]
    assert spans[1].links[0].trace_id == recs[0][1] and spans[1].trace_state == "vendor=abc,other=x:y"
    assert [kv.key for kv in spans[3].attributes][-2:] == ["batcher.deadline_ms", "batcher.error_code"]
    assert spans[4].status.message == "worker lost"
    assert [e.name for e in spans[4].events] == ["batcher.redispatch", "batcher.worker_lost"]


def test_random_records_match_the_sdk_path_too() -> None:
    res = resource()
    encoder = Encoder(res)  # one encoder throughout: what it keeps between requests never leaks
    for seed in range(20):
        recs = records(seed) + records(seed + 100)  # the same shapes again, other ids and values
        random.Random(seed).shuffle(recs)
        assert encoder.encode(recs)[0] == sdk_request(recs, res)
    # the same queue span but for its priority's and attempt's types
    base = records()[0]
    typed = [base, (*base[:7], 0, "batched", 1.0, *base[10:]), (*base[:7], 0.0, "batched", True, *base[10:])]
    assert encoder.encode(typed)[0] == sdk_request(typed, res)


def test_a_queue_span_whose_parent_is_the_callers_says_that_parent_is_remote() -> None:
    """OTLP's span flags say whether a span's parent is remote: a queue span's parent is
    the caller's span (the request's traceparent, another process's), as the broker's
    in-process design (BrokerSpans: the SDK's span, the SDK's encoder) marks it; a queue
    span without a caller is a root, and the batch span's parent (a queue span) is local."""
    _, parent, _ = parent_of("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", None)
    assert parent is not None
    caller = span_context(parent)
    trace = caller.trace_id.to_bytes(16, "big")
    queued = ("echo", 0.0, "batched", 1)  # model, priority, outcome, attempt
    recs = [
        (QUEUE, trace, 5, caller.span_id, T0, T0 + 10, *queued, "1", None, None, None, 0, None),
        (QUEUE, trace, 6, 0, T0, T0 + 10, *queued, "2", None, None, None, 0, None),
        (BATCH, trace, 7, 5, T0 + 10, T0 + 20, {"batcher.model": "echo"}, [(trace, 5, "1")], [], None, None),
    ]  # fmt: skip
    res = resource()
    spans = Encoder(res).encode(recs)[0].resource_spans[0].scope_spans[0].spans
    assert [s.flags for s in spans] == [REMOTE, LOCAL, LOCAL]
    assert [ln.flags for ln in spans[2].links] == [LOCAL]
    # what the SDK's encoder writes for the SDK's own span of that caller
    ctx = SpanContext(caller.trace_id, 5, False, TraceFlags(1))
    sdk = encode_spans([ReadableSpan("batcher.queue", context=ctx, parent=caller, resource=res)])
    assert sdk.resource_spans[0].scope_spans[0].spans[0].flags == spans[0].flags
    assert sdk_request(recs, res) == Encoder(res).encode(recs)[0]  # the reference path agrees


def test_a_bad_record_is_left_out_and_the_others_encoded() -> None:
    recs = records()
    bad = (QUEUE, b"short", "not an int")
    mine, count = Encoder(resource()).encode([recs[0], bad, recs[1]])
    assert count == 2
    assert mine == sdk_request([recs[0], recs[1]], resource())


def test_expand_spells_out_what_the_queue_and_batch_records_imply() -> None:
    q, b = records()[1], records()[4]
    name, kind, *_, attributes, links, events, error, state = expand(q)
    assert (name, kind, error, state) == ("batcher.queue", 1, None, "vendor=abc,other=x:y")
    assert attributes == {
        "batcher.model": "echo", "batcher.priority": 2.5, "batcher.outcome": "batched",
        "batcher.attempt": 2, "batcher.request_id": "req-b", "batcher.deadline_ms": 250.0,
    }  # fmt: skip
    assert links == [(q[13], q[14], {"batcher.link": "batch"})] and events == []
    assert [a for _, _, a in expand(b)[8]] == [{"batcher.request_id": "17"}, {"batcher.request_id": "req-b"}]


def big_batch(links: int, seed: int = 3) -> tuple[Any, ...]:
    """A batch span's record with `links` traced requests (each its own trace)."""
    rng = random.Random(seed)
    trace = tid(rng)
    return (
        BATCH, trace, rng.getrandbits(64), rng.getrandbits(64), T0, T0 + 9_000_000,
        {"batcher.model": "sim", "batcher.batch_size": links, "batcher.traced_requests": links},
        [(tid(rng), rng.getrandbits(64), str(i)) for i in range(links)],
        [("batcher.redispatch", T0, {"batcher.attempt": 2})], None, None,
    )  # fmt: skip


def test_a_batch_of_200_keeps_the_sdks_128_links_and_counts_the_72_dropped() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import SpanContext, TraceFlags

    res, rec = resource(), big_batch(200)
    recs = [records()[0], rec, records()[1]]
    mine, count = Encoder(res).encode(recs)
    assert count == 3 and mine == sdk_request(recs, res)
    span = mine.resource_spans[0].scope_spans[0].spans[1]
    assert len(span.links) == 128 and span.dropped_links_count == 72
    # the newest 128, as the SDK's own span keeps them (the broker's in-process path)
    sdk_span = TracerProvider().get_tracer("t").start_span("batcher.batch")
    for t, s, rid in rec[7]:
        sdk_span.add_link(SpanContext(int.from_bytes(t, "big"), s, False, TraceFlags(1)), {"rid": rid})
    assert sdk_span.dropped_links == 72  # type: ignore[attr-defined]
    assert [ln.span_id for ln in span.links] == [x.context.span_id.to_bytes(8, "big") for x in sdk_span.links]
    assert [ln.attributes[0].value.string_value for ln in span.links] == [str(i) for i in range(72, 200)]
    # 128 exactly is within the limit: nothing dropped
    exact = Encoder(res).encode([big_batch(128)])[0].resource_spans[0].scope_spans[0].spans[0]
    assert len(exact.links) == 128 and exact.dropped_links_count == 0


def test_the_otel_limit_variables_bound_every_record_as_the_sdk_does(monkeypatch: pytest.MonkeyPatch) -> None:
    res, recs = resource(), [*records(), big_batch(9)]
    for env in (
        {"OTEL_SPAN_LINK_COUNT_LIMIT": "4"},
        {"OTEL_SPAN_LINK_COUNT_LIMIT": "0"},
        {"OTEL_SPAN_EVENT_COUNT_LIMIT": "1"},
        {"OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": "3"},
        {"OTEL_LINK_ATTRIBUTE_COUNT_LIMIT": "0", "OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT": "0"},
        {"OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "2"},
    ):
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            mine, count = Encoder(res).encode(recs)
            assert count == len(recs)
            assert mine == sdk_request(recs, res), env
            spans = mine.resource_spans[0].scope_spans[0].spans
            dropped = sum(
                s.dropped_links_count + s.dropped_events_count + s.dropped_attributes_count
                + sum(x.dropped_attributes_count for x in [*s.links, *s.events])
                for s in spans
            )  # fmt: skip
            if "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT" in env:
                assert spans[0].attributes[0].value.string_value == "ec"  # "echo", cut to 2
            else:
                assert dropped > 0, env


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.close()


def settings_for(endpoint: str, **kw: Any) -> TraceSettings:
    return TraceSettings(endpoint=endpoint, export_timeout_ms=2000.0, **kw)


def test_posted_over_http_the_collector_gets_what_the_sdk_path_sends(collector: Collector) -> None:
    res = resource()
    recs = records()
    direct = RecordExporter(make_exporter(settings_for(collector.endpoint)), res)
    assert direct.direct, "the SDK exporter's encoder could not be bypassed: the slow path is in use"
    assert direct.export(recs) is SpanExportResult.SUCCESS
    got_direct = collector.wait_for(lambda s: len(s) == len(recs))
    sdk = RecordExporter(make_exporter(settings_for(collector.endpoint)), res, direct=False)
    assert not sdk.direct
    assert sdk.export(recs) is SpanExportResult.SUCCESS
    got = collector.wait_for(lambda s: len(s) == 2 * len(recs))
    assert got_direct == got[len(recs) :]
    assert {s.resource["service.name"] for s in got} == {"batcher-broker"}
    direct.shutdown()
    sdk.shutdown()


def test_an_erroring_collector_is_a_failed_export_and_the_queue_counts_the_drop() -> None:
    c = Collector("error")
    try:
        settings = settings_for(c.endpoint, schedule_delay_ms=10.0)
        queue = BoundedExporter(RecordExporter(make_exporter(settings), resource()), settings)
        before = spans_dropped()
        queue.put_many(records())
        queue.force_flush(10_000)
        assert spans_dropped() - before == len(records())
        assert c.posts >= 1
        queue.shutdown()
    finally:
        c.close()


def test_a_full_queue_drops_and_counts_what_does_not_fit(collector: Collector) -> None:
    settings = settings_for(collector.endpoint, max_queue_size=3, max_export_batch_size=512)
    queue = BoundedExporter(RecordExporter(make_exporter(settings), resource()), settings)
    before = spans_dropped()
    queue.put_many(records())  # 7 records, room for 3
    assert spans_dropped() - before == len(records()) - 3
    assert queue.force_flush(10_000)
    assert len(collector.wait_for(lambda s: len(s) == 3)) == 3
    queue.shutdown()


def test_over_grpc_the_trace_service_gets_what_the_sdk_path_sends() -> None:
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")
    grpc = pytest.importorskip("grpc")
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    received: list[ExportTraceServiceRequest] = []
    lock = threading.Lock()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
        def Export(self, request: ExportTraceServiceRequest, context: Any) -> ExportTraceServiceResponse:
            with lock:
                received.append(request)
            return ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        settings = settings_for(f"http://127.0.0.1:{port}", protocol="grpc")
        res, recs = resource(), records()
        direct = RecordExporter(make_exporter(settings), res)
        assert direct.direct
        assert direct.export(recs) is SpanExportResult.SUCCESS
        sdk = RecordExporter(make_exporter(settings), res, direct=False)
        assert sdk.export(recs) is SpanExportResult.SUCCESS
        with lock:
            assert len(received) == 2
            assert received[0] == received[1] == sdk_request(recs, res)
        direct.shutdown()
        sdk.shutdown()
    finally:
        server.stop(None)


def test_the_otel_headers_and_compression_variables_hold_as_for_the_sdks_exporter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gzip
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen: list[tuple[dict[str, str], bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            seen.append(({k.lower(): v for k, v in self.headers.items()}, body))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=batcher,authorization=Bearer%20t")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "gzip")
        settings = settings_for(f"http://127.0.0.1:{server.server_address[1]}")
        recs, res = records(), resource()
        direct = RecordExporter(make_exporter(settings), res)
        sdk = RecordExporter(make_exporter(settings), res, direct=False)
        assert direct.direct and direct.export(recs) is SpanExportResult.SUCCESS
        assert sdk.export(recs) is SpanExportResult.SUCCESS
        assert len(seen) == 2
        for headers, _ in seen:
            assert headers["x-tenant"] == "batcher" and headers["authorization"] == "Bearer t"
            assert headers["content-encoding"] == "gzip"
            assert headers["content-type"] == "application/x-protobuf"
        got = [ExportTraceServiceRequest.FromString(gzip.decompress(body)) for _, body in seen]
        assert got[0] == got[1] == sdk_request(recs, res)
        assert seen[0][0]["user-agent"] == seen[1][0]["user-agent"]
    finally:
        server.shutdown()
        server.server_close()
