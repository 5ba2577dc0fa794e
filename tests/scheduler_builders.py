"""Builders and checks shared by tests/unit/core/test_scheduler.py and
tests/unit/core/test_scheduler_policy.py.

Requests, schedulers for one model "m", a batch cost taught through ordinary replies, and
the checks that the random-sequence harness (tests/unit/core/test_scheduler_policy.py's Run) makes after
each loop turn. Every `now` is a plain float:
the scheduler never reads a clock.

pytest rewrites the asserts of test modules only, so the checks here say what they saw.
"""

from __future__ import annotations

import itertools

from batcher.core.scheduler import (
    PREFETCH_GRACE_S,
    Batch,
    BatchSettings,
    ModelQueue,
    Policy,
    QueuedRequest,
    Scheduler,
    WorkerState,
)

_ids = itertools.count()

#: The worker_prefetch of the random-sequence harness: no worker holds more batches.
PREFETCH = 2
#: Where the harnesses' fake clock starts.
START_S = 1000.0


# --- requests and schedulers ----------------------------------------------------------------------


def rq(t: float, priority: float = 0, deadline: float | None = None, rid: object = None) -> QueuedRequest:
    """A request of client "client-<id>" that arrived at fake time `t`; its id is unique
    unless given."""
    rid = next(_ids) if rid is None else rid
    return QueuedRequest([f"client-{rid}".encode(), b""], b"\x80", rid, t, priority, deadline)


def put(s: Scheduler, model: str, *reqs: QueuedRequest) -> list[QueuedRequest]:
    """Enqueue `reqs` in order and return them."""
    for r in reqs:
        s.enqueue(model, r)
    return list(reqs)


def enqueue_many(s: Scheduler, model: str, n: int, t: float) -> list[QueuedRequest]:
    """Enqueue `n` fresh requests that arrived at `t` and return them."""
    return put(s, model, *[rq(t) for _ in range(n)])


def make(
    size: int = 8,
    wait_ms: float = 10.0,
    workers: int = 1,
    slots: int = 1,
    policy: Policy | str = Policy.WINDOW,
    batch_sizes: tuple[int, ...] | None = None,
    max_queue: int = 10_000,
) -> Scheduler:
    """A scheduler for model "m" with workers w0, w1, ... of `slots` batches each (the
    prefetch limit is `slots` too). The policy is "window" unless asked for: under the
    adaptive default an idle worker would take a lone request at once."""
    settings_m = BatchSettings(
        max_batch_size=size,
        max_wait_ms=wait_ms,
        batch_sizes=batch_sizes,
        max_queue=max_queue,
        policy=Policy(policy),
    )
    s = Scheduler(per_model={"m": settings_m}, worker_prefetch=slots)
    for i in range(workers):
        s.add_worker(f"w{i}".encode(), "m", slots)
    return s


def turn(s: Scheduler, now: float) -> tuple[list[tuple[str, QueuedRequest]], list[Batch]]:
    """One broker loop turn: expire, then cut the due batches."""
    return s.expire(now), s.due_batches(now)


def teach(s: Scheduler, observations: list[tuple[int, float]], now: float, model: str = "m") -> float:
    """Teach `model` its batch cost through `complete(..., infer_s=...)`: for each (n, seconds)
    a batch of n is cut (past its window) and reported. Returns a time late enough for the
    arrival-rate estimate to have decayed to nothing."""
    for n, seconds in observations:
        enqueue_many(s, model, n, now)
        now += 1.0  # past any window
        (batch,) = s.due_batches(now)
        assert len(batch.requests) == n, f"taught with a batch of {len(batch.requests)}, not {n}"
        assert s.complete(batch.worker, batch.batch_id, infer_s=seconds) is batch
    return now + 10.0


def int_id(r: QueuedRequest) -> int:
    """The id of a request numbered 0, 1, 2, ... (in arrival order in the property tests)."""
    assert isinstance(r.id, int), f"id {r.id!r}"
    return r.id


def ids(batch: Batch) -> list[object]:
    """The ids of a batch's requests, in batch order."""
    return [r.id for r in batch.requests]


# --- checks of the random-sequence harnesses, after a loop turn at `now` --------------------------


def check_batch(s: Scheduler, batch: Batch, settings: BatchSettings, now: float) -> None:
    """What every batch just cut obeys, whatever the policy: 1 to max_batch_size requests
    (an allowed size when sizes are given), a worker of its model, cut now."""
    n = len(batch.requests)
    assert 1 <= n <= settings.max_batch_size, f"a batch of {n}, max_batch_size {settings.max_batch_size}"
    sizes = settings.batch_sizes
    assert sizes is None or n in sizes, f"a batch of {n}, allowed sizes {sizes}"
    model = s.workers[batch.worker].model
    assert model == batch.model, f"a batch of {batch.model} went to a worker of {model}"
    assert batch.dispatched_at == now, f"cut at {now}, dispatched_at {batch.dispatched_at}"


def check_nothing_due(
    mq: ModelQueue, settings: BatchSettings, now: float, free: list[WorkerState] | None = None
) -> None:
    """The window rule, for a model with a worker that could take a batch now (`free`,
    when known): no full batch waits, and no queued request has waited its max_wait;
    under adaptive, when every free worker is busy, not past the time the first of them
    is due to be done either (a partial batch is held for a busy worker's prefetch slot)."""
    queued = list(mq.queued())
    if queued:
        assert len(queued) < settings.max_batch_size, f"a full batch waits beside a worker: {len(queued)}"
        oldest = min(r.arrived_at for r in queued)
        due = oldest + settings.max_wait_s
        if free and settings.policy is not Policy.WINDOW and all(w.in_flight for w in free):
            due = max(due, min(w.busy_until() for w in free) + PREFETCH_GRACE_S)
        assert now < due, f"waited past its due time beside a worker: {oldest} to {now}"


def check_wakeup(s: Scheduler, now: float) -> float | None:
    """The wake-up the scheduler asks for lies in the future (at `now`, the broker would
    poll with a 0 ms timeout while nothing is due); returns it."""
    wake = s.next_wakeup()
    assert wake is None or wake > now, f"asked to be woken at {wake}, now {now}"
    return wake
