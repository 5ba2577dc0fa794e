"""The sans-I/O batching core, driven with a fake clock (plain floats for `now`)."""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter, defaultdict

import pytest

from batcher.core.scheduler import BatchSettings, NoSuchModel, Policy, QueuedRequest, Scheduler
from tests.scheduler_builders import (
    enqueue_many,
    make,
    put,
    rq,
)

# --- size trigger --------------------------------------------------------------------------------


def test_size_trigger_dispatches_as_soon_as_a_full_batch_waits() -> None:
    s = make(size=4)
    first = enqueue_many(s, "m", 3, t=100.0)
    assert s.due_batches(100.0) == []
    last = enqueue_many(s, "m", 1, t=100.0)
    (batch,) = s.due_batches(100.0)
    assert batch.requests == first + last
    assert batch.worker == b"w0"
    assert batch.model == "m"
    assert batch.dispatched_at == 100.0
    assert s.queued("m") == 0
    assert list(s.in_flight()) == [batch]


def test_size_trigger_needs_a_worker() -> None:
    s = Scheduler(per_model={"m": BatchSettings(max_batch_size=2, max_wait_ms=10.0, policy="window")})
    reqs = enqueue_many(s, "m", 2, t=0.0)
    assert s.due_batches(0.0) == []
    assert s.due_batches(50.0) == []
    assert s.next_wakeup() is None
    s.add_worker(b"late", "m", 1)
    (batch,) = s.due_batches(50.0)
    assert batch.requests == reqs
    assert batch.worker == b"late"


# --- wait trigger --------------------------------------------------------------------------------


def test_wait_trigger_fires_exactly_at_arrival_plus_max_wait() -> None:
    s = make(size=4, wait_ms=10.0)
    (r,) = enqueue_many(s, "m", 1, t=100.0)
    deadline = 100.0 + 0.010
    assert s.next_wakeup() == deadline
    assert s.due_batches(100.0) == []
    assert s.due_batches(math.nextafter(deadline, -math.inf)) == []
    assert s.next_wakeup() == deadline  # nothing moved
    (batch,) = s.due_batches(deadline)
    assert batch.requests == [r]
    assert batch.dispatched_at == deadline
    assert s.next_wakeup() is None


def test_wait_trigger_is_the_oldest_request_and_takes_every_waiting_one() -> None:
    s = make(size=8, wait_ms=10.0)
    reqs = [rq(0.0), rq(0.004), rq(0.009)]
    for r in reqs:
        s.enqueue("m", r)
    assert s.next_wakeup() == 0.0 + 0.010
    (batch,) = s.due_batches(0.010)
    assert batch.requests == reqs


def test_wait_trigger_next_window_starts_from_the_next_oldest() -> None:
    s = make(size=2, wait_ms=10.0, workers=2)
    a, b, c = rq(0.0), rq(0.0), rq(0.005)
    for r in (a, b, c):
        s.enqueue("m", r)
    (first,) = s.due_batches(0.0)  # size trigger for a, b
    assert first.requests == [a, b]
    assert s.next_wakeup() == 0.005 + 0.010
    assert s.due_batches(0.010) == []
    (second,) = s.due_batches(0.005 + 0.010)
    assert second.requests == [c]


def test_zero_wait_dispatches_on_arrival() -> None:
    s = make(size=8, wait_ms=0.0)
    (r,) = enqueue_many(s, "m", 1, t=3.0)
    assert s.next_wakeup() == 3.0
    (batch,) = s.due_batches(3.0)
    assert batch.requests == [r]


def test_next_wakeup_is_the_earliest_over_models() -> None:
    s = Scheduler(
        per_model={
            "slow": BatchSettings(max_batch_size=8, max_wait_ms=50.0, policy="window"),
            "fast": BatchSettings(max_batch_size=8, max_wait_ms=2.0, policy="window"),
        }
    )
    s.add_worker(b"ws", "slow", 1)
    s.add_worker(b"wf", "fast", 1)
    assert s.next_wakeup() is None
    s.enqueue("slow", rq(0.0))
    s.enqueue("fast", rq(0.010))
    assert s.next_wakeup() == 0.010 + 0.002


# --- batch size bound and FIFO -----------------------------------------------------------------


def test_no_batch_exceeds_max_batch_size() -> None:
    s = make(size=8, wait_ms=10.0, workers=20)
    reqs = enqueue_many(s, "m", 100, t=0.0)
    batches = s.due_batches(0.0)
    assert [len(b.requests) for b in batches] == [8] * 12
    assert s.queued("m") == 4
    assert s.due_batches(0.009) == []
    (rest,) = s.due_batches(0.010)
    assert len(rest.requests) == 4
    dispatched = [r for b in [*batches, rest] for r in b.requests]
    assert dispatched == reqs  # FIFO, none lost, none twice


def test_single_worker_drains_a_long_queue_in_fifo_batches() -> None:
    s = make(size=8, wait_ms=10.0)
    reqs = enqueue_many(s, "m", 100, t=0.0)
    order: list[QueuedRequest] = []
    sizes: list[int] = []
    now = 0.0
    while s.queued("m"):
        batches = s.due_batches(now)
        assert len(batches) == 1  # one worker, one slot
        (batch,) = batches
        sizes.append(len(batch.requests))
        order.extend(batch.requests)
        assert s.due_batches(now) == []  # the worker is busy
        assert s.complete(b"w0", batch.batch_id) is batch
        now += 0.001
    assert sizes == [8] * 12 + [4]
    assert order == reqs


def test_fifo_is_per_model() -> None:
    window = BatchSettings(2, 10.0, policy="window")
    s = Scheduler(per_model={"a": window, "b": window}, worker_prefetch=4)
    s.add_worker(b"wa", "a", 4)
    s.add_worker(b"wb", "b", 4)
    ra = [rq(0.0) for _ in range(4)]
    rb = [rq(0.0) for _ in range(4)]
    for x, y in zip(ra, rb, strict=True):
        s.enqueue("a", x)
        s.enqueue("b", y)
    batches = s.due_batches(0.0)
    by_model: dict[str, list[QueuedRequest]] = defaultdict(list)
    for b in batches:
        assert b.worker == {"a": b"wa", "b": b"wb"}[b.model]
        by_model[b.model].extend(b.requests)
    assert by_model == {"a": ra, "b": rb}


# --- busy workers ----------------------------------------------------------------------------


def test_requests_wait_while_every_worker_is_busy() -> None:
    s = make(size=2, wait_ms=10.0)
    enqueue_many(s, "m", 2, t=0.0)
    (busy,) = s.due_batches(0.0)
    waiting = enqueue_many(s, "m", 3, t=0.001)
    assert s.due_batches(1.0) == []  # long past the window, but nobody is free
    assert s.next_wakeup() is None
    assert s.queued("m") == 3
    assert s.complete(b"w0", busy.batch_id) is busy
    (batch,) = s.due_batches(1.0)
    assert batch.requests == waiting[:2]
    assert batch.worker == b"w0"
    assert s.queued("m") == 1


def test_full_batch_goes_as_soon_as_a_worker_frees_even_before_the_window() -> None:
    s = make(size=4, wait_ms=10.0)
    enqueue_many(s, "m", 4, t=5.0)
    (busy,) = s.due_batches(5.0)
    full = enqueue_many(s, "m", 4, t=5.0)
    assert s.due_batches(5.001) == []
    s.complete(b"w0", busy.batch_id)
    (batch,) = s.due_batches(5.001)  # well before 5.0 + 0.010
    assert batch.requests == full


def test_partial_batch_waits_for_its_window_after_a_worker_frees() -> None:
    s = make(size=4, wait_ms=10.0)
    enqueue_many(s, "m", 4, t=5.0)
    (busy,) = s.due_batches(5.0)
    (r,) = enqueue_many(s, "m", 1, t=5.002)
    s.complete(b"w0", busy.batch_id)
    assert s.due_batches(5.003) == []
    assert s.next_wakeup() == 5.002 + 0.010
    (batch,) = s.due_batches(5.002 + 0.010)
    assert batch.requests == [r]


def test_several_workers_take_successive_batches() -> None:
    s = make(size=4, wait_ms=10.0, workers=3)
    reqs = enqueue_many(s, "m", 12, t=0.0)
    batches = s.due_batches(0.0)
    assert [b.requests for b in batches] == [reqs[0:4], reqs[4:8], reqs[8:12]]
    assert sorted(b.worker for b in batches) == [b"w0", b"w1", b"w2"]
    assert len({b.batch_id for b in batches}) == 3
    enqueue_many(s, "m", 4, t=0.0)
    assert s.due_batches(0.0) == []  # all three busy


def test_freed_worker_goes_to_the_back_of_the_line() -> None:
    s = make(size=1, wait_ms=10.0, workers=2)
    enqueue_many(s, "m", 1, t=0.0)
    (first,) = s.due_batches(0.0)
    s.complete(first.worker, first.batch_id)
    enqueue_many(s, "m", 1, t=0.0)
    (second,) = s.due_batches(0.0)
    assert second.worker != first.worker  # least recently used first


def test_worker_with_several_slots_holds_several_batches() -> None:
    s = make(size=2, wait_ms=10.0, workers=1, slots=2)
    enqueue_many(s, "m", 6, t=0.0)
    b1, b2 = s.due_batches(0.0)
    assert b1.worker == b2.worker == b"w0"
    assert s.workers[b"w0"].free_slots == 0
    assert s.due_batches(0.0) == []
    assert s.complete(b"w0", b1.batch_id) is b1
    assert s.workers[b"w0"].free_slots == 1
    (b3,) = s.due_batches(0.0)
    assert b3.worker == b"w0"
    assert {b.batch_id for b in s.in_flight()} == {b2.batch_id, b3.batch_id}


def test_worker_slots_are_capped_by_the_prefetch_limit() -> None:
    s = Scheduler(
        default=BatchSettings(max_batch_size=1, max_wait_ms=10.0, policy="window"), worker_prefetch=2
    )
    s.add_worker(b"asks-5", "x", 5)
    s.add_worker(b"asks-none", "y")
    s.add_worker(b"asks-1", "z", 1)
    for model in ("x", "y", "z"):
        enqueue_many(s, model, 10, t=0.0)
    held = Counter(b.worker for b in s.due_batches(0.0))
    assert held == {b"asks-5": 2, b"asks-none": 2, b"asks-1": 1}


def test_default_prefetch_is_one_batch_per_worker() -> None:
    s = Scheduler(default=BatchSettings(max_batch_size=1, max_wait_ms=10.0, policy="window"))
    s.add_worker(b"w", "m", 4)
    enqueue_many(s, "m", 4, t=0.0)
    assert len(s.due_batches(0.0)) == 1


@pytest.mark.parametrize("prefetch", [0, -1])
def test_worker_prefetch_must_be_positive(prefetch: int) -> None:
    with pytest.raises(ValueError, match=f"^worker_prefetch must be >= 1, got {prefetch}$"):
        Scheduler(worker_prefetch=prefetch)


def test_idle_worker_is_preferred_over_a_busy_one_with_a_free_slot() -> None:
    s = make(size=2, wait_ms=10.0, workers=2, slots=2)
    enqueue_many(s, "m", 2, t=0.0)
    (first,) = s.due_batches(0.0)
    enqueue_many(s, "m", 2, t=0.0)
    (second,) = s.due_batches(0.0)
    assert {first.worker, second.worker} == {b"w0", b"w1"}


def test_busy_worker_with_a_free_slot_gets_a_partial_batch_only_at_the_window() -> None:
    s = make(size=4, wait_ms=10.0, workers=1, slots=2)
    enqueue_many(s, "m", 4, t=0.0)
    (busy,) = s.due_batches(0.0)
    (r,) = enqueue_many(s, "m", 1, t=0.002)
    assert s.due_batches(0.005) == []
    assert s.next_wakeup() == 0.002 + 0.010
    (batch,) = s.due_batches(0.002 + 0.010)
    assert batch.requests == [r]
    assert batch.worker == busy.worker
    assert len(list(s.in_flight())) == 2


def test_completing_a_batch_of_a_partly_busy_worker_does_not_double_book_it() -> None:
    s = make(size=1, wait_ms=10.0, workers=1, slots=3)
    enqueue_many(s, "m", 1, t=0.0)
    (b1,) = s.due_batches(0.0)  # one of three slots used, still free
    s.complete(b"w0", b1.batch_id)
    enqueue_many(s, "m", 5, t=0.0)
    batches = s.due_batches(0.0)
    assert len(batches) == 3  # never more than its three slots
    assert s.workers[b"w0"].free_slots == 0


# --- worker removal and late replies ------------------------------------------------------------


def test_remove_worker_returns_its_in_flight_batches() -> None:
    s = make(size=2, wait_ms=10.0, workers=2, slots=2)
    enqueue_many(s, "m", 8, t=0.0)
    batches = s.due_batches(0.0)
    mine = [b for b in batches if b.worker == b"w0"]
    assert len(mine) == 2
    lost = s.remove_worker(b"w0")
    assert sorted(b.batch_id for b in lost) == sorted(b.batch_id for b in mine)
    assert b"w0" not in s.workers
    assert all(b.worker == b"w1" for b in s.in_flight())
    for b in mine:
        assert s.complete(b"w0", b.batch_id) is None  # late reply from the removed worker


def test_remove_unknown_worker_returns_nothing() -> None:
    s = make()
    assert s.remove_worker(b"nobody") == []
    assert s.remove_worker(b"w0") == []  # idle worker: nothing in flight
    assert s.remove_worker(b"w0") == []  # twice


def test_removed_worker_gets_no_more_batches() -> None:
    s = make(size=2, wait_ms=10.0, workers=2)
    s.remove_worker(b"w0")
    enqueue_many(s, "m", 4, t=0.0)
    (batch,) = s.due_batches(1.0)
    assert batch.worker == b"w1"
    s.remove_worker(b"w1")
    assert s.due_batches(2.0) == []
    assert s.queued("m") == 2  # queued requests stay for the next worker
    s.add_worker(b"w2", "m", 1)
    (batch,) = s.due_batches(2.0)
    assert batch.worker == b"w2"


def test_complete_returns_none_for_unknown_or_late_batch_ids() -> None:
    s = make(size=1, wait_ms=10.0, workers=2)
    enqueue_many(s, "m", 1, t=0.0)
    (batch,) = s.due_batches(0.0)
    other = b"w1" if batch.worker == b"w0" else b"w0"
    assert s.complete(batch.worker, batch.batch_id + 1000) is None  # never issued
    assert s.complete(other, batch.batch_id) is None  # forged by another worker
    assert s.complete(b"stranger", batch.batch_id) is None
    assert list(s.in_flight()) == [batch]  # none of those freed it
    assert s.complete(batch.worker, batch.batch_id) is batch
    assert s.complete(batch.worker, batch.batch_id) is None  # duplicate reply


def test_reannounced_worker_does_not_accept_replies_for_old_batches() -> None:
    s = make(size=1, wait_ms=10.0)
    enqueue_many(s, "m", 1, t=0.0)
    (batch,) = s.due_batches(0.0)
    lost = s.remove_worker(b"w0")  # as the broker does on a second READY
    s.add_worker(b"w0", "m", 1)
    assert lost == [batch]
    assert s.complete(b"w0", batch.batch_id) is None
    assert s.workers[b"w0"].free_slots == 1


# --- models and settings ----------------------------------------------------------------------


def test_unknown_model_is_rejected() -> None:
    s = Scheduler(models=["known"])
    with pytest.raises(NoSuchModel):
        s.enqueue("other", rq(0.0))
    assert isinstance(NoSuchModel("x"), KeyError)
    assert s.queued("other") == 0
    assert not s.knows_model("other")
    assert s.knows_model("known")


def test_a_worker_makes_its_model_known_and_it_stays_known() -> None:
    s = Scheduler()
    assert not s.knows_model("new")
    s.add_worker(b"w", "new", 1)
    assert s.knows_model("new")
    s.remove_worker(b"w")
    assert s.knows_model("new")
    s.enqueue("new", rq(0.0))
    assert s.queued("new") == 1


def test_configured_model_queues_without_workers() -> None:
    s = Scheduler(models=["m"])
    s.enqueue("m", rq(0.0))
    assert s.queued("m") == 1
    assert s.due_batches(100.0) == []


def test_per_model_settings() -> None:
    default = BatchSettings(max_batch_size=3, max_wait_ms=1.0, policy="window")
    big = BatchSettings(max_batch_size=5, max_wait_ms=100.0, policy="window")
    s = Scheduler(default=default, per_model={"big": big}, models=["plain"], worker_prefetch=10)
    assert s.knows_model("big")  # per-model entries are configured models
    s.add_worker(b"wb", "big", 10)
    s.add_worker(b"wp", "plain", 10)
    s.add_worker(b"wn", "new", 10)
    assert s.models["big"].settings == big
    assert s.models["plain"].settings == default
    assert s.models["new"].settings == default
    for model in ("big", "plain", "new"):
        enqueue_many(s, model, 7, t=0.0)
    sizes: dict[str, list[int]] = defaultdict(list)
    for b in s.due_batches(0.0):
        sizes[b.model].append(len(b.requests))
    assert sizes == {"big": [5], "plain": [3, 3], "new": [3, 3]}
    for b in s.due_batches(0.001):  # default window is over, big's is not
        sizes[b.model].append(len(b.requests))
    assert sizes == {"big": [5], "plain": [3, 3, 1], "new": [3, 3, 1]}
    (last,) = s.due_batches(0.100)
    assert (last.model, len(last.requests)) == ("big", 2)


def test_default_settings() -> None:
    assert BatchSettings() == BatchSettings(max_batch_size=8, max_wait_ms=5.0, policy=Policy.ADAPTIVE)
    assert BatchSettings(policy="window").policy is Policy.WINDOW  # a plain str still works
    assert Scheduler().default_settings == BatchSettings()
    assert BatchSettings(max_wait_ms=5.0).max_wait_s == 0.005


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_batch_size": 0}, "max_batch_size must be >= 1, got 0"),
        ({"max_batch_size": -3}, "max_batch_size must be >= 1, got -3"),
        ({"max_wait_ms": -1}, "max_wait_ms must be a finite number >= 0, got -1"),
        ({"max_wait_ms": -0.5}, "max_wait_ms must be a finite number >= 0, got -0.5"),
        ({"max_wait_ms": math.nan}, "max_wait_ms must be a finite number >= 0, got nan"),
        ({"max_wait_ms": math.inf}, "max_wait_ms must be a finite number >= 0, got inf"),
        ({"max_wait_ms": True}, "max_wait_ms must be a finite number >= 0, got True"),
        # Hardening #7: a float size passed validation, then every batch of it raised.
        ({"batch_sizes": (1, 2.0, 4)}, "batch_sizes must be ints, got [1, 2.0, 4]"),
        ({"batch_sizes": (1, True, 4)}, "batch_sizes must be ints, got [1, True, 4]"),
        ({"max_queue": 0}, "max_queue must be >= 1, got 0"),
        ({"policy": "fastest"}, "policy must be one of adaptive, window, got 'fastest'"),
        ({"priority_aging_ms": -1}, "priority_aging_ms must be a finite number >= 0, got -1"),
        ({"priority_aging_ms": True}, "priority_aging_ms must be a finite number >= 0, got True"),
        ({"priority_aging_ms": math.inf}, "priority_aging_ms must be a finite number >= 0, got inf"),
    ],
)
def test_batch_settings_rejects_bad_values(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        BatchSettings(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [2.5, "8", True])
def test_batch_settings_rejects_non_int_batch_size_saying_why(size: object) -> None:
    with pytest.raises(ValueError, match="max_batch_size must be an int"):
        BatchSettings(max_batch_size=size)  # type: ignore[arg-type]


def test_batch_settings_accepts_edge_values() -> None:
    s = BatchSettings(max_batch_size=1, max_wait_ms=0)
    assert (s.max_batch_size, s.max_wait_s) == (1, 0.0)


# The random-sequence property tests (arrivals, workers joining and leaving, replies,
# stray replies, time passing) are tests/unit/core/test_scheduler_policy.py's Run harness: one harness.


# --- bounded state: nothing outlives its stay in the queue ---------------------------------------


@pytest.mark.parametrize("mix", ["plain", "priorities", "deadlines"])
def test_queue_structures_stay_bounded_while_a_full_batch_always_waits(mix: str) -> None:
    """Regression (hardening #1): under saturation (a full batch always waiting, every slot
    busy) the arrival list was only trimmed when the oldest request was looked up, which
    never happened, so every body ever accepted stayed referenced. Each structure now holds
    at most twice the queue's length (plus a constant) whatever the mix of requests."""
    s = make(size=8, workers=1, slots=1)
    mq = s.models["m"]
    rid = itertools.count()
    t = 0.0

    def saturate(turns: int) -> None:
        nonlocal t
        for _ in range(turns):
            for _ in range(8):
                r = rq(t, rid=next(rid))
                if mix == "priorities":
                    r.priority = r.id % 3  # type: ignore[operator]
                elif mix == "deadlines":
                    r.deadline_at = t + 3600.0  # never expires here
                s.enqueue("m", r)
            if mq.size < 100:  # keep a backlog of about 100: the worker is the bottleneck
                continue
            (batch,) = s.due_batches(t)
            assert s.complete(batch.worker, batch.batch_id, 0.001) is batch
            s.expire(t)
            t += 0.001

    saturate(2000)
    assert mq.cancels is None  # no cancel asked: nothing filed for one
    assert s.cancel_id(b"nobody", -1) == []  # the first cancel files the queued requests
    assert mq.cancels is not None and sum(len(ids) for ids in mq.cancels.by_client.values()) == mq.size
    saturate(2000)
    limit = 2 * mq.size + 64
    assert mq.size >= 90  # a backlog throughout
    for name in ("fifo", "heap", "heap_arrivals", "deadlines"):
        assert len(getattr(mq, name)) <= limit, name
    assert mq.cancels is not None and sum(len(ids) for ids in mq.cancels.by_client.values()) == mq.size


def test_a_drained_queue_keeps_no_request() -> None:
    s = make(size=4, workers=1, slots=1)
    mq = s.models["m"]
    reqs = [rq(0.0) for _ in range(200)]
    for i, r in enumerate(reqs):
        r.priority = i % 2
        r.deadline_at = 50.0 if i % 3 == 0 else None
        s.enqueue("m", r)
    s.cancel(lambda r: r.id in {reqs[5].id, reqs[6].id})
    s.cancel_id(reqs[7].envelope[0], reqs[7].id)  # files the cancel index, emptied as the queue is
    t = 0.0
    while mq.size:
        for batch in s.due_batches(t):
            s.complete(batch.worker, batch.batch_id, 0.001)
        t += 0.001
    assert mq.oldest() is None and mq.earliest_deadline() is None
    assert mq.cancels is None  # made by the cancel, dropped once the queue emptied
    held = [*mq.fifo, *(e[3] for e in mq.heap), *mq.heap_arrivals, *(e[2] for e in mq.deadlines)]
    assert len(held) <= 64  # what is left is below the compaction threshold, and none queued
    assert all(r.state != 0 for r in held)


# --- cancel by (client, id): a look-up, scoped to its sender -------------------------------------


def test_cancel_id_removes_only_that_clients_requests_with_that_id(monkeypatch: pytest.MonkeyPatch) -> None:
    s = Scheduler(per_model={"m": BatchSettings(max_batch_size=4), "n": BatchSettings(max_batch_size=4)})

    def mk(client: bytes, req_id: object) -> QueuedRequest:
        return QueuedRequest(envelope=[client, b""], body=b"\x80", id=req_id, arrived_at=0.0)

    a1, a1_again, a2, b1 = mk(b"a", 1), mk(b"a", 1), mk(b"a", 2), mk(b"b", 1)
    other_model = mk(b"a", 1)
    for r in (a1, a1_again, a2, b1):
        s.enqueue("m", r)
    s.enqueue("n", other_model)

    def no_scan(self: object) -> None:
        raise AssertionError("cancel_id scanned the queue")

    assert s.cancel_id(b"c", 9) == []  # the first cancel files the queued requests, once
    monkeypatch.setattr(type(s.models["m"]), "queued", no_scan)
    got = s.cancel_id(b"a", 1)
    assert sorted((m, id(r)) for m, r in got) == sorted(
        [("m", id(a1)), ("m", id(a1_again)), ("n", id(other_model))]
    )
    assert s.queued("m") == 2 and s.queued("n") == 0
    assert s.cancel_id(b"a", 1) == [] and s.cancel_id(b"c", 2) == []
    assert [r for _, r in s.cancel_id(b"b", 1)] == [b1]


def test_cancel_id_leaves_a_dispatched_request_alone() -> None:
    s = make(size=1, workers=1, slots=1)
    r = rq(0.0, rid=7)
    s.enqueue("m", r)
    (batch,) = s.due_batches(0.0)
    assert batch.requests == [r]
    assert s.cancel_id(r.envelope[0], 7) == []


# --- what the broker reads and asks of the scheduler besides batches --------------------------------


def test_views_are_a_snapshot_of_queues_workers_settings_and_cost() -> None:
    s = make(size=4, wait_ms=10.0, workers=2, slots=2)
    enqueue_many(s, "m", 5, 0.0)
    (batch,) = s.due_batches(0.0)  # a full batch of 4 to one worker; 1 waits
    view = s.views()["m"]
    assert view.queued == 1
    other = b"w1" if batch.worker == b"w0" else b"w0"
    assert sorted(view.workers) == sorted([(batch.worker, 1, None), (other, 0, None)])
    assert view.batches_in_flight == 1
    assert view.settings == s.models["m"].settings
    assert view.cost is None and view.no_worker_since is None
    assert s.complete(batch.worker, batch.batch_id, infer_s=0.02) is batch
    assert s.views()["m"].cost == (pytest.approx(0.02), 0.0)
    assert view.queued == 1  # the earlier snapshot did not change


def test_held_and_busy_follow_batches_and_queues() -> None:
    s = make(size=2, wait_ms=10.0, workers=1, slots=2)
    assert not s.busy() and s.held(b"w0") == 0 and s.held(b"nobody") == 0
    enqueue_many(s, "m", 1, 0.0)
    assert s.busy()  # queued only
    (batch,) = s.due_batches(0.010)
    assert s.busy() and s.held(b"w0") == 1  # in a batch only
    s.complete(b"w0", batch.batch_id)
    assert not s.busy() and s.held(b"w0") == 0


def test_running_is_whether_a_worker_holds_a_batch_not_whether_requests_wait() -> None:
    """What the broker reads to keep checking batch time limits while a batch runs."""
    s = make(size=1, wait_ms=10.0, workers=1)
    assert not s.running()
    enqueue_many(s, "m", 1, 0.0)
    assert not s.running() and s.busy()  # queued, in no batch
    (b,) = s.due_batches(0.01)
    assert s.running()
    s.complete(b.worker, b.batch_id)
    assert not s.running()


def test_a_drained_worker_gets_no_batch_but_its_replies_count() -> None:
    s = make(size=1, wait_ms=0.0, workers=2, slots=1)
    enqueue_many(s, "m", 1, 0.0)
    (first,) = s.due_batches(0.0)
    assert s.drain_worker(first.worker) == 1
    assert s.drain_worker(b"nobody") == 0
    enqueue_many(s, "m", 2, 0.0)
    batches = s.due_batches(0.0)
    assert [b.worker for b in batches] == [b"w1" if first.worker == b"w0" else b"w0"]
    assert s.complete(first.worker, first.batch_id) is first
    assert s.due_batches(1.0) == []  # still nothing for the drained one
    assert s.has_workers("m")


def test_remove_all_workers_returns_every_held_batch() -> None:
    s = make(size=1, wait_ms=0.0, workers=3, slots=1)
    enqueue_many(s, "m", 2, 0.0)
    held = s.due_batches(0.0)
    assert len(held) == 2
    assert sorted(b.batch_id for b in s.remove_all_workers()) == sorted(b.batch_id for b in held)
    assert s.workers == {} and not s.has_workers("m")


def test_set_settings_applies_to_the_queue_and_to_the_model_made_later() -> None:
    s = make(size=8, wait_ms=100.0, workers=1)
    enqueue_many(s, "m", 2, 0.0)
    assert s.due_batches(0.001) == []
    s.set_settings("m", BatchSettings(max_batch_size=2, max_wait_ms=100.0, policy="window"))
    (batch,) = s.due_batches(0.001)  # now a full batch
    assert len(batch.requests) == 2
    s.set_settings("new", BatchSettings(max_batch_size=3))
    assert s.knows_model("new") and s.models["new"].settings.max_batch_size == 3


def test_settings_of_gives_each_known_models_settings_and_none_for_an_unknown_one() -> None:
    """What the frontend admits a request against (its model's limits)."""
    small = BatchSettings(max_batch_size=2, max_wait_ms=5.0)
    s = Scheduler(per_model={"m": small}, models=["plain"])
    s.add_worker(b"w", "announced")
    assert s.settings_of("m") is small
    assert s.settings_of("plain") == BatchSettings() and s.settings_of("announced") == BatchSettings()
    assert s.settings_of("nobody") is None


# --- the scheduler's own settings ------------------------------------------------------------------


@pytest.mark.parametrize("timeout_s", [-1.0, math.inf, math.nan])
def test_no_worker_timeout_must_be_finite_and_not_negative(timeout_s: float) -> None:
    with pytest.raises(ValueError) as raised:
        Scheduler(no_worker_timeout_s=timeout_s)
    assert str(raised.value) == f"no_worker_timeout_s must be a finite number >= 0, got {timeout_s}"


def test_by_default_batch_ids_start_at_1_and_a_model_without_worker_waits() -> None:
    s = Scheduler(per_model={"m": BatchSettings(max_batch_size=1, max_wait_ms=0.0)})
    enqueue_many(s, "m", 1, 0.0)
    assert s.unavailable(0.0) == [] and s.unavailable(3600.0) == []
    s.add_worker(b"w", "m")
    (batch,) = s.due_batches(3600.0)
    assert batch.batch_id == 1


# --- the (client, id) index with an id used three times ----------------------------------------------


def test_a_client_reusing_an_id_three_times_cancels_all_three_and_then_the_rest() -> None:
    s = make(size=1, wait_ms=0.0, workers=0)
    same = [rq(0.0, rid="dup") for _ in range(3)]
    for r in same:
        r.envelope = [b"alice", b""]
        s.enqueue("m", r)
    assert sorted(map(id, (r for _, r in s.cancel_id(b"alice", "dup")))) == sorted(map(id, same))
    again = [rq(0.0, rid="dup") for _ in range(3)]
    for r in again:
        r.envelope = [b"alice", b""]
        s.enqueue("m", r)
    s.add_worker(b"w", "m")
    (batch,) = s.due_batches(0.0)  # the first of them leaves in a batch
    assert batch.requests == [again[0]]
    assert [r for _, r in s.cancel_id(b"alice", "dup")] == again[1:]


# --- compaction happens at its documented point: more leftovers than 2 x queued + 64 -------------


@pytest.mark.parametrize(
    ("lane", "structures"),
    [
        ("plain", ("fifo",)),
        ("ranked", ("heap", "heap_arrivals")),
        ("deadline", ("heap", "heap_arrivals", "deadlines")),
    ],
)
def test_a_structure_is_rebuilt_only_past_twice_the_queue_plus_64(
    lane: str, structures: tuple[str, ...]
) -> None:
    """100 requests, removed one by one: at 18 queued, 100 entries are exactly the limit
    (2 x 18 + 64) and stay; one more removal crosses it and the structure shrinks to 17.
    So a rebuild never follows fewer removals than it keeps (amortized O(1))."""
    s = make(size=8, wait_ms=10_000.0, workers=0, max_queue=1000)
    if lane == "plain":
        reqs = [rq(0.0) for _ in range(100)]
    elif lane == "ranked":
        reqs = [rq(0.0, priority=2) for _ in range(100)]
    else:
        reqs = [rq(0.0, deadline=1000.0 + i) for i in range(100)]
    put(s, "m", *reqs)
    mq = s.models["m"]
    for r in reqs[:82]:
        s.cancel_id(r.envelope[0], r.id)
    assert s.queued("m") == 18
    assert {name: len(getattr(mq, name)) for name in structures} == dict.fromkeys(structures, 100)
    s.cancel_id(reqs[82].envelope[0], reqs[82].id)
    assert {name: len(getattr(mq, name)) for name in structures} == dict.fromkeys(structures, 17)


# --- a wait too short to tell from now is no wait ------------------------------------------------------


def test_far_along_the_clock_a_wait_below_its_resolution_dispatches_at_once() -> None:
    """At now = 1e12 s a float cannot tell now + 20 us from now: the heavy-load rule's wait of
    two arrivals at 100,000/s is taken as none (else the broker would be woken at `now`
    over and over)."""
    s = make(size=64, wait_ms=10_000.0, workers=1, policy="adaptive", max_queue=30_000)
    now = 1e12
    t = now - 100.0
    for n in (1, 8, 1, 8):  # t(n) = 20 us, learned
        enqueue_many(s, "m", n, t)
        t += 1.0
        (batch,) = s.due_batches(t)
        s.complete(batch.worker, batch.batch_id, infer_s=0.00002)
    burst = enqueue_many(s, "m", 20_000, now)  # r = 20,000 / 0.2 s
    keep = burst[0]
    s.cancel(lambda r: r is not keep)
    assert now + 0.00002 == now
    (batch,) = s.due_batches(now)
    assert batch.requests == [keep]
