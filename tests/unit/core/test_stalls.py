"""Stalls on a float clock (batcher/core/stalls.py, sans-I/O): a wait that ended late
is a stall past STALL_MIN_S only; two watchers of one stall count it once; and what the
link, the pool, the scheduler and the streams skip of it."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batcher.core.link import Backoff, Drop, PeerLink
from batcher.core.pool import WorkerInfo, WorkerPool
from batcher.core.scheduler import BatchSettings, QueuedRequest, Scheduler
from batcher.core.stalls import STALL_MIN_S, Stalls, overslept
from batcher.core.streams import Streams
from batcher.wire.protocol import Heartbeat


def test_a_wait_late_past_the_tolerance_is_a_stall_from_its_due_time() -> None:
    assert overslept(10.0, 0.5, 10.5 + STALL_MIN_S) is None  # a busy machine's delay
    assert overslept(10.0, 0.5, 14.5) == (10.5, 14.5)
    assert overslept(10.0, 0.0, 12.0) == (10.0, 12.0)  # a poll that only looked


@pytest.mark.parametrize("wait_s", [-0.001, -1.0, math.inf, math.nan])
def test_a_wait_without_an_end_is_never_a_stall(wait_s: float) -> None:
    assert overslept(0.0, wait_s, 100.0) is None


def test_two_watchers_of_one_stall_count_it_once() -> None:
    """The worker's poll and its heartbeat thread both wake late after one SIGCONT."""
    stalls = Stalls()
    assert stalls.count((10.5, 14.5)) == 4.0
    stalls.seen((10.2, 14.5))  # the thread's wait began later
    assert stalls.pending(14.5) and stalls.count() == pytest.approx(0.0) and not stalls.pending(14.5)
    stalls.seen((14.0, 16.0))
    assert stalls.count((20.0, 21.0)) == pytest.approx(1.5 + 1.0)  # only what is new of each
    assert stalls.count() == 0.0


def test_the_other_watchers_wait_overdue_is_a_stall_before_it_is_back_to_say_so() -> None:
    """After a SIGCONT the worker's loop may run before its heartbeat thread does, stopped
    outside its poll (in a model, say): the thread's wait, overdue, is the stall then; the
    thread's own note of it later adds only what came after."""
    stalls = Stalls()
    stalls.waiting(10.0, 0.5)
    assert not stalls.pending(10.5 + STALL_MIN_S)
    assert stalls.pending(14.0) and stalls.count(None, 14.0) == 3.5
    stalls.seen((10.5, 14.01))  # the thread, back
    stalls.woke()
    assert stalls.count(None, 14.02) == pytest.approx(0.01)
    assert not stalls.pending(100.0) and stalls.count(None, 100.0) == 0.0  # it may wait for the socket


@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0, 10)), max_size=20), st.integers(0, 20))
def test_stalls_counted_never_exceed_the_time_they_cover(spans: list[tuple[float, float]], cut: int) -> None:
    stalls = Stalls()
    told = [(a, a + d) for a, d in spans]
    for stall in told[:cut]:
        stalls.seen(stall)
    counted = stalls.count() + sum(stalls.count(s) for s in sorted(told[cut:], key=lambda s: s[1]))
    assert counted >= 0 and not stalls.pending(math.inf)
    if told:
        assert counted <= max(e for _, e in told) - min(a for a, _ in told) + 1e-9


def worker_link() -> PeerLink:
    link = PeerLink(Backoff(0.25, 8.0), beat_s=1.0, expiry_s=3.0)
    link.connected(0.0)
    return link


def test_a_link_skips_its_own_stall_before_taking_the_peer_for_lost() -> None:
    link = worker_link()
    link.heard(1.0)
    link.stalled(5.0, now=7.0)  # stopped from 1.5 to 6.5 s: the silence is 0.5 s + 0.5 s
    assert link.heard_at == 6.0 and link.next_wakeup() is not None
    assert not isinstance(link.due(8.9), Drop)
    assert isinstance(link.due(9.0), Drop)


def test_a_stall_never_puts_the_last_word_past_now_and_a_down_link_ignores_it() -> None:
    link = worker_link()
    link.heard(5.0)
    link.stalled(10.0, now=6.0)
    assert link.heard_at == 6.0
    link.due(9.0)  # dropped
    assert not link.up
    link.stalled(10.0, now=9.5)
    assert link.heard_at is None and link.retry_at == 9.25


HEARTBEAT = Heartbeat(interval_ms=100.0, liveness=3)


def broker_pool() -> WorkerPool:
    s = Scheduler(per_model={"m": BatchSettings(max_batch_size=1, max_wait_ms=0.0)}, worker_prefetch=2)
    p = WorkerPool(s, HEARTBEAT, 1, now=0.0, streams=Streams())
    p.joined(b"w", WorkerInfo("m", 0, 1), 2, 0.0)
    return p


def test_a_broker_stall_is_no_workers_silence_nor_its_batches_running_time() -> None:
    p = broker_pool()
    s = p.scheduler
    s.enqueue("m", QueuedRequest([b"c", b""], b"\x80", 1, 0.0))
    (batch,) = s.due_batches(0.0)
    limit = s.default_limit_s(batch)
    p.stalled(100.0)
    p.backend_read(100.2)
    assert p.silent() == []  # heard at 0.0, silent 0.2 s of the 100.2 that passed
    p.backend_read(100.31)
    assert [w for w, _ in p.silent()] == [b"w"]
    assert s.hung_batches(100.0 + limit, None) == []
    assert [b for b, _ in s.hung_batches(100.01 + limit, None)] == [batch]


def test_a_broker_stall_is_no_step_level_workers_silence() -> None:
    streams = Streams()
    streams.add_worker(b"w", "m", 1)
    streams.start(b"w", [QueuedRequest([b"c", b""], b"\x80", 1, 0.0)], 10.0)
    streams.stalled(30.0)
    assert streams.hung(42.0, 2.0) == []
    assert [w.worker_id for w, _ in streams.hung(42.01, 2.0)] == [b"w"]
