"""The worker pool's rules on a float clock (batcher/core/pool.py, sans-I/O): liveness judged
up to the last complete read of the backend, lost workers' requests requeued or failed
by attempts and hand-backs, and admission of requests for models without workers."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batcher.core.multiplex import LOAD_LIMIT_S, POOL_NAME, Catalog
from batcher.core.pool import WorkerInfo, WorkerPool, load_hung_message, worker_info
from batcher.core.scheduler import BatchSettings, QueuedRequest, Scheduler
from batcher.core.streams import Streams
from batcher.wire.protocol import ErrorCode, Heartbeat
from batcher.wire.signature import Signature, TensorSpec

HEARTBEAT = Heartbeat(interval_ms=100.0, liveness=3)  # 0.3 s of silence is death


def pool(max_retries: int = 1, no_worker_timeout_s: float = 0.0) -> WorkerPool:
    s = Scheduler(per_model={"m": BatchSettings(max_batch_size=2, max_wait_ms=0.0)}, worker_prefetch=1,
                  no_worker_timeout_s=no_worker_timeout_s)  # fmt: skip
    return WorkerPool(s, HEARTBEAT, max_retries, now=0.0)


def request(rid: int, client: bytes = b"c") -> QueuedRequest:
    return QueuedRequest([client, b""], b"\x80", rid, 0.0)


def join(p: WorkerPool, wid: bytes, now: float = 0.0) -> None:
    p.joined(wid, WorkerInfo("m", 0, 42), None, now)


def dispatch(p: WorkerPool, *rids: int) -> None:
    for rid in rids:
        p.scheduler.enqueue("m", request(rid))
    assert p.scheduler.due_batches(0.0)


# --- liveness ----------------------------------------------------------------------------------


def test_a_worker_is_silent_only_past_its_expiry_counted_to_the_last_complete_read() -> None:
    p = pool()
    join(p, b"w", now=1.0)
    p.backend_read(1.3)
    assert p.silent() == []  # exactly the expiry: not yet
    p.backend_read(1.31)
    assert [w for w, _ in p.silent()] == [b"w"]


def test_a_busy_broker_does_not_make_a_heard_worker_silent() -> None:
    """The loop was busy for 2 s; the last complete read of the backend was at 1.1 s, so
    a heartbeat that arrived at 1.2 s (unread yet) cannot have been missed: not dead."""
    p = pool()
    join(p, b"w", now=1.0)
    p.heard(b"w", 1.1)
    p.backend_read(1.1)
    assert p.silent() == []  # judged at 1.1 s, whatever the wall clock says now


def test_heard_resets_silence() -> None:
    p = pool()
    join(p, b"w", now=0.0)
    p.heard(b"w", 0.5)
    p.backend_read(0.7)
    assert p.silent() == []
    p.backend_read(0.81)
    assert p.silent() == [(b"w", pytest.approx(0.31))]


# --- lost workers ------------------------------------------------------------------------------


def test_a_failed_workers_requests_are_requeued_until_their_retries_are_used() -> None:
    p = pool(max_retries=1)
    join(p, b"w1")
    dispatch(p, 1, 2)
    lost = p.lose(b"w1", failed=True)
    assert lost.failed == [] and lost.batches_requeued == 1
    assert p.scheduler.queued("m") == 2
    for worker, rid in ((b"w2", 1), (b"w3", 2)):  # suspects now: each runs alone
        join(p, worker)
        (batch,) = p.scheduler.due_batches(0.0)
        assert [r.id for r in batch.requests] == [rid]
        lost = p.lose(worker, failed=True)  # the second failure: its retries used up
        assert [(m, r.id) for m, r in lost.failed] == [("m", rid)] and lost.batches_requeued == 0


def test_a_worker_that_leaves_hands_back_free_only_the_first_time() -> None:
    p = pool(max_retries=1)
    outcomes = []
    for i in range(3):
        join(p, b"w%d" % i)
        if i == 0:
            dispatch(p, 7)
        else:
            assert p.scheduler.due_batches(0.0)
        lost = p.lose(b"w%d" % i, failed=False)
        outcomes.append(([r.id for _, r in lost.failed], lost.batches_requeued))
    assert outcomes == [([], 1), ([], 1), ([7], 0)]


def test_max_retries_0_fails_at_the_first_failure_but_not_at_a_leave() -> None:
    p = pool(max_retries=0)
    join(p, b"w")
    dispatch(p, 1)
    assert p.lose(b"w", failed=False).batches_requeued == 1
    join(p, b"v")
    assert p.scheduler.due_batches(0.0)
    assert [r.id for _, r in p.lose(b"v", failed=True).failed] == [1]


def test_lose_forgets_the_worker() -> None:
    p = pool()
    join(p, b"w")
    assert b"w" in p and p.info(b"w") == WorkerInfo("m", 0, 42)
    p.lose(b"w", failed=True)
    assert b"w" not in p and p.info(b"w") is None and p.silent() == [] and p.ids() == []


# --- admission ----------------------------------------------------------------------------------


def test_a_model_whose_workers_failed_refuses_until_one_joins() -> None:
    p = pool()
    p.scheduler.enqueue("m", request(1))
    failed = p.model_failed("m", "every worker of model 'm' failed to start")
    assert [r.id for _, r in failed] == [1]
    assert p.refusal("m", 0.0) == (ErrorCode.WORKER_FAILED, "every worker of model 'm' failed to start")
    join(p, b"w")
    assert p.refusal("m", 0.0) is None


def test_a_multiplexed_worker_that_joins_clears_the_failure_of_each_model_of_its_catalog() -> None:
    """Its catalog's models failed to start elsewhere: it serves them now, and once it has
    left too, their requests wait for a worker again rather than carry the old failure."""
    p = pool()
    for model in ("a", "b"):
        p.model_failed(model, f"every worker of model {model!r} failed to start")
    p.joined(b"mx", WorkerInfo("multiplexed", 0, 7, catalog=Catalog(200, {"a": 100, "b": 100})), None, 0.0)
    assert p.refusal("a", 0.0) is None and p.refusal("b", 0.0) is None
    p.lose(b"mx", failed=False)
    assert p.refusal("a", 1.0) is None and p.refusal("b", 1.0) is None


def test_a_model_without_worker_past_the_timeout_is_unavailable() -> None:
    p = pool(no_worker_timeout_s=10.0)
    p.scheduler.unavailable(100.0)  # the turn that stamps "no worker since"
    assert p.refusal("m", 109.9) is None
    code, message = p.refusal("m", 110.0) or (None, "")
    assert code == ErrorCode.UNAVAILABLE
    assert message == "model 'm' has had no worker for 10.0s (--no-worker-timeout-ms 10000)"


SIG_4 = Signature((TensorSpec("x", "FP32", (-1, 4)),), (TensorSpec("y", "FP32", (-1, 4)),))
SIG_3 = Signature((TensorSpec("x", "FP32", (-1, 3)),), (TensorSpec("y", "FP32", (-1, 3)),))


def test_admission_follows_every_join_leave_and_failure_it_keeps_an_answer_across() -> None:
    """`admission` keeps its answer for a model with a live worker: a worker that joins with
    another signature (a reload), the last one leaving, a failed start: each is seen by the
    next request, as `refusal` and `signature` see it."""
    p = pool(no_worker_timeout_s=10.0)

    def check(now: float) -> tuple[tuple[ErrorCode, str] | None, Signature | None]:
        answer = p.admission("m", now)
        assert answer == (p.refusal("m", now), p.signature("m"))
        assert p.admission("m", now) == answer  # asked again: the same
        return answer

    assert check(0.0) == (None, None)
    p.joined(b"a", WorkerInfo("m", 0, 1, SIG_4), None, 0.0)
    assert check(1.0) == (None, SIG_4)
    p.joined(b"b", WorkerInfo("m", 0, 2, SIG_3), None, 1.0)  # a reload's new worker: the newest counts
    assert check(2.0) == (None, SIG_3)
    p.lose(b"b", failed=False)  # the new one left: the old one's signature again
    assert check(3.0) == (None, SIG_4)
    p.lose(b"a", failed=True)  # none left
    assert check(4.0) == (None, None)
    p.scheduler.unavailable(4.0)  # the turn that stamps "no worker since"
    code, _ = check(14.0)[0] or (None, "")
    assert code == ErrorCode.UNAVAILABLE
    p.joined(b"c", WorkerInfo("m", 0, 3, SIG_3), None, 15.0)
    assert check(15.0) == (None, SIG_3)
    p.lose(b"c", failed=True)
    p.model_failed("m", "cannot start")
    assert check(16.0)[0] == (ErrorCode.WORKER_FAILED, "cannot start")


def test_ready_info_is_checked() -> None:
    assert worker_info({"model": "m", "gpu": 1, "pid": 2}) == WorkerInfo("m", 1, 2)
    for bad in [
        None,
        [],
        {"model": ""},
        {"model": 5},
        {"model": "m", "slots": 1.5},
        {"model": "m", "slots": True},
    ]:
        with pytest.raises(ValueError, match="bad READY info"):
            worker_info(bad)
    assert WorkerInfo("m", None, 3).name(b"\x01") == "m/gpu-/pid3/id01"


# --- edges the mutation run found unpinned -----------------------------------------------------------


def test_worker_name_says_its_gpu_or_a_dash() -> None:
    assert WorkerInfo("m", 2, 7).name(b"\x0a\xff") == "m/gpu2/pid7/id0aff"
    assert WorkerInfo("m", None, 7).name(b"\x0a") == "m/gpu-/pid7/id0a"


def test_ready_info_with_slots_is_accepted() -> None:
    assert worker_info({"model": "m", "gpu": 1, "pid": 9, "slots": 3}) == WorkerInfo("m", 1, 9)


def test_a_fresh_pool_finds_no_worker_silent_before_any_read() -> None:
    p = pool()
    join(p, b"w", now=0.0)
    assert p.silent() == []


def test_slots_announced_in_ready_reach_the_scheduler() -> None:
    s = Scheduler(per_model={"m": BatchSettings(max_batch_size=1, max_wait_ms=0.0)}, worker_prefetch=4)
    p = WorkerPool(s, HEARTBEAT, 1, now=0.0)
    p.joined(b"w", WorkerInfo("m", 0, 1), 2, 0.0)
    assert s.workers[b"w"].slots == 2


def test_losing_an_unknown_worker_changes_nothing() -> None:
    p = pool()
    join(p, b"w")
    lost = p.lose(b"never-joined", failed=True)
    assert (lost.failed, lost.batches_requeued) == ([], 0)
    assert b"w" in p


def test_every_batch_of_a_lost_worker_is_counted_and_only_its_running_one_costs_an_attempt() -> None:
    s = Scheduler(per_model={"m": BatchSettings(max_batch_size=1, max_wait_ms=0.0)}, worker_prefetch=2)
    p = WorkerPool(s, HEARTBEAT, 5, now=0.0)
    p.joined(b"w", WorkerInfo("m", 0, 1), 2, 0.0)
    reqs = [request(1), request(2)]
    reqs[0].attempts = 2
    for r in reqs:
        s.enqueue("m", r)
    assert len(s.due_batches(0.0)) == 2
    lost = p.lose(b"w", failed=True)
    assert lost.batches_requeued == 2
    assert [r.attempts for r in reqs] == [3, 0]  # the one behind it was never begun
    assert [(r.suspect, r.handbacks) for r in reqs] == [(1, 0), (0, 1)]


def test_a_leave_after_a_failure_still_costs_an_attempt() -> None:
    """Only the first hand-back is free, even with a failure in between."""
    p = pool(max_retries=5)
    (r,) = [request(1)]
    p.scheduler.enqueue("m", r)
    for i, failed in enumerate([False, True, False]):
        join(p, b"w%d" % i)
        assert p.scheduler.due_batches(0.0)
        p.lose(b"w%d" % i, failed=failed)
    assert r.attempts == 2  # free, then one for the failure, then one for the second leave


def test_a_batch_that_could_not_be_sent_goes_back_free_and_the_one_running_is_blamed() -> None:
    """The broker found the worker's connection gone when it sent a batch: that batch never
    reached the worker, so it neither took the blame nor cost its requests a try; the one
    the worker ran did."""
    s = Scheduler(per_model={"m": BatchSettings(max_batch_size=1, max_wait_ms=0.0)}, worker_prefetch=2)
    p = WorkerPool(s, HEARTBEAT, 1, now=0.0)
    p.joined(b"w", WorkerInfo("m", 0, 1), 2, 0.0)
    running, unsent = request(1), request(2)
    unsent.attempts = 1  # a retry already: one more charge would fail it
    for r in (running, unsent):
        s.enqueue("m", r)
    first, second = s.due_batches(0.0)
    assert first.requests == [running]
    second.unsent = True
    lost = p.lose(b"w", failed=True)
    assert lost.failed == [] and lost.batches_requeued == 2
    assert (running.attempts, running.suspect) == (1, 1)
    assert (unsent.attempts, unsent.suspect, unsent.handbacks) == (1, 0, 0)


def test_a_worker_whose_only_batch_could_not_be_sent_blames_none() -> None:
    """Two workers gone at once (a pause of serve's group): the batch handed back by the first
    finds the second's connection gone too; it costs nothing there either."""
    p = pool(max_retries=1)
    join(p, b"w1")
    join(p, b"w2")
    (r,) = [request(1)]
    p.scheduler.enqueue("m", r)
    (batch,) = p.scheduler.due_batches(0.0)
    p.lose(batch.worker, failed=True)  # the worker that ran it: one try spent
    (again,) = p.scheduler.due_batches(0.0)
    again.unsent = True
    lost = p.lose(again.worker, failed=True)
    assert lost.failed == [] and lost.batches_requeued == 1 and r.attempts == 1


def test_model_failed_cancels_only_that_models_requests() -> None:
    s = Scheduler(per_model={"m": BatchSettings(2, 0.0), "n": BatchSettings(2, 0.0)})
    p = WorkerPool(s, HEARTBEAT, 1, now=0.0)
    s.enqueue("m", request(1))
    s.enqueue("n", request(2))
    assert [(m, r.id) for m, r in p.model_failed("m", "cannot start")] == [("m", 1)]
    assert (s.queued("m"), s.queued("n")) == (0, 1)


def test_a_failed_start_beside_a_live_worker_refuses_nothing() -> None:
    """A new worker of "m" failed to start, but one is serving: requests still queue."""
    p = pool()
    join(p, b"w")
    p.model_failed("m", "the new worker's model did not load")
    assert p.refusal("m", 1.0) is None


def test_a_worker_that_joins_clears_the_failure_for_good() -> None:
    p = pool()
    p.model_failed("m", "did not load")
    join(p, b"w")
    p.lose(b"w", failed=True)
    assert p.refusal("m", 1.0) is None  # it failed to start once, but then one ran


def test_pool_names_and_lists_workers_by_model() -> None:
    p = pool()
    p.joined(b"\x01", WorkerInfo("m", 0, 11), None, 0.0)
    p.joined(b"\x02", WorkerInfo("n", None, 12), None, 0.0)
    assert p.name(b"\x01") == "m/gpu0/pid11/id01"
    assert p.name(b"\x09") == "id09"  # not (or no longer) in the pool
    assert p.workers_of("m") == [(b"\x01", WorkerInfo("m", 0, 11))]
    assert p.workers_of("x") == []


def test_losing_a_hung_worker_charges_only_the_batch_that_hung() -> None:
    """The batches behind a hung one never began: handed back as by a worker that left."""
    s = Scheduler(per_model={"m": BatchSettings(max_batch_size=1, max_wait_ms=0.0)}, worker_prefetch=2)
    p = WorkerPool(s, HEARTBEAT, 1, now=0.0)
    p.joined(b"w", WorkerInfo("m", 0, 1), 2, 0.0)
    hung, behind = request(1), request(2)
    s.enqueue("m", hung)
    s.enqueue("m", behind)
    first, _ = s.due_batches(0.0)
    assert first.requests == [hung]
    lost = p.lose(b"w", failed=True, blame=first.batch_id)
    assert lost.failed == [] and lost.batches_requeued == 2
    assert (hung.attempts, behind.attempts, behind.handbacks) == (1, 0, 1)
    assert (hung.suspect, behind.suspect) == (1, 0)


def multiplexed_pool(prefetch: int = 2) -> WorkerPool:
    """One multiplexed worker `w` of models a and b (room for both), batches of 2."""
    s = Scheduler(BatchSettings(max_batch_size=2, max_wait_ms=0.0), worker_prefetch=prefetch)
    p = WorkerPool(s, HEARTBEAT, 1, now=0.0)
    p.joined(b"w", WorkerInfo(POOL_NAME, 0, 1, catalog=Catalog(200, {"a": 100, "b": 100})), prefetch, 0.0)
    return p


def test_a_batch_that_hung_loading_its_model_is_answered_at_once_not_sent_to_another_worker() -> None:
    """Re-dispatched, a load that hangs hangs the next worker too: its clients would wait
    twice the time limit for the same worker_failed, and that worker's other models stall."""
    p = multiplexed_pool()
    s = p.scheduler
    loading, others = [request(1), request(2)], [request(3), request(4)]
    for model, reqs in (("a", loading), ("b", others)):
        for r in reqs:
            s.enqueue(model, r)
    cold, behind = s.due_batches(0.0)
    assert cold.cold and cold.requests == loading and behind.requests == others
    ((hung, limit),) = s.hung_batches(1000.0, 1.0)
    assert hung is cold and limit == 1.0 + LOAD_LIMIT_S
    lost = p.lose(b"w", failed=True, blame=cold.batch_id)
    assert lost.load_hung == [("a", r) for r in loading] and lost.failed == []
    assert s.queued("a") == 0 and s.queued("b") == 2  # the batch behind it goes on, free
    assert lost.batches_requeued == 1 and [r.attempts for r in others] == [0, 0]
    message = load_hung_message("a", "its batch ran past the time limit of 61000 ms (--batch-timeout-ms)")
    assert message.startswith("model 'a' hung while loading: its batch ran past the time limit of 61000")


def test_a_warm_batch_that_hung_and_a_cold_one_whose_worker_crashed_are_retried_as_before() -> None:
    p = multiplexed_pool(prefetch=1)
    s = p.scheduler
    s.enqueue("a", request(1))
    (cold,) = s.due_batches(0.0)
    assert cold.cold
    lost = p.lose(b"w", failed=True)  # a crash (no batch named as hung): not a hung load
    assert lost.load_hung == [] and s.queued("a") == 1
    p.joined(b"v", WorkerInfo(POOL_NAME, 0, 2, catalog=Catalog(200, {"a": 100, "b": 100})), 1, 0.0)
    (again,) = s.due_batches(0.0)
    s.complete(b"v", again.batch_id, 0.001, 0.01)  # v holds a now
    s.enqueue("a", request(2))
    (warm,) = s.due_batches(0.01)
    assert not warm.cold
    lost = p.lose(b"v", failed=True, blame=warm.batch_id)  # hung, but loaded nothing
    assert lost.load_hung == [] and s.queued("a") == 1


# --- a request that kills its worker (issue 28, item 7) ------------------------------------------


def test_a_crashed_workers_running_batch_becomes_suspects_that_run_alone() -> None:
    """A worker died (no blame known: a crash) holding a batch of 4: all four cost an
    attempt and are suspects; on the next worker each runs alone, a later arrival too is
    never batched with them; a worker that left (not failed) marks nobody."""
    s = Scheduler(per_model={"m": BatchSettings(max_batch_size=4, max_wait_ms=0.0)})
    p = WorkerPool(s, HEARTBEAT, 1, now=0.0)
    join(p, b"w1")
    crashed = [request(i) for i in range(4)]
    for r in crashed:
        s.enqueue("m", r)
    assert len(s.due_batches(0.0)) == 1
    lost = p.lose(b"w1", failed=True)
    assert lost.failed == [] and lost.batches_requeued == 1
    assert [(r.attempts, r.suspect) for r in crashed] == [(1, 1)] * 4
    later = request(9)
    s.enqueue("m", later)
    join(p, b"w2")
    sizes = []
    while s.queued("m"):
        (b,) = s.due_batches(1.0)
        sizes.append([r.id for r in b.requests])
        s.complete(b.worker, b.batch_id)
    assert sizes == [[0], [1], [2], [3], [9]]
    join(p, b"w3")
    left = [request(10), request(11)]
    for r in left:
        s.enqueue("m", r)
    s.due_batches(2.0)
    p.lose(b"w2", failed=False)
    p.lose(b"w3", failed=False)
    assert [r.suspect for r in left] == [0, 0]


def test_a_worker_running_a_suspect_holds_nothing_else_so_a_lost_reply_cannot_misplace_the_blame() -> None:
    """With prefetch, a worker given suspect A and then B would run A, send its reply,
    run B and die: a crash (os._exit) can lose A's reply still in the socket, and the
    blame would fall on A, the first batch it held. So a worker holding a suspect is
    given nothing more, and a suspect goes only to an idle worker: when it dies, the one
    batch it held is the one that killed it (the adversarial pass saw 1 of 7 innocent
    mates fail this way)."""
    s = Scheduler(per_model={"m": BatchSettings(max_batch_size=4, max_wait_ms=0.0)}, worker_prefetch=2)
    p = WorkerPool(s, HEARTBEAT, 1, now=0.0)
    join(p, b"w1")
    crashed = [request(i) for i in range(3)]
    for r in crashed:
        s.enqueue("m", r)
    assert len(s.due_batches(0.0)) == 1
    p.lose(b"w1", failed=True)  # all three are suspects now, one attempt each
    join(p, b"w2")
    join(p, b"w3")
    (a, b) = s.due_batches(1.0)  # one suspect to each idle worker, none to a prefetch slot
    assert {a.worker, b.worker} == {b"w2", b"w3"} and len(a.requests) == len(b.requests) == 1
    # long past their expected end, their replies not in (lost with a crash, say): the
    # third suspect waits for an idle worker, and nothing rides behind a suspect
    assert s.due_batches(5.0) == []
    s.enqueue("m", request(9))
    assert s.due_batches(6.0) == []
    lost = p.lose(a.worker, failed=True)  # the worker running a's suspect died holding only it
    assert [r for _, r in lost.failed] == a.requests and lost.batches_requeued == 0  # retries spent
    assert [r.attempts for r in b.requests] == [1]
    s.complete(b.worker, b.batch_id)
    (c,) = s.due_batches(7.0)
    assert c.worker == b.worker and len(c.requests) == 1 and c.requests[0].suspect


@dataclass
class PoisonRun:
    """What became of a queue holding one request that kills every worker running it."""

    served: list[object]
    failed: list[object]
    deaths: int


def run_with_a_poison(
    n: int, poison_at: int, batch_size: int, prefetch: int, workers: int, max_retries: int, late: int
) -> PoisonRun:
    """Simulate workers on a float clock: every 10 ms each worker runs its first batch;
    a batch holding the poison kills its worker, which the pool loses (failed, no blame:
    a crash) and a fresh worker replaces. `late` more requests arrive one per step."""
    s = Scheduler(
        per_model={"m": BatchSettings(max_batch_size=batch_size, max_wait_ms=0.0, policy="window")},
        worker_prefetch=prefetch,
    )
    p = WorkerPool(s, HEARTBEAT, max_retries, now=0.0)
    ids = itertools.count()

    def spawn(now: float) -> None:
        p.joined(b"w%d" % next(ids), WorkerInfo("m", None, 1), None, now)

    for _ in range(workers):
        spawn(0.0)
    reqs = [request(i) for i in range(n)]
    for r in reqs:
        s.enqueue("m", r)
    run = PoisonRun([], [], 0)
    now, pending_late = 0.0, list(range(n, n + late))
    for _ in range(10_000):
        if pending_late:
            r = request(pending_late.pop(0))
            r.arrived_at = now
            s.enqueue("m", r)
        s.due_batches(now)
        for wid, w in list(s.workers.items()):
            if not w.in_flight:
                continue
            batch = next(iter(w.in_flight.values()))
            if any(r.id == poison_at for r in batch.requests):
                run.deaths += 1
                run.failed += [r.id for _, r in p.lose(wid, failed=True).failed]
                spawn(now)
            else:
                s.complete(wid, batch.batch_id, 0.01, now)
                run.served += [r.id for r in batch.requests]
        now += 0.01
        if not pending_late and not s.busy():
            break
    return run


@given(
    n=st.integers(1, 24),
    data=st.data(),
    batch_size=st.integers(1, 8),
    prefetch=st.integers(1, 3),
    workers=st.integers(1, 3),
    max_retries=st.integers(1, 3),
    late=st.integers(0, 12),
)
def test_a_crashing_poison_fails_alone_after_its_retries_and_every_mate_is_served(
    n: int, data: st.DataObject, batch_size: int, prefetch: int, workers: int, max_retries: int, late: int
) -> None:
    poison_at = data.draw(st.integers(0, n - 1))
    run = run_with_a_poison(n, poison_at, batch_size, prefetch, workers, max_retries, late)
    assert run.failed == [poison_at]
    assert sorted(run.served) == [i for i in range(n + late) if i != poison_at]  # each once
    assert run.deaths == max_retries + 1  # it killed one worker per attempt, and no more


def test_with_max_retries_0_a_crash_fails_the_whole_batch_it_was_in() -> None:
    """No retry at all: nothing can tell the poison from its mates (as before)."""
    run = run_with_a_poison(4, 2, 4, 1, 1, 0, 0)
    assert sorted(run.failed) == [0, 1, 2, 3] and run.deaths == 1


def test_the_pool_tells_workers_its_heartbeat_settings() -> None:
    assert Heartbeat.from_frame(pool().heartbeat_frame) == HEARTBEAT


# --- a REPLY that breaks the protocol -----------------------------------------------------------


def test_a_bad_reply_fails_the_batch_it_names_and_keeps_the_worker() -> None:
    p = pool()
    join(p, b"w")
    dispatch(p, 1)
    (batch_id,) = [b.batch_id for b in p.scheduler.in_flight() if b.worker == b"w"]
    batch, broken = p.bad_reply(b"w", batch_id)
    assert batch is not None and [r.id for r in batch.requests] == [1] and broken is False
    assert p.scheduler.held(b"w") == 0  # failed, not left held


def test_a_bad_reply_naming_no_batch_breaks_a_worker_only_if_it_holds_some() -> None:
    p = pool()
    join(p, b"idle")
    assert p.bad_reply(b"idle", None) == (None, False)  # nothing to lose: the message is dropped
    join(p, b"busy")
    dispatch(p, 1)
    holder = b"idle" if p.scheduler.held(b"idle") else b"busy"
    assert p.bad_reply(holder, None) == (None, True)
    assert p.bad_reply(holder, 10**6) == (None, False)  # names an unknown batch: dropped, kept


# --- what a READY may say of the worker (docs/protocol.md 6.2) ---------------------------------


def test_ready_info_carries_the_signature_cost_credit_and_warmup_error_it_announced() -> None:
    raw_sig = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}], "outputs": []}
    info = worker_info(
        {"model": "m", "gpu": 0, "pid": 5, "signature": raw_sig, "cost_ms": [1, 2.5], "max_active": 8}
    )
    assert info == WorkerInfo("m", 0, 5, Signature((TensorSpec("x", "FP32", (-1, 4)),), ()), (1.0, 2.5), 8)
    assert type(info.cost_ms[0]) is float and info.warmup == "measured"  # type: ignore[index]
    failed = worker_info({"model": "m", "warmup_error": "out of memory"})
    assert (failed.warmup_error, failed.warmup, failed.cost_ms) == (
        "out of memory",
        "failed: out of memory",
        None,
    )
    assert worker_info({"model": "m"}).warmup is None  # no warm-up ran


def test_ready_cost_ms_must_be_two_numbers_within_a_day() -> None:
    for good in ([0, 0], [86_400_000, 86_400_000.0], [0.5, 86_400_000]):
        assert worker_info({"model": "m", "cost_ms": good}).cost_ms == (float(good[0]), float(good[1]))
    for bad in ([1], [1, 2, 3], (1, 2), "12", [1, True], [True, 1], [-0.001, 1], [1, 86_400_000.5], [1, "2"]):
        with pytest.raises(
            ValueError, match=r"^bad READY cost_ms: must be \[a, b\], two numbers in \[0, one day\], got "
        ):
            worker_info({"model": "m", "cost_ms": bad})
    with pytest.raises(ValueError) as info:
        worker_info({"model": "m", "cost_ms": ["x" * 1000, 1]})
    assert len(str(info.value)) <= 200 and str(info.value).endswith("...")  # a huge value is cut


def test_ready_max_active_must_be_an_int_from_1_to_4096() -> None:
    for good in (1, 4096):
        assert worker_info({"model": "m", "max_active": good}).max_active == good
    for bad in (0, 4097, -1, 2.0, True, "3"):
        with pytest.raises(ValueError, match=r"^bad READY max_active: must be an int in \[1, 4096\], got "):
            worker_info({"model": "m", "max_active": bad})
    with pytest.raises(ValueError) as info:
        worker_info({"model": "m", "max_active": "x" * 1000})
    assert len(str(info.value)) <= 200 and str(info.value).endswith("...")


def test_ready_warmup_error_must_be_a_str_and_is_cut_to_500_characters() -> None:
    assert worker_info({"model": "m", "warmup_error": "e" * 501}).warmup_error == "e" * 500
    assert worker_info({"model": "m", "warmup_error": "e" * 500}).warmup_error == "e" * 500
    with pytest.raises(ValueError, match=r"^bad READY warmup_error: must be a str, got 5$"):
        worker_info({"model": "m", "warmup_error": 5})
    with pytest.raises(ValueError) as info:
        worker_info({"model": "m", "warmup_error": [0] * 1000})
    assert len(str(info.value)) <= 200 and str(info.value).endswith("...")


def test_a_ready_signature_that_is_no_signature_is_refused_with_why() -> None:
    with pytest.raises(ValueError, match=r"^bad READY signature: a signature is a map of inputs and outputs"):
        worker_info({"model": "m", "signature": [1]})


def test_the_public_name_leaves_the_pid_out_and_an_unknown_worker_is_named_by_its_id() -> None:
    assert WorkerInfo("m", 2, 7).public_name(b"\x0a\xff") == "m/gpu2/id0aff"
    assert WorkerInfo("m", None, 7).public_name(b"\x0a") == "m/gpu-/id0a"
    p = pool()
    p.joined(b"\x01", WorkerInfo("m", 3, 9), None, 0.0)
    assert (p.name(b"\x01"), p.public_name(b"\x01")) == ("m/gpu3/pid9/id01", "m/gpu3/id01")
    assert (p.name(b"\x02"), p.public_name(b"\x02")) == ("id02", "id02")


def test_a_models_warmup_is_its_newest_live_workers() -> None:
    p = pool()
    assert p.warmup("m") is None  # no worker
    p.joined(b"a", WorkerInfo("m", 0, 1, cost_ms=(1.0, 2.0)), None, 0.0)
    p.joined(b"b", WorkerInfo("m", 0, 2, warmup_error="oom"), None, 0.0)
    p.joined(b"c", WorkerInfo("other", 0, 3, cost_ms=(1.0, 2.0)), None, 0.0)
    assert p.warmup("m") == "failed: oom"
    p.lose(b"b", failed=False)
    assert p.warmup("m") == "measured"


def test_a_suspect_handed_back_by_a_worker_that_left_still_runs_alone() -> None:
    """A worker that leaves (DISCONNECT) proves nothing about the suspect it held: it
    stays one, and runs alone on the next worker too."""
    s = Scheduler(per_model={"m": BatchSettings(max_batch_size=4, max_wait_ms=0.0)})
    p = WorkerPool(s, HEARTBEAT, 3, now=0.0)
    join(p, b"w1")
    crashed = [request(0), request(1)]
    for r in crashed:
        s.enqueue("m", r)
    s.due_batches(0.0)
    p.lose(b"w1", failed=True)
    join(p, b"w2")
    (b,) = s.due_batches(1.0)
    assert [r.id for r in b.requests] == [0]  # alone
    p.lose(b"w2", failed=False)
    assert [(r.attempts, r.suspect > 0) for r in crashed] == [(1, True), (1, True)]
    for r in (request(5), request(6)):
        s.enqueue("m", r)
    join(p, b"w3")
    sizes = []
    while s.queued("m"):
        (b,) = s.due_batches(2.0)
        sizes.append([r.id for r in b.requests])
        s.complete(b.worker, b.batch_id)
    assert sizes == [[0], [1], [5, 6]]


def test_a_warm_up_cost_in_ready_seeds_the_models_cost_in_seconds() -> None:
    p = pool()
    assert p.scheduler.cost("m") is None
    p.joined(b"w", WorkerInfo("m", 0, 1, cost_ms=(2.0, 0.5)), None, 0.0)
    a_s, b_s = p.scheduler.cost("m")  # type: ignore[misc]
    assert a_s == pytest.approx(0.002) and b_s == pytest.approx(0.0005)


def test_the_pool_keeps_the_streams_it_is_given_and_joins_step_level_workers_to_them() -> None:
    streams = Streams()
    p = WorkerPool(pool().scheduler, HEARTBEAT, 1, now=0.0, streams=streams)
    assert p.streams is streams
    p.joined(b"s", WorkerInfo("m", 0, 1, max_active=3), None, 5.0)
    p.joined(b"b", WorkerInfo("m", 0, 2), None, 5.0)
    w = streams.worker(b"s")
    assert w is not None and (w.model, w.max_active, w.free) == ("m", 3, 3)
    assert b"b" not in streams  # a batch-level worker holds no sequences


def test_sequences_whose_start_could_not_be_sent_go_back_free_the_others_cost_a_try() -> None:
    streams = Streams()
    p = WorkerPool(pool().scheduler, HEARTBEAT, 1, now=0.0, streams=streams)
    p.joined(b"s", WorkerInfo("m", 0, 1, max_active=3), None, 0.0)
    held, unsent = request(1), request(2)
    unsent.attempts = 1  # one more charge would fail it
    for r in (held, unsent):
        p.scheduler.enqueue("m", r)
    streams.start(b"s", p.scheduler.take("m", 1), 0.0)
    (new,) = streams.start(b"s", p.scheduler.take("m", 1), 1.0)
    assert new.request is unsent
    new.unsent = True
    lost = p.lose(b"s", failed=True)
    assert lost.failed == [] and lost.batches_requeued == 1
    assert (held.attempts, unsent.attempts, unsent.handbacks) == (1, 1, 0)
    assert p.scheduler.queued("m") == 2


def test_a_multiplexed_ready_makes_a_worker_of_every_model_of_its_catalog() -> None:
    wire = {"budget_mb": 200, "models": {"a/1": 100, "b/1": 100}}
    info = worker_info({"model": "multiplexed", "gpu": None, "pid": 3, "multiplexed": wire})
    assert info.catalog is not None and info.catalog.wire() == wire
    p = pool()
    p.joined(b"p", info, None, 0.0)
    s = p.scheduler
    assert s.has_workers("a/1") and s.has_workers("b/1") and not s.has_workers("multiplexed")
    for bad, why in (
        ({"budget_mb": 50, "models": {"a": 100}}, "needs 100 MB"),
        ({"budget_mb": 50}, "budget_mb and models"),
        ([1], "budget_mb and models"),
    ):
        with pytest.raises(ValueError, match="bad READY multiplexed: .*" + why):
            worker_info({"model": "multiplexed", "multiplexed": bad})
    with pytest.raises(ValueError, match="a step-level worker cannot be multiplexed"):
        worker_info({"model": "m", "max_active": 4, "multiplexed": wire})


def test_a_multiplexed_worker_announces_its_models_signatures() -> None:
    sig = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}], "outputs": []}
    wire = {"budget_mb": 200, "models": {"a/1": 100, "b/1": 100}}
    p = pool()
    info = worker_info({"model": "multiplexed", "multiplexed": wire, "signatures": {"a/1": sig}})
    p.joined(b"p", info, None, 0.0)
    a = p.signature("a/1")
    assert a is not None and a.wire()["inputs"] == sig["inputs"]
    assert p.signature("b/1") is None and p.signature("multiplexed") is None
    for bad in ({"c": sig}, {"a/1": {"inputs": 1}}, [sig]):
        with pytest.raises(ValueError, match="bad READY signatures"):
            worker_info({"model": "multiplexed", "multiplexed": wire, "signatures": bad})
    with pytest.raises(ValueError, match="bad READY signatures"):
        worker_info({"model": "m", "signatures": {"a/1": sig}})  # only a multiplexed worker's


def test_a_workers_info_gives_its_signature_for_its_own_model_only() -> None:
    sig = Signature.from_wire({"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}], "outputs": []})
    info = WorkerInfo("m", 0, 1, signature=sig)
    assert info.signature_of("m") is sig and info.signature_of("other") is None


def test_a_multiplexed_worker_may_announce_the_signature_of_every_model_of_its_catalog() -> None:
    sig = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}], "outputs": []}
    wire = {"budget_mb": 200, "models": {"a/1": 100, "b/1": 100}}
    p = pool()
    p.joined(
        b"p",
        worker_info({"model": "multiplexed", "multiplexed": wire, "signatures": {"a/1": sig, "b/1": sig}}),
        None,
        0.0,
    )
    assert all(p.signature(m) is not None for m in ("a/1", "b/1"))


def test_a_bad_readys_catalog_or_signatures_are_refused_in_a_message_of_at_most_300_characters() -> None:
    """Whatever a worker sends, the log line that says why its READY was refused stays short."""
    wire = {"budget_mb": 200, "models": {"a/1": 100, "b/1": 100}}
    long_name = {"name": "x" * 400, "datatype": "FP32", "shape": [1]}
    for bad, why in (
        (
            {"multiplexed": {"budget_mb": 50, "models": {"a" * 1000: 1}}},
            "multiplexed: .*name must be 1 to 256",
        ),
        ({"multiplexed": wire, "signatures": {"c" * 1000: {}}}, "signatures: a map of the multiplexed"),
        (
            {"multiplexed": wire, "signatures": {"a/1": {"inputs": [long_name]}}},
            "signatures: a tensor's name",
        ),
    ):
        with pytest.raises(ValueError, match="bad READY " + why) as refused:
            worker_info({"model": "multiplexed", **bad})
        assert len(str(refused.value)) <= 300


def test_a_multiplexed_worker_that_announced_no_signatures_has_none() -> None:
    wire = {"budget_mb": 200, "models": {"a/1": 100, "b/1": 100}}
    p = pool()
    p.joined(b"p", worker_info({"model": "multiplexed", "multiplexed": wire}), None, 0.0)
    assert p.signature("a/1") is None and p.signature("b/1") is None


def test_a_step_level_worker_cannot_be_multiplexed() -> None:
    wire = {"budget_mb": 200, "models": {"a/1": 100}}
    with pytest.raises(ValueError, match=r"^bad READY: a step-level worker cannot be multiplexed$"):
        worker_info({"model": "m", "max_active": 4, "multiplexed": wire})


def test_a_hung_loads_clients_are_told_it_is_not_retried() -> None:
    message = load_hung_message("a", "its batch ran past the time limit of 61000 ms (--batch-timeout-ms)")
    assert message.startswith("model 'a' hung while loading: its batch ran past the time limit of 61000")
    assert message.endswith("not retried on another worker")


def _nested(depth: int) -> list[object]:
    """A list nested `depth` deep (msgpack decodes up to 1024 levels; repr stops sooner)."""
    value: list[object] = [0]
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "info",
    [
        {"model": _nested(1000)},
        {"model": "m", "cost_ms": _nested(1000)},
        {"model": "m", "cost_ms": list(range(200_000))},
        {"model": "m", "max_active": _nested(1000)},
        {"model": "m", "warmup_error": _nested(1000)},
        {"model": "m", "signature": {"inputs": _nested(1000)}},
        {"model": "m", "signature": {"inputs": [{"name": "x", "datatype": "FP32", "shape": _nested(1000)}]}},
        {"model": "m", "multiplexed": {"budget_mb": _nested(1000), "models": {"a": 1}}},
        {"model": "m", "multiplexed": {"budget_mb": 10, "models": {"a": _nested(1000)}}},
        {"model": "m", "multiplexed": {"budget_mb": 10, "models": {"a": 1}}, "signatures": _nested(1000)},
    ],
)
def test_a_ready_of_values_nested_too_deep_or_too_long_to_show_is_refused_in_a_short_message(
    info: dict[str, object],
) -> None:
    """A worker's READY is a peer's msgpack: a value nested past what repr can go, or of
    megabytes, is refused (ValueError, as any bad READY) in a message of a few hundred
    characters, never a RecursionError, whatever the caller's stack."""
    with pytest.raises(ValueError) as refused:
        worker_info(info)
    message = str(refused.value)
    assert message.startswith("bad READY") and len(message) < 600
    assert "nested too deeply to show" in message or "..." in message
