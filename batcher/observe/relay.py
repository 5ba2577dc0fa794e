"""The broker's spans without the SDK in its process: its loop keeps each span as a raw
record (ids, times, and a queue span's attribute values in their places: a tuple), and
hands them, msgpack-packed, a batch of records at a time, to an exporter process of its
own (batcher.observe.relay_exporter) over an ipc:// PAIR socket; that process encodes
them into OTLP's protobuf messages (batcher.observe.otlp_records, where the record
formats are) and exports them. What moved the benchmark: the SDK's span start and end
(about 35 and 26 us) and the OTLP encode (about 78 us a span) ran under the broker's
GIL; a record costs the loop a few microseconds (docs/benchmarks.md, "Tracing"). Records
the exporter cannot take yet (it is starting, or its socket is full) are kept, up to the
export queue's size, and sent at the next flush (a batch's end, or the heartbeat tick);
past that, dropped, counted.

Same face as batcher.observe.broker_spans.BrokerSpans (the in-process SDK, kept for
comparison: BATCHER_TRACE_IN_PROCESS=1). A relay socket that is full (the exporter
process behind) drops records, counted with the exporter's own drops."""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict
from typing import Any, NamedTuple

import msgpack
import msgspec
import zmq

from batcher.observe.attributes import STREAM_FINE, batch_attributes, stream_attributes
from batcher.observe.clock import wall_offset_ns
from batcher.observe.counters import count_dropped
from batcher.observe.settings import TraceSettings
from batcher.wire.tracecontext import format_traceparent, parse_traceparent, parse_tracestate, should_sample

log = logging.getLogger("batcher.tracing")

#: The first item of a queue span's record and of a batch span's (their formats:
#: batcher.observe.otlp_records, which encodes them in the exporter process).
QUEUE, BATCH = 0, 1
#: Record messages the relay socket holds before the loop drops (counted) instead.
RELAY_HWM = 1000
#: Records kept before a batch's end hands them over; fewer wait for the heartbeat tick
#: (every 500 ms): one message of a few hundred records costs the loop less than one a batch.
FLUSH_RECORDS = 256
#: The exporter process's niceness (os.nice): it yields the CPU to serving, on a machine
#: without a core to spare, at the price of spans dropped (counted) when it falls behind.
EXPORTER_NICE = int(os.environ.get("BATCHER_TRACE_EXPORTER_NICE", "10"))
#: Open batch spans kept at most (a worker that never answers cannot grow the table).
MAX_OPEN_BATCHES = 100_000
#: Records packed for the exporter process: msgspec writes the very bytes msgpack.packb
#: does (a unit test compares them), in a quarter of its time (0.22 against 0.83 us a
#: record), and this runs on the broker's loop.
_pack = msgspec.msgpack.Encoder().encode


def _b(trace_id: int) -> bytes:
    """A 128-bit trace id as msgpack carries it (its ints stop at 64 bits)."""
    return trace_id.to_bytes(16, "big")


class Ctx(NamedTuple):
    """A span's context, as the broker keeps it."""

    trace_id: int
    span_id: int
    flags: int = 1
    state: str | None = None


#: A Ctx from a tuple of its four fields, without NamedTuple's Python-level __new__.
_ctx = functools.partial(tuple.__new__, Ctx)


class RelayTrace:
    """A traced request's context at the broker (as spans.RequestTrace)."""

    __slots__ = ("parent", "queue", "stream")

    def __init__(self, parent: Ctx | None) -> None:
        self.parent = parent
        self.queue: Ctx | None = None
        #: A stream's open delivery span: [ctx, parent span id, start ns, attributes, start].
        self.stream: list[Any] | None = None


class RelaySpans:
    """The broker's spans as records, exported by a process of their own."""

    def __init__(self, settings: TraceSettings, service: str, attributes: dict[str, Any]) -> None:
        self.ratio = settings.sample_ratio
        self.parent_based = settings.parent_based
        self.samples_roots = self.ratio > 0.0
        self._offset_ns = wall_offset_ns()
        self._bits = random.getrandbits
        self._random = random.random
        self._records: list[tuple[Any, ...]] = []
        #: Records kept while the exporter process cannot take them (it starts, or lags).
        self._max_kept = settings.max_queue_size
        self._open: dict[int, list[Any]] = {}
        self._dir = tempfile.mkdtemp(prefix="batcher-trace-")
        address = f"ipc://{os.path.join(self._dir, 'relay')}"
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._sock: zmq.Socket[Any] = self._ctx.socket(zmq.PAIR)
        self._sock.setsockopt(zmq.SNDHWM, RELAY_HWM)
        self._sock.setsockopt(zmq.LINGER, 2000)
        self._sock.bind(address)
        config = json.dumps(
            {
                "settings": asdict(settings),
                "service": service,
                "attributes": attributes,
                "nice": EXPORTER_NICE,
            }
        )
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "batcher.observe.relay_exporter", address, config], stdin=subprocess.PIPE
        )

    def ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._offset_ns

    def admit(self, traceparent: object, tracestate: object) -> RelayTrace | None:
        """A request's trace if it is sampled (None: it costs nothing more)."""
        parent = parse_traceparent(traceparent) if traceparent is not None else None
        ratio = self.ratio
        if parent is None and ratio >= 1.0:
            return RelayTrace(None)
        if not should_sample(parent, ratio, self._random(), self.parent_based):
            return None
        if parent is None:
            return RelayTrace(None)
        state = parse_tracestate(tracestate) if tracestate is not None else None
        return RelayTrace(Ctx(int(parent.trace_id, 16), int(parent.span_id, 16), parent.flags, state))

    def queue_ended(
        self,
        req: Any,
        model: str,
        outcome: str,
        now: float,
        code: str | None = None,
        batch: Ctx | None = None,
    ) -> None:
        """A traced request left its queue: its queue span (as BrokerSpans.queue_ended)."""
        rt: RelayTrace = req.trace
        if rt.queue is not None:
            return
        parent = rt.parent
        rid = req.id
        if rid is not None and type(rid) is not str:
            rid = str(rid)
        deadline_at = req.deadline_at
        deadline_ms = None if deadline_at is None else round((deadline_at - req.arrived_at) * 1000.0, 3)
        if parent is None:
            ctx = Ctx(self._bits(128) or 1, self._bits(64) or 1)
            parent_id = 0
        else:
            ctx = Ctx(parent.trace_id, self._bits(64) or 1, 1, parent.state)
            parent_id = parent.span_id
        rt.queue = ctx
        offset = self._offset_ns
        self._records.append(
            (
                QUEUE, ctx.trace_id.to_bytes(16, "big"), ctx.span_id, parent_id,
                int(req.arrived_at * 1e9) + offset, int(now * 1e9) + offset,
                model, float(req.priority), outcome, req.attempts + 1, rid, deadline_ms, code,
                None if batch is None else batch.trace_id.to_bytes(16, "big"),
                0 if batch is None else batch.span_id, ctx.state,
            )
        )  # fmt: skip
        if outcome not in ("batched", "started") and len(self._records) >= FLUSH_RECORDS:
            self.flush()

    def refused(self, rt: RelayTrace, req_id: object, model: str | None, code: str, now: float) -> None:
        """A traced request refused at the door: a queue span of no length, with its code
        (no priority or attempt: it was never queued; as BrokerSpans.refused)."""
        parent = rt.parent
        if parent is None:
            trace_id, parent_id, state = self._bits(128) or 1, 0, None
        else:
            trace_id, parent_id, state = parent.trace_id, parent.span_id, parent.state
        at_ns = self.ns(now)
        self._records.append(
            (QUEUE, _b(trace_id), self._bits(64) or 1, parent_id, at_ns, at_ns, model or "", None, "refused",
             None, None if req_id is None else str(req_id), None, code, None, 0, state)
        )  # fmt: skip
        if len(self._records) >= FLUSH_RECORDS:
            self.flush()

    def batch_started(self, batch: Any, worker: str, cost: float, now: float) -> str | None:
        """The batch's span begins (its record is made when it ends); its traceparent for
        the BATCH header, None when none of its requests is traced."""
        traced = [r for r in batch.requests if r.trace is not None]
        if not traced:
            return None
        first = traced[0]
        if first.trace.queue is None:
            self.queue_ended(first, batch.model, "batched", now)
        parent = first.trace.queue
        ctx = Ctx(parent.trace_id, self._bits(64) or 1, 1, parent.state)
        links = [(_b(parent.trace_id), parent.span_id, str(first.id))]
        if len(traced) > 1:
            self._batched(traced, batch.model, now, ctx, links)
        attempt, attributes = batch_attributes(batch, cost, worker, len(traced))
        events = [("batcher.redispatch", self.ns(now), {"batcher.attempt": attempt})] if attempt > 1 else []
        if len(self._open) >= MAX_OPEN_BATCHES:  # the oldest ends now (exported, as BrokerSpans ends it)
            self._end_batch(next(iter(self._open)), now, None)
        self._open[batch.batch_id] = [ctx, parent.span_id, self.ns(now), attributes, links, events]
        return format_traceparent(ctx.trace_id, ctx.span_id, 1)

    def _batched(self, traced: list[Any], model: str, now: float, batch: Ctx, links: list[Any]) -> None:
        """The queue spans of a batch's traced requests but its first (whose queue span is
        the batch's parent), each linked to the batch, and the batch's link to each: what
        `queue_ended(r, model, "batched", now, batch=batch)` records, in one loop (the
        broker's loop is the serving bottleneck, and these are most of its spans)."""
        bits, offset, append, link = self._bits, self._offset_ns, self._records.append, links.append
        end_ns = int(now * 1e9) + offset
        batch_trace, batch_span = _b(batch.trace_id), batch.span_id
        for r in traced[1:]:
            rt: RelayTrace = r.trace
            q = rt.queue
            if q is not None:  # its queue span has ended already (never, today)
                link((_b(q.trace_id), q.span_id, str(r.id)))
                continue
            parent = rt.parent
            if parent is None:
                trace_id, parent_id, state = bits(128) or 1, 0, None
            else:
                trace_id, parent_id, state = parent.trace_id, parent.span_id, parent.state
            span_id = bits(64) or 1
            rt.queue = _ctx((trace_id, span_id, 1, state))
            rid = r.id
            if rid is not None and type(rid) is not str:
                rid = str(rid)
            deadline_at = r.deadline_at
            deadline_ms = None if deadline_at is None else round((deadline_at - r.arrived_at) * 1000.0, 3)
            trace = trace_id.to_bytes(16, "big")
            append(
                (
                    QUEUE, trace, span_id, parent_id, int(r.arrived_at * 1e9) + offset, end_ns,
                    model, float(r.priority), "batched", r.attempts + 1, rid, deadline_ms, None,
                    batch_trace, batch_span, state,
                )
            )  # fmt: skip
            link((trace, span_id, str(r.id)))

    def stream_started(self, req: Any, model: str, worker: str, now: float) -> str:
        """A traced request given to a step-level worker's slot: its queue span ends and
        its stream span begins (as BrokerSpans.stream_started); the START header's traceparent."""
        rt: RelayTrace = req.trace
        self.queue_ended(req, model, "started", now)
        q = rt.queue
        assert q is not None
        ctx = Ctx(q.trace_id, self._bits(64) or 1, 1, q.state)
        rt.stream = [ctx, q.span_id, self.ns(now), stream_attributes(req, model, worker), now]
        return format_traceparent(ctx.trace_id, ctx.span_id, 1)

    def stream_chunk(self, rt: RelayTrace, now: float) -> None:
        """A traced stream's first chunk reached the broker."""
        if rt.stream is not None:
            rt.stream[3]["batcher.first_chunk_ms"] = round((now - rt.stream[4]) * 1000.0, 3)

    def stream_ended(self, rt: RelayTrace, now: float, outcome: str, chunks: int, why: str | None) -> None:
        """A traced stream was answered: its span's record (the general form)."""
        if rt.stream is None:
            return
        (ctx, parent_id, start_ns, attributes, _), rt.stream = rt.stream, None
        attributes["batcher.outcome"] = outcome
        attributes["batcher.chunks"] = chunks
        end_ns = self.ns(now)
        events = [] if why is None else [("batcher.worker_lost", end_ns, {"batcher.reason": why})]
        error = None if outcome in STREAM_FINE else why or outcome
        self._records.append(
            ("batcher.stream", 0, _b(ctx.trace_id), ctx.span_id, parent_id, start_ns, end_ns, attributes, [],
             events, error, ctx.state)
        )  # fmt: skip
        if len(self._records) >= FLUSH_RECORDS:
            self.flush()

    def _end_batch(self, batch_id: int, now: float, error: str | None) -> None:
        held = self._open.pop(batch_id, None)
        if held is None:
            return
        ctx, parent_id, start_ns, attributes, links, events = held
        self._records.append(
            (
                BATCH, _b(ctx.trace_id), ctx.span_id, parent_id, start_ns, self.ns(now),
                attributes, links, events, error, ctx.state,
            )
        )  # fmt: skip
        if len(self._records) >= FLUSH_RECORDS:
            self.flush()

    def batch_answered(
        self, batch_id: int, now: float, infer_ms: float, wait_ms: float | None, padding: Any, errors: Any
    ) -> Ctx | None:
        """The worker's REPLY came: the batch span ends, with the worker's figures; its
        context (the batch's exemplar on the latency histograms), None when not traced."""
        held = self._open.get(batch_id)
        if held is None:
            return None
        attributes = held[3]
        attributes["batcher.infer_ms"] = float(infer_ms)
        if wait_ms is not None:
            attributes["batcher.worker_wait_ms"] = float(wait_ms)
        if padding is not None:
            padded, real = padding
            attributes["batcher.padding_waste"] = padded / real if real else 0.0
        failed = errors if isinstance(errors, int) else sum(errors.values())
        self._end_batch(batch_id, now, f"{failed} requests failed" if failed else None)
        ctx: Ctx = held[0]
        return ctx

    def batch_failed(self, batch_id: int, now: float, event: str, why: str) -> None:
        """The batch will not be answered: its span ends with `event`."""
        held = self._open.get(batch_id)
        if held is not None:
            held[5].append((event, self.ns(now), {"batcher.reason": why}))
            self._end_batch(batch_id, now, why)

    def flush(self) -> None:
        """Hand the records kept so far to the exporter process (dropped, counted, when
        its socket is full), and take the drop counts it sent back."""
        records = self._records
        if records:
            try:
                self._sock.send(_pack(records), zmq.NOBLOCK)
                self._records = []
            except zmq.ZMQError:  # the exporter not connected yet, or behind: kept, up to a bound
                if len(records) > self._max_kept:
                    count_dropped(len(records) - self._max_kept)
                    self._records = records[-self._max_kept :]
        try:
            while True:
                said = msgpack.unpackb(self._sock.recv(zmq.NOBLOCK))
                count_dropped(int(said))
        except (zmq.ZMQError, ValueError, TypeError):
            return

    def shutdown(self) -> None:
        """Hand over what is left, then let the exporter process export it and exit."""
        self.flush()
        self._sock.close(2000)
        self._ctx.term()
        if self._proc.stdin is not None:
            self._proc.stdin.close()  # the exporter process's signal to finish
        try:
            self._proc.wait(5.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)
