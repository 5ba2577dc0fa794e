"""A test OTLP/HTTP collector: POST /v1/traces bodies decoded with the OpenTelemetry proto
package (opentelemetry-proto) into plain span records the tests assert on. It can answer
errors (503, or 400: refused and not retried) or answer late, to show that a collector's
trouble never reaches serving.

It speaks HTTP/1.1 and keeps each connection open across posts, as the OpenTelemetry
Collector (and any OTLP/HTTP receiver worth benchmarking against) does: every answer
carries its Content-Length. An HTTP/1.0 receiver closes after each answer, so every
export would pay a new TCP connection on both sides, which is the test's cost, not
batcher's (docs/tracing.md, "What tracing costs")."""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


@dataclass
class SpanRecord:
    """One span as the collector received it (ids as lowercase hex)."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links: list[tuple[str, str, dict[str, Any]]]
    events: list[str]
    trace_state: str
    status_code: int
    resource: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return None if kind is None else getattr(v, kind)


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def decode(body: bytes) -> list[SpanRecord]:
    """The spans of one ExportTraceServiceRequest."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    out = []
    for rs in request.resource_spans:
        resource = _attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    SpanRecord(
                        service=str(resource.get("service.name")),
                        name=s.name,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        kind=s.kind,
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes=_attrs(s.attributes),
                        links=[
                            (ln.trace_id.hex(), ln.span_id.hex(), _attrs(ln.attributes)) for ln in s.links
                        ],
                        events=[e.name for e in s.events],
                        trace_state=s.trace_state,
                        status_code=s.status.code,
                        resource=resource,
                    )
                )
    return out


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client gone while its connection was kept open (its process stopped) is no
        error of the collector's; anything else is printed, as the standard server does."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


class Collector:
    """The collector on a free loopback port: `endpoint` to give --trace-endpoint, `spans`
    received so far; `mode` "ok", "error" (answers 503), "reject" (answers 400, which the
    SDK's exporter does not retry: each post is one failed export at once; the spans it
    refused are in `refused`), "slow" (answers after `delay_s`) or "sink" (answers at
    once, decoding nothing: for benchmarks)."""

    def __init__(self, mode: str = "ok", delay_s: float = 2.0) -> None:
        self.mode = mode
        self.delay_s = delay_s
        self.spans: list[SpanRecord] = []
        self.refused: list[SpanRecord] = []
        self.posts = 0
        self._lock = threading.Lock()
        self._released = threading.Event()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: one connection per exporter

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with collector._lock:
                    collector.posts += 1
                if collector.mode == "error":
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if collector.mode == "reject":
                    refused = decode(body)
                    with collector._lock:
                        collector.refused.extend(refused)
                    self.send_response(400)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if collector.mode == "slow":
                    collector._released.wait(collector.delay_s)  # a collector that answers late
                spans = decode(body) if collector.mode != "sink" else []
                with collector._lock:
                    collector.spans.extend(spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def of_trace(self, trace_id: str) -> list[SpanRecord]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def refused_snapshot(self) -> list[SpanRecord]:
        with self._lock:
            return list(self.refused)

    def snapshot(self) -> list[SpanRecord]:
        with self._lock:
            return list(self.spans)

    def wait_for(self, predicate: Any, timeout_s: float = 15.0) -> list[SpanRecord]:
        """The spans once `predicate(spans)` holds (AssertionError with them if it never does)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.snapshot()
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"collector: condition not met in {timeout_s}s; got {spans}")
            time.sleep(0.05)  # polling the collector's list for a condition, with a deadline

    def close(self) -> None:
        self._released.set()
        self.server.shutdown()
        self.server.server_close()
