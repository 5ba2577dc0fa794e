"""A stream's delivery span at the broker (`batcher.stream`, docs/tracing.md "Streams"),
as the broker's in-process SDK path makes it (BrokerSpans; the exporter-process path,
RelaySpans, is the default and runs in tests/integration/tracing): the queue span's
child, its START's traceparent, its chunks and first chunk's time, its outcome, and
error status but for ok, cancelled and client_gone."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from batcher.observe.broker_spans import BrokerSpans
from batcher.observe.settings import TraceSettings
from batcher.observe.spans import Tracer
from batcher.wire.tracecontext import parse_traceparent


def request(spans: BrokerSpans, rid: str, arrived_at: float) -> Any:
    caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    return SimpleNamespace(
        id=rid, priority=0.0, attempts=0, handbacks=0, deadline_at=None, arrived_at=arrived_at,
        trace=spans.admit(caller, None),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("outcome", "why", "error"),
    [("ok", None, False), ("cancelled", None, False), ("client_gone", None, False),
     ("deadline_exceeded", None, True), ("worker_lost", "worker lost", True)],
)  # fmt: skip
def test_a_streams_broker_span_from_its_start_to_its_answer(
    outcome: str, why: str | None, error: bool
) -> None:
    keep = InMemorySpanExporter()
    tracer = Tracer(TraceSettings(endpoint="http://127.0.0.1:9", schedule_delay_ms=10.0), "batcher-broker",
                    exporter=keep)  # fmt: skip
    spans = BrokerSpans(tracer)
    req = request(spans, "r1", 100.0)
    traceparent = spans.stream_started(req, "simlm", "simlm/gpu-/pid1/id1", 100.5)
    spans.stream_chunk(req.trace, 100.52)  # its first chunk (the broker calls it for that one only)
    spans.stream_ended(req.trace, 101.5, outcome, 7, why)
    spans.stream_ended(req.trace, 102.0, "ok", 8, None)  # ended once only
    assert tracer.flush(5.0)
    queue, stream = sorted(keep.get_finished_spans(), key=lambda s: s.name)
    assert (queue.name, stream.name) == ("batcher.queue", "batcher.stream")
    assert queue.attributes["batcher.outcome"] == "started" and queue.end_time == tracer.ns(100.5)
    assert stream.parent is not None and stream.parent.span_id == queue.context.span_id
    parsed = parse_traceparent(traceparent)
    assert parsed is not None and int(parsed.span_id, 16) == stream.context.span_id
    assert (stream.start_time, stream.end_time) == (tracer.ns(100.5), tracer.ns(101.5))
    assert dict(stream.attributes) == {
        "batcher.model": "simlm", "batcher.worker": "simlm/gpu-/pid1/id1", "batcher.attempt": 1,
        "batcher.request_id": "r1", "batcher.first_chunk_ms": 20.0, "batcher.outcome": outcome,
        "batcher.chunks": 7,
    }  # fmt: skip
    assert (stream.status.status_code is StatusCode.ERROR) is error
    assert [e.name for e in stream.events] == ([] if why is None else ["batcher.worker_lost"])
    tracer.shutdown()
