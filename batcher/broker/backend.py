"""The broker's worker side: the backend ROUTER and what workers say on it (READY,
REPLY, CHUNK, HEARTBEAT, DISCONNECT), heartbeats to them, and what becomes of a lost
worker's batches and sequences. Every rule is the worker pool's (batcher/core/pool.py), the
scheduler's or batcher.core.streams'; this class reads and writes the socket and reports to
the stats."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import zmq

from batcher.broker.metrics import exemplar_of
from batcher.broker.stats import BrokerStats
from batcher.core.pool import WorkerInfo, WorkerPool, load_hung_message, worker_info
from batcher.core.scheduler import Batch, QueuedRequest, Scheduler
from batcher.core.streams import Sequence, Verdict
from batcher.transport.zmqio import readable, recv_frames, send_frames
from batcher.wire import protocol
from batcher.wire.frames import ReplyHeader
from batcher.wire.protocol import ErrorCode, WorkerProtocolError

log = logging.getLogger("batcher.broker")
#: The error message of a sequence its worker dropped unasked.
DROPPED_BY_WORKER = "the worker dropped the sequence"

#: Messages taken at once before the loop looks at the frontend and the timers...
DRAIN_LIMIT = 2000
#: ...or this much time, whichever comes first (see batcher.broker.loop).
DRAIN_BUDGET_S = 0.005
#: Budgets read before taking an unreachable worker for dead (its goodbye may be queued).
GOODBYE_READS = 10


class Backend:
    """Workers, as the broker's loop sees them; `deliver(envelope, body)` sends a reply
    to a client (False: the client is gone), `reply_error` and `fail_batch` answer
    requests with an error."""

    def __init__(
        self,
        sock: zmq.Socket[Any],
        scheduler: Scheduler,
        pool: WorkerPool,
        stats: BrokerStats,
        deliver: Callable[[list[bytes], bytes], bool],
        reply_error: Callable[[QueuedRequest, str, ErrorCode, str], None],
        fail_batch: Callable[[Batch, ErrorCode, str], None],
        deliver_batch: Callable[[list[QueuedRequest], list[Any], Any], None],
    ) -> None:
        self.sock = sock
        self.scheduler = scheduler
        self.pool = pool
        self.stats = stats
        self.deliver = deliver
        self.reply_error = reply_error
        self.fail_batch = fail_batch
        self.deliver_batch = deliver_batch
        #: Set by `serve`: kill the local worker process of this pid (a hung model).
        self.on_hung: Callable[[int], None] = lambda pid: None
        #: Set by `serve`: the worker process of this pid announced itself (READY).
        self.on_joined: Callable[[int], None] = lambda pid: None
        self.cache: Any = None  #: the response cache (batcher.broker.response_cache), or None
        self.tracer: Any = None  #: the broker's spans when tracing is on (batcher.observe), else None

    def drain(self, now: float) -> bool:
        """Handle what the workers sent, within one budget; True once read to the end. The
        first message is stamped `now` (the turn's), each next one the budget's clock read."""
        sock = self.sock
        budget_end = now + DRAIN_BUDGET_S
        for i in range(DRAIN_LIMIT):
            try:
                frames = recv_frames(sock, copied=4)
            except zmq.Again:
                self.pool.backend_read(now)
                return True
            try:
                self._on_worker_message(frames, now)
            except WorkerProtocolError as exc:  # a peer that is not a worker, or a broken one
                self.stats.dropped_backend += 1
                log.warning("dropped a malformed backend message (%d frames): %s", len(frames), exc)
            except Exception:  # a bug of ours, not the worker's
                self.stats.dropped_backend += 1
                log.exception("unexpected error handling a backend message (the broker goes on)")
            if i == 0 and not readable(sock):  # read to the end (zmqio.readable: after the first only)
                self.pool.backend_read(now)
                return True
            now = time.monotonic()  # not the turn's: a REPLY may have come since (frontend.drain)
            if now >= budget_end:
                return False
        return False

    def _on_worker_message(self, frames: list[bytes], now: float) -> None:
        if len(frames) < 3 or frames[1] != protocol.WORKER_PROTOCOL:
            raise WorkerProtocolError("not a batcher worker message")
        worker_id, command = frames[0], frames[2]
        if command == protocol.CMD_READY and len(frames) == 4:
            self._on_ready(worker_id, frames[3], now)
            return
        if worker_id not in self.pool:
            # Not a worker of ours (we restarted, or declared it dead): make it announce
            # itself again; whatever it sent is dropped.
            self.stats.dropped_backend += 1
            if command != protocol.CMD_DISCONNECT:
                self.send(worker_id, [protocol.WORKER_PROTOCOL, protocol.CMD_DISCONNECT])
            return
        self.pool.heard(worker_id, now)
        if command == protocol.CMD_REPLY:
            if len(frames) < 4:
                exc = WorkerProtocolError(f"REPLY must have a header, got {len(frames) - 1} frames")
                self._bad_reply(worker_id, exc)
                raise exc
            self._on_reply(worker_id, frames[3], frames[4:], now)
        elif command == protocol.CMD_CHUNK and len(frames) >= 4:
            self._on_chunk(worker_id, frames[3], frames[4:], now)
        elif command == protocol.CMD_DISCONNECT:
            log.info("worker %s left", self.pool.name(worker_id))
            # Its counters, as a HEARTBEAT's (6.5): the spans dropped since its last one.
            self.stats.worker_said(self.pool.info(worker_id), worker_id, frames[3:])
            self.lost(worker_id, "worker left", failed=False)
        elif command == protocol.CMD_HEARTBEAT:
            self.stats.worker_said(self.pool.info(worker_id), worker_id, frames[3:])
        else:
            raise WorkerProtocolError(f"unknown command {command!r} with {len(frames)} frames")

    def _on_ready(self, worker_id: bytes, info_frame: bytes, now: float) -> None:
        try:
            raw = protocol.unpack(info_frame)
        except Exception as exc:  # msgpack raises several unrelated types
            raise WorkerProtocolError(f"READY info is not valid msgpack: {exc!r}") from None
        try:
            info = worker_info(raw)
        except ValueError as exc:
            raise WorkerProtocolError(str(exc)) from None
        if worker_id in self.pool:  # announced again: whatever it held is lost
            self.lost(worker_id, "worker restarted during the batch")
        self.pool.joined(worker_id, info, raw.get("slots"), now)
        if self.cache is not None:
            self.cache.worker_said(info.models, raw)
        self.stats.metrics.worker_event(info.model, "joined")
        log.info("worker joined: %s", self.pool.name(worker_id))
        if info.warmup_error is not None:
            log.warning(
                "worker %s could not be warmed up (%s): no cost or time limit is derived from its "
                "warm-up; its model's first batch gets the first-batch time limit",
                self.pool.name(worker_id), info.warmup_error,
            )  # fmt: skip
        if type(info.pid) is int:
            self.on_joined(info.pid)
        # At once, not at the next tick: a worker started with other heartbeat flags
        # adopts the broker's before its silence could be taken for death.
        self.send(worker_id, [protocol.WORKER_PROTOCOL, protocol.CMD_HEARTBEAT, self.pool.heartbeat_frame])

    def _on_reply(self, worker_id: bytes, header_frame: bytes, bodies: list[Any], now: float) -> None:
        try:
            header = protocol.parse_reply_header(header_frame)
        except WorkerProtocolError as exc:
            self._bad_reply(worker_id, exc)
            raise
        batch_id, infer_ms, lengths, errors, wait_ms = header[:5]
        batch = self.scheduler.complete(worker_id, batch_id, infer_ms / 1000.0, now)
        if batch is None:
            self.stats.dropped_backend += 1
            log.warning("dropped a reply for unknown batch %r from %s", batch_id, self.pool.name(worker_id))
            return
        # Queue time as the client lives it: in the broker's queue, then in the worker's prefetch
        # until the model began. The worker counts from when it read the batch (it reads only
        # between batches), so the time since dispatch less the model time bounds it from above.
        in_worker_ms = max(wait_ms or 0.0, (now - batch.dispatched_at) * 1000.0 - infer_ms)
        requests = batch.requests
        try:
            if len(lengths) != len(requests):
                raise ValueError(f"{len(lengths)} replies for {len(requests)} requests")
            replies = protocol.split_bodies(lengths, bodies)
        except ValueError as exc:
            log.warning("malformed reply from worker %s: %s", self.pool.name(worker_id), exc)
            self.fail_batch(batch, ErrorCode.WORKER_FAILED, f"the worker sent a malformed reply: {exc}")
            return
        # The replies first, back to back; the batch's counts after.
        self.deliver_batch(requests, replies, errors)  # (kept by the response cache when none failed)
        count_answered(self, worker_id, batch, header, in_worker_ms, now)

    def _on_chunk(self, worker_id: bytes, header_frame: bytes, bodies: list[Any], now: float) -> None:
        """A step-level worker's chunks: each forwarded untouched to its client, in order;
        a final one frees the sequence's slot. A client found gone ends its sequence (the
        worker is told to stop it). A CHUNK that breaks the protocol takes its worker for
        broken: its sequences cannot be matched any more."""
        streams = self.pool.streams
        try:
            if worker_id not in streams:
                raise WorkerProtocolError("CHUNK from a worker that did not announce max_active")
            header = protocol.parse_chunk_header(header_frame)
            replies = protocol.split_bodies(header.lengths, bodies)
        except (WorkerProtocolError, ValueError) as exc:
            log.warning("malformed CHUNK from worker %s: %s", self.pool.name(worker_id), exc)
            self.lost(worker_id, f"the worker sent a malformed CHUNK: {exc}")
            raise WorkerProtocolError(str(exc)) from None
        streams.heard(worker_id, header.counters, now)
        deliver, stats = self.deliver, self.stats
        for seq_id, flag, body in zip(header.seq_ids, header.flags, replies, strict=True):
            verdict, seq = streams.on_chunk(worker_id, seq_id, flag, now)
            if seq is None:
                continue
            if verdict is Verdict.ABANDONED:
                stream_ended(self.tracer, seq, now, str(ErrorCode.WORKER_FAILED))
                self.reply_error(seq.request, seq.model, ErrorCode.WORKER_FAILED, DROPPED_BY_WORKER)
                continue
            delivered = deliver(seq.request.envelope, body)
            chunk_counted(stats, self.tracer, seq, now)
            if verdict is Verdict.DELIVER_FINAL:
                stream_ended(self.tracer, seq, now, _final_outcome(flag, body), stats)
            elif not delivered:  # the client is gone: nobody reads what comes next
                self.end_stream(seq, None, "client_gone")

    def end_stream(self, seq: Sequence, code: ErrorCode | None, reason: str, message: str = "") -> None:
        """The broker ends a sequence before its worker did: its client is answered `code`
        (None: it is gone), the worker told to stop, and the ending counted by `reason`."""
        if seq.answered:
            return
        held = self.pool.streams.answer(seq)
        stream_ended(self.tracer, seq, time.monotonic(), reason if code is None else str(code))
        if code is not None:
            self.reply_error(seq.request, seq.model, code, message)
        if held:
            self.send(seq.worker, protocol.cancel_frames([seq.seq_id]))
        self.stats.sequence_cancelled(seq.model, reason)

    def _bad_reply(self, worker_id: bytes, exc: WorkerProtocolError) -> None:
        """Do what the pool's rule (`WorkerPool.bad_reply`) says of a REPLY that breaks the protocol."""
        batch, broken = self.pool.bad_reply(worker_id, exc.batch_id)
        if batch is not None:
            self.fail_batch(batch, ErrorCode.WORKER_FAILED, f"the worker sent a malformed reply: {exc}")
        elif broken:
            log.warning("worker %s sent a reply naming no batch: taken for broken", self.pool.name(worker_id))
            self.lost(worker_id, f"the worker sent a malformed reply: {exc}")

    def heartbeat(self, now: float) -> None:
        """Tell every worker we live; take those silent past their liveness for dead (the
        backend is read first: a heartbeat that arrived while the loop was busy counts)."""
        if self.tracer is not None:
            self.tracer.flush()
        self.drain(now)
        for worker_id, silent_s in self.pool.silent():
            log.warning("worker %s silent for %.1fs: taken for dead", self.pool.name(worker_id), silent_s)
            self.lost(worker_id, f"worker silent for {silent_s:.1f}s")
        self.beat(now)

    def beat(self, now: float) -> None:
        """Send every worker a heartbeat; one whose connection is gone is taken for dead,
        unless its goodbye was waiting: libzmq refuses sends to a peer that closed its
        socket while that peer's last messages (a DISCONNECT, a REPLY) are still unread,
        so those are read before the peer is judged."""
        beat = [protocol.WORKER_PROTOCOL, protocol.CMD_HEARTBEAT, self.pool.heartbeat_frame]
        unreachable = [worker_id for worker_id in self.pool.ids() if not self.send(worker_id, beat)]
        for _ in range(GOODBYE_READS if unreachable else 0):
            if self.drain(now):  # a goodbye may wait behind other workers' replies
                break
        for worker_id in unreachable:
            if worker_id in self.pool:  # ROUTER_MANDATORY: the connection is gone (a crash)
                log.warning("worker %s disconnected: taken for dead", self.pool.name(worker_id))
                self.lost(worker_id, "worker disconnected")

    def send(self, worker_id: bytes, frames: list[bytes]) -> bool:
        try:
            send_frames(self.sock, [worker_id, *frames])
            return True
        except zmq.ZMQError:
            return False

    def check_time_limits(self, now: float, limit_s: float | None) -> None:
        """Take every worker whose batch ran past its time limit for hung (its heartbeats
        prove only that the process lives): it is told to exit (`serve` also kills its
        own), and its requests go back to their queue within their retries, each a
        suspect that runs alone from then on (the pool's rule for the batch blamed), but
        for a batch that hung loading its model: answered `worker_failed` at once."""
        for batch, limit in self.scheduler.hung_batches(now, limit_s):
            worker_id = batch.worker
            if worker_id not in self.pool:
                continue  # lost already, with another of its batches
            limit_ms = 1000.0 * limit
            log.warning(
                "worker %s: a batch of %d ran past its time limit (%.0f ms): taken for hung, told to exit",
                self.pool.name(worker_id), len(batch.requests), limit_ms,
            )  # fmt: skip
            why = f"its batch ran past the time limit of {limit_ms:.0f} ms (--batch-timeout-ms)"
            self._stop_hung(worker_id, why, blame=batch.batch_id)  # the batches behind it never began
        for w, limit in self.pool.streams.hung(min(now, self.pool.read_at), limit_s):
            if w.worker_id not in self.pool:
                continue
            limit_ms = 1000.0 * limit
            log.warning(
                "worker %s: no step ended within its time limit (%.0f ms): taken for hung, told to exit",
                self.pool.name(w.worker_id), limit_ms,
            )  # fmt: skip
            why = f"its step ran past the time limit of {limit_ms:.0f} ms (--batch-timeout-ms)"
            self._stop_hung(w.worker_id, why)

    def _stop_hung(self, worker_id: bytes, why: str, blame: int | None = None) -> None:
        """Tell a hung worker to exit (`serve` kills its own too) and take it for lost."""
        info = self.pool.info(worker_id)
        self.stats.batches_timed_out += 1
        self.send(worker_id, [protocol.WORKER_PROTOCOL, protocol.CMD_EXIT])
        if info is not None and isinstance(info.pid, int):
            self.on_hung(info.pid)
        self.lost(worker_id, why, blame=blame)

    def process_exited(self, pid: int, code: int | None, now: float) -> None:
        """`serve` saw the process of one of its workers exit: take that worker for dead now,
        so its batches move on without waiting for its silence to be noticed."""
        self.drain(now)  # its last REPLY or DISCONNECT may be waiting: read them first
        for worker_id in self.pool.ids():
            info = self.pool.info(worker_id)
            if info is not None and info.pid == pid:
                log.warning(
                    "worker %s: its process exited with code %s: taken for dead",
                    self.pool.name(worker_id),
                    code,
                )
                self.lost(worker_id, f"the worker's process exited with code {code}", failed=code != 0)

    def lost(self, worker_id: bytes, why: str, failed: bool = True, blame: int | None = None) -> None:
        """Forget a worker: the pool decides which of its requests go back to their queue
        and which have used up their retries (answered worker_failed)."""
        info = self.pool.info(worker_id)
        if info is not None:
            worker_gone(self.stats, self.cache, info, failed)
        self.stats.workers_lost += failed
        end_lost_spans(self.tracer, self.pool, worker_id, why, blame)
        lost = self.pool.lose(worker_id, failed, blame)
        self.stats.batches_retried += lost.batches_requeued
        for model, req in lost.failed:
            self.reply_error(req, model, ErrorCode.WORKER_FAILED, why)
        for model, req in lost.load_hung:
            self.reply_error(req, model, ErrorCode.WORKER_FAILED, load_hung_message(model, why))


def first_exemplar(seq: Sequence) -> dict[str, str] | None:
    """A stream's first chunk's exemplar: its queue span, when it is traced."""
    rt = seq.request.trace
    return exemplar_of(rt.queue) if seq.chunks == 1 and rt is not None else None


def chunk_counted(stats: BrokerStats, tracer: Any, seq: Sequence, now: float) -> None:
    """A chunk delivered: counted (the first one's time to first chunk with its exemplar),
    and the first one's time on the stream's span when it is traced."""
    first = seq.chunks == 1
    stats.chunk(seq.model, first, now - seq.request.arrived_at, now, first_exemplar(seq))
    if first and tracer is not None and seq.request.trace is not None:
        tracer.stream_chunk(seq.request.trace, now)


def stream_ended(
    tracer: Any,
    seq: Sequence,
    now: float,
    outcome: str,
    stats: BrokerStats | None = None,
    why: str | None = None,
) -> None:
    """A sequence was answered with `outcome` (counted in `stats` when its worker ended
    it): its stream span ends, with its chunks, when it is traced."""
    if stats is not None:
        stats.count(seq.model, outcome)
    if tracer is not None and seq.request.trace is not None:
        tracer.stream_ended(seq.request.trace, now, outcome, seq.chunks, why)


def worker_gone(stats: Any, cache: Any, info: WorkerInfo, failed: bool) -> None:
    """A worker died or left: counted (under its name: a multiplexed one's is the pool's),
    and the cached replies of each model it served dropped (batcher.broker.response_cache:
    a reload's old weights answer no more)."""
    stats.metrics.worker_event(info.model, "died" if failed else "left")
    if cache is not None:
        cache.worker_left(info.models)


def count_answered(
    backend: Backend, worker_id: bytes, batch: Batch, header: ReplyHeader, in_worker_ms: float, now: float
) -> None:
    """The counts of a batch whose replies went out (and its span's end), and what a
    multiplexed worker's load of its model cost and changed: the load and its unloads as
    the broker's own replay placed the batch (batcher.core.multiplex), its time as the
    worker says: a REPLY cannot count a load or an unload that replay did not make."""
    batch_id, infer_ms, _, errors, wait_ms, padding, refused, load = header
    tracer, arrivals = backend.tracer, [r.arrived_at for r in batch.requests]
    span = tracer and tracer.batch_answered(batch_id, now, infer_ms, wait_ms, padding, errors)
    backend.stats.batch_answered(
        batch.model, arrivals, batch.dispatched_at, wait_ms, infer_ms, in_worker_ms, errors, refused, padding,
        now, exemplar_of(span),
    )  # fmt: skip
    if load is not None:  # a multiplexed worker loaded the batch's model first
        backend.scheduler.held_by(worker_id, load[2], batch)
        if batch.cold:  # counted as the broker's replay has it: a REPLY cannot inflate them
            backend.stats.model_loaded(batch.model, load[0], batch.unloaded, backend.pool.info(worker_id))


def end_lost_spans(tracer: Any, pool: WorkerPool, worker_id: bytes, why: str, blame: int | None) -> None:
    """The spans of a lost worker's batches end, each with its event: the blamed one
    `batcher.hung_batch_killed`, the others `batcher.worker_lost` (their requests are
    re-dispatched, or answered worker_failed past their retries); so do those of its
    streams not answered yet (outcome worker_lost: each re-run elsewhere, in a stream span
    of its own, or answered worker_failed). Nothing without a tracer."""
    if tracer is None:
        return
    state = pool.scheduler.workers.get(worker_id)
    now = time.monotonic()
    for batch_id in list(state.in_flight) if state is not None else ():
        event = "batcher.hung_batch_killed" if batch_id == blame else "batcher.worker_lost"
        tracer.batch_failed(batch_id, now, event, why)
    step = pool.streams.worker(worker_id)
    for seq in step.unanswered() if step is not None else ():
        stream_ended(tracer, seq, now, "worker_lost", why=why)


def _final_outcome(flag: int, body: Any) -> str:
    """A final chunk's outcome for the counters: "ok", or its error's code (an error reply
    is small, and rare: reading it costs little)."""
    if flag == protocol.CHUNK_FINAL:
        return "ok"
    try:
        code = protocol.unpack(bytes(body))["error"]["code"]
    except Exception:  # msgpack raises several unrelated types; a body without the code
        return str(ErrorCode.MODEL_ERROR)
    return code if code in _WORKER_FINAL_CODES else str(ErrorCode.MODEL_ERROR)


#: The error codes a step-level worker may end a sequence with.
_WORKER_FINAL_CODES = frozenset(
    str(c) for c in (ErrorCode.MODEL_ERROR, ErrorCode.BAD_REQUEST, ErrorCode.DEADLINE_EXCEEDED)
)
