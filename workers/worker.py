"""A model-worker process: one DEALER, one model, one (simulated) GPU.

It announces itself with READY, then runs every BATCH it receives through the model
and answers with one REPLY holding a finished reply body per request, so the broker
forwards them to clients without touching them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from socket import socketpair
from typing import Any

import zmq

from batcher import protocol
from batcher.protocol import ErrorCode, Heartbeat
from batcher.security import secure_client
from batcher.stopping import StopSignals
from batcher.zmqio import recv_frames, send_frames
from workers.models import ModelFn, ModelSpec, SimSettings, load_model

log = logging.getLogger("batcher.worker")

#: Back-off between attempts to reach a broker that stopped answering (seconds).
RECONNECT_MIN_S = 0.25
RECONNECT_MAX_S = 8.0


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

    def __post_init__(self) -> None:
        ModelSpec.parse(self.model)  # raises with a precise message
        if self.gpu is not None and self.gpu < 0:
            raise ValueError(f"gpu must be >= 0, got {self.gpu}")


def run_batch(model: ModelFn, header_frame: bytes, batch_frame: bytes, worker_name: str) -> list[bytes]:
    """Run one BATCH message through the model; returns the REPLY frames.

    Whatever the model does, every request of the batch gets a reply: its output, or
    `model_error` for all of them when the model raises or returns the wrong count.
    """
    batch_id, queue_ms = protocol.unpack(header_frame)
    requests: list[dict[str, Any]] = protocol.unpack(batch_frame)
    n = len(requests)
    t0 = time.perf_counter()
    try:
        outputs = model([r.get("input") for r in requests])
        if not isinstance(outputs, list | tuple) or len(outputs) != n:
            got = f"{len(outputs)} outputs" if isinstance(outputs, list | tuple) else repr(type(outputs))
            raise ValueError(f"model returned {got} for a batch of {n}")
    except Exception as exc:
        infer_ms = (time.perf_counter() - t0) * 1000.0
        message = f"{type(exc).__name__}: {exc}"
        log.warning("model raised on a batch of %d: %s", n, message)
        replies = [protocol.error_reply(r.get("id"), ErrorCode.MODEL_ERROR, message) for r in requests]
        return protocol.reply_frames(batch_id, infer_ms, replies, errors=n)
    infer_ms = round((time.perf_counter() - t0) * 1000.0, 3)
    replies = []
    errors = 0
    for r, out, q in zip(requests, outputs, queue_ms, strict=True):
        meta = {"batch_size": n, "worker": worker_name, "queue_ms": q, "infer_ms": infer_ms}
        try:
            replies.append(protocol.ok_reply(r.get("id"), out, meta))
        except (TypeError, ValueError, OverflowError) as exc:
            errors += 1
            replies.append(
                protocol.error_reply(r.get("id"), ErrorCode.MODEL_ERROR, f"output cannot be encoded: {exc}")
            )
    return protocol.reply_frames(batch_id, infer_ms, replies, errors)


class Worker:
    """Connects to the broker's backend and serves batches until told to stop.

    The socket belongs to the main thread, which keeps heartbeating while the model
    runs in a thread of its own; batches are run one at a time, in arrival order.
    """

    def __init__(self, settings: WorkerSettings, context: zmq.Context[Any] | None = None) -> None:
        self.settings = settings
        self.spec = ModelSpec.parse(settings.model)
        gpu = settings.gpu
        self.name = f"{socket.gethostname()}/gpu{gpu if gpu is not None else '-'}/{os.getpid()}"
        self.ctx: zmq.Context[Any] = context or zmq.Context()
        self.signals = StopSignals()
        self.model: ModelFn | None = None
        self.batches = 0
        self.reconnects = 0
        self._sock: zmq.Socket[Any] | None = None
        self._pending: deque[list[bytes]] = deque()  # BATCH frames not started yet
        self._running: Future[list[bytes]] | None = None
        self._running_on = 0  # the connection the running batch came on
        self._connection = 0  # counts connections: a reply goes back only on its batch's own
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._done_r, self._done_w = socketpair()
        self._done_r.setblocking(False)
        self._poller = zmq.Poller()
        self._told_to_reconnect = False

    def load(self) -> None:
        """Load the model, with CUDA_VISIBLE_DEVICES set first as a real GPU would need."""
        if self.settings.gpu is not None:  # --gpu N means device N, whatever was inherited
            os.environ["CUDA_VISIBLE_DEVICES"] = str(self.settings.gpu)
        self.model = load_model(self.spec, self.settings.gpu, self.settings.sim)
        log.info("model %s loaded (%s) on gpu %s", self.spec.name, self.spec.target, self.settings.gpu)

    def run(self) -> None:
        """Serve until SIGINT/SIGTERM (after finishing the batch at hand) or the parent dies."""
        if self.model is None:
            self.load()
        hb = self.settings.heartbeat
        self._poller.register(self.signals.fd, zmq.POLLIN)
        self._poller.register(self._done_r.fileno(), zmq.POLLIN)
        self._connect()
        now = time.monotonic()
        next_beat, heard_at = now + hb.interval_s, now
        backoff_s, reconnect_at = RECONNECT_MIN_S, None
        try:
            while self._parent_alive() and not (self.signals.count and self._running is None):
                wake = next_beat if reconnect_at is None else min(next_beat, reconnect_at)
                events = dict(self._poller.poll(max(0, math.ceil((wake - time.monotonic()) * 1000))))
                now = time.monotonic()
                if self._done_r.fileno() in events:
                    self._finish_batch()
                if self._sock is not None and self._sock in events and self._drain():
                    heard_at, backoff_s = now, RECONNECT_MIN_S
                if self.signals.fd in events:
                    self.signals.clear()
                    log.info("worker %s stopping after its current batch", self.name)
                if self._sock is not None and (self._told_to_reconnect or now - heard_at > hb.expiry_s):
                    log.warning("worker %s: lost the broker; reconnecting in %.1fs", self.name, backoff_s)
                    self._disconnect()
                    reconnect_at, backoff_s = now + backoff_s, min(RECONNECT_MAX_S, backoff_s * 2)
                if reconnect_at is not None and now >= reconnect_at:
                    self._connect()
                    heard_at, reconnect_at = now, None
                if self._sock is not None and now >= next_beat:
                    send_frames(self._sock, [protocol.WORKER_PROTOCOL, protocol.CMD_HEARTBEAT])
                    next_beat = now + hb.interval_s
            if self._sock is not None:
                send_frames(self._sock, [protocol.WORKER_PROTOCOL, protocol.CMD_DISCONNECT])
        finally:
            self._disconnect(linger_ms=500)
            self._executor.shutdown(wait=False, cancel_futures=True)
            self.signals.close()
            self._done_r.close()
            self._done_w.close()
        log.info("worker %s stopped after %d batches", self.name, self.batches)

    def _connect(self) -> None:
        """A fresh DEALER (and so a fresh identity at the broker), announced with READY."""
        sock: zmq.Socket[Any] = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.settings.curve_server_key:
            secure_client(sock, self.settings.curve_server_key, self.settings.curve_secret_key)
        sock.connect(self.settings.connect)
        send_frames(sock, protocol.ready_frames(self.spec.name, self.settings.gpu, os.getpid()))
        self._poller.register(sock, zmq.POLLIN)
        self._sock = sock
        self._connection += 1
        self._told_to_reconnect = False
        log.info("worker %s ready for model %s at %s", self.name, self.spec.name, self.settings.connect)

    def _disconnect(self, linger_ms: int = 0) -> None:
        """Drop the socket. Batches not started yet go too: the broker that lost us
        re-dispatches them (and drops any late reply)."""
        if self._sock is None:
            return
        self._poller.unregister(self._sock)
        self._sock.close(linger=linger_ms)
        self._sock = None
        self._pending.clear()
        self.reconnects += 1

    def _drain(self) -> bool:
        """Take every message from the broker; returns whether any came."""
        assert self._sock is not None
        heard = False
        while True:
            try:
                frames = recv_frames(self._sock)
            except zmq.Again:
                return heard
            heard = True
            if len(frames) < 2 or frames[0] != protocol.WORKER_PROTOCOL:
                log.warning("ignored a broker message of %d frames", len(frames))
            elif frames[1] == protocol.CMD_BATCH and len(frames) == 4:
                self._pending.append(frames)
                self._start_next()
            elif frames[1] == protocol.CMD_DISCONNECT:
                log.info("worker %s: the broker does not know us; announcing again", self.name)
                self._told_to_reconnect = True
                return heard
            elif frames[1] != protocol.CMD_HEARTBEAT:
                log.warning("ignored broker command %r", frames[1])

    def _start_next(self) -> None:
        if self._running is not None or not self._pending or self.signals.count:
            return
        assert self.model is not None
        frames = self._pending.popleft()
        self._running_on = self._connection
        self._running = self._executor.submit(_run_safely, self.model, frames[2], frames[3], self.name)
        self._running.add_done_callback(lambda _: self._done_w.send(b"\0"))

    def _finish_batch(self) -> None:
        with contextlib.suppress(OSError):
            self._done_r.recv(4096)
        if self._running is None or not self._running.done():
            return
        reply = self._running.result()
        self._running = None
        self.batches += 1
        # A batch from an earlier connection belongs to a broker that has taken us for dead
        # (or to one that restarted): it re-dispatched the batch, so the reply must not go
        # to the new connection, where its batch id could name another batch.
        if self._sock is not None and self._running_on == self._connection:
            send_frames(self._sock, reply)
        self._start_next()

    def _parent_alive(self) -> bool:
        parent = self.settings.parent_pid
        return parent is None or os.getppid() == parent


def _run_safely(model: ModelFn, header_frame: bytes, batch_frame: bytes, name: str) -> list[bytes]:
    try:
        return run_batch(model, header_frame, batch_frame, name)
    except Exception:
        # Undecodable batch: an empty REPLY makes the broker fail all its requests.
        log.exception("could not decode a batch")
        return protocol.reply_frames(protocol.unpack(header_frame)[0], 0.0, [])


class ModelLoadError(RuntimeError):
    """The model could not be imported or built; the worker cannot start."""


def run_worker(settings: WorkerSettings) -> None:
    """The `batcher worker` body: load, serve, stop cleanly on SIGINT/SIGTERM."""
    worker = Worker(settings)
    try:
        worker.load()
    except Exception as exc:
        raise ModelLoadError(f"cannot load model {settings.model!r}: {type(exc).__name__}: {exc}") from exc
    worker.signals.install()
    if settings.parent_pid is not None:
        # Started by `serve`: a terminal's Ctrl-C is for `serve`, which drains the broker
        # first and then sends us SIGTERM.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        worker.run()
    finally:
        worker.ctx.term()
