"""The batching and scheduling rules, apart from any socket: a sans-I/O core.

The broker feeds it events (a request arrived or was cancelled, a worker joined,
finished a batch or left) together with the current time, and asks it which
requests expired, which batches are due and when to wake up next. Nothing here
imports zmq or reads a clock, so every rule is tested with a fake clock
(tests/test_scheduler.py, tests/test_scheduler_policy.py).

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

import bisect
import copy
import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import NamedTuple

from batcher.errors import BatcherError


class Policy(StrEnum):
    """How a model's queue turns into batches (module docstring)."""

    ADAPTIVE = "adaptive"
    WINDOW = "window"


POLICIES = tuple(p.value for p in Policy)
#: What requests may be grouped by (`--bucket-by`): the first axis of the input tensor.
BUCKET_BY = ("length",)


class RequestState(IntEnum):
    """Queued, then exactly one of: in a batch, or answered without one (expired,
    cancelled, unavailable)."""

    QUEUED = 0
    DISPATCHED = 1
    REMOVED = 2


QUEUED, DISPATCHED, REMOVED = RequestState.QUEUED, RequestState.DISPATCHED, RequestState.REMOVED

#: Time constant of the arrival-rate estimate (seconds).
RATE_TAU_S = 0.2
#: adaptive: unbatched work must exceed this many times the workers' capacity before the
#: policy waits to build bigger batches (below it, a lone closed-loop client never waits).
HEAVY_LOAD = 1.2
#: adaptive: under heavy load, batches are sized so that workers are busy this share of time.
TARGET_BUSY = 0.8
#: A deadline-bound batch is cut this long before it would have to start, at the latest.
DEADLINE_MARGIN_S = 0.001
#: adaptive: a partial batch waits for a busy worker's prefetch slot until that worker is
#: expected to be done plus this much (its reply's trip back), not just max_wait_ms.
PREFETCH_GRACE_S = 0.0005
#: The shortest time limit a batch gets by default (fast models).
MIN_BATCH_LIMIT_S = 1.0
#: The default time limit of a model's batches before any of them was answered.
FIRST_BATCH_LIMIT_S = 60.0


@dataclass(frozen=True, slots=True)
class BatchSettings:
    """How one model's requests are queued and grouped into batches."""

    max_batch_size: int = 8
    max_wait_ms: float = 5.0
    batch_sizes: tuple[int, ...] | None = None
    max_queue: int = 10_000
    policy: Policy = Policy.ADAPTIVE
    max_batch_cost: float | None = None
    priority_aging_ms: float = 0.0  # 0: priority is strict
    bucket_by: str | None = None  # "length": requests of different length buckets never share a batch
    length_buckets: tuple[int, ...] | None = None  # the buckets' upper bounds, e.g. (16, 32, 64, 128)

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_queue"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size!r}")
        wait = self.max_wait_ms
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait < math.inf:
            raise ValueError(f"max_wait_ms must be a finite number >= 0, got {wait!r}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        object.__setattr__(self, "policy", Policy(self.policy))  # a plain str is accepted
        aging = self.priority_aging_ms
        if isinstance(aging, bool) or not isinstance(aging, int | float) or not 0 <= aging < math.inf:
            raise ValueError(f"priority_aging_ms must be a finite number >= 0, got {aging!r}")
        cap = self.max_batch_cost
        if cap is not None and (
            isinstance(cap, bool) or not isinstance(cap, int | float) or not 0 < cap < math.inf
        ):
            raise ValueError(f"max_batch_cost must be a finite number > 0, got {cap!r}")
        if self.batch_sizes is not None:
            sizes = self.batch_sizes
            if not all(type(n) is int for n in sizes):
                raise ValueError(f"batch_sizes must be ints, got {list(sizes)}")
            if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] != 1:
                raise ValueError(
                    "batch_sizes must be increasing, without repeats, and start at 1 "
                    f"(so a lone request can be served), got {list(sizes)}"
                )
            if sizes[-1] > self.max_batch_size:
                raise ValueError(
                    f"batch_sizes must not exceed max_batch_size {self.max_batch_size}, got {list(sizes)}"
                )

        self._check_buckets()

    def _check_buckets(self) -> None:
        if self.bucket_by not in (None, *BUCKET_BY):
            raise ValueError(f"bucket_by must be one of {', '.join(BUCKET_BY)}, got {self.bucket_by!r}")
        bounds = self.length_buckets
        if bounds is not None:
            if not all(type(n) is int for n in bounds):
                raise ValueError(f"length_buckets must be ints, got {list(bounds)}")
            if not bounds or list(bounds) != sorted(set(bounds)) or bounds[0] < 1:
                raise ValueError(
                    f"length_buckets must be increasing ints >= 1, without repeats, got {list(bounds)}"
                )
        if (self.bucket_by is None) != (bounds is None):
            raise ValueError(
                "bucket_by and length_buckets go together (--bucket-by length --length-buckets 16,32,64), "
                f"got bucket_by={self.bucket_by!r} and length_buckets={bounds!r}"
            )

    def bucket(self, length: int) -> int:
        """The length bucket of a request: the index of the first bound >= `length`, or
        len(length_buckets) for a request longer than the last (a bucket of its own)."""
        assert self.length_buckets is not None
        return bisect.bisect_left(self.length_buckets, length)

    @property
    def max_wait_s(self) -> float:
        """The wait window in seconds, the unit the scheduler's clock uses."""
        return self.max_wait_ms / 1000.0

    def cut_size(self, queued: int) -> int:
        """How many of `queued` requests the next batch takes."""
        n = min(queued, self.max_batch_size)
        if self.batch_sizes is None:
            return n
        return max(s for s in self.batch_sizes if s <= n) if n >= 1 else 0


@dataclass(slots=True, eq=False)
class QueuedRequest:
    """One accepted request: where to answer it, what to forward, how to order it.

    `envelope` and `body` are opaque to the scheduler; the broker forwards `body`
    untouched and answers on `envelope`.
    """

    envelope: list[bytes]
    body: bytes
    id: object
    arrived_at: float
    priority: float = 0
    deadline_at: float | None = None
    state: RequestState = QUEUED
    seq: int = 0
    attempts: int = 0  # batches it was sent in whose worker failed
    handbacks: int = 0  # batches it was sent in whose worker left and handed it back
    cost: float = 1.0  # its share of max_batch_cost (tokens, pixels, bytes...)
    suspect: int = 0  # batches it was in whose worker died or hung on them: it then runs alone
    rank: float = 0.0  # its place by priority: lower first (set when it is queued)
    stream: bool = False  # answered chunk by chunk; its error reply says "more": false
    bucket: int | None = None  # its length bucket, with --bucket-by: batches never mix buckets


@dataclass(slots=True, eq=False)
class Batch:
    """Requests sent to one worker as one message, answered by one reply message."""

    batch_id: int
    model: str
    worker: bytes
    requests: list[QueuedRequest]
    dispatched_at: float
    expected_done_at: float = 0.0
    expected_start: float = 0.0  # when its worker should begin it (after the batches ahead)
    suspect: bool = False  # a suspect run alone: its worker holds nothing else meanwhile


@dataclass(slots=True, eq=False)
class WorkerState:
    """What the scheduler knows of a worker: its model and the batches it holds."""

    worker_id: bytes
    model: str
    slots: int
    in_flight: dict[int, Batch] = field(default_factory=dict)
    last_used: int = 0  # dispatch counter value when it last got a batch (least recent first)
    running_suspect: bool = False  # its one batch is a suspect's (see free_slots)

    @property
    def free_slots(self) -> int:
        """0 while it runs a suspect: should it die, the batch it held is then the one
        that killed it (were another behind it, a reply lost with the crash could put
        the blame on the wrong one)."""
        return 0 if self.running_suspect else self.slots - len(self.in_flight)

    def busy_until(self) -> float:
        """When its last batch is expected to finish (0 when it holds none)."""
        return max((b.expected_done_at for b in self.in_flight.values()), default=0.0)


class _LinearFit:
    """y = a + b*x by exponentially weighted least squares (recent points count most)."""

    DECAY = 0.97

    def __init__(self) -> None:
        self._w = self._x = self._xx = self._y = self._xy = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.DECAY
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._xx = self._xx * d + x * x
        self._y = self._y * d + y
        self._xy = self._xy * d + x * y

    @property
    def known(self) -> bool:
        return self._w > 0

    def coefficients(self) -> tuple[float, float]:
        """(a, b); with a single x seen so far, b = 0 and a = the mean y."""
        w = self._w
        if w == 0:
            return 0.0, 0.0
        mean_x, mean_y = self._x / w, self._y / w
        var_x = self._xx / w - mean_x * mean_x
        if var_x < 1e-6 * max(1.0, mean_x * mean_x):
            return mean_y, 0.0
        b = max(0.0, (self._xy / w - mean_x * mean_y) / var_x)
        a = max(0.0, mean_y - b * mean_x)
        return a, b


class CostModel:
    """The batch cost of one model, learned online from worker reports: t(n) = a + b*n
    over the request count, and t(c) = a + b*c over the batch's summed request `cost`.
    Each fit's recent prediction error is kept; the cost fit is used once it predicts
    clearly better (requests of one model that differ in size: tokens, pixels)."""

    DECAY = 0.97
    #: The cost fit must err this much less than the count fit to be used.
    BETTER = 0.8
    #: Batches seen before the fits are judged.
    MIN_BATCHES = 8

    def __init__(self) -> None:
        self._count = _LinearFit()
        self._cost = _LinearFit()
        self._err_count = self._err_cost = 0.0
        self._batches = 0
        self._cost_per_request = 1.0  # recent mean of a request's cost
        # Until a batch's summed cost differs from its count (requests without a `cost`),
        # the cost fit would be the count fit point for point: it is not kept (on a lone
        # request's path its second fit cost 20 us), and copied from it the first time.
        self._costs_differ = False

    def observe(self, n: int, seconds: float, cost: float | None = None) -> None:
        """A batch of `n` requests (of summed `cost`, when known) took `seconds`."""
        if cost is None:
            cost = float(n)
        if cost == n and not self._costs_differ:
            if self._batches:
                miss = self._predict(self._count, n) - seconds
                self._err_count = self._err_count * self.DECAY + miss * miss
            self._batches += 1
            self._count.add(n, seconds)
            return
        if not self._costs_differ:
            self._costs_differ = True
            self._cost = copy.copy(self._count)
            self._err_cost = self._err_count
        d = self.DECAY
        if self._batches:
            self._err_count = self._err_count * d + (self._predict(self._count, n) - seconds) ** 2
            self._err_cost = self._err_cost * d + (self._predict(self._cost, cost) - seconds) ** 2
            self._cost_per_request = self._cost_per_request * d + (1 - d) * (cost / n if n else 1.0)
        else:
            self._cost_per_request = cost / n if n else 1.0
        self._batches += 1
        self._count.add(n, seconds)
        self._cost.add(cost, seconds)

    @staticmethod
    def _predict(fit: _LinearFit, x: float) -> float:
        a, b = fit.coefficients()
        return a + b * x

    @property
    def known(self) -> bool:
        return self._batches > 0

    @property
    def by_cost(self) -> bool:
        """Whether the cost fit predicts clearly better than the count fit (and is used)."""
        return (
            self._costs_differ
            and self._batches >= self.MIN_BATCHES
            and self._err_cost < self.BETTER * self._err_count
        )

    def coefficients(self) -> tuple[float, float]:
        """(a, b) in seconds of t(n) = a + b*n: from the count fit, or from the cost fit at
        the recent mean cost of a request, when that fit is used."""
        if self.by_cost:
            a, b = self._cost.coefficients()
            return a, b * self._cost_per_request
        return self._count.coefficients()

    def predict(self, n: int, cost: float | None = None) -> float:
        """The expected time of a batch of `n` requests of summed `cost` (when known)."""
        if cost is not None and self.by_cost:
            return self._predict(self._cost, cost)
        a, b = self.coefficients()
        return a + b * n


class ArrivalRate:
    """Requests per second, an exponentially decaying count over about RATE_TAU_S."""

    def __init__(self) -> None:
        self._count = 0.0
        self._at = 0.0

    def arrive(self, now: float) -> None:
        if now == self._at:  # requests taken in one drain of the socket share a time
            self._count += 1.0
            return
        self._count = self._count * math.exp(-(now - self._at) / RATE_TAU_S) + 1.0
        self._at = now

    def per_second(self, now: float) -> float:
        return self._count * math.exp(-max(0.0, now - self._at) / RATE_TAU_S) / RATE_TAU_S


@dataclass(slots=True, eq=False)
class ModelQueue:
    """A model's waiting requests, its workers, and what it has learned of its load.

    Requests leave the lanes lazily (a dispatched or cancelled one is skipped when it
    reaches a head), so every structure is compacted once more than half of it is such
    leftovers: the queue's memory follows the number of requests waiting, not the number
    ever accepted, whatever mix of priorities and deadlines arrives.
    """

    settings: BatchSettings
    # Scheduling order lives in two lanes: requests of priority 0 without a deadline (the
    # common case) in `fifo`, already in order, and all others in `heap`; pop() takes the
    # lesser head, so the order is as if all were in one heap, at a deque's cost.
    fifo: deque[QueuedRequest] = field(default_factory=deque)
    heap: list[tuple[float, float, int, QueuedRequest]] = field(default_factory=list)
    heap_arrivals: deque[QueuedRequest] = field(default_factory=deque)  # the heap lane's, by seq
    deadlines: list[tuple[float, int, QueuedRequest]] = field(default_factory=list)
    # (client routing id, request id) -> the request(s) queued under it, so a cancel is a
    # look-up and not a scan (a client may reuse an id: then a list).
    by_client: dict[bytes, dict[object, QueuedRequest | list[QueuedRequest]]] = field(default_factory=dict)
    size: int = 0
    queued_cost: float = 0.0  # the sum of the queued requests' costs
    suspects: int = 0  # queued requests whose batch killed or hung its worker before (each runs alone)
    workers: dict[bytes, None] = field(default_factory=dict)  # an ordered set
    cost: CostModel = field(default_factory=CostModel)
    rate: ArrivalRate = field(default_factory=ArrivalRate)
    recheck_at: float = math.inf  # adaptive: when a decision to wait is reconsidered
    # Since when the model has had no worker (stamped at the first turn that finds it so,
    # cleared when one joins); None while it has one.
    no_worker_since: float | None = None
    # With --bucket-by: a queue per length bucket, sharing this one's workers and cost
    # model; their requests are never batched with this queue's or each other's.
    buckets: dict[int, ModelQueue] = field(default_factory=dict)

    def lanes(self) -> list[ModelQueue]:
        """This queue and its bucket queues: every queue of the model."""
        return [self, *self.buckets.values()] if self.buckets else [self]

    def total(self) -> int:
        """Requests waiting in all of the model's queues."""
        return self.size + sum(b.size for b in self.buckets.values()) if self.buckets else self.size

    def bucket_queue(self, bucket: int | None) -> ModelQueue:
        """The queue of a length bucket (this one for None), made on first use."""
        if bucket is None:
            return self
        q = self.buckets.get(bucket)
        if q is None:
            q = self.buckets[bucket] = ModelQueue(self.settings, workers=self.workers, cost=self.cost)
        return q

    def oldest(self) -> QueuedRequest | None:
        """The earliest-arrived request still queued: the older of the two lanes' oldest."""
        fifo, arrivals = self.fifo, self.heap_arrivals
        while fifo and fifo[0].state != QUEUED:
            fifo.popleft()
        while arrivals and arrivals[0].state != QUEUED:
            arrivals.popleft()
        if not arrivals:
            return fifo[0] if fifo else None
        if not fifo:
            return arrivals[0]
        return fifo[0] if fifo[0].seq < arrivals[0].seq else arrivals[0]

    def earliest_deadline(self) -> float | None:
        dl = self.deadlines
        while dl and dl[0][2].state != QUEUED:
            heapq.heappop(dl)
        return dl[0][0] if dl else None

    def _heap_next(self) -> bool:
        """Whether the next request in scheduling order heads the heap lane (else the fifo
        lane); both heads are first cleared of leftovers."""
        fifo, heap = self.fifo, self.heap
        while fifo and fifo[0].state != QUEUED:
            fifo.popleft()
        while heap and heap[0][3].state != QUEUED:
            heapq.heappop(heap)
        return bool(heap) and (not fifo or _heap_first(heap[0], fifo[0]))

    def peek(self) -> QueuedRequest:
        """The next request in scheduling order, left in the queue."""
        return self.heap[0][3] if self._heap_next() else self.fifo[0]

    def pop(self) -> QueuedRequest:
        """The next request in scheduling order (priority, deadline, arrival)."""
        req = heapq.heappop(self.heap)[3] if self._heap_next() else self.fifo.popleft()
        self._forget(req)
        self.unindex(req)
        return req

    def added(self, req: QueuedRequest) -> None:
        """Count a request just put in a lane."""
        self.size += 1
        self.queued_cost += req.cost
        self.suspects += req.suspect > 0

    def _forget(self, req: QueuedRequest) -> None:
        self.size -= 1
        self.queued_cost = self.queued_cost - req.cost if self.size else 0.0  # no drift when empty
        self.suspects -= req.suspect > 0

    def full(self) -> bool:
        """Whether the queue holds a whole batch: max_batch_size requests, or costs that
        reach max_batch_cost."""
        s = self.settings
        return self.size >= s.max_batch_size or (
            s.max_batch_cost is not None and self.queued_cost >= s.max_batch_cost
        )

    def queued(self) -> Iterator[QueuedRequest]:
        """Every request still queued, in no particular order."""
        yield from (r for r in self.fifo if r.state == QUEUED)
        yield from (entry[3] for entry in self.heap if entry[3].state == QUEUED)

    def discard(self, req: QueuedRequest) -> None:
        """Take a queued request out (expired or cancelled); its entries go lazily."""
        req.state = REMOVED
        self._forget(req)
        self.unindex(req)
        self.compact()

    def compact(self) -> None:
        """Rebuild each structure that holds more leftovers than queued requests (amortized
        O(1) a request: a rebuild follows at least as many removals as it keeps)."""
        limit = 2 * self.size + 64
        if len(self.heap) > limit:
            self.heap = [e for e in self.heap if e[3].state == QUEUED]
            heapq.heapify(self.heap)
        if len(self.fifo) > limit:
            self.fifo = deque(r for r in self.fifo if r.state == QUEUED)
        if len(self.heap_arrivals) > limit:
            self.heap_arrivals = deque(r for r in self.heap_arrivals if r.state == QUEUED)
        if len(self.deadlines) > limit:
            self.deadlines = [e for e in self.deadlines if e[2].state == QUEUED]
            heapq.heapify(self.deadlines)

    def index(self, req: QueuedRequest) -> None:
        """File a queued request under its client and id, for cancel()."""
        client = req.envelope[0]
        ids = self.by_client.get(client)
        if ids is None:
            ids = self.by_client[client] = {}
        held = ids.get(req.id)
        if held is None:
            ids[req.id] = req
        elif isinstance(held, list):
            held.append(req)
        else:
            ids[req.id] = [held, req]

    def unindex(self, req: QueuedRequest) -> None:
        client = req.envelope[0]
        ids = self.by_client[client]
        held = ids[req.id]
        if held is req:
            del ids[req.id]
            if not ids:
                del self.by_client[client]
        else:
            assert isinstance(held, list)
            held.remove(req)
            if len(held) == 1:
                ids[req.id] = held[0]

    def find(self, client: bytes, req_id: object) -> list[QueuedRequest]:
        """The queued requests that `client` sent with this id."""
        held = self.by_client.get(client, {}).get(req_id)
        if held is None:
            return []
        return list(held) if isinstance(held, list) else [held]


def _heap_first(entry: tuple[float, float, int, QueuedRequest], head: QueuedRequest) -> bool:
    """Whether a heap entry comes before the fifo lane's head, whose key is (its rank, inf,
    its seq): the fifo lane holds requests without deadline in arrival order, of priority
    0 (rank 0) or, with aging, of ranks that grow with arrival."""
    rank, deadline, seq, _ = entry
    if rank != head.rank:
        return rank < head.rank
    return deadline < math.inf or seq < head.seq


class WorkerView(NamedTuple):
    """A worker as the broker may see it: read-only."""

    worker_id: bytes
    batches_held: int


class ModelView(NamedTuple):
    """A model's queue and workers as the broker may see them (stats, gauges): read-only."""

    queued: int
    workers: tuple[WorkerView, ...]
    settings: BatchSettings
    cost: tuple[float, float] | None  # the learned (a, b) of t(n) = a + b*n in seconds
    no_worker_since: float | None
    cost_basis: str = "count"  # what t() is learned over: "count", or "cost" when that predicts better

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
        self._workers: dict[bytes, WorkerState] = {}
        self._next_batch_id = first_batch_id
        self._seq = itertools.count()
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

    def views(self) -> dict[str, ModelView]:
        """Every model's queue and workers, as a snapshot the caller cannot change."""
        return {name: self._view(mq) for name, mq in self._models.items()}

    def _view(self, mq: ModelQueue) -> ModelView:
        workers = tuple(WorkerView(w, len(self._workers[w].in_flight)) for w in mq.workers)
        cost = mq.cost.coefficients() if mq.cost.known else None
        basis = "cost" if mq.cost.by_cost else "count"
        return ModelView(mq.total(), workers, mq.settings, cost, mq.no_worker_since, basis)

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
        if mq is None or mq.cost.known:
            return
        for n in sorted({1, max(2, mq.settings.max_batch_size)}):
            mq.cost.observe(n, a_s + b_s * n)

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
        model_queue = self._models.get(model)
        if model_queue is None:
            raise NoSuchModel(model)
        if model_queue.total() >= model_queue.settings.max_queue:
            raise QueueFull(model)
        mq = model_queue.bucket_queue(request.bucket)
        request.seq = next(self._seq)
        request.rank = self._rank(mq, request)
        if request.priority == 0 and request.deadline_at is None:
            mq.fifo.append(request)  # in seq order, like the heap would keep it
            mq.added(request)
        else:
            self._push(mq, request)
            mq.heap_arrivals.append(request)
        mq.index(request)
        mq.rate.arrive(request.arrived_at)

    def requeue(self, model: str, requests: list[QueuedRequest], count_attempt: bool = True) -> None:
        """Put the requests of a batch whose worker failed (or left) back in their queue,
        where their original arrival keeps them ahead of later requests. The queue limit
        does not apply: they were accepted already."""
        model_queue = self._models[model]
        by_queue: dict[int, tuple[ModelQueue, list[QueuedRequest]]] = {}
        for req in requests:
            mq = model_queue.bucket_queue(req.bucket)
            req.state = QUEUED
            req.attempts += count_attempt
            self._push(mq, req)
            mq.index(req)
            by_queue.setdefault(id(mq), (mq, []))[1].append(req)
        for mq, back in by_queue.values():
            # Rebuild the heap lane's arrival order (rare: only after a worker failure),
            # since requests older than the requeued ones may still be queued there.
            queued = {id(r): r for r in [*back, *mq.heap_arrivals] if r.state == QUEUED}
            mq.heap_arrivals = deque(sorted(queued.values(), key=lambda r: r.seq))

    @staticmethod
    def _rank(mq: ModelQueue, req: QueuedRequest) -> float:
        """Its place by priority, lower first: priority less its wait in aging intervals."""
        aging_ms = mq.settings.priority_aging_ms
        return -req.priority + (req.arrived_at * 1000.0 / aging_ms if aging_ms else 0.0)

    @staticmethod
    def _push(mq: ModelQueue, req: QueuedRequest) -> None:
        deadline = req.deadline_at
        heapq.heappush(mq.heap, (req.rank, math.inf if deadline is None else deadline, req.seq, req))
        if deadline is not None:
            heapq.heappush(mq.deadlines, (deadline, req.seq, req))
        mq.added(req)

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
        `req_id`; a look-up, whatever the queue's length. Requests in a batch stay."""
        out = []
        for name, mq in self._queues():
            for req in mq.find(client, req_id):
                mq.discard(req)
                out.append((name, req))
        return out

    def expire(self, now: float) -> list[tuple[str, QueuedRequest]]:
        """Remove and return the queued requests whose deadline is at or before `now`."""
        out = []
        for name, mq in self._queues():
            while mq.deadlines and (mq.deadlines[0][2].state != QUEUED or mq.deadlines[0][0] <= now):
                _, _, req = heapq.heappop(mq.deadlines)  # (discard may rebuild the list)
                if req.state == QUEUED:
                    mq.discard(req)
                    out.append((name, req))
        return out

    def set_settings(self, model: str, settings: BatchSettings) -> None:
        """New batching settings for a model (a reloaded config); queued requests stay, ranked
        again if the priority aging changed."""
        model_queue = self._model(model)
        aging_changed = model_queue.settings.priority_aging_ms != settings.priority_aging_ms
        for mq in model_queue.lanes():
            mq.settings = settings
            if aging_changed and mq.size:
                self._rerank(mq)

    def _rerank(self, mq: ModelQueue) -> None:
        """Rank every queued request by the model's current aging, all in the heap lane (the
        fifo lane's order may no longer be rank order)."""
        queued = sorted(mq.queued(), key=lambda r: r.seq)
        mq.fifo, mq.heap, mq.heap_arrivals, mq.deadlines = deque(), [], deque(queued), []
        mq.size, mq.queued_cost, mq.suspects = 0, 0.0, 0
        for req in queued:
            req.rank = self._rank(mq, req)
            self._push(mq, req)

    def unavailable(self, now: float) -> list[tuple[str, QueuedRequest, float]]:
        """Remove and return, with how long their model has had no worker, the queued
        requests of every model that has had none for `no_worker_timeout_s` (0: never).
        Also where "no worker since" is stamped, so call it every turn."""
        out: list[tuple[str, QueuedRequest, float]] = []
        for name, mq in self._models.items():
            if mq.workers:
                mq.no_worker_since = None
                continue
            if mq.no_worker_since is None:
                mq.no_worker_since = now
            without_s = now - mq.no_worker_since
            if mq.total() and self.no_worker_timeout_s and without_s >= self.no_worker_timeout_s:
                for lane in mq.lanes():
                    for req in list(lane.queued()):
                        lane.discard(req)
                        out.append((name, req, without_s))
        return out

    def without_worker_s(self, model: str, now: float) -> float | None:
        """How long `model` has had no worker, if past `no_worker_timeout_s` (a request for
        it is then refused at once); None otherwise."""
        mq = self._models.get(model)
        if mq is None or mq.workers or mq.no_worker_since is None or not self.no_worker_timeout_s:
            return None
        without_s = now - mq.no_worker_since
        return without_s if without_s >= self.no_worker_timeout_s else None

    def add_worker(
        self, worker_id: bytes, model: str, slots: int | None = None, step: bool = False
    ) -> list[Batch]:
        """A worker announced itself (READY). It may hold `worker_prefetch` batches at once
        (fewer if it asks for fewer `slots`); a `step`-level one holds none: it takes
        requests one by one (`take`), for the sequence slots batcher.core.streams counts. A
        worker announcing itself again is a fresh one: the batches it held are returned,
        to be answered or sent elsewhere."""
        lost = self.remove_worker(worker_id)
        mq = self._model(model)
        limit = self.worker_prefetch if slots is None else max(1, min(slots, self.worker_prefetch))
        if step:
            limit = 0
        self._workers[worker_id] = WorkerState(worker_id, model, limit)
        mq.workers[worker_id] = None
        return lost

    def take(self, model: str, n: int) -> list[QueuedRequest]:
        """Up to `n` queued requests of `model`, in scheduling order (across its length
        buckets too), taken out as dispatched: for a step-level worker's free slots."""
        model_queue = self._models.get(model)
        out: list[QueuedRequest] = []
        while model_queue is not None and len(out) < n:
            lanes = _oldest_first(model_queue)
            mq = lanes[0] if lanes else model_queue
            if not mq.size:
                break
            req = mq.pop()
            req.state = DISPATCHED
            mq.compact()
            out.append(req)
        return out

    def drain_worker(self, worker_id: bytes) -> int:
        """Send a worker no more batches (it is being replaced); returns how many it still
        holds. It stays a worker of its model, so its replies are taken as usual."""
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
        self._models[w.model].workers.pop(worker_id, None)
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
            cost = sum(r.cost for r in batch.requests)
            self._models[batch.model].cost.observe(len(batch.requests), infer_s, cost)
        if now is not None and w.in_flight:
            following = next(iter(w.in_flight.values()))  # batches run in the order sent
            following.expected_start = max(following.expected_start, now)
        return batch

    # --- decisions --------------------------------------------------------------------------

    def due_batches(self, now: float) -> list[Batch]:
        """Cut every batch that is due at `now` and assign each to a worker."""
        out: list[Batch] = []
        for name, model_queue in self._models.items():
            for mq in _oldest_first(model_queue):
                while mq.size:
                    worker = self._pick_worker(mq, now)
                    if worker is None:
                        break
                    out.append(self._cut(name, mq, worker, now))
        return out

    def next_wakeup(self) -> float | None:
        """The earliest time at which something may become due without any new event."""
        best = math.inf
        for model_queue in self._models.values():
            since = model_queue.no_worker_since
            for mq in model_queue.lanes():
                if mq.deadlines:
                    dl = mq.earliest_deadline()
                    if dl is not None:
                        best = min(best, dl)
                if mq.size and not mq.workers and since is not None and self.no_worker_timeout_s:
                    best = min(best, since + self.no_worker_timeout_s)
                if mq.size:
                    best = min(best, self._due_at(mq))
        return None if best == math.inf else best

    def _due_at(self, mq: ModelQueue) -> float:
        """When a model's waiting requests are cut into a batch at the latest, given its
        workers' free slots (inf without one): its window, or a recheck of adaptive's;
        adaptive sends a partial batch to a busy worker's prefetch slot only once that
        worker is expected to be done (_pick_worker)."""
        free = [self._workers[w] for w in mq.workers if self._workers[w].free_slots > 0]
        if mq.suspects and mq.peek().suspect:  # a suspect goes to an idle worker only
            free = [w for w in free if not w.in_flight]
        if not free:
            return math.inf
        due = self._wait_until(mq)
        if mq.settings.policy is not Policy.WINDOW and all(w.in_flight for w in free):
            due = max(due, min(w.busy_until() for w in free) + PREFETCH_GRACE_S)
        return min(due, mq.recheck_at)

    # --- internals --------------------------------------------------------------------------

    def _queues(self) -> Iterator[tuple[str, ModelQueue]]:
        """(model, queue) of every queue: each model's, and its bucket queues."""
        for name, model_queue in self._models.items():
            for mq in model_queue.lanes():
                yield name, mq

    def _model(self, name: str) -> ModelQueue:
        mq = self._models.get(name)
        if mq is None:
            mq = ModelQueue(self._per_model.get(name, self.default_settings))
            self._models[name] = mq
        return mq

    def _wait_until(self, mq: ModelQueue) -> float:
        """The latest time the queue's head batch may wait for more requests."""
        oldest = mq.oldest()
        assert oldest is not None
        t = oldest.arrived_at + mq.settings.max_wait_s
        dl = mq.earliest_deadline()
        if dl is not None:  # leave time to run the batch before the earliest deadline
            t = min(t, dl - mq.cost.predict(mq.settings.cut_size(mq.size)) - DEADLINE_MARGIN_S)
        return t

    def _pick_worker(self, mq: ModelQueue, now: float) -> WorkerState | None:
        """The worker the next batch goes to now, or None if the queue should wait."""
        idle: list[WorkerState] = []
        prefetching: list[WorkerState] = []
        for wid in mq.workers:
            w = self._workers[wid]
            if w.free_slots <= 0:
                continue
            if not w.in_flight:
                idle.append(w)
            else:
                prefetching.append(w)
        if prefetching and mq.suspects and mq.peek().suspect:
            prefetching = []  # a suspect goes to an idle worker only (WorkerState.free_slots)
        if not idle and not prefetching:
            return None
        s = mq.settings
        mq.recheck_at = math.inf
        full = mq.full()
        if full or now >= self._wait_until(mq):
            if idle:
                return min(idle, key=_least_recently_used)
            first = min(prefetching, key=WorkerState.busy_until)
            if full or s.policy is Policy.WINDOW or now >= first.busy_until() + PREFETCH_GRACE_S:
                return first
            return None  # adaptive: a partial batch sent now would only wait in the worker
        if not idle or s.policy is Policy.WINDOW:
            return None
        # adaptive: an idle worker takes the queue now unless waiting should pay
        gap = self._fill_time_if_load_needs_bigger_batches(mq, now)
        if gap is None:
            gap = self._gap_if_waiting_pays(mq, len(idle), now)
        if gap is None or now + gap <= now:  # a wait too short to tell from now is none
            return min(idle, key=_least_recently_used)
        mq.recheck_at = now + gap  # no arrival by then: the rate estimate has dropped
        return None

    def _fill_time_if_load_needs_bigger_batches(self, mq: ModelQueue, now: float) -> float | None:
        """Under heavy load, the time to wait for the batch size the load needs, else None.

        With W workers, arrival rate r and cost t(n) = a + b*n, batches of n keep the
        workers busy a share r*t(n)/(W*n) of the time. When even unbatched work would
        overload them (r*t(1) > W, with a margin), dispatching whatever is queued the
        moment a worker idles makes batches just big enough to keep up, and queues grow
        at that edge. Waiting instead for n = r*a / (W*RHO - r*b), the size that leaves
        the workers RHO busy, keeps headroom; the wait is still bounded by max_wait_ms.
        """
        if not mq.cost.known:
            return None
        rate = mq.rate.per_second(now)
        a, b = mq.cost.coefficients()
        workers = len(mq.workers)
        if rate <= 0 or workers == 0 or rate * (a + b) <= workers * HEAVY_LOAD:
            return None
        headroom = workers * TARGET_BUSY - rate * b
        size = mq.settings.max_batch_size
        if headroom > 0:
            # A whole number of requests: waiting for a fraction of one would recheck ever
            # sooner as the rate estimate decays toward the target, and never dispatch.
            size = min(size, math.ceil(rate * a / headroom))
        if mq.size >= size:
            return None
        return (size - mq.size) / rate

    def _gap_if_waiting_pays(self, mq: ModelQueue, idle_workers: int, now: float) -> float | None:
        """The expected time to the next arrival if holding the queue for it lowers the
        total latency, else None.

        Dispatching n now, the next arrival (in g = 1/rate) waits for the first worker to
        free, at F, and finishes near F + t(1); held back, it joins this batch and all
        finish at now + g + t(n+1). Holding costs the n queued requests g + b each.
        With another idle worker the next arrival would not wait at all, so it never pays.
        """
        if idle_workers > 1 or not mq.cost.known:
            return None
        rate = mq.rate.per_second(now)
        if rate <= 0:
            return None
        n = mq.size
        a, b = mq.cost.coefficients()
        gap = 1.0 / rate
        first_free = now + a + b * n
        for wid in mq.workers:
            w = self._workers[wid]
            if w.in_flight:
                first_free = min(first_free, max(now, w.busy_until()))
        gain = (first_free + a + b) - (now + gap + a + b * (n + 1))
        return gap if gain > n * (gap + b) else None

    def _cut(self, name: str, mq: ModelQueue, worker: WorkerState, now: float) -> Batch:
        requests = self._take(name, mq)
        n = len(requests)
        for r in requests:
            r.state = DISPATCHED
        mq.compact()
        start = max(now, worker.busy_until())
        batch = Batch(self._next_batch_id, name, worker.worker_id, requests, now)
        if requests[0].suspect:  # a suspect is always cut alone, for an idle worker
            batch.suspect = worker.running_suspect = True
        batch.expected_start = start
        batch.expected_done_at = start + mq.cost.predict(n, sum(r.cost for r in requests))
        self._next_batch_id += 1
        worker.in_flight[batch.batch_id] = batch
        worker.last_used = batch.batch_id
        return batch

    def _take(self, name: str, mq: ModelQueue) -> list[QueuedRequest]:
        """The next batch's requests, in scheduling order: cut_size of them, fewer when
        their costs would pass max_batch_cost (the first is always taken), or before a
        request whose batch killed or hung its worker before: such a suspect runs alone,
        so that a poison request takes none of its batch-mates down with it again."""
        s = mq.settings
        n = s.cut_size(mq.size)
        cap = s.max_batch_cost
        if cap is None and not mq.suspects:
            return [mq.pop() for _ in range(n)]
        if mq.peek().suspect:
            return [mq.pop()]
        requests: list[QueuedRequest] = []
        total = 0.0
        while len(requests) < n:
            if requests:
                following = mq.peek()
                if following.suspect or (cap is not None and total + following.cost > cap):
                    break
            requests.append(mq.pop())
            total += requests[-1].cost
        allowed = s.cut_size(len(requests))  # with batch_sizes: round down to one of them
        if allowed < len(requests):
            back = requests[allowed:]
            del requests[allowed:]
            self.requeue(name, back, count_attempt=False)
        return requests

    def hung_batches(self, now: float, limit_s: float | None) -> list[tuple[Batch, float]]:
        """(batch, its limit) of each worker's running batch (its first: batches run in the
        order sent) that ran past its time limit, counted from when the worker should have
        begun it: `limit_s`, or by default `default_limit_s`."""
        out = []
        for w in self._workers.values():
            if not w.in_flight:
                continue
            batch = next(iter(w.in_flight.values()))
            limit = limit_s if limit_s is not None else self.default_limit_s(batch)
            if now > batch.expected_start + limit:
                out.append((batch, limit))
        return out

    def default_limit_s(self, batch: Batch) -> float:
        """10 x a batch's cost bound n x t(1) (no model takes longer per item in a batch
        than alone; t(n) = a + b*n extrapolated from one batch size could say much less),
        or 10 x its expected time from its summed request cost when the model's time is
        learned over cost (a costly request takes longer than an average one), at least
        MIN_BATCH_LIMIT_S; FIRST_BATCH_LIMIT_S before any batch of the model was answered
        (a first batch may load weights or compile kernels)."""
        cost = self._models[batch.model].cost
        if not cost.known:
            return FIRST_BATCH_LIMIT_S
        n = len(batch.requests)
        expected = max(n * cost.predict(1), cost.predict(n, sum(r.cost for r in batch.requests)))
        return max(10.0 * expected, MIN_BATCH_LIMIT_S)


def _oldest_first(model_queue: ModelQueue) -> list[ModelQueue]:
    """A model's queues in the order they get workers: by their next requests, in the
    order one queue would keep them (priority, then deadline, then arrival), so that
    priorities and deadlines hold across length buckets and no bucket starves."""
    if not model_queue.buckets:
        return [model_queue]
    waiting = []
    for mq in model_queue.lanes():
        if mq.size:
            head = mq.peek()
            deadline = math.inf if head.deadline_at is None else head.deadline_at
            waiting.append(((head.rank, deadline, head.seq), mq))
    return [mq for _, mq in sorted(waiting, key=lambda entry: entry[0])]


def _least_recently_used(w: WorkerState) -> int:
    return w.last_used
