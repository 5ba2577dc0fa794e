"""The broker's rules about workers, apart from any socket: a sans-I/O core beside the
scheduler (no zmq, the time passed in), tested on a float clock (tests/unit/core/test_pool.py).

- **Liveness.** A worker is alive while it has been heard from within its heartbeat
  expiry, counted up to the last time the broker read its backend to the end: a worker
  whose messages arrived while the broker was busy is never taken for dead for it.
- **Lost workers.** A worker that failed (it crashed, hung or fell silent) was running
  one batch, its first (batches run in the order sent), or the one that hung: each of
  that batch's requests costs an attempt and becomes a suspect, which runs alone from
  then on (batcher.core.policy.batch_requests), so that a request that kills every worker it meets
  takes none of its batch-mates with it again. The batches behind it, which the worker
  had not begun, are handed back as by a worker that left on its own (DISCONNECT):
  free the first time only; a batch (or a step-level worker's sequence) the broker could
  not send it at all (its connection was gone) goes back free. A request whose attempts
  reach `max_retries` is answered `worker_failed`; the others go back to their queue,
  ahead of later arrivals.
- **A load that hung.** A multiplexed worker's batch that had to load its model first
  (`Batch.cold`) and hung is not re-dispatched: the load would most likely hang the next
  worker too, and keep its clients (and that worker's other models) waiting as long
  again. Its requests are answered `worker_failed` at once (`load_hung_message`).
- **Lost sequences.** A step-level worker's sequences follow batcher.core.streams: one
  that has sent no chunk is a request like any other here (retried, or answered
  `worker_failed` past its retries); one that has sent a chunk is answered
  `worker_failed` at once.
- **Admission.** A request for a model whose every worker failed to start, or that has
  had no worker for the scheduler's `no_worker_timeout_s`, is refused at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from batcher.core.multiplex import LOAD_LIMIT_S, Catalog
from batcher.core.queue import Batch, QueuedRequest
from batcher.core.scheduler import Scheduler
from batcher.core.streams import Streams
from batcher.wire.codes import MAX_ACTIVE, MAX_REPORTED_MS, ErrorCode, clip
from batcher.wire.frames import MAX_WARMUP_ERROR_CHARS, Heartbeat
from batcher.wire.signature import Signature


class WorkerInfo(NamedTuple):
    """What a worker said of itself in READY, for logs, stats and reloads."""

    model: str
    gpu: object
    pid: object
    signature: Signature | None = None
    cost_ms: tuple[float, float] | None = None  # t(n) = a + b*n its warm-up measured
    max_active: int | None = None  # a step-level worker's credit: the sequences it holds at once
    warmup_error: str | None = None  # why its warm-up failed: it announced no cost
    catalog: Catalog | None = None  # a multiplexed worker's models and budget
    signatures: dict[str, Signature] | None = None  # and their signatures, by model

    def signature_of(self, model: str) -> Signature | None:
        """The signature this worker announced for `model` (None: none, or not its model)."""
        if self.catalog is None:
            return self.signature if self.model == model else None
        return None if self.signatures is None else self.signatures.get(model)

    def serves(self, model: str) -> bool:
        return self.model == model if self.catalog is None else model in self.catalog.sizes_mb

    @property
    def models(self) -> tuple[str, ...]:
        """The models it serves: its own, or each of its catalog (not the pool's name,
        POOL_NAME, which no request names)."""
        return (self.model,) if self.catalog is None else tuple(self.catalog.sizes_mb)

    @property
    def warmup(self) -> str | None:
        """What its warm-up gave: "measured" (cost_ms), "failed: WHY", or None (none ran)."""
        if self.cost_ms is not None:
            return "measured"
        return None if self.warmup_error is None else f"failed: {self.warmup_error}"

    def name(self, worker_id: bytes) -> str:
        """`model/gpuN/pidP/idHEX`: the worker's name in logs and stats."""
        gpu = "-" if self.gpu is None else self.gpu
        return f"{self.model}/gpu{gpu}/pid{self.pid}/id{worker_id.hex()}"

    def public_name(self, worker_id: bytes) -> str:
        """`model/gpuN/idHEX`: the name without the pid, for a client that is no admin."""
        gpu = "-" if self.gpu is None else self.gpu
        return f"{self.model}/gpu{gpu}/id{worker_id.hex()}"


@dataclass
class Lost:
    """What a lost worker leaves behind: requests to answer `worker_failed` (with their
    model), and how many of its batches went back to a queue."""

    failed: list[tuple[str, QueuedRequest]] = field(default_factory=list)
    batches_requeued: int = 0
    #: The requests of a batch that hung loading its model: answered `worker_failed`
    #: with `load_hung_message`, never re-dispatched.
    load_hung: list[tuple[str, QueuedRequest]] = field(default_factory=list)


class BadReply(NamedTuple):
    """What a REPLY that breaks the protocol costs: the batch it named, to fail (None: it
    named none of this worker's), and whether its worker is taken for broken."""

    batch: Batch | None
    broken: bool


class WorkerPool:
    """The live workers of one broker, and the rules above."""

    def __init__(
        self,
        scheduler: Scheduler,
        heartbeat: Heartbeat,
        max_retries: int,
        now: float,
        streams: Streams | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.streams = streams if streams is not None else Streams()
        self.heartbeat = heartbeat
        self.heartbeat_frame = heartbeat.frame()  # what every HEARTBEAT to a worker carries
        self.max_retries = max_retries
        self._heard_at: dict[bytes, float] = {}  # worker -> when it last said anything
        self._info: dict[bytes, WorkerInfo] = {}  # in the order the workers joined
        self._backend_read_at = now
        self._failed_models: dict[str, str] = {}  # model -> why no worker of it can start
        # model -> the signature its requests are checked against, for a model with a live
        # worker (never refused then): what `admission` answers per request without a walk
        # of the workers; emptied whenever a worker joins or is lost, or a model fails.
        self._admitted: dict[str, Signature | None] = {}

    # --- who is there ---------------------------------------------------------------------

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._heard_at

    def signature(self, model: str) -> Signature | None:
        """The signature the model's newest live worker announced (None if it announced
        none): a reload may change the model, and a worker gone says nothing any more."""
        for info in reversed(self._info.values()):
            if info.serves(model):
                return info.signature_of(model)
        return None

    def warmup(self, model: str) -> str | None:
        """What the warm-up of the model's newest live worker gave (WorkerInfo.warmup)."""
        for info in reversed(self._info.values()):
            if info.model == model:
                return info.warmup
        return None

    def info(self, worker_id: bytes) -> WorkerInfo | None:
        return self._info.get(worker_id)

    def name(self, worker_id: bytes) -> str:
        info = self._info.get(worker_id)
        return info.name(worker_id) if info else f"id{worker_id.hex()}"

    def public_name(self, worker_id: bytes) -> str:
        """name() without the worker's pid (WorkerInfo.public_name)."""
        info = self._info.get(worker_id)
        return info.public_name(worker_id) if info else f"id{worker_id.hex()}"

    def ids(self) -> list[bytes]:
        """Every live worker, in a list the caller may lose workers from while it goes."""
        return list(self._heard_at)

    def workers_of(self, model: str) -> list[tuple[bytes, WorkerInfo]]:
        """(id, info) of each live worker of `model`."""
        return [(w, info) for w, info in self._info.items() if info.model == model]

    # --- events -----------------------------------------------------------------------------

    def joined(self, worker_id: bytes, info: WorkerInfo, slots: int | None, now: float) -> None:
        """READY from a worker not in the pool (one announcing itself again is `lose`t first)."""
        step = info.max_active is not None
        self.scheduler.add_worker(worker_id, info.model, slots, step=step, catalog=info.catalog)
        if info.max_active is not None:
            self.streams.add_worker(worker_id, info.model, info.max_active)
        if info.cost_ms is not None and info.catalog is None:  # its warm-up: the cost is known at once
            self.scheduler.seed_cost(info.model, info.cost_ms[0] / 1000.0, info.cost_ms[1] / 1000.0)
        self._heard_at[worker_id] = now
        self._info[worker_id] = info
        for model in info.models:
            self._failed_models.pop(model, None)
        self._admitted.clear()

    def heard(self, worker_id: bytes, now: float) -> None:
        """Any message of a known worker: a sign of life."""
        self._heard_at[worker_id] = now

    def backend_read(self, started_at: float) -> None:
        """The backend was read to its end, in a read that began at `started_at`: every
        worker message that arrived before then has been seen."""
        self._backend_read_at = started_at

    @property
    def read_at(self) -> float:
        """When the broker's last read of its backend to the end began."""
        return self._backend_read_at

    def stalled(self, by_s: float) -> None:
        """The broker did not run for `by_s` (batcher.core.stalls): it heard no worker
        then and watched none, so their silence and their batches' and steps' time
        limits skip that time."""
        for worker_id, at in self._heard_at.items():
            self._heard_at[worker_id] = at + by_s
        for batch in self.scheduler.in_flight():
            batch.expected_start += by_s
        self.streams.stalled(by_s)

    def silent(self) -> list[tuple[bytes, float]]:
        """(worker, seconds of silence) of each worker past its liveness."""
        read_at, expiry = self._backend_read_at, self.heartbeat.expiry_s
        return [(w, read_at - at) for w, at in self._heard_at.items() if read_at - at > expiry]

    def lose(self, worker_id: bytes, failed: bool, blame: int | None = None) -> Lost:
        """Forget a worker; requeue its batches' requests or fail them (module docstring).
        `blame` names the batch that failed it when that is known (one that hung: if that
        batch had to load its model first, its requests are `load_hung`); by default a
        failed worker's running batch is blamed: the first it was sent. A batch or a
        sequence marked `unsent` never reached it: it goes back free."""
        hung = failed and blame is not None
        self._heard_at.pop(worker_id, None)
        self._info.pop(worker_id, None)
        self._admitted.clear()
        lost = Lost()
        batches = self.scheduler.remove_worker(worker_id)
        if failed and blame is None:
            blame = next((b.batch_id for b in batches if not b.unsent), None)
        for batch in batches:
            if batch.unsent:
                lost.batches_requeued += 1
                self.scheduler.requeue(batch.model, batch.requests, count_attempt=False)
            elif hung and batch.batch_id == blame and batch.cold:
                lost.load_hung.extend((batch.model, req) for req in batch.requests)
            else:
                self._hand_back(batch, failed and batch.batch_id == blame, lost)
        retry: list[tuple[str, QueuedRequest]] = []
        for seq in self.streams.remove_worker(worker_id):
            # One that sent a chunk cannot start over: its client holds part of an answer.
            if seq.unsent or (not seq.chunks and self._retries(seq.request, failed)):
                retry.append((seq.model, seq.request))
            else:
                lost.failed.append((seq.model, seq.request))
        if retry:
            lost.batches_requeued += 1
            self.scheduler.requeue(retry[0][0], [req for _, req in retry], count_attempt=False)
        return lost

    def _retries(self, req: QueuedRequest, failed: bool) -> bool:
        """Whether a request of a lost worker goes back to its queue (counting the attempt
        it cost), or has used up its retries."""
        costs_attempt = failed or req.handbacks > 0
        req.handbacks += not failed
        if costs_attempt and req.attempts >= self.max_retries:
            return False
        req.attempts += costs_attempt
        return True

    def _hand_back(self, batch: Batch, failed: bool, lost: Lost) -> None:
        """Requeue or fail a lost worker's batch; `failed`: the batch that failed it, whose
        requests are suspects from now on."""
        retry: list[QueuedRequest] = []
        for req in batch.requests:
            req.suspect += failed
            if self._retries(req, failed):
                retry.append(req)
            else:
                lost.failed.append((batch.model, req))
        if retry:
            lost.batches_requeued += 1
            self.scheduler.requeue(batch.model, retry, count_attempt=False)

    # --- admission --------------------------------------------------------------------------

    def bad_reply(self, worker_id: bytes, batch_id: int | None) -> BadReply:
        """A REPLY from `worker_id` broke the protocol. It fails the batch it names, if that
        is one of this worker's. One that names none can be matched to nothing: a worker
        holding batches is then taken for broken (they go elsewhere, their clients never
        left waiting); one holding none has nothing to lose, and only the message is dropped."""
        batch = None if batch_id is None else self.scheduler.complete(worker_id, batch_id)
        if batch is not None:
            return BadReply(batch, broken=False)
        return BadReply(None, broken=batch_id is None and bool(self.scheduler.held(worker_id)))

    def model_failed(self, model: str, why: str) -> list[tuple[str, QueuedRequest]]:
        """No worker of `model` can start: its queued requests (returned, to be answered
        `worker_failed`) and new ones are refused until a worker of it joins after all."""
        self._failed_models[model] = why
        self._admitted.clear()
        return self.scheduler.cancel(lambda r: True, model)

    def admission(self, model: str, now: float) -> tuple[tuple[ErrorCode, str] | None, Signature | None]:
        """`refusal(model, now)` and `signature(model)` at once, for every request: kept for a
        model that has a live worker (so no refusal) until a worker joins or is lost."""
        signature = self._admitted.get(model, _UNKNOWN)
        if signature is not _UNKNOWN:
            return None, signature
        refusal, signature = self.refusal(model, now), self.signature(model)
        if refusal is None and self.scheduler.has_workers(model):
            self._admitted[model] = signature
        return refusal, signature

    def refusal(self, model: str, now: float) -> tuple[ErrorCode, str] | None:
        """Why a request for `model` must be refused at once, or None to queue it."""
        if model in self._failed_models and not self.scheduler.has_workers(model):
            return ErrorCode.WORKER_FAILED, self._failed_models[model]
        without_s = self.scheduler.without_worker_s(model, now)
        if without_s is not None:
            return ErrorCode.UNAVAILABLE, self.unavailable_message(model, without_s)
        return None

    def unavailable_message(self, model: str, without_s: float) -> str:
        limit_ms = self.scheduler.no_worker_timeout_s * 1000.0
        return f"model {model!r} has had no worker for {without_s:.1f}s (--no-worker-timeout-ms {limit_ms:g})"


def load_hung_message(model: str, why: str) -> str:
    """What the clients of a batch that hung loading its model are told (`why`: the time
    limit it ran past)."""
    return (
        f"model {model!r} hung while loading: {why}, {LOAD_LIMIT_S:g} s of it for the load; "
        "not retried on another worker"
    )


#: What `WorkerPool.admission` finds for a model it keeps nothing for.
_UNKNOWN: Any = object()


def worker_info(info: Any) -> WorkerInfo:
    """A READY's info map as WorkerInfo; ValueError for a map no worker sends."""
    model, slots = (info.get("model"), info.get("slots")) if isinstance(info, dict) else (None, None)
    if not isinstance(model, str) or not model or not (slots is None or type(slots) is int):
        raise ValueError(f"bad READY info {clip(info, 200)}")
    raw = info.get("signature")
    try:
        signature = None if raw is None else Signature.from_wire(raw)
    except ValueError as exc:
        raise ValueError(f"bad READY signature: {exc}") from None
    cost = info.get("cost_ms")
    if cost is not None and not (
        isinstance(cost, list)
        and len(cost) == 2
        and all(
            isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v <= MAX_REPORTED_MS for v in cost
        )
    ):
        raise ValueError(
            f"bad READY cost_ms: must be [a, b], two numbers in [0, one day], got {clip(cost, 120)}"
        )
    cost_ms = None if cost is None else (float(cost[0]), float(cost[1]))
    max_active = info.get("max_active")
    if max_active is not None and not (type(max_active) is int and 1 <= max_active <= MAX_ACTIVE):
        raise ValueError(
            f"bad READY max_active: must be an int in [1, {MAX_ACTIVE}], got {clip(max_active, 120)}"
        )
    warmup_error = info.get("warmup_error")
    if warmup_error is not None and not isinstance(warmup_error, str):
        raise ValueError(f"bad READY warmup_error: must be a str, got {clip(warmup_error, 150)}")
    if warmup_error is not None:
        warmup_error = warmup_error[:MAX_WARMUP_ERROR_CHARS]
    raw_catalog = info.get("multiplexed")
    try:
        catalog = None if raw_catalog is None else Catalog.from_wire(raw_catalog)
    except ValueError as exc:
        raise ValueError(f"bad READY multiplexed: {exc}"[:300]) from None
    if catalog is not None and max_active is not None:
        raise ValueError("bad READY: a step-level worker cannot be multiplexed")
    signatures = _signatures(info.get("signatures"), catalog)
    return WorkerInfo(
        model,
        info.get("gpu"),
        info.get("pid"),
        signature,
        cost_ms,
        max_active,
        warmup_error,
        catalog,
        signatures,
    )


def _signatures(raw: Any, catalog: Catalog | None) -> dict[str, Signature] | None:
    """A multiplexed READY's `signatures` (model -> wire signature, each of its catalog);
    ValueError for anything else."""
    if raw is None:
        return None
    if catalog is None or not isinstance(raw, dict) or not set(raw) <= set(catalog.sizes_mb):
        raise ValueError(
            f"bad READY signatures: a map of the multiplexed models' signatures, got {clip(raw, 200)}"
        )
    try:
        return {model: Signature.from_wire(sig) for model, sig in raw.items()}
    except ValueError as exc:
        raise ValueError(f"bad READY signatures: {exc}"[:300]) from None
