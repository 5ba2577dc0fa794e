"""When a model's batch is due, and for which worker: pure functions of its queue, its
workers and the time (the broker passes `now`; nothing here reads a clock).

- `window`: a batch goes to a worker with a free slot as soon as `max_batch_size`
  requests wait, or when the oldest has waited `max_wait_ms`;
- `adaptive`: the same two triggers, and besides, an idle worker takes the queue at
  once unless waiting for the next arrival is expected to lower latency, judged from the
  model's learned batch cost t(n) = a + b*n and its arrival rate (batcher.core.cost_model);
- either policy cuts a batch early rather than let a queued request miss its deadline by
  waiting.

A new policy is a value of `Policy` (batcher.core.limits) and its rule here; its property
tests go in tests/unit/core/test_scheduler_policy.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from batcher.core.cost_model import CostModel
from batcher.core.limits import FIRST_BATCH_LIMIT_S, MIN_BATCH_LIMIT_S, Policy
from batcher.core.multiplex import LOAD_LIMIT_S
from batcher.core.queue import Batch, ModelQueue, QueuedRequest, WorkerState, oldest_first

#: adaptive: unbatched work must exceed this many times the workers' capacity before the
#: policy waits to build bigger batches (below it, a lone closed-loop client never waits).
HEAVY_LOAD = 1.2
#: adaptive: under heavy load, batches are sized so that workers are busy this share of time.
TARGET_BUSY = 0.8
#: The most models that only workers announced, none serving them now, the broker keeps
#: (forget_unserved): past it the oldest are forgotten at once.
MAX_UNSERVED_MODELS = 1024
#: A deadline-bound batch is cut this long before it would have to start, at the latest.
DEADLINE_MARGIN_S = 0.001
#: adaptive: a partial batch waits for a busy worker's prefetch slot until that worker is
#: expected to be done plus this much (its reply's trip back), not just max_wait_ms.
PREFETCH_GRACE_S = 0.0005

__all__ = [
    "DEADLINE_MARGIN_S",
    "HEAVY_LOAD",
    "MAX_UNSERVED_MODELS",
    "PREFETCH_GRACE_S",
    "TARGET_BUSY",
    "batch_requests",
    "default_limit_s",
    "due_at",
    "fill_time_if_load_needs_bigger_batches",
    "forget_unserved",
    "gap_if_waiting_pays",
    "hung_batches",
    "least_recently_used",
    "next_wakeup",
    "oldest_first",
    "pick_worker",
    "unavailable",
    "usable",
    "wait_until",
    "without_worker_s",
    "worker_left",
]


def next_wakeup(
    models: Iterable[ModelQueue], workers: dict[bytes, WorkerState], no_worker_timeout_s: float
) -> float | None:
    """The earliest time at which something may become due without any new event."""
    best = math.inf
    for model_queue in models:
        since = model_queue.no_worker_since
        for mq in model_queue.lanes():
            if mq.deadlines:
                dl = mq.earliest_deadline()
                if dl is not None:
                    best = min(best, dl)
            if mq.size and not mq.workers and since is not None and no_worker_timeout_s:
                best = min(best, since + no_worker_timeout_s)
            if mq.size:
                best = min(best, due_at(mq, workers))
    return None if best == math.inf else best


def due_at(mq: ModelQueue, workers: dict[bytes, WorkerState]) -> float:
    """When a model's waiting requests are cut into a batch at the latest, given its
    workers' free slots (inf without one): its window, or a recheck of adaptive's;
    adaptive sends a partial batch to a busy worker's prefetch slot only once that
    worker is expected to be done (pick_worker)."""
    free = usable(mq, workers)
    if mq.suspects and mq.peek().suspect:  # a suspect goes to an idle worker only
        free = [w for w in free if not w.in_flight]
    if not free:
        return math.inf
    due = wait_until(mq)
    if mq.settings.policy is not Policy.WINDOW and all(w.in_flight for w in free):
        due = max(due, min(w.busy_until() for w in free) + PREFETCH_GRACE_S)
    return min(due, mq.recheck_at)


def wait_until(mq: ModelQueue) -> float:
    """The latest time the queue's head batch may wait for more requests."""
    oldest = mq.oldest()
    assert oldest is not None
    t = oldest.arrived_at + mq.settings.max_wait_s
    dl = mq.earliest_deadline()
    if dl is not None:  # leave time to run the batch before the earliest deadline
        t = min(t, dl - mq.cost.predict(mq.settings.cut_size(mq.size)) - DEADLINE_MARGIN_S)
    return t


def pick_worker(mq: ModelQueue, workers: dict[bytes, WorkerState], now: float) -> WorkerState | None:
    """The worker the next batch goes to now, or None if the queue should wait (then
    `mq.recheck_at` says until when, at the latest, when adaptive chose to wait)."""
    idle: list[WorkerState] = []
    prefetching: list[WorkerState] = []
    for w in usable(mq, workers):
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
    if full or now >= wait_until(mq):
        if idle:
            return _idle_choice(idle, mq.name)
        first = min(prefetching, key=WorkerState.busy_until)
        if full or s.policy is Policy.WINDOW or now >= first.busy_until() + PREFETCH_GRACE_S:
            return first
        return None  # adaptive: a partial batch sent now would only wait in the worker
    if not idle or s.policy is Policy.WINDOW:
        return None
    # adaptive: an idle worker takes the queue now unless waiting should pay
    gap = fill_time_if_load_needs_bigger_batches(mq, now)
    if gap is None:
        gap = gap_if_waiting_pays(mq, workers, len(idle), now)
    if gap is None or now + gap <= now:  # a wait too short to tell from now is none
        return _idle_choice(idle, mq.name)
    mq.recheck_at = now + gap  # no arrival by then: the rate estimate has dropped
    return None


def unavailable(
    models: dict[str, ModelQueue], timeout_s: float, now: float
) -> list[tuple[str, QueuedRequest, float]]:
    """Remove and return, with how long their model has had no worker, the queued
    requests of every model that has had none for `timeout_s` (0: never). Also where "no
    worker since" is stamped, so call it every turn."""
    out: list[tuple[str, QueuedRequest, float]] = []
    for name, mq in models.items():
        without_s = mq.stamp_no_worker(now)
        if without_s is not None and mq.total() and timeout_s and without_s >= timeout_s:
            out.extend((name, req, without_s) for req in mq.discard_all())
    return out


def worker_left(
    models: dict[str, ModelQueue], unserved: dict[str, None], worker_id: bytes, names: Iterable[str]
) -> None:
    """A worker of `names` is gone: each model only workers announced (`announced`) that it
    leaves without one becomes the newest candidate of `forget_unserved`."""
    for name in names:
        mq = models[name]
        mq.workers.pop(worker_id, None)
        if mq.announced and not mq.workers:
            unserved[name] = unserved.pop(name, None)  # (moved to the end if it was there)


def forget_unserved(
    models: dict[str, ModelQueue], unserved: dict[str, None], timeout_s: float, now: float
) -> list[str]:
    """Remove from `models`, and return, the models that no configuration named and that only
    workers announced (a catalog of up to 1024 at each READY), once they have no worker and
    nothing of theirs is queued: when they have had none for `timeout_s` (a request for them
    would be refused `unavailable` by then; 0: never for time alone), and at once, oldest
    first, past MAX_UNSERVED_MODELS of them. A worker announcing ever new names must not grow
    the broker without bound, and a model whose worker restarts keeps its queue meanwhile.
    `unserved`: the candidates, in the order they lost their last worker (`worker_left`)."""
    if not unserved:
        return []
    over = len(unserved) - MAX_UNSERVED_MODELS
    done: list[str] = []  # candidates no more: served again, configured since, or forgotten
    forgotten: list[str] = []
    for name in unserved:
        mq = models[name]
        if mq.workers or not mq.announced:
            done.append(name)
            over -= 1
            continue
        without_s = mq.stamp_no_worker(now)
        if over <= 0 and not (timeout_s and without_s is not None and without_s >= timeout_s):
            break  # the others lost their worker later still
        if not mq.total():  # (what is queued is refused `unavailable` past timeout_s, or expires)
            done.append(name)
            forgotten.append(name)
            over -= 1
    for name in done:
        del unserved[name]
    for name in forgotten:
        del models[name]
    return forgotten


def without_worker_s(mq: ModelQueue | None, timeout_s: float, now: float) -> float | None:
    """How long a model has had no worker, if past `timeout_s` (a request for it is then
    refused at once); None otherwise."""
    if mq is None or mq.workers or mq.no_worker_since is None or not timeout_s:
        return None
    without_s = now - mq.no_worker_since
    return without_s if without_s >= timeout_s else None


def usable(mq: ModelQueue, workers: dict[bytes, WorkerState]) -> list[WorkerState]:
    """The model's workers with a free slot that its next batch may go to. A multiplexed
    model's (batcher.core.multiplex) are those holding it, while any does: one that
    would have to load it is taken only when none holds it, or when its queue holds two
    full batches more than they take (then the model spreads to a worker more)."""
    free = [workers[w] for w in mq.workers if workers[w].free_slots > 0]
    if all(w.resident is None for w in free):
        return free
    if not any(_holds(workers[w], mq.name) for w in mq.workers):
        return free
    warm = [w for w in free if _holds(w, mq.name)]
    if warm or mq.size < 2 * mq.settings.max_batch_size:
        return warm
    return free


def _holds(w: WorkerState, model: str) -> bool:
    """Whether `w` runs `model` without loading it: a worker of that model alone does."""
    return w.resident is None or model in w.resident


def fill_time_if_load_needs_bigger_batches(mq: ModelQueue, now: float) -> float | None:
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


def gap_if_waiting_pays(
    mq: ModelQueue, workers: dict[bytes, WorkerState], idle_workers: int, now: float
) -> float | None:
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
        w = workers[wid]
        if w.in_flight:
            first_free = min(first_free, max(now, w.busy_until()))
    gain = (first_free + a + b) - (now + gap + a + b * (n + 1))
    return gap if gain > n * (gap + b) else None


def batch_requests(mq: ModelQueue) -> list[QueuedRequest]:
    """The next batch's requests, taken out in scheduling order: cut_size of them, fewer
    when their costs would pass max_batch_cost (the first is always taken), or before a
    request whose batch killed or hung its worker before: such a suspect runs alone,
    so that a poison request takes none of its batch-mates down with it again."""
    s = mq.settings
    n = s.cut_size(mq.size)
    cap = s.max_batch_cost
    if cap is None and not mq.suspects:
        return mq.pop_many(n)
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
        mq.put_back(back, count_attempt=False)
    return requests


def hung_batches(
    workers: Iterable[WorkerState], now: float, limit_s: float | None, default: Callable[[Batch], float]
) -> list[tuple[Batch, float]]:
    """(batch, its limit) of each worker's running batch (its first: batches run in the
    order sent) that ran past its time limit, counted from when the worker should have
    begun it: `limit_s`, or by default `default(batch)`."""
    out = []
    for w in workers:
        if not w.in_flight:
            continue
        batch = next(iter(w.in_flight.values()))
        limit = limit_s if limit_s is not None else default(batch)
        if batch.cold:  # its worker loads a model first (batcher.core.multiplex)
            limit += LOAD_LIMIT_S
        if now > batch.expected_start + limit:
            out.append((batch, limit))
    return out


def default_limit_s(cost: CostModel, requests: list[QueuedRequest]) -> float:
    """10 x a batch's cost bound n x t(1) (no model takes longer per item in a batch
    than alone; t(n) = a + b*n extrapolated from one batch size could say much less),
    or 10 x its expected time from its summed request cost when the model's time is
    learned over cost (a costly request takes longer than an average one), at least
    MIN_BATCH_LIMIT_S; FIRST_BATCH_LIMIT_S before any batch of the model was answered
    (a first batch may load weights or compile kernels)."""
    if not cost.known:
        return FIRST_BATCH_LIMIT_S
    n = len(requests)
    expected = max(n * cost.predict(1), cost.predict(n, sum(r.cost for r in requests)))
    return max(10.0 * expected, MIN_BATCH_LIMIT_S)


def least_recently_used(w: WorkerState) -> int:
    return w.last_used


def _idle_choice(idle: list[WorkerState], model: str) -> WorkerState:
    """The least recently used idle worker; for a multiplexed model none of them holds,
    one with room for it (that unloads nothing) before the others."""
    if idle[0].resident is None:
        return min(idle, key=least_recently_used)
    return min(idle, key=lambda w: (w.resident is not None and not w.resident.room_for(model), w.last_used))
