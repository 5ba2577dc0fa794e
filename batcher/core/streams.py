"""Step-level (generative) workers as the broker sees them, apart from any socket: a
sans-I/O core beside the scheduler (no zmq, the time passed in), tested on a float
clock and by property tests (tests/unit/core/test_streams.py).

Rules:
- **Credit.** A step-level worker announces how many sequences it holds at once
  (`max_active`, its credit). The broker sends it a queued request only for a free
  slot, and a slot is free again only when the worker says the sequence ended (its
  final reply, or its acknowledgement of a cancel): never more than `max_active`
  sequences are the worker's at once, whatever the order of messages.
- **Exactly one final reply.** A sequence is answered once: by its worker's final
  chunk, or by the broker (cancel, deadline, client gone, worker lost). Once answered,
  any chunk still coming for it is dropped, and the worker is told to stop it.
- **Lost workers.** A sequence of a lost worker that has sent no chunk yet may run
  again elsewhere (within the pool's retries); one that has sent a chunk ends with
  `worker_failed`, since its client already holds part of an answer.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum

from batcher.core.queue import QueuedRequest
from batcher.wire.codes import CHUNK_DROPPED, CHUNK_MORE

#: A step-level worker that holds a sequence and sends no CHUNK for this long (with no
#: --batch-timeout-ms) is taken for hung. Generous: a prefill of a long prompt may take
#: many times a decode step, and a model may compile on its first step.
STEP_LIMIT_S = 60.0
#: A shorter --batch-timeout-ms is raised to this for step-level workers: they report
#: progress every 100 ms (workers/steps.py PROGRESS_EVERY_S), and a busy machine delays that.
MIN_STEP_LIMIT_S = 1.0


@dataclass(slots=True, eq=False)
class Sequence:
    """One request given to a step-level worker: its chunks go back as they come."""

    seq_id: int
    model: str
    worker: bytes
    request: QueuedRequest
    chunks: int = 0  # chunks delivered to the client so far
    answered: bool = False  # its final reply went (from the worker or the broker)
    unsent: bool = False  # its START could not be sent (the worker's connection was gone)


@dataclass(slots=True, eq=False)
class StepWorker:
    """A step-level worker: its credit and the sequences it holds (answered or not, until
    it says they ended)."""

    worker_id: bytes
    model: str
    max_active: int
    held: dict[int, Sequence] = field(default_factory=dict)
    draining: bool = False  # being replaced: it gets no new sequence
    counters: dict[str, float] = field(default_factory=dict)  # as its last CHUNK said
    last_chunk_at: float = 0.0  # when it last sent a CHUNK, or got its oldest held sequence

    @property
    def free(self) -> int:
        """Sequences it may be sent now."""
        return 0 if self.draining else self.max_active - len(self.held)

    def unanswered(self) -> list[Sequence]:
        return [s for s in self.held.values() if not s.answered]


class Verdict(Enum):
    """What the broker does with one CHUNK entry."""

    DELIVER = "deliver"  # a chunk: forward it, more follow
    DELIVER_FINAL = "final"  # the final reply: forward it, the sequence ended
    DROP = "drop"  # already answered, unknown, or an acknowledged cancel: forward nothing
    ABANDONED = "abandoned"  # ended by the worker without a reply: the broker answers it


class Streams:
    """The step-level workers of one broker and the sequences they hold (module docstring)."""

    def __init__(self, first_seq_id: int = 1) -> None:
        self._workers: dict[bytes, StepWorker] = {}
        self._by_model: dict[str, list[bytes]] = {}  # model -> its step workers, in join order
        self._sequences: set[int] = set()  # the id of every sequence held by a worker
        # (client routing id, request id) -> its unanswered sequences, for cancel
        self._by_client: dict[tuple[bytes, object], list[Sequence]] = {}
        self._deadlines: list[tuple[float, int, Sequence]] = []
        self._next_id = first_seq_id

    # --- workers ----------------------------------------------------------------------------

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    def __bool__(self) -> bool:
        return bool(self._workers)

    def add_worker(self, worker_id: bytes, model: str, max_active: int) -> None:
        """A step-level worker announced itself with its credit. (Its time limit counts
        from its first sequence, `start`: a worker holding none is never hung.)"""
        if max_active < 1:
            raise ValueError(f"max_active must be >= 1, got {max_active}")
        self._workers[worker_id] = StepWorker(worker_id, model, max_active)
        self._by_model.setdefault(model, []).append(worker_id)

    def remove_worker(self, worker_id: bytes) -> list[Sequence]:
        """Forget a worker; returns its sequences not answered yet (the pool decides their fate)."""
        w = self._workers.pop(worker_id, None)
        if w is None:
            return []
        self._by_model[w.model].remove(worker_id)
        self._sequences.difference_update(w.held)
        out = w.unanswered()
        for seq in out:
            seq.answered = True  # from now on the pool's: answered or queued again, never twice
            self._unindex(seq)
        return out

    def drain_worker(self, worker_id: bytes) -> int:
        """Send a worker no new sequence (it is being replaced); returns how many it holds."""
        w = self._workers.get(worker_id)
        if w is None:
            return 0
        w.draining = True
        return len(w.held)

    def worker(self, worker_id: bytes) -> StepWorker | None:
        return self._workers.get(worker_id)

    def workers_of(self, model: str) -> Iterator[StepWorker]:
        for worker_id in self._by_model.get(model, ()):
            yield self._workers[worker_id]

    # --- dispatch ---------------------------------------------------------------------------

    def free_slots(self) -> list[StepWorker]:
        """The workers with a free slot, the emptiest first (load spreads evenly)."""
        free = [w for w in self._workers.values() if w.free > 0]
        free.sort(key=lambda w: len(w.held))
        return free

    def start(self, worker_id: bytes, requests: list[QueuedRequest], now: float) -> list[Sequence]:
        """Give `requests` to a worker, at most its free slots (ValueError past them)."""
        w = self._workers[worker_id]
        if len(requests) > w.free:
            raise ValueError(f"{len(requests)} sequences for {w.free} free slots")
        if not w.held:
            w.last_chunk_at = now  # its time limit counts from its first sequence
        out = []
        for req in requests:
            seq = Sequence(self._next_id, w.model, worker_id, req)
            self._next_id += 1
            w.held[seq.seq_id] = seq
            self._sequences.add(seq.seq_id)
            self._by_client.setdefault((req.envelope[0], req.id), []).append(seq)
            if req.deadline_at is not None:
                heapq.heappush(self._deadlines, (req.deadline_at, seq.seq_id, seq))
            out.append(seq)
        return out

    # --- what workers say -------------------------------------------------------------------

    def on_chunk(
        self, worker_id: bytes, seq_id: int, flag: int, now: float
    ) -> tuple[Verdict, Sequence | None]:
        """One entry of a worker's CHUNK. A final entry (or a dropped one) frees its slot."""
        w = self._workers.get(worker_id)
        if w is None:
            return Verdict.DROP, None
        w.last_chunk_at = now
        seq = w.held.get(seq_id)
        if seq is None:
            return Verdict.DROP, None  # not this worker's (a late or forged entry)
        ended = flag != CHUNK_MORE
        if ended:
            del w.held[seq_id]
            self._sequences.remove(seq_id)
        if seq.answered:
            return Verdict.DROP, None
        if flag == CHUNK_DROPPED:  # dropped by the worker unasked: the broker must answer it
            self.answer(seq)
            return Verdict.ABANDONED, seq
        seq.chunks += 1
        if ended:
            self.answer(seq)
            return Verdict.DELIVER_FINAL, seq
        return Verdict.DELIVER, seq

    def answer(self, seq: Sequence) -> bool:
        """The sequence's final reply goes now; returns whether its worker still holds it
        (then it must be told to stop: its slot frees when it acknowledges). False for one
        answered already."""
        if seq.answered:
            return False
        seq.answered = True
        self._unindex(seq)
        if len(self._deadlines) > 2 * len(self._sequences) + 64:  # answered ones leave lazily
            self._deadlines = [e for e in self._deadlines if not e[2].answered]
            heapq.heapify(self._deadlines)
        return seq.seq_id in self._sequences

    def _unindex(self, seq: Sequence) -> None:
        key = (seq.request.envelope[0], seq.request.id)
        held = self._by_client.get(key)
        if held is not None:
            if seq in held:
                held.remove(seq)
            if not held:
                del self._by_client[key]

    # --- the broker's own endings -----------------------------------------------------------

    def cancel_id(self, client: bytes, req_id: object) -> list[Sequence]:
        """The unanswered sequences that `client` sent with `req_id` (a look-up)."""
        return list(self._by_client.get((client, req_id), ()))

    def expire(self, now: float) -> list[Sequence]:
        """The unanswered sequences whose deadline is at or before `now`."""
        out = []
        dl = self._deadlines
        while dl and (dl[0][0] <= now or dl[0][2].answered):
            _, _, seq = heapq.heappop(dl)
            if not seq.answered:
                out.append(seq)
        return out

    def next_deadline(self) -> float | None:
        dl = self._deadlines
        while dl and dl[0][2].answered:
            heapq.heappop(dl)
        return dl[0][0] if dl else None

    def hung(self, read_at: float, limit_s: float | None) -> list[tuple[StepWorker, float]]:
        """(worker, its limit) of each worker holding a sequence that sent no CHUNK for its
        time limit, `limit_s` (at least MIN_STEP_LIMIT_S) or STEP_LIMIT_S: a step (or a
        prefill) that never ends (heartbeats prove only that the process lives; a working
        one sends a CHUNK at least every 100 ms while it steps, chunks or not). Silence
        counts up to `read_at`, the start of the broker's last read of its backend to the
        end: a CHUNK that waits unread while the broker is busy is no silence."""
        limit = STEP_LIMIT_S if limit_s is None else max(limit_s, MIN_STEP_LIMIT_S)
        return [(w, limit) for w in self._workers.values() if w.held and read_at - w.last_chunk_at > limit]

    def stalled(self, by_s: float) -> None:
        """The broker did not run for `by_s` (batcher.core.stalls): no CHUNK could be read
        then, so every worker's step time limit counts that much later."""
        for w in self._workers.values():
            w.last_chunk_at += by_s

    def heard(self, worker_id: bytes, counters: dict[str, float], now: float) -> None:
        """A worker's CHUNK, with or without entries: its counters, and a sign that its
        steps make progress."""
        w = self._workers.get(worker_id)
        if w is not None:
            w.counters = counters
            w.last_chunk_at = now

    # --- introspection ----------------------------------------------------------------------

    def busy(self) -> bool:
        """Whether any sequence is still unanswered (a draining broker waits for none)."""
        return bool(self._by_client)

    def unanswered(self) -> list[Sequence]:
        return [s for held in self._by_client.values() for s in held]

    def active(self, model: str) -> int:
        """Sequences of `model` its workers hold now."""
        return sum(len(w.held) for w in self.workers_of(model))

    def held(self, worker_id: bytes) -> int:
        w = self._workers.get(worker_id)
        return len(w.held) if w else 0
