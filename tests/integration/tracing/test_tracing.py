"""OpenTelemetry traces across gateway, broker and worker (issue 32, docs/tracing.md),
received by a test OTLP/HTTP collector (tests/otlp_collector.py): the span tree and
parents, the batch span linked to each of its requests, durations against the reply's
queue_ms and infer_ms; context set by the Python client and by a raw client; sampling
0 and an unsampled parent; a collector down, slow or erroring; bad context ignored."""

from __future__ import annotations

import json
import secrets
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from batcher.client import Client
from batcher.serve.launcher import ServeProcess, free_tcp_address
from tests.helpers import pack, recv_reply, sample, scrape, start_broker, wait_until
from tests.otlp_collector import Collector, SpanRecord

pytestmark = pytest.mark.integration

SIM = ("--model", "sim", "--workers", "1", "--sim-base-ms", "20", "--sim-per-item-ms", "1")
SERVER, CLIENT = 2, 3  # the proto's SpanKind values


def new_traceparent(sampled: bool = True) -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}", trace_id, span_id


def free_port() -> int:
    return int(free_tcp_address().rsplit(":", 1)[1])


@pytest.fixture
def collector() -> Iterator[Callable[..., Collector]]:
    made: list[Collector] = []

    def make(mode: str = "ok", delay_s: float = 2.0) -> Collector:
        made.append(Collector(mode, delay_s))
        return made[-1]

    yield make
    for c in made:
        c.close()


def by_name(spans: list[SpanRecord], name: str) -> list[SpanRecord]:
    return [s for s in spans if s.name == name]


def one(spans: list[SpanRecord], name: str) -> SpanRecord:
    found = by_name(spans, name)
    assert len(found) == 1, (name, spans)
    return found[0]


def has_worker_spans(trace_id: str) -> Callable[[list[SpanRecord]], bool]:
    def check(spans: list[SpanRecord]) -> bool:
        names = {s.name for s in spans if s.trace_id == trace_id}
        return {"batcher.queue", "batcher.batch", "batcher.worker.model", "batcher.worker.encode"} <= names

    return check


def post_infer(port: int, headers: dict[str, str], value: float = 1.0) -> dict[str, Any]:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [value]}]}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v2/models/sim/infer",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        answer: dict[str, Any] = json.loads(r.read())
        return answer


def test_an_http_request_is_one_trace_from_gateway_to_worker(
    serve: Callable[..., ServeProcess], collector: Callable[..., Collector]
) -> None:
    c = collector()
    http_port = free_port()
    serve(*SIM, "--http-port", str(http_port), "--trace-endpoint", c.endpoint, workers=1)
    wait_until(lambda: _live(http_port), 20.0, "the gateway's HTTP port")
    traceparent, trace_id, caller_span = new_traceparent()
    post_infer(http_port, {"traceparent": traceparent, "tracestate": "vendor=abc"})
    spans = c.wait_for(
        lambda s: (
            has_worker_spans(trace_id)(s)
            and any(x.name.startswith("POST") and x.trace_id == trace_id for x in s)
        )
    )
    mine = [s for s in spans if s.trace_id == trace_id]
    assert {s.service for s in mine} == {"batcher-gateway", "batcher-broker", "batcher-worker"}
    server = one(mine, "POST /v2/models/{model}/infer")
    # The gateway's request-duration histogram leads to this request's server span.
    durations = exemplars(openmetrics(http_port), "batcher_gateway_request_duration_seconds")
    assert f'span_id="{server.span_id}",trace_id="{trace_id}"' in durations, durations
    assert server.parent_id == caller_span and server.kind == SERVER
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["http.request.method"] == "POST"
    assert server.trace_state == "vendor=abc"
    parse, trip = one(mine, "batcher.gateway.parse"), one(mine, "batcher.gateway.broker")
    assert parse.parent_id == trip.parent_id == server.span_id and trip.kind == CLIENT
    queue = one(mine, "batcher.queue")
    assert queue.parent_id == trip.span_id and queue.attributes["batcher.outcome"] == "batched"
    assert queue.trace_state == "vendor=abc"  # carried on through the row's request
    batch = one(mine, "batcher.batch")
    assert batch.parent_id == queue.span_id
    assert (trace_id, queue.span_id) in [(t, s) for t, s, _ in batch.links]
    for name in ("batcher.worker.decode", "batcher.worker.model", "batcher.worker.encode"):
        assert one(mine, name).parent_id == batch.span_id
    assert one(mine, "batcher.worker.model").resource["batcher.model"] == "sim"
    # Each child lies within its parent (clocks of one machine).
    for child, parent in (
        (trip, server),
        (queue, trip),
        (batch, trip),
        (one(mine, "batcher.worker.model"), batch),
    ):
        assert parent.start_ns <= child.start_ns and child.end_ns <= parent.end_ns + 1_000_000, (
            child,
            parent,
        )


def _live(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/live", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_a_python_client_in_a_span_sets_the_context_and_a_batch_links_all_its_requests(
    serve: Callable[..., ServeProcess], collector: Callable[..., Collector]
) -> None:
    from opentelemetry.sdk.trace import TracerProvider

    c = collector()
    sp = serve(
        "--model", "sim", "--workers", "1", "--sim-base-ms", "60", "--sim-per-item-ms", "1",
        "--max-batch-size", "8", "--policy", "window", "--max-wait-ms", "200",
        "--trace-endpoint", c.endpoint, workers=1,
    )  # fmt: skip
    tracer = TracerProvider().get_tracer("test")  # a caller's own spans (not exported)
    contexts = []
    with Client(sp.frontend, timeout_s=10) as client:
        handles = []
        for i in range(8):
            with tracer.start_as_current_span(f"caller {i}") as span:
                contexts.append(span.get_span_context())
                handles.append(client.submit(float(i)))
        replies = [h.result() for h in handles]
    assert len(replies) == 8
    trace_ids = {f"{ctx.trace_id:032x}" for ctx in contexts}
    spans = c.wait_for(lambda s: _all_queued(s, trace_ids) and by_name(s, "batcher.batch"))
    queues = [s for s in spans if s.name == "batcher.queue" and s.trace_id in trace_ids]
    callers = {f"{ctx.span_id:016x}" for ctx in contexts}
    assert {q.parent_id for q in queues} == callers  # each a child of its caller's span
    batch = one(spans, "batcher.batch")
    assert batch.attributes["batcher.batch_size"] == 8
    assert {(q.trace_id, q.span_id) for q in queues} == {(t, s) for t, s, _ in batch.links}
    # Every request's trace leads to the batch: its child in one, a link from the others.
    for q in queues:
        assert batch.parent_id == q.span_id or (batch.trace_id, batch.span_id) in [
            (t, s) for t, s, _ in q.links
        ]


def _all_queued(spans: list[SpanRecord], trace_ids: set[str]) -> bool:
    return {s.trace_id for s in spans if s.name == "batcher.queue"} >= trace_ids


def openmetrics(port: int) -> str:
    """The /metrics page at `port` in the OpenMetrics exposition (where exemplars show)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/metrics", headers={"Accept": "application/openmetrics-text"}
    )
    with urllib.request.urlopen(request, timeout=5) as r:
        return str(r.read().decode())


def exemplars(text: str, family: str) -> str:
    """The exemplars on `family`'s bucket lines, joined."""
    return " ".join(
        ln.split("#", 1)[1] for ln in text.splitlines() if ln.startswith(f"{family}_bucket") and "#" in ln
    )


def test_durations_match_the_replys_queue_and_infer_ms_from_a_raw_client(
    serve: Callable[..., ServeProcess], collector: Callable[..., Collector], zctx: zmq.Context[Any]
) -> None:
    c = collector()
    metrics_port = free_port()
    sp = serve(*SIM, "--trace-endpoint", c.endpoint, "--metrics-port", str(metrics_port), workers=1)
    traceparent, trace_id, caller_span = new_traceparent()
    sock = zctx.socket(zmq.DEALER)
    sock.connect(sp.frontend)
    sock.send_multipart([b"", pack({"id": 1, "input": 3.0, "traceparent": traceparent})])
    reply = recv_reply(sock)
    assert reply["ok"], reply
    mine = [s for s in c.wait_for(has_worker_spans(trace_id)) if s.trace_id == trace_id]
    queue, model = one(mine, "batcher.queue"), one(mine, "batcher.worker.model")
    assert queue.parent_id == caller_span
    # The reply's queue_ms is the broker's queue plus the worker's wait; infer_ms the model's.
    assert queue.duration_ms <= reply["queue_ms"] + 1.0
    assert abs(model.duration_ms - reply["infer_ms"]) < 5.0, (model.duration_ms, reply["infer_ms"])
    assert model.attributes["batcher.infer_ms"] == reply["infer_ms"]
    # The queue-wait histogram's exemplar leads to this trace (OpenMetrics exposition).
    request = urllib.request.Request(
        f"http://127.0.0.1:{metrics_port}/metrics", headers={"Accept": "application/openmetrics-text"}
    )
    with urllib.request.urlopen(request, timeout=5) as r:
        text = r.read().decode()
    lines = [
        ln for ln in text.splitlines() if ln.startswith("batcher_queue_wait_seconds_bucket") and "#" in ln
    ]
    assert any(f'trace_id="{trace_id}"' in ln and f'span_id="{queue.span_id}"' in ln for ln in lines), lines
    # So do the batch's model time and worker wait: their exemplar is the batch span.
    batch = one(mine, "batcher.batch")
    for family in ("batcher_inference_seconds", "batcher_worker_wait_seconds"):
        assert f'span_id="{batch.span_id}",trace_id="{trace_id}"' in exemplars(text, family), family


def test_ratio_zero_exports_nothing_and_an_unsampled_parent_is_respected(
    serve: Callable[..., ServeProcess], collector: Callable[..., Collector], zctx: zmq.Context[Any]
) -> None:
    c = collector()
    sp = serve(*SIM, "--trace-endpoint", c.endpoint, "--trace-sample-ratio", "0", workers=1)
    unsampled, unsampled_trace, _ = new_traceparent(sampled=False)
    with Client(sp.frontend, timeout_s=10) as client:
        for i in range(20):
            client.request(float(i))  # no context: ratio 0 traces none
        client.request(1.0)
    sock = zctx.socket(zmq.DEALER)
    sock.connect(sp.frontend)
    sock.send_multipart([b"", pack({"id": 1, "input": 1.0, "traceparent": unsampled})])
    assert recv_reply(sock)["ok"]
    # A sampled parent is followed whatever the ratio: its spans mark that all before have left.
    marker, marker_trace, _ = new_traceparent()
    sock.send_multipart([b"", pack({"id": 2, "input": 1.0, "traceparent": marker})])
    assert recv_reply(sock)["ok"]
    spans = c.wait_for(has_worker_spans(marker_trace))
    assert {s.trace_id for s in spans} == {marker_trace}, spans
    assert unsampled_trace not in {s.trace_id for s in spans}


@pytest.mark.parametrize("trouble", ["down", "error", "slow"])
def test_a_collector_down_slow_or_erroring_never_touches_serving(
    serve: Callable[..., ServeProcess], collector: Callable[..., Collector], trouble: str
) -> None:
    if trouble == "down":
        endpoint = f"http://{free_tcp_address().removeprefix('tcp://')}"  # nothing listens there
    else:
        endpoint = collector(trouble, delay_s=30.0).endpoint
    metrics_port, http_port = free_port(), free_port()
    sp = serve(
        *SIM, "--trace-endpoint", endpoint, "--metrics-port", str(metrics_port),
        "--http-port", str(http_port), workers=1, stop_timeout_s=15.0,
    )  # fmt: skip
    with Client(sp.frontend, timeout_s=10) as client:
        started = time.monotonic()
        replies = client.request_many([float(i) for i in range(64)])
        elapsed_s = time.monotonic() - started
    assert len(replies) == 64
    # 64 requests of a 20 ms + 1 ms/item model at up to 32 a batch: well under a second
    # whatever the collector does (the export thread waits, the loop never does).
    assert elapsed_s < 3.0, elapsed_s
    if trouble != "slow":  # a slow collector delays spans; its queue is far from full
        wait_until(
            lambda: sample(scrape(metrics_port), "batcher_trace_spans_dropped_total") > 0,
            20.0,
            "the broker's dropped spans counted",
        )
        # The workers' drops reach the broker with their heartbeats: its metrics and stats.
        wait_until(
            lambda: (
                scrape(metrics_port).get(("batcher_worker_trace_spans_dropped_total", (("model", "sim"),)), 0)
                > 0
            ),
            20.0,
            "the worker's dropped spans counted at the broker",
        )
        with Client(sp.frontend, timeout_s=10) as client:
            assert client.control("stats")["worker_trace_spans_dropped"]["sim"] > 0
        # The gateway's drops are on its own /metrics.
        wait_until(lambda: _live(http_port), 20.0, "the gateway's HTTP port")
        for i in range(4):
            assert post_infer(http_port, {}, float(i))["outputs"]
        wait_until(
            lambda: sample(scrape(http_port), "batcher_trace_spans_dropped_total") > 0,
            20.0,
            "the gateway's dropped spans counted",
        )


def test_a_worker_that_stops_reports_the_spans_it_dropped_since_its_last_heartbeat(
    spawn: Callable[..., Any], zctx: zmq.Context[Any], collector: Callable[..., Collector]
) -> None:
    # A collector that refuses every post (400, not retried): each of the worker's exports
    # fails at once, its spans dropped. Heartbeats 20 s apart: none carries a count before
    # the worker stops, so only its DISCONNECT can (docs/tracing.md, "Limits").
    refusing = collector("reject")
    trace = ("--trace-endpoint", refusing.endpoint)
    beat = ("--heartbeat-ms", "20000")
    frontend, backend = start_broker(spawn, zctx, "--model", "sim", *beat, *trace)
    worker = spawn("worker", "--connect", backend, "--model", "sim", "--sim-base-ms", "1", *beat, *trace)
    with Client(frontend, timeout_s=10, context=zctx) as client:
        for i in range(5):  # one at a time: 5 batches, 3 worker spans each
            assert client.request(float(i)) is not None
        worker_spans = 15

        def refused_from_worker() -> int:
            return sum(s.service == "batcher-worker" for s in refusing.refused_snapshot())

        wait_until(lambda: refused_from_worker() >= worker_spans, 15.0, "the worker's exports refused")
        assert refused_from_worker() == worker_spans
        assert client.control("stats")["worker_trace_spans_dropped"].get("sim", 0) < worker_spans
        worker.process.send_signal(signal.SIGTERM)  # a normal stop: drain, DISCONNECT
        assert worker.process.wait(15) == 0
        wait_until(
            lambda: client.control("stats")["worker_trace_spans_dropped"].get("sim", 0) == worker_spans,
            5.0,
            "the stopped worker's drops counted at the broker",
        )


def test_bad_context_is_ignored_never_an_error(
    serve: Callable[..., ServeProcess], collector: Callable[..., Collector], zctx: zmq.Context[Any]
) -> None:
    c = collector()
    sp = serve(*SIM, "--trace-endpoint", c.endpoint, workers=1)
    sock = zctx.socket(zmq.DEALER)
    sock.connect(sp.frontend)
    good, good_trace, _ = new_traceparent()
    bad_bodies = [
        {"id": 1, "input": 1.0, "traceparent": "00-not-a-trace-01"},
        {"id": 2, "input": 1.0, "traceparent": {"a": "map"}, "tracestate": 5},
        {"id": 3, "input": 1.0, "traceparent": "x" * 100_000},
        {"id": 4, "input": 1.0, "traceparent": good, "tracestate": "k=" + "v" * 10_000},
    ]
    for body in bad_bodies:
        sock.send_multipart([b"", pack(body)])
        reply = recv_reply(sock)
        assert reply["ok"] and reply["id"] == body["id"], reply
    spans = c.wait_for(lambda s: len(by_name(s, "batcher.queue")) >= 4 and has_worker_spans(good_trace)(s))
    queues = by_name(spans, "batcher.queue")
    ids = {q.attributes["batcher.request_id"]: q for q in queues}
    assert ids["4"].trace_id == good_trace and ids["4"].trace_state == ""  # the huge tracestate dropped
    for rid in ("1", "2", "3"):
        assert ids[rid].parent_id == ""  # a new trace (ratio 1), the bad context ignored


@pytest.mark.parametrize("command", ["serve", "broker", "worker", "gateway"])
def test_every_process_command_takes_the_trace_options_and_refuses_bad_ones(
    cli: Callable[..., Any], command: str
) -> None:
    helped = cli(command, "--help")
    assert "--trace-endpoint" in helped.stdout and "--trace-sample-ratio" in helped.stdout
    bad = cli(command, "--trace-endpoint", "collector:4318")
    assert bad.returncode == 2 and "trace_endpoint must be an http:// or https:// URL" in bad.stderr
    ratio = cli(command, "--trace-endpoint", "http://127.0.0.1:4318", "--trace-sample-ratio", "2")
    assert ratio.returncode == 2 and "--trace-sample-ratio" in ratio.stderr


def test_a_lost_workers_batch_span_ends_with_an_event_and_its_retry_is_a_new_linked_batch(
    serve: Callable[..., ServeProcess], collector: Callable[..., Collector], zctx: zmq.Context[Any]
) -> None:
    import os
    import signal

    import psutil

    from tests.helpers import model_stats

    c = collector()
    sp = serve(
        "--model", "sim", "--workers", "2", "--sim-base-ms", "1500", "--sim-per-item-ms", "0",
        "--max-retries", "2", "--trace-endpoint", c.endpoint, workers=2, timeout_s=30.0,
    )  # fmt: skip
    traceparent, trace_id, _ = new_traceparent()
    sock = zctx.socket(zmq.DEALER)
    sock.connect(sp.frontend)
    sock.send_multipart([b"", pack({"id": 1, "input": 1.0, "traceparent": traceparent})])
    wait_until(
        lambda: model_stats(sp.frontend, zctx, "sim").get("batches_in_flight") == 1, 10.0, "the batch sent"
    )
    assert sp.process is not None
    workers = [p for p in psutil.Process(sp.process.pid).children() if "worker" in " ".join(p.cmdline())]
    for p in workers:  # the batch's worker among them: its batch is lost, its request retried
        os.kill(p.pid, signal.SIGKILL)
    reply = recv_reply(sock, timeout_s=40.0)
    assert reply["ok"], reply
    spans = c.wait_for(
        lambda s: len([x for x in by_name(s, "batcher.batch") if x.trace_id == trace_id]) >= 2, 30.0
    )
    first, second = sorted(
        (x for x in by_name(spans, "batcher.batch") if x.trace_id == trace_id), key=lambda x: x.start_ns
    )
    assert "batcher.worker_lost" in first.events and first.status_code == 2  # STATUS_CODE_ERROR
    assert second.attributes["batcher.attempt"] == 2 and "batcher.redispatch" in second.events
    queue = one([x for x in spans if x.trace_id == trace_id], "batcher.queue")
    assert first.parent_id == second.parent_id == queue.span_id  # both batches lead back to the request


def test_a_grpc_call_is_traced_from_its_metadata(
    serve: Callable[..., ServeProcess], collector: Callable[..., Collector]
) -> None:
    import numpy as np
    import tritonclient.grpc as tgrpc

    c = collector()
    grpc_port = free_port()
    serve(*SIM, "--grpc-port", str(grpc_port), "--trace-endpoint", c.endpoint, workers=1)
    client = tgrpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        wait_until(lambda: _grpc_live(client), 20.0, "the gateway's gRPC port")
        traceparent, trace_id, caller_span = new_traceparent()
        inp = tgrpc.InferInput("x", [1], "FP32")
        inp.set_data_from_numpy(np.array([1.0], dtype=np.float32))
        client.infer("sim", [inp], headers={"traceparent": traceparent})
    finally:
        client.close()
    spans = c.wait_for(has_worker_spans(trace_id))
    mine = [s for s in spans if s.trace_id == trace_id]
    server = c.wait_for(lambda s: [x for x in s if x.trace_id == trace_id and x.name.endswith("/ModelInfer")])
    rpc = one([x for x in server if x.trace_id == trace_id], "inference.GRPCInferenceService/ModelInfer")
    assert rpc.parent_id == caller_span and rpc.kind == SERVER and rpc.attributes["rpc.grpc.status"] == "OK"
    assert one(mine, "batcher.queue").parent_id == one(server, "batcher.gateway.broker").span_id


def _grpc_live(client: Any) -> bool:
    try:
        return bool(client.is_server_live())
    except Exception:
        return False


def test_a_stream_is_its_queue_span_its_broker_delivery_span_and_one_worker_span(
    serve: Callable[..., ServeProcess], collector: Callable[..., Collector], zctx: zmq.Context[Any]
) -> None:
    c = collector()
    metrics_port = free_port()
    sp = serve(
        "--model", "simlm", "--workers", "1", "--trace-endpoint", c.endpoint,
        "--metrics-port", str(metrics_port), workers=1,
    )  # fmt: skip
    traceparent, trace_id, caller_span = new_traceparent()
    sock = zctx.socket(zmq.DEALER)
    sock.connect(sp.frontend)
    body = {"id": 1, "input": {"tokens": 5}, "stream": True, "traceparent": traceparent}
    started = time.monotonic()
    sock.send_multipart([b"", pack(body)])
    replies = [recv_reply(sock)]
    while replies[-1].get("more"):
        replies.append(recv_reply(sock))
    took_ms = (time.monotonic() - started) * 1000.0
    assert [r["ok"] for r in replies] == [True] * 5, replies

    def all_three(spans: list[SpanRecord]) -> bool:
        names = {s.name for s in spans if s.trace_id == trace_id}
        return {"batcher.queue", "batcher.stream", "batcher.worker.sequence"} <= names

    mine = [s for s in c.wait_for(all_three) if s.trace_id == trace_id]
    queue, stream = one(mine, "batcher.queue"), one(mine, "batcher.stream")
    seq = one(mine, "batcher.worker.sequence")
    assert queue.parent_id == caller_span and queue.attributes["batcher.outcome"] == "started"
    # The broker's delivery of the stream: from its START to its last chunk, one span.
    assert stream.parent_id == queue.span_id and stream.service == "batcher-broker"
    assert stream.attributes["batcher.outcome"] == "ok" and stream.attributes["batcher.chunks"] == 5
    assert stream.attributes["batcher.request_id"] == "1" and stream.attributes["batcher.model"] == "simlm"
    assert stream.attributes["batcher.worker"].startswith("simlm/")
    assert stream.start_ns >= queue.end_ns and stream.duration_ms <= took_ms
    assert 0 <= stream.attributes["batcher.first_chunk_ms"] <= stream.duration_ms
    assert stream.status_code != 2  # not an error
    # The worker's span of the stream is the broker's delivery span's child, within it.
    assert seq.parent_id == stream.span_id and seq.service == "batcher-worker"
    assert stream.start_ns <= seq.start_ns and seq.end_ns <= stream.end_ns
    assert seq.attributes["batcher.chunks"] == 5 and seq.attributes["batcher.outcome"] == "ok"
    assert seq.attributes["batcher.steps"] >= 5
    assert 0 <= seq.attributes["batcher.first_chunk_ms"] <= seq.duration_ms
    assert seq.events == ["batcher.admitted", "batcher.first_chunk"]
    # The time-to-first-chunk histogram's exemplar leads to this stream's trace.
    first = exemplars(openmetrics(metrics_port), "batcher_time_to_first_chunk_seconds")
    assert f'span_id="{queue.span_id}",trace_id="{trace_id}"' in first, first


def test_a_cancelled_streams_broker_span_ends_at_the_cancel_with_the_chunks_delivered(
    serve: Callable[..., ServeProcess], collector: Callable[..., Collector], zctx: zmq.Context[Any]
) -> None:
    c = collector()
    sp = serve(
        "--model", "simlm", "--workers", "1", "--trace-endpoint", c.endpoint,
        "--simlm-step-base-ms", "20", workers=1,
    )  # fmt: skip
    traceparent, trace_id, _ = new_traceparent()
    sock = zctx.socket(zmq.DEALER)
    sock.connect(sp.frontend)
    sock.send_multipart(
        [b"", pack({"id": 7, "input": {"tokens": 1000}, "stream": True, "traceparent": traceparent})]
    )
    replies = [recv_reply(sock) for _ in range(3)]  # 3 chunks, then the client cancels
    assert all(r["ok"] and r.get("more") for r in replies), replies
    sock.send_multipart([b"", pack({"id": 7, "op": "cancel"})])
    while replies[-1].get("more", False) and replies[-1].get("ok", False):
        replies.append(recv_reply(sock))
    assert replies[-1]["error"]["code"] == "cancelled", replies[-1]
    delivered = len(replies) - 1  # the chunks before the cancel's answer
    stream = one(
        [
            s
            for s in c.wait_for(lambda s: any(x.name == "batcher.stream" for x in s))
            if s.trace_id == trace_id
        ],
        "batcher.stream",
    )
    assert stream.attributes["batcher.outcome"] == "cancelled"
    assert stream.attributes["batcher.chunks"] == delivered >= 3
    assert stream.status_code != 2  # a client's cancel is no error


def test_a_stream_whose_worker_is_killed_ends_its_broker_span_worker_lost(
    spawn: Callable[..., Any], collector: Callable[..., Collector], zctx: zmq.Context[Any]
) -> None:
    c = collector()
    trace = ("--trace-endpoint", c.endpoint)
    beat = ("--heartbeat-ms", "100")
    frontend, backend = start_broker(spawn, zctx, "--model", "simlm", *beat, *trace)
    worker = spawn(
        "worker", "--connect", backend, "--model", "simlm", "--simlm-step-base-ms", "20", *beat, *trace
    )
    traceparent, trace_id, _ = new_traceparent()
    sock = zctx.socket(zmq.DEALER)
    sock.connect(frontend)
    sock.send_multipart(
        [b"", pack({"id": 3, "input": {"tokens": 1000}, "stream": True, "traceparent": traceparent})]
    )
    first = recv_reply(sock, timeout_s=20.0)
    assert first["ok"] and first.get("more"), first
    worker.process.send_signal(signal.SIGKILL)  # it had sent a chunk: the stream cannot start over
    replies = [first]
    while replies[-1].get("ok") and replies[-1].get("more"):
        replies.append(recv_reply(sock, timeout_s=20.0))
    assert replies[-1]["error"]["code"] == "worker_failed", replies[-1]
    spans = c.wait_for(lambda s: any(x.name == "batcher.stream" and x.trace_id == trace_id for x in s))
    stream = one([x for x in spans if x.trace_id == trace_id], "batcher.stream")
    assert stream.attributes["batcher.outcome"] == "worker_lost" and "batcher.worker_lost" in stream.events
    assert stream.attributes["batcher.chunks"] == len(replies) - 1 and stream.status_code == 2  # ERROR
