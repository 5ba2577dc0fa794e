"""Tracer.record (batcher.observe.spans): a span made after the fact as the SDK's finished
span at once, the same span, once encoded, as the SDK's own start and end make of the same
inputs (but for its new span id, and trace id for a root): parents remote and local,
links, events, errors, attributes the SDK's limits drop or refuse."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.span import TraceState

from batcher.observe.settings import TraceSettings
from batcher.observe.spans import Tracer


def sdk_record(
    tracer: Tracer, name: str, parent: Any, start_s: float, end_s: float, **kw: Any
) -> SpanContext:
    """What Tracer.record did before: the SDK's span started, its events added, ended."""
    events = kw.pop("events", ())
    error = kw.pop("error", None)
    span = tracer.start(name, parent, start_s, kw.pop("attributes", None), kw.pop("links", ()), **kw)
    for event, at_s, attrs in events:
        span.add_event(event, attrs, timestamp=tracer.ns(at_s))
    tracer.end(span, end_s, error)
    ctx: SpanContext = span.get_span_context()
    return ctx


CASES: list[dict[str, Any]] = [
    {"attributes": {"batcher.batch_id": "12", "batcher.batch_size": 25}},
    {"attributes": {"batcher.infer_ms": 0.25, "batcher.worker_wait_ms": 0.01}, "error": "ValueError: no"},
    {"kind": SpanKind.SERVER, "attributes": {"batcher.model": "m", "none": None, "bad": {"x": 1}},
     "links": [Link(SpanContext(5, 6, False, TraceFlags(1)), {"batcher.link": "batch"})],
     "events": [("batcher.redispatch", 1.5, {"batcher.attempt": 2})]},
    {"attributes": {f"a{i}": i for i in range(200)},
     "links": [Link(SpanContext(i + 1, i + 1, True, TraceFlags(1))) for i in range(200)]},
    {},
]  # fmt: skip


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("parent_kind", ["remote", "local", "random", "root"])
def test_record_makes_the_span_the_sdks_start_and_end_made(case: int, parent_kind: str) -> None:
    keep = InMemorySpanExporter()
    tracer = Tracer(TraceSettings(endpoint="http://127.0.0.1:9", schedule_delay_ms=10.0), "batcher-worker",
                    {"batcher.model": "echo"}, exporter=keep)  # fmt: skip
    state = TraceState.from_header(["v=1"])
    parent = {
        "remote": SpanContext(0xAB, 0xCD, True, TraceFlags(1), state),
        "local": SpanContext(0xAB, 0xCE, False, TraceFlags(1), state),
        "random": SpanContext(0xAB, 0xCF, True, TraceFlags(3)),  # sampled, its trace id random
        "root": None,
    }[parent_kind]
    now = time.monotonic()
    kw = dict(CASES[case])
    kw["events"] = [(n, now + dt, a) for n, dt, a in kw.get("events", ())]
    mine = tracer.record("batcher.worker.model", parent, now, now + 0.002, **kw)
    theirs = sdk_record(tracer, "batcher.worker.model", parent, now, now + 0.002, **kw)
    assert tracer.flush(5.0)
    tracer.shutdown()
    assert [s.context for s in keep.get_finished_spans()] == [mine, theirs]
    assert mine.trace_flags == theirs.trace_flags and mine.trace_state == theirs.trace_state
    assert (mine.trace_id == theirs.trace_id) == (parent is not None)
    a, b = (encode_spans([s]) for s in keep.get_finished_spans())
    for request in (a, b):  # the new ids aside
        span = request.resource_spans[0].scope_spans[0].spans[0]
        span.span_id = b"\x00" * 8
        if parent is None:
            span.trace_id = b"\x00" * 16
    assert a == b
