"""The step-level workers' sans-I/O core on a float clock (batcher/core/streams.py): credit
accounting, exactly one final reply per sequence, the broker's own endings (cancel,
deadline, client gone), hung workers; and what a lost step-level worker leaves behind
(batcher/core/pool.py), with Scheduler.take feeding free slots. No zmq, no processes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from batcher.core.pool import WorkerInfo, WorkerPool
from batcher.core.scheduler import BatchSettings, QueuedRequest, Scheduler
from batcher.core.streams import STEP_LIMIT_S, Sequence, Streams, Verdict
from batcher.wire.protocol import CHUNK_DROPPED, CHUNK_ERROR, CHUNK_FINAL, CHUNK_FLAGS, CHUNK_MORE, Heartbeat

_rid = iter(range(10**9))


def rq(
    t: float = 0.0,
    client: bytes = b"c",
    rid: object = None,
    deadline: float | None = None,
    priority: float = 0,
) -> QueuedRequest:
    """A request of `client` that arrived at fake time `t`; its id is unique unless given."""
    return QueuedRequest([client, b""], b"\x80", next(_rid) if rid is None else rid, t, priority, deadline)


def streams_with(*workers: tuple[bytes, int], model: str = "m") -> Streams:
    s = Streams()
    for wid, max_active in workers:
        s.add_worker(wid, model, max_active)
    return s


# --- the credit accounting, as a state machine ------------------------------------------------

CLIENTS = (b"a", b"b")
REQ_IDS = (1, 2)
UNKNOWN_SEQ = 10**12
NEVER_A_WORKER = b"never"


@dataclass
class WorkerModel:
    model: str
    max_active: int
    held: set[int] = field(default_factory=set)
    draining: bool = False


@dataclass
class SeqModel:
    seq: Sequence
    worker: bytes
    client: bytes
    req_id: int
    deadline: float | None
    open: bool = True  # no final reply yet
    finals: int = 0  # DELIVER_FINAL + broker answers + ABANDONED + the pool's (worker removed)
    ended: bool = False  # its worker said it ended (final, error, dropped), or was removed
    chunks: int = 0


class StreamsMachine(RuleBasedStateMachine):
    """Random interleavings of worker joins, starts, CHUNK entries (right, late, forged),
    broker endings, expiry, drains and removals, checked against a plain model."""

    def __init__(self) -> None:
        super().__init__()
        self.streams = Streams()
        self.now = 0.0
        self.workers: dict[bytes, WorkerModel] = {}
        self.ever: list[bytes] = []  # every worker id used so far
        self.seqs: dict[int, SeqModel] = {}

    @initialize(first=st.integers(0, 2**62))
    def make(self, first: int) -> None:
        self.streams = Streams(first_seq_id=first)

    # --- helpers --------------------------------------------------------------------------

    def _pick(self, options: list[bytes], i: int) -> bytes | None:
        return options[i % len(options)] if options else None

    def _final(self, sm: SeqModel) -> None:
        assert sm.open, "a second final reply"
        sm.open = False
        sm.finals += 1

    def _broker_answers(self, sm: SeqModel) -> None:
        """What the broker does for a cancel, a deadline or a client gone."""
        was_open = sm.open
        held = self.streams.answer(sm.seq)
        # Whether its worker still holds it: always, for one not answered yet (a worker
        # that ended it answered it, a removed one had the pool answer it).
        assert held == was_open
        if was_open:
            self._final(sm)
        assert sm.seq.answered

    # --- rules ----------------------------------------------------------------------------

    @rule(
        max_active=st.integers(1, 5), reuse=st.booleans(), i=st.integers(0, 99), model=st.sampled_from("mn")
    )
    def add_worker(self, max_active: int, reuse: bool, i: int, model: str) -> None:
        gone = [w for w in self.ever if w not in self.workers]
        wid = self._pick(gone, i) if reuse else None
        if wid is None:
            wid = b"w%d" % len(self.ever)
            self.ever.append(wid)
        self.streams.add_worker(wid, model, max_active)
        self.workers[wid] = WorkerModel(model, max_active)

    @precondition(lambda self: bool(self.workers))
    @rule(
        i=st.integers(0, 99),
        reqs=st.lists(
            st.tuples(st.sampled_from(CLIENTS), st.sampled_from(REQ_IDS), st.none() | st.floats(0.0, 3.0)),
            max_size=6,
        ),
    )
    def start(self, i: int, reqs: list[tuple[bytes, int, float | None]]) -> None:
        wid = self._pick(sorted(self.workers), i)
        assert wid is not None
        wm = self.workers[wid]
        free = 0 if wm.draining else wm.max_active - len(wm.held)
        requests = [rq(self.now, c, r, None if d is None else self.now + d) for c, r, d in reqs]
        if len(requests) > free:
            busy_before = self.streams.busy()
            with pytest.raises(ValueError):
                self.streams.start(wid, requests, self.now)
            assert self.streams.held(wid) == len(wm.held)  # nothing half-started
            assert self.streams.busy() == busy_before
            return
        out = self.streams.start(wid, requests, self.now)
        assert [s.request for s in out] == requests
        for seq, (c, r, _) in zip(out, reqs, strict=True):
            assert seq.seq_id not in self.seqs, "a sequence id used twice"
            assert seq.worker == wid and seq.model == wm.model and seq.chunks == 0 and not seq.answered
            self.seqs[seq.seq_id] = SeqModel(seq, wid, c, r, seq.request.deadline_at)
            wm.held.add(seq.seq_id)

    @rule(
        wi=st.integers(0, 99),
        si=st.integers(0, 999),
        flag=st.sampled_from(CHUNK_FLAGS),
        own=st.booleans(),
        dt=st.sampled_from([0.0, 0.25]),
    )
    def chunk(self, wi: int, si: int, flag: int, own: bool, dt: float) -> None:
        """One CHUNK entry: most often for a sequence of the sending worker (`own`), else
        from any worker, ever or never seen, for any sequence id (late or forged)."""
        self.now += dt
        seq_ids = sorted(self.seqs)
        if own and seq_ids:
            seq_id = seq_ids[si % len(seq_ids)]
            wid = self.seqs[seq_id].worker
        else:
            wid = self._pick([*self.ever, NEVER_A_WORKER], wi) or NEVER_A_WORKER
            seq_id = self._pick_seq(seq_ids, si)
        wm = self.workers.get(wid)
        verdict, seq = self.streams.on_chunk(wid, seq_id, flag, self.now)
        if wm is None or seq_id not in wm.held:
            assert (verdict, seq) == (Verdict.DROP, None)
            return
        sm = self.seqs[seq_id]
        if flag != CHUNK_MORE:  # it ended: only now does its slot free
            wm.held.discard(seq_id)
            sm.ended = True
        if not sm.open:
            assert (verdict, seq) == (Verdict.DROP, None)  # answered already: nothing goes
            return
        assert seq is sm.seq
        if flag == CHUNK_DROPPED:
            assert verdict is Verdict.ABANDONED
            self._final(sm)  # the broker answers it worker_failed
        elif flag == CHUNK_MORE:
            assert verdict is Verdict.DELIVER
            sm.chunks += 1
        else:
            assert verdict is Verdict.DELIVER_FINAL
            sm.chunks += 1
            self._final(sm)
        assert seq.chunks == sm.chunks

    @staticmethod
    def _pick_seq(seq_ids: list[int], si: int) -> int:
        options = [*seq_ids, UNKNOWN_SEQ]
        return options[si % len(options)]

    @precondition(lambda self: bool(self.seqs))
    @rule(si=st.integers(0, 999))
    def broker_answers(self, si: int) -> None:
        """A cancel, a deadline, or a client found gone: the broker ends the sequence."""
        seq_ids = sorted(self.seqs)
        self._broker_answers(self.seqs[seq_ids[si % len(seq_ids)]])

    @rule(client=st.sampled_from([*CLIENTS, b"stranger"]), req_id=st.sampled_from([*REQ_IDS, 3]))
    def cancel(self, client: bytes, req_id: int) -> None:
        found = self.streams.cancel_id(client, req_id)
        expected = {
            s for s, sm in self.seqs.items() if sm.open and (sm.client, sm.req_id) == (client, req_id)
        }
        assert sorted(s.seq_id for s in found) == sorted(expected)  # each once, only unanswered ones
        for seq in found:
            assert not seq.answered
            self._broker_answers(self.seqs[seq.seq_id])
        assert self.streams.cancel_id(client, req_id) == []

    @rule(dt=st.floats(0.0, 2.0))
    def expire(self, dt: float) -> None:
        self.now += dt
        out = self.streams.expire(self.now)
        expected = {
            s
            for s, sm in self.seqs.items()
            if sm.open and sm.deadline is not None and sm.deadline <= self.now
        }
        ids = [s.seq_id for s in out]
        assert sorted(ids) == sorted(expected)
        for seq in out:
            assert not seq.answered
            self._broker_answers(self.seqs[seq.seq_id])
        assert self.streams.expire(self.now) == []

    @rule(dt=st.floats(0.0, 2.0))
    def tick(self, dt: float) -> None:
        self.now += dt

    @rule(i=st.integers(0, 99))
    def remove_worker(self, i: int) -> None:
        wid = self._pick([*self.ever, NEVER_A_WORKER], i) or NEVER_A_WORKER
        wm = self.workers.pop(wid, None)
        out = self.streams.remove_worker(wid)
        if wm is None:
            assert out == []
            return
        expected = {s for s in wm.held if self.seqs[s].open}
        assert sorted(s.seq_id for s in out) == sorted(expected)
        for s in wm.held:
            sm = self.seqs[s]
            sm.ended = True
            if sm.open:
                self._final(sm)  # the pool's: answered worker_failed, or queued again
        assert all(s.answered for s in out)
        assert wid not in self.streams and self.streams.worker(wid) is None

    @rule(i=st.integers(0, 99))
    def drain_worker(self, i: int) -> None:
        wid = self._pick([*self.ever, NEVER_A_WORKER], i) or NEVER_A_WORKER
        wm = self.workers.get(wid)
        n = self.streams.drain_worker(wid)
        if wm is None:
            assert n == 0
            return
        assert n == len(wm.held)
        wm.draining = True

    # --- invariants -----------------------------------------------------------------------

    @invariant()
    def credit_is_exact(self) -> None:
        for wid, wm in self.workers.items():
            w = self.streams.worker(wid)
            assert w is not None and wid in self.streams
            assert 0 <= len(w.held) <= w.max_active == wm.max_active
            assert set(w.held) == wm.held  # a slot frees only when the worker says so
            assert w.free == (0 if wm.draining else wm.max_active - len(w.held))
            assert self.streams.held(wid) == len(wm.held)
        for wid in [*self.ever, NEVER_A_WORKER]:
            if wid not in self.workers:
                assert wid not in self.streams and self.streams.held(wid) == 0
        assert bool(self.streams) == bool(self.workers)

    @invariant()
    def one_final_reply_each(self) -> None:
        for sm in self.seqs.values():
            assert sm.finals <= 1
            assert sm.finals == (0 if sm.open else 1)
            if sm.ended:
                assert sm.finals == 1
            assert sm.seq.answered == (not sm.open)

    @invariant()
    def busy_iff_unanswered(self) -> None:
        open_ids = {s for s, sm in self.seqs.items() if sm.open}
        assert self.streams.busy() == bool(open_ids)
        assert sorted(s.seq_id for s in self.streams.unanswered()) == sorted(open_ids)

    @rule()
    def next_deadline_is_the_earliest_open_one(self) -> None:
        """A rule, not an invariant: next_deadline clears answered entries off the heap's
        top, which would leave expire() none to skip."""
        deadlines = [sm.deadline for sm in self.seqs.values() if sm.open and sm.deadline is not None]
        assert self.streams.next_deadline() == (min(deadlines) if deadlines else None)

    @invariant()
    def free_slots_emptiest_first(self) -> None:
        free = self.streams.free_slots()
        assert {w.worker_id for w in free} == {
            wid for wid, wm in self.workers.items() if not wm.draining and len(wm.held) < wm.max_active
        }
        held = [len(w.held) for w in free]
        assert held == sorted(held)

    @invariant()
    def active_per_model(self) -> None:
        for model in "mn":
            expected = sum(len(wm.held) for wm in self.workers.values() if wm.model == model)
            assert self.streams.active(model) == expected
            assert {w.worker_id for w in self.streams.workers_of(model)} == {
                wid for wid, wm in self.workers.items() if wm.model == model
            }


TestStreamsMachine = StreamsMachine.TestCase


# --- examples: verdicts ------------------------------------------------------------------------


def test_chunks_are_delivered_in_order_then_the_final_one_frees_the_slot() -> None:
    s = streams_with((b"w", 1))
    (seq,) = s.start(b"w", [rq()], 0.0)
    assert s.worker(b"w") is not None and s.worker(b"w").free == 0  # type: ignore[union-attr]
    assert s.on_chunk(b"w", seq.seq_id, CHUNK_MORE, 0.1) == (Verdict.DELIVER, seq)
    assert seq.chunks == 1 and not seq.answered
    assert s.on_chunk(b"w", seq.seq_id, CHUNK_MORE, 0.2) == (Verdict.DELIVER, seq)
    assert s.held(b"w") == 1 and s.busy()
    assert s.on_chunk(b"w", seq.seq_id, CHUNK_FINAL, 0.3) == (Verdict.DELIVER_FINAL, seq)
    assert seq.chunks == 3 and seq.answered
    assert s.held(b"w") == 0 and not s.busy()
    assert [w.worker_id for w in s.free_slots()] == [b"w"]
    # A repeated final (or any late entry) for it is dropped.
    assert s.on_chunk(b"w", seq.seq_id, CHUNK_FINAL, 0.4) == (Verdict.DROP, None)
    assert s.on_chunk(b"w", seq.seq_id, CHUNK_MORE, 0.4) == (Verdict.DROP, None)


def test_an_error_entry_is_the_final_reply() -> None:
    s = streams_with((b"w", 2))
    (seq,) = s.start(b"w", [rq()], 0.0)
    assert s.on_chunk(b"w", seq.seq_id, CHUNK_ERROR, 0.1) == (Verdict.DELIVER_FINAL, seq)
    assert seq.answered and s.held(b"w") == 0


def test_a_chunk_after_the_broker_answered_is_dropped_and_the_slot_waits_for_the_ack() -> None:
    s = streams_with((b"w", 1))
    (seq,) = s.start(b"w", [rq(client=b"c", rid=7)], 0.0)
    assert s.answer(seq) is True  # the worker still holds it: tell it to stop
    assert s.answer(seq) is False  # answered once only
    assert not s.busy() and s.cancel_id(b"c", 7) == []
    assert s.held(b"w") == 1 and s.free_slots() == []  # not freed by the broker's answer
    assert s.on_chunk(b"w", seq.seq_id, CHUNK_MORE, 0.1) == (Verdict.DROP, None)
    assert s.held(b"w") == 1 and seq.chunks == 0
    assert s.on_chunk(b"w", seq.seq_id, CHUNK_FINAL, 0.2) == (Verdict.DROP, None)  # raced the cancel
    assert s.held(b"w") == 0  # its end frees the slot, whatever the flag
    assert s.on_chunk(b"w", seq.seq_id, CHUNK_DROPPED, 0.3) == (Verdict.DROP, None)  # the late ack


def test_the_cancel_ack_frees_the_slot() -> None:
    s = streams_with((b"w", 1))
    (seq,) = s.start(b"w", [rq()], 0.0)
    assert s.answer(seq)
    assert s.on_chunk(b"w", seq.seq_id, CHUNK_DROPPED, 0.1) == (Verdict.DROP, None)
    assert s.held(b"w") == 0 and [w.worker_id for w in s.free_slots()] == [b"w"]


def test_a_dropped_entry_for_an_unanswered_sequence_is_abandoned() -> None:
    s = streams_with((b"w", 2))
    a, b = s.start(b"w", [rq(), rq()], 0.0)
    assert s.on_chunk(b"w", a.seq_id, CHUNK_MORE, 0.1)[0] is Verdict.DELIVER
    assert s.on_chunk(b"w", a.seq_id, CHUNK_DROPPED, 0.2) == (Verdict.ABANDONED, a)
    assert a.answered and a.chunks == 1  # the dropped entry is no chunk
    assert s.held(b"w") == 1 and s.busy()
    assert s.answer(a) is False  # the broker's answer to it was that ABANDONED
    assert [x.seq_id for x in s.unanswered()] == [b.seq_id]


def test_entries_from_unknown_workers_or_for_other_workers_sequences_are_dropped() -> None:
    s = streams_with((b"w1", 1), (b"w2", 1))
    (seq,) = s.start(b"w1", [rq()], 0.0)
    assert s.on_chunk(b"w2", seq.seq_id, CHUNK_FINAL, 0.1) == (Verdict.DROP, None)
    assert s.on_chunk(b"ghost", seq.seq_id, CHUNK_FINAL, 0.1) == (Verdict.DROP, None)
    assert s.on_chunk(b"w1", seq.seq_id + 1000, CHUNK_FINAL, 0.1) == (Verdict.DROP, None)
    assert s.held(b"w1") == 1 and not seq.answered


def test_start_past_the_free_slots_raises_and_starts_nothing() -> None:
    s = streams_with((b"w", 2))
    with pytest.raises(ValueError, match="3 sequences for 2 free slots"):
        s.start(b"w", [rq(), rq(), rq()], 0.0)
    assert s.held(b"w") == 0 and not s.busy()
    s.start(b"w", [rq()], 0.0)
    with pytest.raises(ValueError):
        s.start(b"w", [rq(), rq()], 0.0)
    assert s.drain_worker(b"w") == 1
    with pytest.raises(ValueError, match="1 sequences for 0 free slots"):
        s.start(b"w", [rq()], 0.0)
    assert s.held(b"w") == 1


def test_max_active_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_active must be >= 1"):
        Streams().add_worker(b"w", "m", 0)


def test_sequence_ids_are_unique_from_the_first() -> None:
    s = Streams(first_seq_id=41)
    s.add_worker(b"w1", "m", 2)
    s.add_worker(b"w2", "m", 2)
    a = s.start(b"w1", [rq(), rq()], 0.0)
    b = s.start(b"w2", [rq()], 0.0)
    assert [x.seq_id for x in a + b] == [41, 42, 43]


# --- examples: the broker's endings -----------------------------------------------------------


def test_cancel_id_finds_only_that_clients_unanswered_sequences() -> None:
    s = streams_with((b"w", 5))
    mine1, mine2, other_id, other_client = s.start(
        b"w",
        [rq(client=b"c", rid=1), rq(client=b"c", rid=1), rq(client=b"c", rid=2), rq(client=b"d", rid=1)],
        0.0,
    )
    assert s.cancel_id(b"c", 1) == [mine1, mine2]
    s.on_chunk(b"w", mine1.seq_id, CHUNK_FINAL, 0.1)  # answered by its worker
    assert s.cancel_id(b"c", 1) == [mine2]
    s.answer(mine2)
    assert s.cancel_id(b"c", 1) == []
    assert s.cancel_id(b"d", 1) == [other_client] and s.cancel_id(b"c", 2) == [other_id]


def test_expire_and_next_deadline() -> None:
    s = streams_with((b"w", 4))
    late, early, never, mid = s.start(
        b"w", [rq(deadline=3.0), rq(deadline=1.0), rq(deadline=None), rq(deadline=2.0)], 0.0
    )
    assert s.next_deadline() == 1.0
    assert s.expire(math.nextafter(1.0, 0.0)) == []
    assert s.expire(1.0) == [early]  # at the deadline: expired
    s.answer(early)
    assert s.next_deadline() == 2.0
    s.answer(mid)  # cancelled before its deadline: never expired
    assert s.next_deadline() == 3.0
    assert s.expire(10.0) == [late]
    s.answer(late)
    assert s.next_deadline() is None and s.expire(100.0) == []
    assert s.unanswered() == [never]


def test_expire_never_returns_a_sequence_answered_before_its_deadline() -> None:
    s = streams_with((b"w", 3))
    first, cancelled, ended = s.start(b"w", [rq(deadline=1.0), rq(deadline=2.0), rq(deadline=3.0)], 0.0)
    s.answer(cancelled)  # behind the head of the deadlines: still in there
    s.on_chunk(b"w", ended.seq_id, CHUNK_FINAL, 0.5)
    assert s.expire(5.0) == [first]
    s.answer(first)
    assert s.expire(5.0) == [] and s.next_deadline() is None


def test_expire_skips_a_sequence_its_worker_ended() -> None:
    s = streams_with((b"w", 1))
    (seq,) = s.start(b"w", [rq(deadline=1.0)], 0.0)
    s.on_chunk(b"w", seq.seq_id, CHUNK_FINAL, 0.5)
    assert s.next_deadline() is None
    assert s.expire(2.0) == []


# --- examples: hung workers and dispatch order -------------------------------------------------


def test_hung_with_a_given_limit_counts_from_the_last_chunk() -> None:
    s = streams_with((b"w", 2), (b"idle", 2))
    s.start(b"w", [rq()], 10.0)
    assert s.hung(12.0, 2.0) == []  # exactly the limit: not yet
    ((w, limit),) = s.hung(12.01, 2.0)
    assert w.worker_id == b"w" and limit == 2.0
    s.on_chunk(b"w", 999, CHUNK_MORE, 12.5)  # any entry proves a step ran
    assert s.hung(14.0, 2.0) == []
    assert [w.worker_id for w, _ in s.hung(14.6, 2.0)] == [b"w"]


def test_hung_default_limit_is_step_limit_s_whatever_the_steps_took() -> None:
    """A long prefill may take many times a decode step: the default limit does not
    follow the steps' times, only silence past STEP_LIMIT_S counts."""
    s = streams_with((b"w", 2))
    s.start(b"w", [rq()], 0.0)
    assert s.hung(STEP_LIMIT_S, None) == []
    assert s.hung(STEP_LIMIT_S + 0.01, None) == [(s.worker(b"w"), STEP_LIMIT_S)]
    s.heard(b"w", {"step_ms": 2.0, "active": 1}, STEP_LIMIT_S)  # a CHUNK of counters alone: progress
    assert s.worker(b"w").counters == {"step_ms": 2.0, "active": 1}  # type: ignore[union-attr]
    assert s.hung(2 * STEP_LIMIT_S, None) == []
    assert s.hung(2 * STEP_LIMIT_S + 0.01, None) == [(s.worker(b"w"), STEP_LIMIT_S)]


def test_a_worker_holding_nothing_is_never_hung_and_its_clock_starts_with_a_sequence() -> None:
    s = streams_with((b"w", 2))
    assert s.hung(1000.0, 1.0) == []
    s.start(b"w", [rq()], 1000.0)  # its limit counts from here, not from when it joined
    assert s.hung(1000.5, 1.0) == []
    s.start(b"w", [rq()], 1000.9)  # a second one does not restart the clock
    assert [w.worker_id for w, _ in s.hung(1001.5, 1.0)] == [b"w"]


def test_free_slots_emptiest_first_and_never_a_full_or_draining_worker() -> None:
    s = streams_with((b"busy", 3), (b"empty", 3), (b"one", 3), (b"full", 1), (b"drained", 3))
    s.start(b"busy", [rq(), rq()], 0.0)
    s.start(b"one", [rq()], 0.0)
    s.start(b"full", [rq()], 0.0)
    s.drain_worker(b"drained")
    assert [w.worker_id for w in s.free_slots()] == [b"empty", b"one", b"busy"]
    assert [w.free for w in s.free_slots()] == [3, 2, 1]


def test_remove_worker_returns_its_unanswered_sequences_answered_for_good() -> None:
    s = streams_with((b"w", 3))
    cancelled, chunked, fresh = s.start(b"w", [rq(), rq(), rq()], 0.0)
    s.answer(cancelled)
    s.on_chunk(b"w", chunked.seq_id, CHUNK_MORE, 0.1)
    assert s.remove_worker(b"w") == [chunked, fresh]
    assert chunked.answered and fresh.answered and not s.busy()
    assert s.remove_worker(b"w") == []
    assert s.answer(fresh) is False
    assert s.on_chunk(b"w", fresh.seq_id, CHUNK_FINAL, 0.2) == (Verdict.DROP, None)


# --- a lost step-level worker (batcher/core/pool.py) -------------------------------------------------


def step_pool(max_retries: int = 1) -> WorkerPool:
    scheduler = Scheduler(per_model={"m": BatchSettings(max_batch_size=4, max_wait_ms=0.0)})
    return WorkerPool(scheduler, Heartbeat(), max_retries, 0.0, Streams())


def join_step(p: WorkerPool, wid: bytes, max_active: int = 4) -> None:
    p.joined(wid, WorkerInfo("m", None, 1, max_active=max_active), None, 0.0)


def start_all(p: WorkerPool, wid: bytes) -> list[Sequence]:
    w = p.streams.worker(wid)
    assert w is not None
    return p.streams.start(wid, p.scheduler.take("m", w.free), 0.0)


def test_a_step_worker_takes_sequences_not_batches() -> None:
    p = step_pool()
    join_step(p, b"w")
    for _ in range(3):
        p.scheduler.enqueue("m", rq())
    assert p.scheduler.due_batches(0.0) == []  # no batch slot: its credit is the streams'
    assert p.streams.worker(b"w") is not None and p.streams.worker(b"w").free == 4  # type: ignore[union-attr]


def test_a_lost_step_workers_chunkless_sequences_are_requeued_first_and_in_order() -> None:
    p = step_pool(max_retries=1)
    join_step(p, b"w")
    reqs = [rq(t=0.0) for _ in range(5)]
    for r in reqs:
        p.scheduler.enqueue("m", r)
    seqs = start_all(p, b"w")
    assert [s.request for s in seqs] == reqs[:4]
    later = rq(t=1.0)
    p.scheduler.enqueue("m", later)
    p.streams.on_chunk(b"w", seqs[1].seq_id, CHUNK_MORE, 0.1)  # its client holds a part
    p.streams.on_chunk(b"w", seqs[3].seq_id, CHUNK_FINAL, 0.1)  # done: nothing to do
    assert p.scheduler.queued("m") == 2
    lost = p.lose(b"w", failed=True)
    assert lost.failed == [("m", reqs[1])]
    assert lost.batches_requeued == 1
    assert p.scheduler.queued("m") == 4
    assert reqs[0].attempts == 1 and reqs[2].attempts == 1 and reqs[1].attempts == 0
    assert b"w" not in p and b"w" not in p.streams and not p.streams.busy()
    # Back ahead of the requests that were still queued and of later arrivals.
    assert p.scheduler.take("m", 2) == [reqs[0], reqs[2]]
    assert p.scheduler.take("m", 10) == [reqs[4], later]
    assert p.scheduler.take("m", 10) == []


def test_a_lost_step_workers_answered_sequences_are_neither_requeued_nor_failed() -> None:
    p = step_pool()
    join_step(p, b"w", max_active=2)
    p.scheduler.enqueue("m", rq())
    p.scheduler.enqueue("m", rq())
    cancelled, kept = start_all(p, b"w")
    p.streams.answer(cancelled)  # the broker answered it; the worker had not acknowledged
    lost = p.lose(b"w", failed=True)
    assert lost.failed == []
    assert p.scheduler.take("m", 10) == [kept.request]


def test_a_chunkless_sequence_fails_once_its_retries_are_used() -> None:
    p = step_pool(max_retries=1)
    join_step(p, b"w1")
    r = rq()
    p.scheduler.enqueue("m", r)
    start_all(p, b"w1")
    lost = p.lose(b"w1", failed=True)
    assert lost.failed == [] and p.scheduler.queued("m") == 1
    join_step(p, b"w2")
    (seq,) = start_all(p, b"w2")
    assert seq.request is r
    lost = p.lose(b"w2", failed=True)
    assert lost.failed == [("m", r)] and lost.batches_requeued == 0
    assert p.scheduler.queued("m") == 0


def test_a_step_worker_that_left_hands_its_sequences_back_free_once() -> None:
    p = step_pool(max_retries=1)
    r = rq()
    p.scheduler.enqueue("m", r)
    for wid in (b"w1", b"w2", b"w3"):
        join_step(p, wid)
        (seq,) = start_all(p, wid)
        assert seq.request is r
        lost = p.lose(wid, failed=False)
        if wid == b"w3":  # the second hand-back cost its one retry; the third fails it
            assert lost.failed == [("m", r)]
        else:
            assert lost.failed == [] and p.scheduler.queued("m") == 1
    assert r.attempts == 1


# --- Scheduler.take ---------------------------------------------------------------------------


@given(
    st.lists(st.tuples(st.integers(0, 3), st.none() | st.integers(1, 5)), max_size=25),
    st.lists(st.integers(-1, 6), min_size=1, max_size=8),
)
def test_take_follows_priority_then_deadline_then_arrival_and_never_takes_more_than_asked(
    specs: list[tuple[int, int | None]], asks: list[int]
) -> None:
    s = Scheduler(per_model={"m": BatchSettings(max_queue=100)})
    reqs = [
        rq(t=float(i), priority=p, deadline=None if d is None else 100.0 + d)
        for i, (p, d) in enumerate(specs)
    ]
    for r in reqs:
        s.enqueue("m", r)
    order = sorted(
        range(len(reqs)),
        key=lambda i: (
            -reqs[i].priority,
            math.inf if reqs[i].deadline_at is None else reqs[i].deadline_at,
            i,
        ),
    )
    taken: list[QueuedRequest] = []
    for n in asks:
        before = s.queued("m")
        got = s.take("m", n)
        assert len(got) == min(max(n, 0), before)
        assert s.queued("m") == before - len(got)
        taken += got
    assert taken == [reqs[i] for i in order[: len(taken)]]
    assert s.take("nobody", 3) == []


def test_a_limit_shorter_than_the_progress_reports_allow_is_raised() -> None:
    """Workers report progress every 100 ms: a --batch-timeout-ms of 1 ms would kill them
    between two reports, so step-level workers get at least MIN_STEP_LIMIT_S."""
    from batcher.core.streams import MIN_STEP_LIMIT_S

    s = streams_with((b"w", 2))
    s.start(b"w", [rq()], 0.0)
    assert s.hung(MIN_STEP_LIMIT_S, 0.001) == []
    assert s.hung(MIN_STEP_LIMIT_S + 0.01, 0.001) == [(s.worker(b"w"), MIN_STEP_LIMIT_S)]


# --- bounded state: nothing outlives its sequence ----------------------------------------------


def test_cancelled_sequences_leave_the_deadlines_and_a_removed_worker_leaves_nothing() -> None:
    """Sequences the broker answers before their deadline stay in the deadlines' heap only
    lazily: however many come and go behind one long sequence (whose deadline is the
    heap's head, so none is popped), the heap holds at most twice the held sequences
    (plus a constant), and the deadlines still answer right; a removed worker's
    sequences are forgotten, answered or not."""
    s = streams_with((b"w", 4))
    (long_one,) = s.start(b"w", [rq(deadline=500.0)], 0.0)
    for i in range(1000):
        (seq,) = s.start(b"w", [rq(float(i), deadline=1000.0 + i)], float(i))
        assert s.answer(seq)  # cancelled: its worker still holds it, and is told to stop it
        assert len(s._deadlines) <= 2 * s.held(b"w") + 64
        assert s.on_chunk(b"w", seq.seq_id, CHUNK_DROPPED, float(i)) == (Verdict.DROP, None)  # the ack
    assert s.next_deadline() == 500.0
    (open_one,) = s.start(b"w", [rq(deadline=3000.0)], 1000.0)
    assert s.expire(2500.0) == [long_one]
    s.answer(long_one)
    assert s.next_deadline() == 3000.0 and s.unanswered() == [open_one]
    assert s.remove_worker(b"w") == [open_one]
    assert not s._sequences and not s._by_client and s.next_deadline() is None
