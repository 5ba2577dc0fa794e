"""The batching and scheduling rules, apart from any socket: a sans-I/O core.

The broker feeds it events (a request arrived or was cancelled, a worker joined,
finished a batch or left) together with the current time, and asks it which
requests expired, which batches are due and when to wake up next. Nothing here
imports zmq or reads a clock, so every rule is tested with a fake clock
(tests/unit/core/test_scheduler.py, tests/unit/core/test_scheduler_policy.py).

Its parts are modules of their own: the settings (batcher.core.limits), the queues
(batcher.core.queue), the learned cost (batcher.core.cost_model) and when a batch is due
(batcher.core.policy); `Scheduler` holds the models and workers and composes them. Every
name of those parts is importable from here too.

Rules, per model:
- order: higher `priority` first, then earliest deadline, then arrival; with
  `priority_aging_ms` A, a request's priority grows by one every A ms it waits, so
  requests are ordered by priority - arrival / A (then deadline, then arrival) and no
  flood of higher priorities starves the rest;
- a queued request whose deadline passes is expired (never sent to a worker);
- the queue holds at most `max_queue` requests; one more is QueueFull;
- a batch never exceeds `max_batch_size`, and with `batch_sizes` it is cut to the
  largest allowed size the queue can fill;
- with `max_batch_cost`, the sum of a batch's request costs never exceeds it either,
  except for a lone request costlier than the cap, which runs alone; a queue whose
  costs reach the cap counts as a full batch;
- `window` policy: a batch goes to a worker with a free slot as soon as
  `max_batch_size` requests wait, or when the oldest has waited `max_wait_ms`;
- `adaptive` policy: the same two triggers, and besides, an idle worker takes the
  queue at once unless waiting for the next arrival is expected to lower latency,
  judged from the model's learned batch cost t(n) = a + b*n and its arrival rate;
- either policy cuts a batch early rather than let a queued request miss its
  deadline by waiting.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

from batcher.core import policy
from batcher.core.cost_model import RATE_TAU_S, ArrivalRate, CostModel
from batcher.core.limits import (
    BUCKET_BY,
    FIRST_BATCH_LIMIT_S,
    MIN_BATCH_LIMIT_S,
    POLICIES,
    BatchSettings,
    Policy,
)
from batcher.core.multiplex import Catalog, Resident, place, replay
from batcher.core.policy import DEADLINE_MARGIN_S, HEAVY_LOAD, PREFETCH_GRACE_S, TARGET_BUSY
from batcher.core.queue import (
    DISPATCHED,
    QUEUED,
    REMOVED,
    Batch,
    ModelQueue,
    QueuedRequest,
    RequestState,
    WorkerState,
    oldest_first,
)
from batcher.errors import BatcherError

__all__ = [
    "BUCKET_BY",
    "DEADLINE_MARGIN_S",
    "DISPATCHED",
    "FIRST_BATCH_LIMIT_S",
    "HEAVY_LOAD",
    "MIN_BATCH_LIMIT_S",
    "POLICIES",
    "PREFETCH_GRACE_S",
    "QUEUED",
    "RATE_TAU_S",
    "REMOVED",
    "TARGET_BUSY",
    "ArrivalRate",
    "Batch",
    "BatchSettings",
    "CostModel",
    "ModelQueue",
    "ModelView",
    "NoSuchModel",
    "Policy",
    "QueueFull",
    "QueuedRequest",
    "RequestState",
    "Scheduler",
    "WorkerState",
    "WorkerView",
]


class WorkerView(NamedTuple):
    """A worker as the broker may see it: read-only."""

    worker_id: bytes
    batches_held: int
    holds: bool | None = None  # a multiplexed worker: whether it holds the model (None: not one)


class ModelView(NamedTuple):
    """A model's queue and workers as the broker may see them (stats, gauges): read-only."""

    queued: int
    workers: tuple[WorkerView, ...]
    settings: BatchSettings
    cost: tuple[float, float] | None  # the learned (a, b) of t(n) = a + b*n in seconds
    no_worker_since: float | None
    cost_basis: str = "count"  # what t() is learned over: "count", or "cost" when that predicts better
    offered: int = 0  # requests offered to the model, ever (the autoscaling signal's rate)

    @property
    def batches_in_flight(self) -> int:
        return sum(w.batches_held for w in self.workers)


class NoSuchModel(BatcherError, KeyError):
    """A request named a model that is neither configured nor served by any worker."""


class QueueFull(BatcherError):
    """The model's queue is full; the request must be refused now, not dropped later."""


class Scheduler:
    """Per-model priority queues, deadlines and the dispatch policies (module docstring)."""

    def __init__(
        self,
        default: BatchSettings | None = None,
        per_model: dict[str, BatchSettings] | None = None,
        models: list[str] | None = None,
        worker_prefetch: int = 1,
        first_batch_id: int = 1,
        no_worker_timeout_s: float = 0.0,
    ) -> None:
        if worker_prefetch < 1:
            raise ValueError(f"worker_prefetch must be >= 1, got {worker_prefetch}")
        if not 0 <= no_worker_timeout_s < math.inf:
            raise ValueError(f"no_worker_timeout_s must be a finite number >= 0, got {no_worker_timeout_s}")
        self.no_worker_timeout_s = no_worker_timeout_s  # 0: a model without worker waits forever
        self.default_settings = default or BatchSettings()
        self.worker_prefetch = worker_prefetch
        self._per_model = dict(per_model or {})
        self._models: dict[str, ModelQueue] = {}
        self._unserved: dict[str, None] = {}  # announced models that lost their last worker, oldest first
        self._workers: dict[bytes, WorkerState] = {}
        self._next_batch_id = first_batch_id
        self._seq = itertools.count()
        for name in [*(models or []), *self._per_model]:
            self._model(name)

    # --- introspection --------------------------------------------------------------------

    def knows_model(self, model: str) -> bool:
        """True for a configured model or one that a worker serves (or served, till forgotten)."""
        return model in self._models

    @property
    def models(self) -> dict[str, ModelQueue]:
        return self._models

    @property
    def workers(self) -> dict[bytes, WorkerState]:
        return self._workers

    def views(self) -> dict[str, ModelView]:
        """Every model's queue and workers, as a snapshot the caller cannot change."""
        return {name: _view(mq, self._workers) for name, mq in self._models.items()}

    def held(self, worker_id: bytes) -> int:
        """Batches a worker holds (0 for one the scheduler does not know)."""
        w = self._workers.get(worker_id)
        return len(w.in_flight) if w else 0

    def has_workers(self, model: str) -> bool:
        mq = self._models.get(model)
        return bool(mq and mq.workers)

    def busy(self) -> bool:
        """Whether any request is queued or in a batch (a draining broker waits for none)."""
        return any(mq.total() for mq in self._models.values()) or any(
            w.in_flight for w in self._workers.values()
        )

    def running(self) -> bool:
        """Whether any worker holds a batch."""
        return any(w.in_flight for w in self._workers.values())

    def queued(self, model: str) -> int:
        """Requests of `model` waiting for a batch."""
        mq = self._models.get(model)
        return mq.total() if mq else 0

    def in_flight(self) -> Iterator[Batch]:
        """Every batch that a worker holds now."""
        for w in self._workers.values():
            yield from w.in_flight.values()

    def seed_cost(self, model: str, a_s: float, b_s: float) -> None:
        """A worker's warm-up measured t(n) = a + b*n: the model's cost, until batches
        report theirs (a cost already learned from batches is kept)."""
        mq = self._models.get(model)
        if mq is not None:
            mq.cost.seed(a_s, b_s, mq.settings.max_batch_size)

    def settings_of(self, model: str) -> BatchSettings | None:
        """A known model's batching settings (None for one the scheduler does not know)."""
        mq = self._models.get(model)
        return mq.settings if mq else None

    def cost(self, model: str) -> tuple[float, float] | None:
        """The learned (a, b) of t(n) = a + b*n in seconds, None before any report."""
        mq = self._models.get(model)
        return mq.cost.coefficients() if mq and mq.cost.known else None

    # --- events -----------------------------------------------------------------------------

    def enqueue(self, model: str, request: QueuedRequest) -> None:
        """Queue an accepted request. Raises NoSuchModel for a model nobody serves and
        QueueFull when the model's queue is full."""
        mq = self._models.get(model)
        if mq is None:
            raise NoSuchModel(model)
        mq.offered += 1  # (total() and bucket_queue() only where there are buckets)
        if (mq.total() if mq.buckets else mq.size) >= mq.settings.max_queue:
            raise QueueFull(model)
        (mq if request.bucket is None else mq.bucket_queue(request.bucket)).put(request, next(self._seq))

    def requeue(self, model: str, requests: list[QueuedRequest], count_attempt: bool = True) -> None:
        """Put a failed (or left) worker's batch back in its queue, ahead of later arrivals;
        the queue limit does not apply: they were accepted already."""
        self._models[model].requeue(requests, count_attempt)

    def cancel(
        self, match: Callable[[QueuedRequest], bool], model: str | None = None
    ) -> list[tuple[str, QueuedRequest]]:
        """Remove the queued requests (of `model`, or of all) for which `match(request)` is
        true; returns them with their model. Requests already in a batch are not touched."""
        out = []
        for name, mq in self._queues():
            if model is not None and name != model:
                continue
            for req in [r for r in mq.queued() if match(r)]:
                mq.discard(req)
                out.append((name, req))
        return out

    def cancel_id(self, client: bytes, req_id: object) -> list[tuple[str, QueuedRequest]]:
        """Remove the queued requests that `client` (the first envelope frame) sent with
        `req_id`; a look-up, whatever the queue's length (ModelQueue.find). Requests in a batch stay."""
        out = []
        for name, mq in self._queues():
            for req in mq.find(client, req_id):
                mq.discard(req)
                out.append((name, req))
        return out

    def expire(self, now: float) -> list[tuple[str, QueuedRequest]]:
        """Remove and return the queued requests whose deadline is at or before `now`."""
        return [(name, req) for name, mq in self._queues() for req in mq.expire(now)]

    def set_settings(self, model: str, settings: BatchSettings) -> None:
        """New batching settings (a reloaded config); the queued stay, ranked again for a new aging."""
        model_queue = self._model(model)
        model_queue.announced = False  # configured now: never forgotten
        aging_changed = model_queue.settings.priority_aging_ms != settings.priority_aging_ms
        for mq in model_queue.lanes():
            mq.settings = settings
            if aging_changed and mq.size:
                mq.rerank()

    def unavailable(self, now: float) -> list[tuple[str, QueuedRequest, float]]:
        """The queued requests refused for no worker now (batcher.core.policy.unavailable)."""
        return policy.unavailable(self._models, self.no_worker_timeout_s, now)

    def forget_unserved(self, now: float) -> list[str]:
        """The announced models forgotten now (batcher.core.policy.forget_unserved): call it each turn."""
        return policy.forget_unserved(self._models, self._unserved, self.no_worker_timeout_s, now)

    def without_worker_s(self, model: str, now: float) -> float | None:
        """How long `model` has had no worker, past the timeout (policy.without_worker_s)."""
        return policy.without_worker_s(self._models.get(model), self.no_worker_timeout_s, now)

    def add_worker(
        self,
        worker_id: bytes,
        model: str,
        slots: int | None = None,
        step: bool = False,
        catalog: Catalog | None = None,
    ) -> list[Batch]:
        """A worker announced itself (READY). It may hold `worker_prefetch` batches at once
        (fewer if it asks for fewer `slots`); a `step`-level one holds none: it takes
        requests one by one (`take`), for the sequence slots batcher.core.streams counts. A
        multiplexed one (`catalog`) serves every model of it, holding none yet. One
        announcing itself again is fresh: the batches it held are returned."""
        lost = self.remove_worker(worker_id)
        limit = self.worker_prefetch if slots is None else max(1, min(slots, self.worker_prefetch))
        if step:
            limit = 0
        models = (model,) if catalog is None else tuple(catalog.sizes_mb)
        resident = None if catalog is None else Resident(catalog)
        self._workers[worker_id] = WorkerState(worker_id, model, limit, resident=resident, models=models)
        for name in models:
            if name not in self._models:  # known by this READY alone: forgotten once unserved
                self._model(name).announced = True
            self._models[name].workers[worker_id] = None
        return lost

    def take(self, model: str, n: int) -> list[QueuedRequest]:
        """Up to `n` queued requests of `model`, in scheduling order (across its length
        buckets too), taken out as dispatched: for a step-level worker's free slots."""
        model_queue = self._models.get(model)
        return model_queue.take(n) if model_queue is not None else []

    def drain_worker(self, worker_id: bytes) -> int:
        """Send a worker (being replaced) no more batches; its replies still count. Returns those it holds."""
        w = self._workers.get(worker_id)
        if w is None:
            return 0
        w.slots = 0
        return len(w.in_flight)

    def remove_all_workers(self) -> list[Batch]:
        """Forget every worker (the broker is stopping now); returns the batches they held."""
        return [batch for w in list(self._workers) for batch in self.remove_worker(w)]

    def remove_worker(self, worker_id: bytes) -> list[Batch]:
        """A worker left or died; returns the batches it held so they can be answered."""
        w = self._workers.pop(worker_id, None)
        if w is None:
            return []
        policy.worker_left(self._models, self._unserved, worker_id, w.models)
        return list(w.in_flight.values())

    def complete(
        self, worker_id: bytes, batch_id: int, infer_s: float | None = None, now: float | None = None
    ) -> Batch | None:
        """A worker answered a batch; frees its slot and teaches the cost model. None for
        an unknown batch (a late or forged reply), which the broker must not deliver. With
        `now`, the worker's next batch is known to begin no sooner (its time limit counts
        from then)."""
        w = self._workers.get(worker_id)
        if w is None:
            return None
        batch = w.in_flight.pop(batch_id, None)
        if batch is None:
            return None
        if batch.suspect:
            w.running_suspect = False
        if infer_s is not None and infer_s >= 0:
            self._models[batch.model].cost.observe(len(batch.requests), infer_s, batch.cost)
        if now is not None and w.in_flight:
            following = next(iter(w.in_flight.values()))  # batches run in the order sent
            following.expected_start = max(following.expected_start, now)
        return batch

    def held_by(self, worker_id: bytes, held: tuple[str, ...], batch: Batch) -> None:
        """A multiplexed worker's word, answering `batch`, on what it holds (multiplex.replay)."""
        w = self._workers.get(worker_id)
        if w is not None and w.resident is not None:
            replay(w.resident, held, batch, w.in_flight.values())

    # --- decisions --------------------------------------------------------------------------

    def due_batches(self, now: float) -> list[Batch]:
        """Cut every batch that is due at `now` and assign each to a worker."""
        out: list[Batch] = []
        for name, model_queue in self._models.items():
            for mq in oldest_first(model_queue):
                while mq.size:
                    worker = policy.pick_worker(mq, self._workers, now)
                    if worker is None:
                        break
                    out.append(self._cut(name, mq, worker, now))
        return out

    def next_wakeup(self) -> float | None:
        """The earliest time at which something may become due without any new event."""
        return policy.next_wakeup(self._models.values(), self._workers, self.no_worker_timeout_s)

    def hung_batches(self, now: float, limit_s: float | None) -> list[tuple[Batch, float]]:
        """(batch, its limit) of each running batch past its time limit (policy.hung_batches)."""
        return policy.hung_batches(self._workers.values(), now, limit_s, self.default_limit_s)

    def default_limit_s(self, batch: Batch) -> float:
        """A batch's default time limit (batcher.core.policy.default_limit_s)."""
        return policy.default_limit_s(self._models[batch.model].cost, batch.requests)

    # --- internals --------------------------------------------------------------------------

    def _queues(self) -> Iterator[tuple[str, ModelQueue]]:
        """(model, queue) of every queue: each model's, and its bucket queues."""
        for name, model_queue in self._models.items():
            for mq in model_queue.lanes():
                yield name, mq

    def _model(self, name: str) -> ModelQueue:
        mq = self._models.get(name)
        if mq is None:
            mq = ModelQueue(self._per_model.get(name, self.default_settings), name=name)
            self._models[name] = mq
        return mq

    def _cut(self, name: str, mq: ModelQueue, worker: WorkerState, now: float) -> Batch:
        requests = policy.batch_requests(mq)
        n = len(requests)
        for r in requests:
            r.state = DISPATCHED
        mq.compact()
        start = max(now, worker.busy_until())
        batch = Batch(self._next_batch_id, name, worker.worker_id, requests, now)
        if requests[0].suspect:  # a suspect is always cut alone, for an idle worker
            batch.suspect = worker.running_suspect = True
        batch.expected_start = start
        batch.cost = sum(r.cost for r in requests)
        batch.expected_done_at = start + mq.cost.predict(n, batch.cost)
        if worker.resident is not None:  # its worker runs the same rule (batcher.core.multiplex)
            place(worker.resident, batch)
        self._next_batch_id += 1
        worker.in_flight[batch.batch_id] = batch
        worker.last_used = batch.batch_id
        return batch


def _view(mq: ModelQueue, workers: dict[bytes, WorkerState]) -> ModelView:
    held = tuple(_worker_view(workers[w], mq.name) for w in mq.workers)
    cost = mq.cost.coefficients() if mq.cost.known else None
    basis = "cost" if mq.cost.by_cost else "count"
    return ModelView(mq.total(), held, mq.settings, cost, mq.no_worker_since, basis, mq.offered)


def _worker_view(w: WorkerState, model: str) -> WorkerView:
    return WorkerView(w.worker_id, len(w.in_flight), None if w.resident is None else model in w.resident)
