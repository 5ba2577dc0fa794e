"""The cancel index made at a queue's first cancel (CancelIndex) changes nothing a client
sees: whatever the events (plain, prioritized and deadlined requests, length buckets, ids
reused, batches cut, failed and requeued, cancels by id or by client, expiries, a model's
queue emptied), a model queue that files its requests only at the first cancel cuts the
same batches, cancels and expires the same requests and keeps the same counts as one
filed from the start (as every queue was before the index was made lazily)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from batcher.core.limits import BatchSettings
from batcher.core.policy import batch_requests
from batcher.core.queue import DISPATCHED, ModelQueue, QueuedRequest, oldest_first

_put = st.tuples(
    st.just("put"),
    st.sampled_from([b"a", b"b"]),  # the client
    st.sampled_from([1, 2, "x", None]),  # its id: reused on purpose
    st.sampled_from([0, 0, 0, 1, -1]),  # priority
    st.one_of(st.none(), st.none(), st.floats(0.0, 0.5)),  # deadline after its arrival (s)
    st.sampled_from([None, None, 1, 2]),  # length bucket
    st.sampled_from([1.0, 2.0, 0.5]),  # cost
)
_plain = st.tuples(
    st.just("put"),
    st.sampled_from([b"a", b"b"]),
    st.sampled_from([1, 2]),
    st.just(0),
    st.none(),
    st.none(),
    st.just(1.0),
)
_cancel = st.tuples(st.just("cancel"), st.sampled_from([b"a", b"b"]), st.sampled_from([1, 2, "x", None]))
_events = st.lists(
    st.one_of(
        _put,
        _plain,
        _plain,
        _cancel,
        st.tuples(st.just("gone"), st.sampled_from([b"a", b"b"])),
        st.just(("cut",)),
        st.just(("cut",)),
        st.tuples(st.just("fail"), st.integers(0, 7)),
        st.just(("expire",)),
        st.just(("discard_all",)),
        st.tuples(st.just("later"), st.sampled_from([0.0, 0.0005, 0.002, 0.1])),
    ),
    max_size=80,
)


class _Model:
    """A model's queue driven as the scheduler drives it; `filed_from_start` makes the
    cancel index of each of its queues before any request comes."""

    def __init__(self, batch: BatchSettings, filed_from_start: bool) -> None:
        self.mq = ModelQueue(batch)
        self.filed_from_start = filed_from_start
        self.in_flight: list[list[QueuedRequest]] = []
        self.requests: list[QueuedRequest] = []
        self.seq = 0

    def index(self, r: QueuedRequest) -> int:
        return next(i for i, q in enumerate(self.requests) if q is r)

    def apply(self, event: tuple[Any, ...], now: float) -> object:
        kind = event[0]
        mq = self.mq
        if kind == "put":
            _, client, rid, priority, deadline_s, bucket, cost = event
            r = QueuedRequest(
                [client, b""], b"\x80", rid, now, priority, None if deadline_s is None else now + deadline_s
            )
            r.cost, r.bucket = cost, bucket
            lane = mq.bucket_queue(bucket)
            if self.filed_from_start:
                lane.find(b"nobody", -1)
            self.seq += 1
            lane.put(r, self.seq)
            self.requests.append(r)
            return None
        if kind == "cancel":
            out = []
            for lane in mq.lanes():
                for r in lane.find(event[1], event[2]):
                    lane.discard(r)
                    out.append(self.index(r))
            return sorted(out)  # (the replies to one client and id: the same bytes in any order)
        if kind == "gone":  # Scheduler.cancel: by a predicate, without the index
            out = []
            for lane in mq.lanes():
                for r in [r for r in lane.queued() if r.envelope[0] == event[1]]:
                    lane.discard(r)
                    out.append(self.index(r))
            return sorted(out)
        if kind == "cut":
            lanes = oldest_first(mq)
            if not lanes or not lanes[0].size:
                return None
            batch = batch_requests(lanes[0])
            for r in batch:
                r.state = DISPATCHED
            lanes[0].compact()
            self.in_flight.append(batch)
            return [self.index(r) for r in batch]
        if kind == "fail":
            if not self.in_flight:
                return None
            batch = self.in_flight.pop(event[1] % len(self.in_flight))
            mq.requeue(batch, count_attempt=True)
            return [self.index(r) for r in batch]
        if kind == "expire":
            return sorted(self.index(r) for lane in mq.lanes() for r in lane.expire(now))
        if kind == "discard_all":
            return sorted(self.index(r) for r in mq.discard_all())
        return None

    def counts(self) -> list[tuple[int, float, int]]:
        return [(lane.size, lane.queued_cost, lane.suspects) for lane in self.mq.lanes()]


@settings(max_examples=300)
@given(_events, st.sampled_from([None, 3.0]), st.integers(1, 5), st.sampled_from([0.0, 50.0]))
def test_a_queue_filed_at_its_first_cancel_acts_as_one_filed_from_the_start(
    events: list[tuple[Any, ...]], max_cost: float | None, max_size: int, aging_ms: float
) -> None:
    batch = BatchSettings(max_batch_size=max_size, max_batch_cost=max_cost, priority_aging_ms=aging_ms)
    lazy, eager = _Model(batch, filed_from_start=False), _Model(batch, filed_from_start=True)
    now = 1000.0
    for event in events:
        if event[0] == "later":
            now += event[1]
            continue
        assert lazy.apply(event, now) == eager.apply(event, now), event
        assert lazy.counts() == eager.counts()
    # every request still queued can be cancelled, and the queues end empty
    for r in [*lazy.requests]:
        assert lazy.apply(("cancel", r.envelope[0], r.id), now) == eager.apply(
            ("cancel", r.envelope[0], r.id), now
        )
    assert lazy.counts() == eager.counts() and all(size == 0 for size, _, _ in lazy.counts())
