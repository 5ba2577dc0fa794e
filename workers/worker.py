"""A model-worker process: one DEALER, one model, one (simulated) GPU.

It announces itself with READY, then runs every BATCH it receives through the model
and answers with one REPLY holding a finished reply body per request, so the broker
forwards them to clients without touching them.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
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

    The model runs in the main thread, right where the batch arrives (no hand-off to
    another thread on the hot path). The socket belongs to whichever thread holds
    `_socket_lock`: the main thread, except while the model runs, when a small thread
    may take it to send heartbeats, so a worker in a long batch is not taken for dead.
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
        self._pending: deque[list[bytes]] = deque()  # BATCH frames not run yet
        self._poller = zmq.Poller()
        self._told_to_reconnect = False
        self._socket_lock = threading.Lock()  # a full memory barrier when the socket changes thread
        self._in_model = False
        self._stopped = threading.Event()

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
        beat = threading.Thread(target=self._beat_while_in_model, name="heartbeat", daemon=True)
        try:
            with self._socket_lock:
                beat.start()
                self._serve()
        finally:
            self._stopped.set()
            beat.join(timeout=1.0)
            with self._socket_lock:
                self._disconnect(linger_ms=500)
            self.signals.close()
        log.info("worker %s stopped after %d batches", self.name, self.batches)

    def _serve(self) -> None:
        hb = self.settings.heartbeat
        self._poller.register(self.signals.fd, zmq.POLLIN)
        self._connect()
        now = time.monotonic()
        next_beat, heard_at = now + hb.interval_s, now
        backoff_s, reconnect_at = RECONNECT_MIN_S, None
        while self._parent_alive() and not self.signals.count:
            wake = next_beat if reconnect_at is None else min(next_beat, reconnect_at)
            events = dict(self._poller.poll(max(0, math.ceil((wake - time.monotonic()) * 1000))))
            now = time.monotonic()
            if self._sock is not None and self._sock in events and self._drain():
                heard_at, backoff_s = now, RECONNECT_MIN_S
            if self.signals.fd in events:
                self.signals.clear()
            if self._pending:
                self._run_pending()
                continue  # poll again first: what the broker sent meanwhile is news of it
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
        if self.signals.count:
            log.info("worker %s stopping", self.name)
        if self._sock is not None:
            # Batches received but not run go back to the broker's queue when it reads this.
            send_frames(self._sock, [protocol.WORKER_PROTOCOL, protocol.CMD_DISCONNECT])

    def _run_pending(self) -> None:
        """Run the batches received so far, in order, answering each on its connection;
        a stop signal lets the batch at hand finish and leaves the rest to the broker."""
        assert self.model is not None
        while self._pending and not self.signals.count and self._sock is not None:
            frames = self._pending.popleft()
            self._in_model = True
            self._socket_lock.release()  # the heartbeat thread may use the socket meanwhile
            try:
                reply = _run_safely(self.model, frames[2], frames[3], self.name)
            finally:
                self._socket_lock.acquire()
                self._in_model = False
            self.batches += 1
            send_frames(self._sock, reply)

    def _beat_while_in_model(self) -> None:
        """Heartbeat while the main thread is inside the model and cannot."""
        interval = self.settings.heartbeat.interval_s
        while not self._stopped.wait(interval):
            if not self._in_model:
                continue
            with self._socket_lock:
                if self._in_model and self._sock is not None:
                    send_frames(self._sock, [protocol.WORKER_PROTOCOL, protocol.CMD_HEARTBEAT])

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
        self._told_to_reconnect = False
        log.info("worker %s ready for model %s at %s", self.name, self.spec.name, self.settings.connect)

    def _disconnect(self, linger_ms: int = 0) -> None:
        """Drop the socket. Batches not run yet go too: a broker that lost us re-dispatches
        them, and a reply can only ever go back on the connection its batch came on."""
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
            elif frames[1] == protocol.CMD_DISCONNECT:
                log.info("worker %s: the broker does not know us; announcing again", self.name)
                self._told_to_reconnect = True
                self._pending.clear()
                return heard
            elif frames[1] != protocol.CMD_HEARTBEAT:
                log.warning("ignored broker command %r", frames[1])

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
