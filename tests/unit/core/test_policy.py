"""batcher.core.policy on its own: the pure functions of a queue, its workers and the time
(the rules through a whole Scheduler are in tests/unit/core/test_scheduler_policy.py)."""

from __future__ import annotations

import itertools
import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from batcher.core import policy
from batcher.core.cost_model import CostModel
from batcher.core.limits import FIRST_BATCH_LIMIT_S, MIN_BATCH_LIMIT_S, BatchSettings, Policy
from batcher.core.queue import QUEUED, Batch, ModelQueue, QueuedRequest, WorkerState

_seq = itertools.count()


def req(t: float, cost: float = 1.0, deadline: float | None = None, suspect: int = 0) -> QueuedRequest:
    rid = next(_seq)
    r = QueuedRequest([f"client-{rid}".encode(), b""], b"\x80", rid, t, 0, deadline, cost=cost)
    r.suspect = suspect
    return r


def queue(*reqs: QueuedRequest, **settings: Any) -> ModelQueue:
    mq = ModelQueue(BatchSettings(**settings))
    for r in reqs:
        mq.put(r, next(_seq))
    return mq


def worker(mq: ModelQueue, name: bytes = b"w", slots: int = 1) -> dict[bytes, WorkerState]:
    mq.workers[name] = None
    return {name: WorkerState(name, "m", slots)}


@given(st.lists(st.floats(min_value=0.5, max_value=10.0), min_size=1, max_size=20), st.floats(1.0, 30.0))
def test_a_batch_never_passes_the_cost_cap_but_for_a_lone_request(costs: list[float], cap: float) -> None:
    mq = queue(*[req(0.0, c) for c in costs], max_batch_size=8, max_batch_cost=cap)
    while mq.size:
        batch = policy.batch_requests(mq)
        assert batch and len(batch) <= 8
        assert len(batch) == 1 or sum(r.cost for r in batch) <= cap


def test_a_suspect_runs_alone_and_the_batch_before_it_stops_short() -> None:
    a, b, bad, c = req(0.0), req(1.0), req(2.0, suspect=1), req(3.0)
    mq = queue(a, b, bad, c, max_batch_size=8)
    assert policy.batch_requests(mq) == [a, b]
    assert policy.batch_requests(mq) == [bad]
    assert policy.batch_requests(mq) == [c]


def test_a_batch_cut_short_by_its_cost_rounds_down_to_an_allowed_size() -> None:
    reqs = [req(float(i), cost) for i, cost in enumerate([1, 1, 1, 5])]
    mq = queue(*reqs, max_batch_size=4, batch_sizes=(1, 2, 4), max_batch_cost=4.0)
    assert policy.batch_requests(mq) == reqs[:2]  # three fit the cap; two is the allowed size
    assert reqs[2].state == QUEUED and reqs[2].attempts == 0 and mq.peek() is reqs[2]


def test_the_wait_ends_at_the_window_or_before_the_deadline() -> None:
    mq = queue(req(1.0), max_wait_ms=10.0)
    assert policy.wait_until(mq) == 1.0 + 0.010
    mq.put(req(1.001, deadline=1.005), next(_seq))
    assert policy.wait_until(mq) == 1.005 - policy.DEADLINE_MARGIN_S


def test_nothing_is_due_without_a_worker_with_a_free_slot() -> None:
    mq = queue(req(1.0), max_wait_ms=10.0, policy=Policy.WINDOW)
    assert policy.due_at(mq, {}) == math.inf
    workers = worker(mq)
    assert policy.due_at(mq, workers) == 1.010
    assert policy.pick_worker(mq, workers, 1.009) is None
    assert policy.pick_worker(mq, workers, 1.010) is workers[b"w"]
    assert policy.next_wakeup([mq], workers, 0.0) == 1.010


def test_the_default_limit_follows_the_learned_cost() -> None:
    cost = CostModel()
    requests = [req(0.0) for _ in range(4)]
    assert policy.default_limit_s(cost, requests) == FIRST_BATCH_LIMIT_S
    cost.observe(1, 0.001)
    assert policy.default_limit_s(cost, requests) == MIN_BATCH_LIMIT_S
    cost.observe(1, 0.5)  # a slow model: 10 x n x t(1)
    (a, b) = cost.coefficients()
    assert policy.default_limit_s(cost, requests) == 10.0 * 4 * (a + b)


def test_a_batch_past_its_limit_is_hung_counted_from_its_start() -> None:
    w = WorkerState(b"w", "m", 2)
    first = Batch(1, "m", b"w", [req(0.0)], 0.0, expected_start=5.0)
    w.in_flight = {1: first, 2: Batch(2, "m", b"w", [req(0.0)], 0.0, expected_start=0.0)}
    idle = WorkerState(b"idle", "m", 1)
    assert policy.hung_batches([w, idle], 7.0, 2.0, lambda b: 100.0) == []
    assert policy.hung_batches([w, idle], 7.1, 2.0, lambda b: 100.0) == [(first, 2.0)]
    assert policy.hung_batches([w], 7.1, None, lambda b: 3.0) == []
    assert policy.hung_batches([w], 8.1, None, lambda b: 3.0) == [(first, 3.0)]


def test_a_seeded_cost_is_the_warm_up_line_and_never_overrides_a_learned_one() -> None:
    cost = CostModel()
    cost.seed(0.002, 0.001, 8)
    a, b = cost.coefficients()
    assert math.isclose(a, 0.002) and math.isclose(b, 0.001)
    cost.seed(1.0, 1.0, 8)
    assert cost.coefficients() == (a, b)


# --- the survivors of mutation testing -------------------------------------------------------


def test_the_default_limit_bounds_a_batch_by_n_times_one_requests_cost() -> None:
    cost = CostModel()
    cost.seed(0.1, 0.05, 32)  # t(1) = 0.15 s, t(2) = 0.2 s
    requests = [req(0.0) for _ in range(4)]
    assert math.isclose(policy.default_limit_s(cost, requests), 10.0 * 4 * 0.15)


def test_an_idle_worker_before_a_hung_one_is_passed_over() -> None:
    w = WorkerState(b"w", "m", 1)
    hung = Batch(1, "m", b"w", [req(0.0)], 0.0, expected_start=0.0)
    w.in_flight = {1: hung}
    assert policy.hung_batches([WorkerState(b"idle", "m", 1), w], 5.0, 2.0, lambda b: 100.0) == [(hung, 2.0)]


def test_a_suspect_at_the_head_is_due_for_an_idle_worker_only() -> None:
    mq = queue(req(1.0, suspect=1), max_wait_ms=10.0, policy=Policy.WINDOW)
    workers = worker(mq, b"idle", slots=2)
    assert policy.due_at(mq, workers) == 1.010
    busy = workers[b"idle"]
    busy.in_flight = {1: Batch(1, "m", b"idle", [req(0.0)], 0.0, expected_start=0.0)}
    assert policy.due_at(mq, workers) == math.inf  # a free slot, but the worker is busy
    # A suspect queued behind the head leaves the head free to go to a busy worker's slot.
    later = queue(req(1.0), req(1.001, suspect=1), max_wait_ms=10.0, policy=Policy.WINDOW)
    later.workers[b"idle"] = None
    assert policy.due_at(later, {b"idle": busy}) == 1.010
