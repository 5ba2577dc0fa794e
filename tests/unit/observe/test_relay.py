"""The broker's span records (batcher.observe.relay.RelaySpans) of a batch: the queue
spans its start records in one loop are, record for record, what ending each request's
queue span alone (`queue_ended`, linked to the batch) records, with the same links,
contexts and ids, for requests with and without a caller's context, tracestate,
deadline, and ids of every type."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("msgpack")

from batcher.observe.relay import Ctx, RelaySpans, RelayTrace


def spans(seed: int) -> RelaySpans:
    """A RelaySpans without its exporter process or socket (records are only kept)."""
    rs = RelaySpans.__new__(RelaySpans)
    rs.ratio, rs.parent_based, rs.samples_roots = 1.0, True, True
    rs._offset_ns = 1_700_000_000_000_000_000
    rs._bits = random.Random(seed).getrandbits
    rs._random = random.Random(seed + 1).random
    rs._records, rs._max_kept, rs._open = [], 2048, {}
    return rs


def requests(seed: int, now: float) -> list[Any]:
    rng = random.Random(seed)
    out = []
    for i in range(12):
        parent = None
        if i % 3 == 1:
            parent = Ctx(rng.getrandbits(128) or 1, rng.getrandbits(64) or 1, 1, "k=v" if i % 2 else None)
        out.append(
            SimpleNamespace(
                id=[f"r{i}", i, None, 2.5][i % 4],
                priority=[0.0, 3, -1.5][i % 3],
                attempts=i % 2,
                handbacks=0,
                deadline_at=None if i % 4 == 0 else now + 0.25 * i,
                arrived_at=now - 0.001 * i,
                trace=RelayTrace(parent),
                cost=1.0,
            )
        )
    return out


def one_by_one(rs: RelaySpans, batch: Any, now: float) -> tuple[Any, list[Any]]:
    """What batch_started recorded before its loop: each request's queue_ended."""
    traced = [r for r in batch.requests if r.trace is not None]
    first = traced[0]
    rs.queue_ended(first, batch.model, "batched", now)
    parent = first.trace.queue
    ctx = Ctx(parent.trace_id, rs._bits(64) or 1, 1, parent.state)
    links = [(parent.trace_id.to_bytes(16, "big"), parent.span_id, str(first.id))]
    for r in traced[1:]:
        rs.queue_ended(r, batch.model, "batched", now, batch=ctx)
        q = r.trace.queue
        links.append((q.trace_id.to_bytes(16, "big"), q.span_id, str(r.id)))
    return ctx, links


@pytest.mark.parametrize("seed", range(5))
def test_a_batch_s_queue_spans_are_what_queue_ended_records(seed: int) -> None:
    now = time.monotonic()
    mine, theirs = spans(seed), spans(seed)
    mine_batch = SimpleNamespace(requests=requests(seed, now), model="echo", batch_id=7, multiplexed=False)
    their_batch = SimpleNamespace(requests=requests(seed, now), model="echo", batch_id=7, multiplexed=False)
    traceparent = mine.batch_started(mine_batch, "w-1", 12.0, now)
    ctx, links = one_by_one(theirs, their_batch, now)
    assert traceparent == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-01"
    assert mine._records == theirs._records
    assert len(mine._records) == len(mine_batch.requests)
    assert mine._open[7][4] == links
    for a, b in zip(mine_batch.requests, their_batch.requests, strict=True):
        assert a.trace.queue == b.trace.queue
        assert isinstance(a.trace.queue, Ctx) and a.trace.queue.trace_id == b.trace.queue.trace_id


@pytest.mark.parametrize("seed", range(3))
def test_records_cross_to_the_exporter_as_msgpack_writes_and_reads_them(seed: int) -> None:
    """The relay packs with msgspec and the exporter process reads with it: the bytes are
    msgpack's own (a 64-bit span id, 128-bit trace ids as bytes, attributes, links, events,
    tracestate), and what the exporter reads is what msgpack reads."""
    import msgpack

    pytest.importorskip("opentelemetry.sdk")  # (the exporter process's module imports it)
    from batcher.observe import relay, relay_exporter

    now = time.monotonic()
    rs = spans(seed)
    batch = SimpleNamespace(requests=requests(seed, now), model="echo", batch_id=7, multiplexed=False)
    rs.batch_started(batch, "w-1", 12.0, now)
    rs.batch_answered(7, now + 0.01, 1.5, 0.25, (12, 10), 0)
    records = rs._records
    assert {r[0] for r in records} == {relay.QUEUE, relay.BATCH}
    packed = relay._pack(records)
    assert packed == msgpack.packb(records)
    assert relay_exporter._unpack(packed) == msgpack.unpackb(packed, raw=False, strict_map_key=False)
    top = (1 << 64) - 1
    assert relay._pack([(relay.QUEUE, top)]) == msgpack.packb([(relay.QUEUE, top)])
