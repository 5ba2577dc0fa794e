"""The batching rules, apart from any socket: a sans-I/O core.

The broker feeds it events (a request arrived, a worker joined, a batch finished, a
worker left) together with the current time, and asks it which batches are due and
when to wake up next. Nothing here imports zmq or reads a clock, so every rule is
tested with a fake clock (tests/test_scheduler.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class BatchSettings:
    """How one model's requests are grouped into batches."""

    max_batch_size: int = 8
    max_wait_ms: float = 5.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size!r}")
        if not self.max_wait_ms >= 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {self.max_wait_ms!r}")

    @property
    def max_wait_s(self) -> float:
        """The wait window in seconds, the unit the scheduler's clock uses."""
        return self.max_wait_ms / 1000.0


@dataclass(slots=True, eq=False)
class QueuedRequest:
    """One accepted request: where to answer it, what to forward, when it arrived.

    `envelope` and `body` are opaque to the scheduler; the broker forwards `body`
    untouched and answers on `envelope`.
    """

    envelope: list[bytes]
    body: bytes
    id: object
    arrived_at: float


@dataclass(slots=True, eq=False)
class Batch:
    """Requests sent to one worker as one message, answered by one reply message."""

    batch_id: int
    model: str
    worker: bytes
    requests: list[QueuedRequest]
    dispatched_at: float


@dataclass(slots=True, eq=False)
class WorkerState:
    """What the scheduler knows of a worker: its model and the batches it holds."""

    worker_id: bytes
    model: str
    slots: int
    in_flight: dict[int, Batch] = field(default_factory=dict)

    @property
    def free_slots(self) -> int:
        return self.slots - len(self.in_flight)


@dataclass(slots=True, eq=False)
class ModelQueue:
    """A model's waiting requests and its workers that can take a batch now."""

    settings: BatchSettings
    queue: deque[QueuedRequest] = field(default_factory=deque)
    idle: deque[bytes] = field(default_factory=deque)  # workers with a free slot, LRU first
    workers: set[bytes] = field(default_factory=set)


class UnknownModel(KeyError):
    """A request named a model that is neither configured nor served by any worker."""


class Scheduler:
    """Per-model queues and the window rule: a batch goes to a worker with a free slot
    as soon as `max_batch_size` requests wait, or when the oldest has waited
    `max_wait_ms`. No batch is larger than `max_batch_size`; order is FIFO."""

    def __init__(
        self,
        default: BatchSettings | None = None,
        per_model: dict[str, BatchSettings] | None = None,
        models: list[str] | None = None,
    ) -> None:
        self.default_settings = default or BatchSettings()
        self._per_model = dict(per_model or {})
        self._models: dict[str, ModelQueue] = {}
        self._workers: dict[bytes, WorkerState] = {}
        self._next_batch_id = 1
        for name in [*(models or []), *self._per_model]:
            self._model(name)

    # --- introspection --------------------------------------------------------------------

    def knows_model(self, model: str) -> bool:
        """True for a configured model or one that a worker has ever served."""
        return model in self._models

    @property
    def models(self) -> dict[str, ModelQueue]:
        return self._models

    @property
    def workers(self) -> dict[bytes, WorkerState]:
        return self._workers

    def queued(self, model: str) -> int:
        """Requests of `model` waiting for a batch."""
        mq = self._models.get(model)
        return len(mq.queue) if mq else 0

    def in_flight(self) -> Iterator[Batch]:
        """Every batch that a worker holds now."""
        for w in self._workers.values():
            yield from w.in_flight.values()

    # --- events -----------------------------------------------------------------------------

    def enqueue(self, model: str, request: QueuedRequest) -> None:
        """Queue an accepted request; raises UnknownModel for a model nobody serves."""
        mq = self._models.get(model)
        if mq is None:
            raise UnknownModel(model)
        mq.queue.append(request)

    def add_worker(self, worker_id: bytes, model: str, slots: int) -> None:
        """A worker announced itself (READY); it can take `slots` batches at once."""
        if worker_id in self._workers:
            self.remove_worker(worker_id)  # re-announced: treat as a fresh worker
        mq = self._model(model)
        self._workers[worker_id] = WorkerState(worker_id, model, max(1, slots))
        mq.workers.add(worker_id)
        mq.idle.append(worker_id)

    def remove_worker(self, worker_id: bytes) -> list[Batch]:
        """A worker left or died; returns the batches it held so they can be answered."""
        w = self._workers.pop(worker_id, None)
        if w is None:
            return []
        mq = self._models[w.model]
        mq.workers.discard(worker_id)
        if worker_id in mq.idle:
            mq.idle.remove(worker_id)
        return list(w.in_flight.values())

    def complete(self, worker_id: bytes, batch_id: int) -> Batch | None:
        """A worker answered a batch; frees its slot. None for an unknown batch
        (a late or forged reply), which the broker must not deliver."""
        w = self._workers.get(worker_id)
        if w is None:
            return None
        batch = w.in_flight.pop(batch_id, None)
        if batch is None:
            return None
        if w.free_slots == 1:  # it had none free, so it was not in the idle queue
            self._models[w.model].idle.append(worker_id)
        return batch

    # --- decisions --------------------------------------------------------------------------

    def due_batches(self, now: float) -> list[Batch]:
        """Cut every batch that is due at `now` and assign each to a worker."""
        out: list[Batch] = []
        for name, mq in self._models.items():
            while mq.queue and mq.idle and self._is_due(mq, now):
                out.append(self._cut(name, mq, now))
        return out

    def next_wakeup(self) -> float | None:
        """The earliest time at which a batch may become due without any new event."""
        best: float | None = None
        for mq in self._models.values():
            if mq.queue and mq.idle:
                t = mq.queue[0].arrived_at + mq.settings.max_wait_s
                if best is None or t < best:
                    best = t
        return best

    # --- internals --------------------------------------------------------------------------

    def _model(self, name: str) -> ModelQueue:
        mq = self._models.get(name)
        if mq is None:
            mq = ModelQueue(self._per_model.get(name, self.default_settings))
            self._models[name] = mq
        return mq

    @staticmethod
    def _is_due(mq: ModelQueue, now: float) -> bool:
        s = mq.settings
        return len(mq.queue) >= s.max_batch_size or now >= mq.queue[0].arrived_at + s.max_wait_s

    def _cut(self, name: str, mq: ModelQueue, now: float) -> Batch:
        queue = mq.queue
        n = min(len(queue), mq.settings.max_batch_size)
        requests = [queue.popleft() for _ in range(n)]
        worker_id = mq.idle.popleft()
        w = self._workers[worker_id]
        batch = Batch(self._next_batch_id, name, worker_id, requests, now)
        self._next_batch_id += 1
        w.in_flight[batch.batch_id] = batch
        if w.free_slots > 0:
            mq.idle.append(worker_id)
        return batch
