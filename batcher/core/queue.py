"""A model's queue: the requests waiting for a batch, kept in scheduling order, and the
batches and workers they leave it for.

Order: higher `priority` first, then earliest deadline, then arrival; with
`priority_aging_ms` A, a request's priority grows by one every A ms it waits (its
`rank`). Nothing here reads a clock: arrival times and `now` are arguments.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import msgspec

from batcher.core.cost_model import ArrivalRate, CostModel
from batcher.core.limits import BatchSettings
from batcher.core.multiplex import Resident


class RequestState(IntEnum):
    """Queued, then exactly one of: in a batch, or answered without one (expired,
    cancelled, unavailable)."""

    QUEUED = 0
    DISPATCHED = 1
    REMOVED = 2


QUEUED, DISPATCHED, REMOVED = RequestState.QUEUED, RequestState.DISPATCHED, RequestState.REMOVED


class QueuedRequest(msgspec.Struct, eq=False):
    """One accepted request: where to answer it, what to forward, how to order it.

    `envelope` and `body` are opaque to the scheduler; the broker forwards `body`
    untouched and answers on `envelope`. A msgspec Struct compared by identity (as the
    slotted dataclass it was): made for every request, with all its fields, in 0.15 us
    where the dataclass took 0.32 and its fields set after.
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
    trace: Any = None  # its trace at the broker when it is traced (batcher.observe), opaque here
    cache_key: Any = None  # its response cache key when its reply may be cached (batcher.core.cache)


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
    cost: float = 0.0  # its requests' summed cost (the cost model predicts and learns by it)
    multiplexed: bool = False  # its worker serves many models: the BATCH names the model
    cold: bool = False  # that worker loads the model first (batcher.core.multiplex)
    unloaded: tuple[str, ...] = ()  # the models it unloads for it
    held_after: tuple[str, ...] = ()  # and the models it holds after this batch, least recent first
    unsent: bool = False  # its BATCH could not be sent (the worker's connection was gone)


@dataclass(slots=True, eq=False)
class WorkerState:
    """What the scheduler knows of a worker: its model and the batches it holds."""

    worker_id: bytes
    model: str
    slots: int
    in_flight: dict[int, Batch] = field(default_factory=dict)
    last_used: int = 0  # dispatch counter value when it last got a batch (least recent first)
    running_suspect: bool = False  # its one batch is a suspect's (see free_slots)
    #: A multiplexed worker's models held (batcher.core.multiplex); None for a worker of one model.
    resident: Resident | None = None
    models: tuple[str, ...] = ()  # the models it serves: its own, or its catalog's

    @property
    def free_slots(self) -> int:
        """0 while it runs a suspect: should it die, the batch it held is then the one
        that killed it (were another behind it, a reply lost with the crash could put
        the blame on the wrong one)."""
        return 0 if self.running_suspect else self.slots - len(self.in_flight)

    def busy_until(self) -> float:
        """When its last batch is expected to finish (0 when it holds none)."""
        return max((b.expected_done_at for b in self.in_flight.values()), default=0.0)


class CancelIndex:
    """(client routing id, request id) -> the request(s) queued under it (a client may
    reuse an id: then a list), so that a cancel is a look-up, whatever the queue's length."""

    __slots__ = ("by_client",)

    def __init__(self, queued: Iterable[QueuedRequest]) -> None:
        self.by_client: dict[bytes, dict[object, QueuedRequest | list[QueuedRequest]]] = {}
        for req in sorted(queued, key=lambda r: r.seq):  # in arrival order
            self.add(req)

    def add(self, req: QueuedRequest) -> None:
        """File a queued request under its client and id."""
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

    def remove(self, req: QueuedRequest) -> None:
        """Unfile a request that leaves the queue."""
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
    # The queued requests by client and id, so a cancel is a look-up and not a scan: made
    # at a cancel that finds requests waiting (`find`), dropped when the queue empties; a
    # queue no client cancels in pays nothing for it.
    cancels: CancelIndex | None = None
    size: int = 0
    queued_cost: float = 0.0  # the sum of the queued requests' costs
    suspects: int = 0  # queued requests whose batch killed or hung its worker before (each runs alone)
    workers: dict[bytes, None] = field(default_factory=dict)  # an ordered set
    cost: CostModel = field(default_factory=CostModel)
    rate: ArrivalRate = field(default_factory=ArrivalRate)
    offered: int = 0  # requests offered to the model (queued or refused for a full queue), ever
    recheck_at: float = math.inf  # adaptive: when a decision to wait is reconsidered
    # Since when the model has had no worker (stamped at the first turn that finds it so,
    # cleared when one joins); None while it has one.
    no_worker_since: float | None = None
    # With --bucket-by: a queue per length bucket, sharing this one's workers and cost
    # model; their requests are never batched with this queue's or each other's.
    buckets: dict[int, ModelQueue] = field(default_factory=dict)
    name: str = ""  # the model's (a multiplexed worker holds some models and not others)
    # Made by a worker's READY alone, no configuration: forgotten once unserved (policy.forget_unserved).
    announced: bool = False

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
            q = self.buckets[bucket] = ModelQueue(
                self.settings, workers=self.workers, cost=self.cost, name=self.name
            )
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
        if self.cancels is not None:
            self._unfile(req)
        return req

    def pop_many(self, n: int) -> list[QueuedRequest]:
        """The next `n` requests (at most `size`) in scheduling order, as `pop` n times
        gives them; from the fifo lane alone (plain requests, none cancelled) by a list
        comprehension (again if some were taken out before): the broker's busiest path."""
        if self.heap or self.cancels is not None:
            return [self.pop() for _ in range(n)]
        popleft = self.fifo.popleft
        out = [popleft() for _ in range(n)]
        if any([r.state for r in out]):  # (QUEUED is 0) some were taken out before: skipped
            out = [r for r in out if r.state == QUEUED]
            while len(out) < n:
                out += [req] if (req := popleft()).state == QUEUED else []
        self.size -= n
        queued_cost = self.queued_cost
        for r in out:  # one by one, as pop() takes them: the same float
            queued_cost -= r.cost
        self.queued_cost = queued_cost if self.size else 0.0  # no drift when empty
        if self.suspects:
            self.suspects -= sum([r.suspect > 0 for r in out])
        return out

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
        if self.cancels is not None:
            self._unfile(req)
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

    def find(self, client: bytes, req_id: object) -> list[QueuedRequest]:
        """The queued requests that `client` sent with this id. The first call while
        requests wait files them all (CancelIndex), and the index is kept until the queue
        is empty again: a cancel now and then (a gateway's late rows) does not keep every
        request of the model paying for it."""
        if not self.size:
            return []
        if self.cancels is None:
            self.cancels = CancelIndex(self.queued())
        return self.cancels.find(client, req_id)

    def _unfile(self, req: QueuedRequest) -> None:
        """A request left the queue: out of the cancel index, dropped once nothing waits."""
        assert self.cancels is not None
        if self.size:
            self.cancels.remove(req)
        else:
            self.cancels = None

    # --- putting requests in, in scheduling order ------------------------------------------------

    def rank(self, req: QueuedRequest) -> float:
        """Its place by priority, lower first: priority less its wait in aging intervals."""
        aging_ms = self.settings.priority_aging_ms
        return -req.priority + (req.arrived_at * 1000.0 / aging_ms if aging_ms else 0.0)

    def push(self, req: QueuedRequest) -> None:
        """Put a request in the heap lane (and the deadlines' heap, when it has one)."""
        deadline = req.deadline_at
        heapq.heappush(self.heap, (req.rank, math.inf if deadline is None else deadline, req.seq, req))
        if deadline is not None:
            heapq.heappush(self.deadlines, (deadline, req.seq, req))
        self.added(req)

    def put(self, request: QueuedRequest, seq: int) -> None:
        """Queue a newly accepted request, the `seq`-th; a plain one (priority 0, no
        deadline) in the fifo lane, any other in the heap lane."""
        request.seq = seq
        if request.priority == 0 and request.deadline_at is None:
            # `rank` and `added`, written out for the common case (2 calls a request fewer)
            aging_ms = self.settings.priority_aging_ms
            request.rank = request.arrived_at * 1000.0 / aging_ms if aging_ms else 0.0
            self.fifo.append(request)  # in seq order, like the heap would keep it
            self.size += 1
            self.queued_cost += request.cost
            self.suspects += request.suspect > 0
        else:
            request.rank = self.rank(request)
            self.push(request)
            self.heap_arrivals.append(request)
        if self.cancels is not None:
            self.cancels.add(request)
        self.rate.arrive(request.arrived_at)

    def put_back(self, requests: list[QueuedRequest], count_attempt: bool) -> None:
        """Queue again requests that were taken out of this queue (their batch failed, or a
        batch was rounded down); their original arrival keeps them ahead of later ones."""
        for req in requests:
            req.state = QUEUED
            req.attempts += count_attempt
            self.push(req)
            if self.cancels is not None:
                self.cancels.add(req)
        # Rebuild the heap lane's arrival order (rare: only after a worker failure),
        # since requests older than the requeued ones may still be queued there.
        queued = {id(r): r for r in [*requests, *self.heap_arrivals] if r.state == QUEUED}
        self.heap_arrivals = deque(sorted(queued.values(), key=lambda r: r.seq))

    def requeue(self, requests: list[QueuedRequest], count_attempt: bool) -> None:
        """Put requests of this model back, each in its length bucket's queue (put_back)."""
        by_queue: dict[int, tuple[ModelQueue, list[QueuedRequest]]] = {}
        for req in requests:
            mq = self.bucket_queue(req.bucket)
            by_queue.setdefault(id(mq), (mq, []))[1].append(req)
        for mq, back in by_queue.values():
            mq.put_back(back, count_attempt)

    def rerank(self) -> None:
        """Rank every queued request by the current aging, all in the heap lane (the fifo
        lane's order may no longer be rank order)."""
        queued = sorted(self.queued(), key=lambda r: r.seq)
        self.fifo, self.heap, self.heap_arrivals, self.deadlines = deque(), [], deque(queued), []
        self.size, self.queued_cost, self.suspects = 0, 0.0, 0
        for req in queued:
            req.rank = self.rank(req)
            self.push(req)

    # --- taking requests out ---------------------------------------------------------------------

    def expire(self, now: float) -> list[QueuedRequest]:
        """Remove and return the queued requests whose deadline is at or before `now`."""
        out = []
        while self.deadlines and (self.deadlines[0][2].state != QUEUED or self.deadlines[0][0] <= now):
            _, _, req = heapq.heappop(self.deadlines)  # (discard may rebuild the list)
            if req.state == QUEUED:
                self.discard(req)
                out.append(req)
        return out

    def take(self, n: int) -> list[QueuedRequest]:
        """Up to `n` queued requests of the model, in scheduling order (across its length
        buckets too), taken out as dispatched."""
        out: list[QueuedRequest] = []
        while len(out) < n:
            lanes = oldest_first(self)
            mq = lanes[0] if lanes else self
            if not mq.size:
                break
            req = mq.pop()
            req.state = DISPATCHED
            mq.compact()
            out.append(req)
        return out

    def discard_all(self) -> list[QueuedRequest]:
        """Take out every request queued for the model (in all its length buckets)."""
        out = []
        for lane in self.lanes():
            for req in list(lane.queued()):
                lane.discard(req)
                out.append(req)
        return out

    def stamp_no_worker(self, now: float) -> float | None:
        """How long the model has had no worker (None while it has one), stamping since
        when at the first call that finds it so and clearing that once one joins."""
        if self.workers:
            self.no_worker_since = None
            return None
        if self.no_worker_since is None:
            self.no_worker_since = now
        return now - self.no_worker_since


def _heap_first(entry: tuple[float, float, int, QueuedRequest], head: QueuedRequest) -> bool:
    """Whether a heap entry comes before the fifo lane's head, whose key is (its rank, inf,
    its seq): the fifo lane holds requests without deadline in arrival order, of priority
    0 (rank 0) or, with aging, of ranks that grow with arrival."""
    rank, deadline, seq, _ = entry
    if rank != head.rank:
        return rank < head.rank
    return deadline < math.inf or seq < head.seq


def oldest_first(model_queue: ModelQueue) -> list[ModelQueue]:
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
