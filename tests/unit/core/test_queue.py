"""batcher.core.queue on its own: a model's queue, its lanes and the requests' order, driven
with plain floats for the time (no Scheduler around it)."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batcher.core.limits import BatchSettings
from batcher.core.queue import DISPATCHED, QUEUED, REMOVED, ModelQueue, QueuedRequest, oldest_first

_seq = itertools.count()


def req(
    t: float, priority: float = 0, deadline: float | None = None, bucket: int | None = None
) -> QueuedRequest:
    rid = next(_seq)
    r = QueuedRequest([f"client-{rid}".encode(), b""], b"\x80", rid, t, priority, deadline)
    r.bucket = bucket
    return r


def queue(aging_ms: float = 0.0) -> ModelQueue:
    return ModelQueue(BatchSettings(max_batch_size=4, priority_aging_ms=aging_ms))


def fill(mq: ModelQueue, *reqs: QueuedRequest) -> list[QueuedRequest]:
    for r in reqs:
        mq.put(r, next(_seq))
    return list(reqs)


def drain(mq: ModelQueue) -> list[QueuedRequest]:
    out = []
    while mq.size:
        out.append(mq.pop())
    return out


# A request as (arrival, priority, deadline or None), arrivals in increasing order.
requests = st.lists(
    st.tuples(
        st.sampled_from([0, 0, 0, 1, 2, -1]),
        st.one_of(st.none(), st.floats(min_value=0, max_value=100, allow_nan=False)),
    ),
    max_size=40,
)


@given(requests)
def test_pop_order_is_priority_then_deadline_then_arrival(spec: list[tuple[int, float | None]]) -> None:
    mq = queue()
    reqs = fill(mq, *[req(float(i), p, d) for i, (p, d) in enumerate(spec)])
    assert mq.size == len(reqs)
    key = {id(r): (-r.priority, math.inf if r.deadline_at is None else r.deadline_at, r.seq) for r in reqs}
    assert drain(mq) == sorted(reqs, key=lambda r: key[id(r)])
    assert mq.size == 0 and mq.queued_cost == 0.0


@given(requests, st.data())
def test_put_back_restores_the_order_and_counts_an_attempt(
    spec: list[tuple[int, float | None]], data: st.DataObject
) -> None:
    mq = queue()
    reqs = fill(mq, *[req(float(i), p, d) for i, (p, d) in enumerate(spec)])
    taken = [mq.pop() for _ in range(data.draw(st.integers(0, len(reqs))))]
    mq.put_back(taken, count_attempt=True)
    assert all(r.state == QUEUED and r.attempts == 1 for r in taken)
    assert mq.size == len(reqs)
    key = {id(r): (-r.priority, math.inf if r.deadline_at is None else r.deadline_at, r.seq) for r in reqs}
    assert drain(mq) == sorted(reqs, key=lambda r: key[id(r)])


def test_put_back_without_an_attempt_leaves_the_count() -> None:
    mq = queue()
    (r,) = fill(mq, req(0.0))
    mq.put_back([mq.pop()], count_attempt=False)
    assert r.attempts == 0 and mq.oldest() is r


def test_the_oldest_is_the_earliest_arrival_of_either_lane() -> None:
    mq = queue()
    plain, urgent = fill(mq, req(1.0), req(2.0, priority=5))
    assert mq.peek() is urgent and mq.oldest() is plain
    mq.discard(plain)
    assert plain.state == REMOVED and mq.oldest() is urgent


def test_expire_takes_the_requests_at_or_past_their_deadline() -> None:
    mq = queue()
    early, late, none = fill(mq, req(0.0, deadline=5.0), req(0.0, deadline=9.0), req(0.0))
    assert mq.expire(4.9) == []
    assert mq.expire(5.0) == [early]
    assert early.state == REMOVED and mq.size == 2 and mq.earliest_deadline() == 9.0
    assert mq.expire(100.0) == [late] and mq.oldest() is none


def test_rerank_orders_the_queue_by_the_new_aging() -> None:
    mq = queue()
    old, new = fill(mq, req(0.0), req(10.0, priority=1))
    assert mq.peek() is new
    mq.settings = BatchSettings(
        max_batch_size=4, priority_aging_ms=1.0
    )  # 1 ms: 10 s of waiting is 10,000 priority
    mq.rerank()
    assert drain(mq) == [old, new]


def test_rerank_keeps_the_count_cost_and_suspects_of_the_queued_requests() -> None:
    """A rerank rebuilds the lanes: the summed cost (max_batch_cost reads it) and the count
    of suspects (each runs alone) are still those of the requests queued, and drop to 0
    once they are taken."""
    mq = queue()
    plain, urgent, suspect = req(0.0), req(1.0, priority=1), req(2.0, deadline=9.0)
    plain.cost, urgent.cost, suspect.cost, suspect.suspect = 0.5, 2.0, 1.0, 1
    fill(mq, plain, urgent, suspect)
    mq.settings = BatchSettings(max_batch_size=4, priority_aging_ms=1.0)
    mq.rerank()
    assert (mq.size, mq.queued_cost, mq.suspects) == (3, 3.5, 1)
    assert drain(mq) == [plain, urgent, suspect]
    assert (mq.size, mq.queued_cost, mq.suspects) == (0, 0.0, 0)


def test_aging_ranks_a_request_by_its_wait() -> None:
    mq = queue(aging_ms=1000.0)
    r = req(3.0, priority=2)
    assert mq.rank(r) == -2 + 3.0


def test_with_aging_a_plain_request_is_overtaken_only_within_one_interval_per_priority() -> None:
    """Aging 10 ms: a request of priority 1 goes ahead of a plain one (priority 0, the
    fifo lane) that arrived less than 10 ms before it, and behind one that arrived more."""
    mq = queue(aging_ms=10.0)
    plain = req(1.0)
    within, beyond = req(1.0095, priority=1), req(1.0105, priority=1)
    fill(mq, plain, beyond, within)
    assert plain.rank == 1.0 * 1000.0 / 10.0
    assert drain(mq) == [within, plain, beyond]


def test_requeue_puts_each_request_back_in_its_bucket() -> None:
    mq = queue()
    a, b = req(0.0, bucket=0), req(1.0, bucket=1)
    for r in (a, b):
        mq.bucket_queue(r.bucket).put(r, next(_seq))
    taken = mq.take(2)
    assert taken == [a, b] and all(r.state == DISPATCHED for r in taken) and mq.total() == 0
    mq.requeue(taken, count_attempt=True)
    assert mq.buckets[0].oldest() is a and mq.buckets[1].oldest() is b and mq.size == 0
    assert mq.total() == 2


def test_take_and_oldest_first_go_by_the_heads_across_buckets() -> None:
    mq = queue()
    late, urgent, first = req(2.0, bucket=0), req(3.0, priority=1, bucket=1), req(1.0, bucket=2)
    for r in (first, late, urgent):
        mq.bucket_queue(r.bucket).put(r, next(_seq))
    assert oldest_first(mq) == [mq.buckets[1], mq.buckets[2], mq.buckets[0]]
    assert mq.take(5) == [urgent, first, late]
    assert mq.take(1) == []
    plain = queue()
    assert oldest_first(plain) == [plain]


def test_discard_all_empties_every_bucket() -> None:
    mq = queue()
    reqs = [req(0.0), req(1.0, bucket=3), req(2.0, priority=1, bucket=3)]
    for r in reqs:
        mq.bucket_queue(r.bucket).put(r, next(_seq))
    assert sorted(r.seq for r in mq.discard_all()) == sorted(r.seq for r in reqs)
    assert mq.total() == 0 and all(r.state == REMOVED for r in reqs)


def test_stamp_no_worker_counts_from_the_first_turn_without_one() -> None:
    mq = queue()
    assert mq.stamp_no_worker(10.0) == 0.0
    assert mq.stamp_no_worker(12.5) == 2.5 and mq.no_worker_since == 10.0
    mq.workers[b"w"] = None
    assert mq.stamp_no_worker(13.0) is None and mq.no_worker_since is None
    del mq.workers[b"w"]
    assert mq.stamp_no_worker(20.0) == 0.0


def test_cancel_finds_a_request_by_client_and_id() -> None:
    mq = queue()
    (r,) = fill(mq, req(0.0))
    assert mq.find(r.envelope[0], r.id) == [r]
    mq.discard(r)
    assert mq.find(r.envelope[0], r.id) == [] and mq.cancels is None  # emptied: the index is dropped


def _twin_queues(
    spec: list[tuple[int, float | None]], costs: list[float], gone: set[int]
) -> tuple[ModelQueue, ModelQueue]:
    """Two queues holding the same requests (copies), some of them discarded."""
    pair = (queue(), queue())
    for i, (p, d) in enumerate(spec):
        for mq in pair:
            r = QueuedRequest([b"c", b""], b"\x80", i, float(i), p, d)
            r.cost = costs[i % len(costs)]
            r.suspect = i % 5 == 4
            mq.put(r, i)
            if i in gone:
                mq.discard(r)
    return pair


@given(requests, st.lists(st.floats(min_value=0.1, max_value=9.0), min_size=1, max_size=5), st.data())
def test_pop_many_takes_what_pop_n_times_takes(
    spec: list[tuple[int, float | None]], costs: list[float], data: st.DataObject
) -> None:
    gone = set(data.draw(st.lists(st.integers(0, max(0, len(spec) - 1)), max_size=8))) if spec else set()
    one, many = _twin_queues(spec, costs, gone)
    assert many.suspects == sum(1 for i in range(len(spec)) if i % 5 == 4 and i not in gone)
    while one.size:
        n = data.draw(st.integers(1, one.size))
        expected = [(r.id, r.seq) for r in (one.pop() for _ in range(n))]
        assert [(r.id, r.seq) for r in many.pop_many(n)] == expected
        assert (many.size, many.suspects) == (one.size, one.suspects)
        assert many.queued_cost == one.queued_cost
    assert many.queued_cost == 0.0


@given(requests, st.data())
def test_the_cancel_index_is_filed_at_the_first_find_and_kept_after(
    spec: list[tuple[int, float | None]], data: st.DataObject
) -> None:
    mq = queue()
    reqs = fill(mq, *[req(float(i), p, d) for i, (p, d) in enumerate(spec)], req(99.0))
    taken = [mq.pop() for _ in range(data.draw(st.integers(0, len(reqs) - 1)))]
    assert mq.cancels is None  # nobody cancelled: nothing filed
    assert mq.find(b"nobody", -1) == []  # some wait: the index is made
    later = fill(mq, req(100.0), req(101.0, priority=1))
    if mq.size > 2:
        taken += mq.pop_many(data.draw(st.integers(1, mq.size - 2)))
    queued = [r for r in [*reqs, *later] if r not in taken]
    filed = {
        id(r)
        for ids in (mq.cancels.by_client.values() if mq.cancels is not None else ())
        for held in ids.values()
        for r in (held if isinstance(held, list) else [held])
    }
    assert filed == {id(r) for r in queued}
    for r in queued:
        assert mq.find(r.envelope[0], r.id) == [r]


def test_requests_put_back_after_the_first_cancel_can_be_cancelled() -> None:
    mq = queue()
    a, b, c = fill(mq, req(0.0), req(1.0, priority=1), req(2.0))
    assert mq.find(b"nobody", -1) == []  # the index is made
    taken = mq.pop_many(2)
    assert taken == [b, a]
    mq.put_back(taken, count_attempt=True)
    for r in (a, b, c):
        assert mq.find(r.envelope[0], r.id) == [r]


def test_the_cancel_index_is_dropped_when_the_queue_empties_and_not_made_for_an_empty_one() -> None:
    """A cancel now and then (a gateway's late rows) files a queue's requests only while
    some wait: once it empties, its requests leave the fifo lane in one pass again."""
    mq = queue()
    assert mq.find(b"c", 1) == [] and mq.cancels is None  # nothing waits: nothing made
    a, b = fill(mq, req(0.0), req(1.0))
    assert mq.find(a.envelope[0], a.id) == [a] and mq.cancels is not None
    mq.discard(a)
    assert mq.cancels is not None and mq.find(b.envelope[0], b.id) == [b]
    assert mq.pop() is b and mq.cancels is None
    c, d = fill(mq, req(2.0), req(3.0))
    assert mq.find(c.envelope[0], c.id) == [c]
    assert mq.pop_many(2) == [c, d] and mq.cancels is None


@pytest.mark.parametrize("seed", range(40))
def test_pop_many_leaves_the_very_float_of_queued_cost_that_pop_does(seed: int) -> None:
    """Costs taken off one by one, in pop's order: a sum taken off at once rounds
    differently (in about two runs of three here), and the cost checks would then
    differ between a batch cut in one pass and one cut request by request."""
    rng = random.Random(seed)
    costs = [rng.uniform(0.1, 9.0) for _ in range(rng.randint(2, 5))]
    n = rng.randint(8, 40)
    gone = set(rng.sample(range(n), rng.randint(0, 6)))
    one, many = _twin_queues([(0, None)] * n, costs, gone)
    while one.size:
        k = rng.randint(1, one.size)
        assert [r.id for r in many.pop_many(k)] == [one.pop().id for _ in range(k)]
        assert many.queued_cost == one.queued_cost
