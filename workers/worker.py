"""A model-worker process: one DEALER, one model, one (simulated) GPU.

It announces itself with READY, then runs every BATCH it receives through the model
and answers with one REPLY holding a finished reply body per request, so the broker
forwards them to clients without touching them. A socket monitor tells it when the
broker refuses its handshake (a CURVE key not listed, plaintext against CURVE): it
then says why, and tries again with back-off.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import signal
import socket
import stat
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import zmq

from batcher.client.sync import HANDSHAKE_FAILED, ConnectionWatch
from batcher.core.link import Backoff, Beat, Drop, GiveUp, PeerLink, Reconnect
from batcher.extras import extra_of, install_command
from batcher.transport.allocator import TRIM_INTERVAL_S, heap_trimmer, keep_freed_memory
from batcher.transport.security import secure_client
from batcher.transport.stopping import StopSignals, ignore_stop_signals
from batcher.transport.zmqio import readable, recv_frames, send_frames
from batcher.wire import protocol, tensor
from batcher.wire.protocol import Heartbeat
from batcher.wire.signature import signature_of
from workers import warmup
from workers.batch_runner import (  # re-exported: workers.worker.run_batch is the documented name
    MalformedBatch,
    ModelOutcome,
    PreparedBatch,
    _decode_request,
    _decode_requests,
    _failed_batch,
    _prepare_tensors,
    _prepared_or_error,
    _run_safely,
    call_model,
    finish_batch,
    prepare_batch,
    run_batch,
)
from workers.models import (
    MAX_PADDED_ELEMENTS,
    ModelFn,
    ModelSpec,
    SimSettings,
    check_max_padded_elements,
    load_model,
)
from workers.overlap import ModelThread
from workers.placement import pin_to
from workers.steps import BATCHING_LEVELS, BatchingLevel, StepRunner, is_step_model

log = logging.getLogger("batcher.worker")
R = TypeVar("R")

#: Back-off between attempts to reach a broker that stopped answering (seconds).
RECONNECT_MIN_S = 0.25
RECONNECT_MAX_S = 8.0
RECONNECT_BACKOFF = Backoff(initial_s=RECONNECT_MIN_S, cap_s=RECONNECT_MAX_S)
#: A refused handshake is logged at WARNING once, then again at most this often (DEBUG between).
REFUSAL_LOG_EVERY_S = 60.0
#: How long a step-level worker waits at a time for its socket to take a CHUNK (ms).
OUTBOX_WAIT_MS = 10
#: Batches with a model thread at once (workers/overlap.py): the one it runs and the next.
OVERLAP_BATCHES = 2
#: Exit code of a worker given an address it cannot connect to (sysexits.h EX_USAGE).
EXIT_BAD_ADDRESS = 64


@dataclass(frozen=True)
class WorkerSettings:
    """Everything a worker process needs; the CLI builds one of these."""

    connect: str = "tcp://127.0.0.1:5556"
    model: str = "sim"
    gpu: int | None = None
    sim: SimSettings = field(default_factory=SimSettings)
    parent_pid: int | None = None
    heartbeat: Heartbeat = field(default_factory=Heartbeat)
    curve_server_key: str | None = None  # the broker's public key file: turns CURVE on
    curve_secret_key: str | None = None  # this worker's key pair (.key_secret)
    threads: int | None = None  # an ONNX session's intra-op threads; None: every core
    #: Before READY, run the model at these batch sizes on zero inputs of its signature
    #: and announce the fitted cost (workers/warmup.py); () skips it (--no-warmup).
    warmup_sizes: tuple[int, ...] = (1, 2, 4, 8)
    #: A step-level model's most sequences at once: its credit at the broker.
    max_active: int = 32
    #: When a step-level model admits new sequences (workers/steps.py): "step", between
    #: any two steps; "request", once all it holds have ended (the baseline).
    batching_level: str = BatchingLevel.STEP.value
    #: The CPUs this worker and every thread it starts run on (--cpus); None: not pinned.
    cpus: tuple[int, ...] | None = None
    #: The most elements a stacked model's padded batch may hold (workers/stacking.py).
    max_padded_elements: int = MAX_PADDED_ELEMENTS
    #: A JSON file of one request's input for the warm-up (--warmup-sample); None: the
    #: model's own warmup_sample, else zeros of its signature.
    warmup_sample: str | None = None

    def __post_init__(self) -> None:
        ModelSpec.parse(self.model)  # raises with a precise message
        if type(self.max_active) is not int or not 1 <= self.max_active <= protocol.MAX_ACTIVE:
            raise ValueError(
                f"max_active must be an int in [1, {protocol.MAX_ACTIVE}], got {self.max_active!r}"
            )
        if self.batching_level not in BATCHING_LEVELS:
            raise ValueError(
                f"batching_level must be one of {', '.join(BATCHING_LEVELS)}, got {self.batching_level!r}"
            )
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads_per_worker must be >= 1, got {self.threads}")
        if not all(type(n) is int and n >= 1 for n in self.warmup_sizes):
            raise ValueError(f"warmup sizes must be ints >= 1, got {list(self.warmup_sizes)}")
        if self.gpu is not None and self.gpu < 0:
            raise ValueError(f"gpu must be >= 0, got {self.gpu}")
        check_max_padded_elements(self.max_padded_elements)
        if self.cpus is not None and (not self.cpus or not all(type(c) is int and c >= 0 for c in self.cpus)):
            raise ValueError(f"cpus must be a non-empty list of ids >= 0, got {self.cpus!r}")


#: The exit code of a worker the broker told to exit, its batch past its time limit.
EXIT_HUNG = 75  # sysexits.h EX_TEMPFAIL: serve respawns it

__all__ = [
    "EXIT_BAD_ADDRESS",
    "EXIT_HUNG",
    "MalformedBatch",
    "ModelLoadError",
    "ModelOutcome",
    "PreparedBatch",
    "Worker",
    "WorkerSettings",
    "call_model",
    "finish_batch",
    "prepare_batch",
    "run_batch",
    "run_worker",
]


class Worker:
    """Connects to the broker's backend and serves batches until told to stop.

    The model runs in the main thread, right where the batch arrives (no hand-off to
    another thread on the hot path), unless it releases the GIL (`releases_gil`, as the
    ONNX model does): then it runs on a model thread of its own (workers/overlap.py) and
    the main thread decodes and encodes around it. The socket belongs to whichever
    thread holds `_socket_lock`: the main thread, except while the model runs or a
    batch is decoded or encoded, when a small thread may take it to send heartbeats, so
    a worker in a long batch is not taken for dead.

    Told to stop by SIGINT/SIGTERM (`signals`), or, for a worker of `serve`, by end of
    file on `control_fd`: the read end of a pipe whose only writer is `serve`, which
    closes it to stop the worker, and which the kernel closes when `serve` dies.

    No send ever blocks or raises out of the loop: a message the socket cannot take
    (not connected yet, or given up by libzmq after a refused handshake) is dropped,
    except READY, which is sent again once a handshake succeeds.
    """

    def __init__(
        self,
        settings: WorkerSettings,
        context: zmq.Context[Any] | None = None,
        control_fd: int | None = None,
    ) -> None:
        self.settings = settings
        # The broker's heartbeat once it says it (every HEARTBEAT it sends carries it);
        # this worker's own flags until then.
        self.heartbeat = settings.heartbeat
        self.control_fd = control_fd
        self._released = False  # end of file on control_fd
        if control_fd is not None:
            os.set_blocking(control_fd, False)
        self.spec = ModelSpec.parse(settings.model)
        gpu = settings.gpu
        self.name = f"{socket.gethostname()}/gpu{gpu if gpu is not None else '-'}/{os.getpid()}"
        self.ctx: zmq.Context[Any] = context or zmq.Context()
        self.signals = StopSignals()
        self.model: ModelFn | None = None
        self.signature: dict[str, Any] | None = None  # the model's, as READY carries it
        self.cost_ms: list[float] | None = None  # t(n) = a + b*n from the warm-up, for READY
        self.warmup_error: str | None = None  # why the warm-up failed, for READY
        self.batches = 0
        self.reconnects = 0
        self._sock: zmq.Socket[Any] | None = None
        self._watch: ConnectionWatch | None = None  # the socket's monitor
        # Whether the poller holds the monitor: only until a handshake succeeded, and again
        # once that connection drops (it doubled the poll's work a batch); meanwhile its
        # events are read at each heartbeat.
        self._watching = False
        self._pending: deque[tuple[float, list[Any]]] = deque()  # (arrived at, BATCH frames) not run yet
        # A model that releases the GIL runs on a thread of its own (workers/overlap.py):
        # its jobs: (a batch, self.reconnects when it came); at most OVERLAP_BATCHES at once
        self._model_thread: ModelThread[tuple[PreparedBatch, int], ModelOutcome] | None = None
        self._steps: StepRunner | None = None  # a step-level model's sequences
        self._inbox: deque[tuple[float, list[Any]]] = deque()  # (arrived at, START or CANCEL) not read yet
        self._outbox: deque[list[Any]] = deque()  # CHUNKs the socket could not take yet
        self._poller = zmq.Poller()
        self._told_to_reconnect = False
        #: When to beat, when the broker is lost, when to try it again (batcher/core/link.py).
        self._link = PeerLink(
            RECONNECT_BACKOFF, beat_s=self.heartbeat.interval_s, expiry_s=self.heartbeat.expiry_s
        )
        self._ready_sent = False
        self._refused: str | None = None  # why the current connection's handshake failed
        self._refusals = 0  # handshakes failed in a row
        self._refusal_logged: tuple[str, float] | None = None  # (why, when) of the last warning
        self._socket_lock = threading.Lock()  # a full memory barrier when the socket changes thread
        self._in_model = False
        self._stopped = threading.Event()

    def load(self) -> None:
        """Load the model, with CUDA_VISIBLE_DEVICES set first as a real GPU would need."""
        if self.settings.gpu is not None:  # --gpu N means device N, whatever was inherited
            os.environ["CUDA_VISIBLE_DEVICES"] = str(self.settings.gpu)
        s = self.settings
        self.model = load_model(self.spec, s.gpu, s.sim, s.threads, s.max_padded_elements)
        if is_step_model(self.model):
            s = self.settings
            self._steps = StepRunner(
                self.model,  # type: ignore[arg-type]
                s.max_active,
                BatchingLevel(s.batching_level),
                self.name,
                _decode_requests,
            )
            log.info(
                "model %s loaded (%s, step-level, up to %d sequences)",
                self.spec.name,
                self.spec.target,
                s.max_active,
            )
            return
        _prepare_tensors()
        if getattr(self.model, "releases_gil", False) is True:
            model = self.model
            self._model_thread = ModelThread(lambda job: call_model(model, job[0]))
        declared = signature_of(self.model)  # ValueError for a malformed one: the load fails
        self.signature = None if declared is None else declared.wire()
        sample = None
        if self.settings.warmup_sizes:
            sample = self._sample_from_file()
            if sample is None:
                sample = warmup.sample_of(self.model, declared)
        if sample is not None:
            self._warm_up(sample)
        log.info("model %s loaded (%s) on gpu %s", self.spec.name, self.spec.target, self.settings.gpu)

    def _sample_from_file(self) -> Any:
        """The input of --warmup-sample's JSON file, decoded as a request's input is (its
        tensors as arrays); None without one. ValueError saying what is wrong with it."""
        path = self.settings.warmup_sample
        if path is None:
            return None
        try:
            with open(path, encoding="utf-8") as f:
                value = tensor.json_tensors(json.load(f))
        except (OSError, ValueError) as exc:  # json's and tensor's errors are ValueErrors
            raise ValueError(f"--warmup-sample {path}: {exc}") from None
        request, why = _decode_request(protocol.pack({"input": value}))
        if why is not None:
            raise ValueError(f"--warmup-sample {path}: {why}")
        return request["input"]

    def _warm_up(self, sample: Any) -> None:
        """Run the model at each warm-up size (workers/warmup.py) and keep its fitted cost
        for READY; a model whose warm-up fails is served without a cost, and says why."""
        sizes = self.settings.warmup_sizes
        assert self.model is not None
        t0 = time.perf_counter()
        try:
            a_ms, b_ms = warmup.profile(self.model, sample, sizes)
        except Exception as exc:  # the model's own error: serve it anyway, unprofiled
            self.warmup_error = str(exc)[: protocol.MAX_WARMUP_ERROR_CHARS]
            log.warning(
                "worker %s: warm-up failed, so no cost is announced (the broker learns it from live "
                "batches, the first given the first-batch time limit): %s; give the model a "
                "warmup_sample it accepts (README, \"Models\")",
                self.name, self.warmup_error,
            )  # fmt: skip
            return
        self.cost_ms = [round(a_ms, 4), round(b_ms, 4)]
        log.info(
            "worker %s: warmed up at batch sizes %s in %.0f ms: t(n) = %.3f + %.3f n ms",
            self.name, ",".join(map(str, sizes)), (time.perf_counter() - t0) * 1000, a_ms, b_ms,
        )  # fmt: skip

    def check_address(self) -> None:
        """Raise ValueError, with a one-line reason, if the broker's address (or the CURVE
        key files) cannot be used: checked before the model loads, on a throwaway socket,
        so a typo fails at once rather than after a long load."""
        sock: zmq.Socket[Any] = self.ctx.socket(zmq.DEALER)
        try:
            if self.settings.curve_server_key:
                secure_client(sock, self.settings.curve_server_key, self.settings.curve_secret_key)
            sock.connect(self.settings.connect)
        except zmq.ZMQError as exc:
            why = zmq.strerror(exc.errno) if exc.errno else str(exc)  # str(exc) repeats the address
            raise ValueError(f"cannot connect to {self.settings.connect!r}: {why}") from None
        finally:
            sock.close(linger=0)

    def stop_requested(self) -> bool:
        """Whether a signal, serve (closing our pipe) or our parent's death says stop."""
        return bool(self.signals.count) or self._read_control() or not self._parent_alive()

    def _stop_known(self) -> bool:
        """stop_requested without reading serve's pipe: for the loop, which reads it when
        the poll says it is readable (an empty read raises BlockingIOError: 0.8 us, twice
        a request on a lone request's path)."""
        return bool(self.signals.count) or self._released or not self._parent_alive()

    def run(self) -> None:
        """Serve until told to stop (see the class), finishing the batch at hand first."""
        if self.model is None:
            self.load()
        beat = threading.Thread(target=self._beat_while_in_model, name="heartbeat", daemon=True)
        try:
            with self._socket_lock:
                beat.start()
                self._serve()
        finally:
            self._stopped.set()
            beat.join(timeout=1.0)
            if self._model_thread is not None:
                self._model_thread.close(timeout_s=1.0)
            with self._socket_lock:
                self._disconnect(linger_ms=self._goodbye_linger_ms())
            self.signals.close()
        log.info("worker %s stopped after %d batches", self.name, self.batches)

    def _serve(self) -> None:
        self._poller.register(self.signals.fd, zmq.POLLIN)
        if self.control_fd is not None:
            self._poller.register(self.control_fd, zmq.POLLIN)
        if self._model_thread is not None:
            self._poller.register(self._model_thread.fd, zmq.POLLIN)
        if self.stop_requested():  # e.g. serve stopped while the model was loading
            log.info("worker %s stopping before it connected", self.name)
            return
        self._connect()
        now = time.monotonic()
        self._link.connected(now)
        trim = heap_trimmer() if keep_freed_memory() else None
        next_trim = now + TRIM_INTERVAL_S
        while not self._stop_known():
            wake = self._link.next_wakeup()
            if self._steps is not None and (self._inbox or self._steps.busy()):
                wake = 0.0  # a step is due: only look at what came meanwhile
            timeout_ms = -1 if wake is None else max(0, math.ceil((wake - time.monotonic()) * 1000))
            events = dict(self._poller.poll(timeout_ms))
            now = time.monotonic()
            if self._watch is not None and self._watch.monitor in events:
                self._read_monitor()
            if self._sock is not None and self._sock in events:
                self._drain(now)
            if self.signals.fd in events:
                self.signals.clear()
            if self.control_fd is not None and self.control_fd in events and self._read_control():
                break
            if self._model_thread is not None:
                self._overlap(self._model_thread)
            elif self._pending:
                self._run_pending()
                continue  # poll again first: what the broker sent meanwhile is news of it
            self._follow_link(now)
            if trim is not None and now >= next_trim and not self._busy():  # what a burst took goes back
                trim()
                next_trim = now + TRIM_INTERVAL_S
            if self._steps is not None and self._sock is not None:
                self._run_steps(self._steps)
        if self.signals.count:
            log.info("worker %s stopping", self.name)
        elif self._released:
            log.info("worker %s stopping: serve closed its pipe (it stopped, or died)", self.name)
        elif not self._parent_alive():
            log.info("worker %s stopping: its parent is gone", self.name)
        if self._model_thread is not None:  # the batch at hand finishes and is answered
            self._model_thread.retract()  # the broker gets those back
            for job, outcome in self._wait_for_model(self._model_thread):
                self._answer(job, outcome)
        # Batches received but not run go back to the broker's queue when it reads this.
        self._send([protocol.WORKER_PROTOCOL, protocol.CMD_DISCONNECT])

    def _follow_link(self, now: float) -> None:
        """Do what the link says: drop a connection the broker refused, lost or disowned
        (DISCONNECT), open a fresh one once its back-off is over, beat."""
        if self._sock is not None and self._refused is not None:
            drop = self._link.refused(self._refused, now)
            assert isinstance(drop, Drop)  # a worker never gives up on its broker
            self._log_refusal(self._refused, now, drop.retry_in_s)
            self._disconnect()  # libzmq may never reconnect it: a fresh socket will
        elif self._sock is not None and self._told_to_reconnect:
            self._lost(self._link.refused("the broker does not know us", now))
        while (action := self._link.due(now)) is not None:
            if isinstance(action, Drop):  # no word from the broker for its expiry
                self._lost(action)
            elif isinstance(action, Reconnect):
                self._connect()
            elif isinstance(action, Beat) and self._sock is not None:
                if self._watch is not None and not self._watching:
                    self._read_monitor()  # a dropped connection, or a later handshake's outcome
                self._send([protocol.WORKER_PROTOCOL, protocol.CMD_HEARTBEAT])

    def _lost(self, drop: Drop | GiveUp) -> None:
        assert isinstance(drop, Drop)  # a worker never gives up on its broker
        log.warning("worker %s: lost the broker; reconnecting in %.1fs", self.name, drop.retry_in_s)
        self._disconnect()

    def _busy(self) -> bool:
        return bool(self._pending) or (self._model_thread is not None and self._model_thread.in_flight > 0)

    def _overlap(self, runner: ModelThread[tuple[PreparedBatch, int], ModelOutcome]) -> None:
        """Answer the batches the model thread finished, and keep OVERLAP_BATCHES with it:
        the one it runs and the next, decoded meanwhile."""
        for job, outcome in runner.take():
            self._answer(job, outcome)
        while runner.in_flight < OVERLAP_BATCHES and (batch := self._prepare()) is not None:
            runner.put((batch, self.reconnects))

    def _finished(self, batch: PreparedBatch, outcome: ModelOutcome) -> list[Any]:
        try:
            return finish_batch(batch, outcome, self.name)
        except Exception:  # a bug of ours; the worker goes on, and answers if it can
            log.exception("could not answer a batch")
            return protocol.reply_frames(batch.batch_id, 0.0, [])

    def _wait_for_model(
        self, runner: ModelThread[tuple[PreparedBatch, int], ModelOutcome]
    ) -> list[tuple[tuple[PreparedBatch, int], ModelOutcome]]:
        """Block until the model thread is done, the socket left to the heartbeat thread."""
        return self._unlocked(runner.wait)

    def _prepare(self) -> PreparedBatch | None:
        """The next pending batch decoded, the socket left to the heartbeat thread the
        while (a large batch may take longer than the broker's heartbeat expiry); one
        that cannot be run is answered (or dropped) at once, as `_run_safely` does."""
        while self._pending and self._sock is not None:
            arrived_at, frames = self._pending.popleft()
            prepared = self._unlocked(functools.partial(_prepared_or_error, frames, arrived_at))
            if isinstance(prepared, PreparedBatch):
                return prepared
            reply = _failed_batch(prepared, frames[2])
            if reply is not None:
                self._send(reply)
        return None

    def _answer(self, job: tuple[PreparedBatch, int], outcome: ModelOutcome) -> None:
        """Send the replies of a batch the model thread ran, on the connection it came on
        (a broker that lost us re-dispatched it: any other gets nothing)."""
        batch, connection = job
        reply = self._unlocked(functools.partial(self._finished, batch, outcome))  # heartbeats go on
        if connection != self.reconnects:
            return
        self.batches += 1
        if not self._send(reply):
            log.warning(
                "worker %s: the reply to a batch could not be sent (no connection to the broker, "
                "which re-dispatches that batch)",
                self.name,
            )

    def _run_pending(self) -> None:
        """Run the batches received so far, in order, answering each on its connection;
        a stop lets the batch at hand finish and leaves the rest to the broker. The first
        batch asks only what the loop's poll just told (`_stop_known`): reading serve's
        empty pipe again raised BlockingIOError between a lone request's BATCH and its
        model (20-25 us of a cold CPU); each later one reads it, as a model may run long."""
        assert self.model is not None
        stopped = self._stop_known
        while self._pending and self._sock is not None and not stopped():
            stopped = self.stop_requested
            arrived_at, frames = self._pending.popleft()
            self._in_model = True
            self._socket_lock.release()  # the heartbeat thread may use the socket meanwhile
            try:
                reply = _run_safely(self.model, frames[2], frames[3:], self.name, arrived_at)
            finally:
                self._socket_lock.acquire()
                self._in_model = False
            if reply is not None:
                self.batches += 1
                if not self._send(reply):
                    log.warning(
                        "worker %s: the reply to a batch could not be sent (no connection to the "
                        "broker, which re-dispatches that batch)",
                        self.name,
                    )

    def _run_steps(self, steps: StepRunner) -> None:
        """Read the START and CANCEL messages that came, then run one step, the socket left
        to the heartbeat thread meanwhile in both (a model's start, stop and step may each
        be slow), sending the chunks as one CHUNK after each. No step runs while a CHUNK
        waits for the socket to take it: a chunk is never dropped, and a slow broker slows
        the model down instead."""
        if not self._flush_outbox():
            return
        if self._inbox:
            self._unlocked(lambda: self._read_inbox(steps))
            self._send_chunks(steps)
        if steps.busy() and self._flush_outbox():
            self._unlocked(lambda: steps.run_step(time.monotonic()))
            self._send_chunks(steps)

    def _unlocked(self, work: Callable[[], R]) -> R:
        """Run `work` (the model's, or decoding or encoding a batch) with the socket left
        to the heartbeat thread; its result."""
        self._in_model = True
        self._socket_lock.release()
        try:
            return work()
        finally:
            self._socket_lock.acquire()
            self._in_model = False

    def _read_inbox(self, steps: StepRunner) -> None:
        while True:
            try:
                arrived_at, frames = self._inbox.popleft()
            except IndexError:  # empty (the heartbeat thread may clear it on a DISCONNECT)
                return
            try:
                if frames[1] == protocol.CMD_START and len(frames) >= 3:
                    steps.receive_start(frames[2], frames[3:], arrived_at)
                else:
                    steps.receive_cancel(frames[2])
            except Exception as exc:  # msgpack raises several unrelated types
                log.warning(
                    "worker %s: ignored a malformed broker message: %s", self.name, protocol.describe(exc)
                )

    def _send_chunks(self, steps: StepRunner) -> None:
        frames = steps.take_entries(time.monotonic())
        if frames is not None:
            self._outbox.append(frames)
        self._flush_outbox()

    def _flush_outbox(self) -> bool:
        """Send the CHUNKs that wait, in order; True once none does. While the socket takes
        none (the broker reads slowly: its queue for us is full), wait at most OUTBOX_WAIT_MS
        for room, so the loop still beats and reads its pipe."""
        while self._outbox:
            if self._sock is None:
                self._outbox.clear()  # the connection is gone: the broker answers for those
                return True
            if not self._send(self._outbox[0]):
                self._sock.poll(OUTBOX_WAIT_MS, zmq.POLLOUT)
                return False
            self._outbox.popleft()
        return True

    def _read_control(self) -> bool:
        """Read what is in serve's pipe (nothing is expected); returns whether it reached
        end of file, i.e. serve closed it or died: time to stop."""
        fd = self.control_fd
        while fd is not None and not self._released:
            try:
                if not os.read(fd, 4096):
                    self._released = True
            except BlockingIOError:
                break
            except OSError:  # not readable any more: as good as closed
                self._released = True
        return self._released

    def _beat_while_in_model(self) -> None:
        """Heartbeat while the main thread is inside the model and cannot."""
        while not self._stopped.wait(self.heartbeat.interval_s):
            if not self._in_model:
                continue
            with self._socket_lock:
                if self._in_model:
                    self._send([protocol.WORKER_PROTOCOL, protocol.CMD_HEARTBEAT])
                    # Read what came meanwhile: above all an EXIT, if the batch at hand ran
                    # past the broker's time limit (the model may never return).
                    if self._sock is not None and self._sock.poll(0, zmq.POLLIN):
                        self._drain(time.monotonic())

    def _connect(self) -> None:
        """A fresh DEALER (and so a fresh identity at the broker), announced with READY,
        and a monitor on it, which tells a refused handshake from a silent broker."""
        sock: zmq.Socket[Any] = self.ctx.socket(zmq.DEALER)
        watch = None
        try:
            sock.setsockopt(zmq.LINGER, 0)
            if self.settings.curve_server_key:
                secure_client(sock, self.settings.curve_server_key, self.settings.curve_secret_key)
            watch = ConnectionWatch(
                sock, self.settings.connect, "--curve-workers", self.settings.curve_secret_key
            )
            sock.connect(self.settings.connect)
        except BaseException:
            if watch is not None:
                watch.close()
            sock.close(linger=0)  # an open socket would block ctx.term() for ever
            raise
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(watch.monitor, zmq.POLLIN)
        self._sock, self._watch, self._watching = sock, watch, True
        self._told_to_reconnect = False
        self._refused = None
        self._ready_sent = self._send(self._ready())
        level = logging.DEBUG if self._refusals else logging.INFO  # retries after a refusal: quiet
        log.log(level, "worker %s ready for model %s at %s", self.name, self.spec.name, self.settings.connect)

    def _ready(self) -> list[bytes]:
        max_active = self.settings.max_active if self._steps is not None else None
        return protocol.ready_frames(
            self.spec.name,
            self.settings.gpu,
            os.getpid(),
            signature=self.signature,
            cost_ms=self.cost_ms,
            max_active=max_active,
            warmup_error=self.warmup_error,
        )

    def _goodbye_linger_ms(self) -> int:
        """How long closing may wait for our DISCONNECT to leave: up to 500 ms while the
        connection to the broker is up, none once it is gone (the broker stopped or was
        killed, or serve, our parent, died with its broker): libzmq would hold a message
        nobody can read for the whole linger, and the process would wait with it."""
        parent = self.settings.parent_pid
        if parent is not None and os.getppid() != parent:
            return 0
        if self._watch is None:
            return 0
        self._watch.poll()
        return 500 if self._watch.connected else 0

    def _disconnect(self, linger_ms: int = 0) -> None:
        """Drop the socket. Batches not run yet go too: a broker that lost us re-dispatches
        them, and a reply can only ever go back on the connection its batch came on."""
        if self._sock is None:
            return
        if self._watch is not None:
            if self._watching:
                self._poller.unregister(self._watch.monitor)
            self._watch.close()
            self._watch, self._watching = None, False
        self._poller.unregister(self._sock)
        self._sock.close(linger=linger_ms)
        self._sock = None
        self._pending.clear()
        if self._model_thread is not None:
            self._model_thread.retract()
        self._inbox.clear()
        self._outbox.clear()
        if self._steps is not None:
            self._steps.reset()
        self.reconnects += 1

    def _send(self, frames: list[bytes]) -> bool:
        """Send on the current connection without blocking; False when there is none or
        it cannot take the message (not connected yet, or given up after a refusal)."""
        if self._sock is None:
            return False
        try:
            send_frames(self._sock, frames)
        except zmq.Again:
            return False
        return True

    def _read_monitor(self) -> None:
        """Note a failed handshake (handled by the loop), and after a successful one send
        READY if it could not go before, and say so if the broker had refused us."""
        watch = self._watch
        assert watch is not None
        for event, _ in watch.poll():
            if event in HANDSHAKE_FAILED:
                self._refused = watch.refusal()
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if self._refusals:
                    log.info(
                        "worker %s: the broker at %s accepted us after %d failed handshakes",
                        self.name,
                        self.settings.connect,
                        self._refusals,
                    )
                self._refusals, self._refusal_logged = 0, None
                if not self._ready_sent:
                    self._ready_sent = self._send(self._ready())
        if watch.handshake_ok == self._watching:  # up: read at heartbeats; down: at once
            if self._watching:
                self._poller.unregister(watch.monitor)
            else:
                self._poller.register(watch.monitor, zmq.POLLIN)
            self._watching = not self._watching

    def _log_refusal(self, why: str, now: float, retry_s: float) -> None:
        """A failed handshake: WARNING the first time, then at most every REFUSAL_LOG_EVERY_S
        (DEBUG in between), so a worker left refused for days does not flood its log."""
        self._refusals += 1
        last = self._refusal_logged
        again = last is not None and last[0] == why and now - last[1] < REFUSAL_LOG_EVERY_S
        level = logging.DEBUG if again else logging.WARNING
        if not again:
            self._refusal_logged = (why, now)
        log.log(
            level,
            "worker %s cannot join the broker at %s: %s; retrying in %.2gs (failed handshakes: %d)",
            self.name,
            self.settings.connect,
            why,
            retry_s,
            self._refusals,
        )

    def _drain(self, now: float) -> bool:
        """Take every message from the broker (a BATCH noted with `now`, its arrival);
        returns whether any came. Read until the socket says none waits (ZMQ_EVENTS), not
        until a read raises zmq.Again: on a lone request's path, the exception after the
        BATCH cost 20-50 us of a cold CPU between the BATCH's arrival and the model."""
        sock = self._sock
        assert sock is not None
        heard = False
        while True:
            try:
                frames = recv_frames(sock, copied=3)  # large bodies stay zmq.Frames
            except zmq.Again:  # woken for nothing
                return heard
            heard = True
            self._link.heard(now)
            if len(frames) < 2 or frames[0] != protocol.WORKER_PROTOCOL:
                log.warning("ignored a broker message of %d frames", len(frames))
            elif frames[1] == protocol.CMD_BATCH and len(frames) >= 4:
                self._pending.append((now, frames))
            elif frames[1] in (protocol.CMD_START, protocol.CMD_CANCEL) and len(frames) >= 3:
                self._inbox.append((now, frames))  # read between steps, by the main thread
            elif frames[1] == protocol.CMD_DISCONNECT:
                log.info("worker %s: the broker does not know us; announcing again", self.name)
                self._told_to_reconnect = True
                self._pending.clear()
                self._inbox.clear()
                return heard
            elif frames[1] == protocol.CMD_HEARTBEAT:
                if len(frames) >= 3:
                    self._adopt_heartbeat(frames[2], now)
            elif frames[1] == protocol.CMD_EXIT:
                log.error(
                    "worker %s: the broker took a batch of ours for hung (past its time limit); exiting",
                    self.name,
                )
                logging.shutdown()
                os._exit(EXIT_HUNG)  # from any thread: the model may never return
            else:
                log.warning("ignored broker command %r", frames[1])
            if not readable(sock):
                return True

    def _adopt_heartbeat(self, frame: bytes, now: float) -> None:
        """Beat and judge the broker as it says (6.6), whatever this worker's own flags."""
        try:
            said = protocol.Heartbeat.from_frame(frame)
        except ValueError as exc:
            log.warning("worker %s: ignored the broker's heartbeat settings: %s", self.name, exc)
            return
        if said != self.heartbeat:
            was = self.heartbeat
            log.info(
                "worker %s: using the broker's heartbeat, %g ms x %d (was %g ms x %d)",
                self.name, said.interval_ms, said.liveness, was.interval_ms, was.liveness,
            )  # fmt: skip
            self.heartbeat = said
            self._link.retime(said.interval_s, said.expiry_s, now)

    def _parent_alive(self) -> bool:
        """Without a control pipe, a worker given --parent-pid polls for its parent instead."""
        parent = self.settings.parent_pid
        return parent is None or self.control_fd is not None or os.getppid() == parent


class ModelLoadError(RuntimeError):
    """The model could not be imported or built; the worker cannot start."""


def control_pipe(settings: WorkerSettings) -> int | None:
    """stdin, when this is a worker of `serve` (--parent-pid) and stdin is a pipe: `serve`
    keeps its write end and closes it to stop us."""
    if settings.parent_pid is None:
        return None
    try:
        return 0 if stat.S_ISFIFO(os.fstat(0).st_mode) else None
    except OSError:  # no stdin at all
        return None


def run_worker(settings: WorkerSettings) -> None:
    """The `batcher worker` body: check the address, load, serve, stop cleanly.

    A lone worker stops on SIGINT/SIGTERM. A worker of `serve` ignores both, from before
    its model loads (they reach it too when the whole process group is signalled, as
    systemd and a terminal's Ctrl-C do), and stops when `serve`, having drained the
    broker, closes its pipe, or when `serve` dies. Exits with EXIT_BAD_ADDRESS, after a
    one-line error, when it cannot connect to the given address at all.
    """
    control_fd = control_pipe(settings)
    if control_fd is not None:
        ignore_stop_signals()
    if settings.cpus is not None:  # before any thread starts: zmq's, the model's
        try:
            pin_to(settings.cpus)
        except (ValueError, OSError) as exc:
            log.error("--cpus %s: %s", ",".join(map(str, settings.cpus)), exc)
            raise SystemExit(EXIT_BAD_ADDRESS) from None
    worker = Worker(settings, control_fd=control_fd)
    try:
        try:
            worker.check_address()
        except ValueError as exc:
            log.error("%s", exc)
            raise SystemExit(EXIT_BAD_ADDRESS) from None
        try:
            worker.load()
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            extra = extra_of(exc.name) if isinstance(exc, ModuleNotFoundError) else None
            if extra is not None:  # numpy, onnxruntime: say which pip install brings it
                why += f" ({install_command(extra)})"
            raise ModelLoadError(f"cannot load model {settings.model!r}: {why}") from exc
        if control_fd is None:
            worker.signals.install()
            if settings.parent_pid is not None:
                # Given --parent-pid without a pipe: a terminal's Ctrl-C is for the parent.
                signal.signal(signal.SIGINT, signal.SIG_IGN)
        worker.run()
    finally:
        worker.ctx.term()
