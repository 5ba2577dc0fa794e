"""A model-worker process: one DEALER, one model, one (simulated) GPU.

It announces itself with READY, then runs every BATCH it receives through the model
and answers with one REPLY holding a finished reply body per request, so the broker
forwards them to clients without touching them.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from batcher import protocol
from batcher.protocol import ErrorCode
from batcher.stopping import StopSignals
from batcher.zmqio import recv_frames, send_frames
from workers.models import ModelFn, ModelSpec, SimSettings, load_model

log = logging.getLogger("batcher.worker")

#: How often a worker looks at its parent and the broker when nothing else happens.
TICK_MS = 1000


@dataclass(frozen=True)
class WorkerSettings:
    """Everything a worker process needs; the CLI builds one of these."""

    connect: str = "tcp://127.0.0.1:5556"
    model: str = "sim"
    gpu: int | None = None
    sim: SimSettings = field(default_factory=SimSettings)
    parent_pid: int | None = None

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
        return protocol.reply_frames(batch_id, infer_ms, replies)
    infer_ms = round((time.perf_counter() - t0) * 1000.0, 3)
    replies = []
    for r, out, q in zip(requests, outputs, queue_ms, strict=True):
        meta = {"batch_size": n, "worker": worker_name, "queue_ms": q, "infer_ms": infer_ms}
        try:
            replies.append(protocol.ok_reply(r.get("id"), out, meta))
        except (TypeError, ValueError, OverflowError) as exc:
            replies.append(
                protocol.error_reply(r.get("id"), ErrorCode.MODEL_ERROR, f"output cannot be encoded: {exc}")
            )
    return protocol.reply_frames(batch_id, infer_ms, replies)


class Worker:
    """Connects to the broker's backend and serves batches until told to stop."""

    def __init__(self, settings: WorkerSettings, context: zmq.Context[Any] | None = None) -> None:
        self.settings = settings
        self.spec = ModelSpec.parse(settings.model)
        gpu = settings.gpu
        self.name = f"{socket.gethostname()}/gpu{gpu if gpu is not None else '-'}/{os.getpid()}"
        self.ctx: zmq.Context[Any] = context or zmq.Context()
        self.signals = StopSignals()
        self.model: ModelFn | None = None
        self.batches = 0

    def load(self) -> None:
        """Load the model, with CUDA_VISIBLE_DEVICES set first as a real GPU would need."""
        if self.settings.gpu is not None:
            os.environ.setdefault("CUDA_VISIBLE_DEVICES", str(self.settings.gpu))
        self.model = load_model(self.spec, self.settings.gpu, self.settings.sim)
        log.info("model %s loaded (%s) on gpu %s", self.spec.name, self.spec.target, self.settings.gpu)

    def run(self) -> None:
        """Serve until SIGINT/SIGTERM (after finishing the batch at hand) or the parent dies."""
        if self.model is None:
            self.load()
        assert self.model is not None
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(self.settings.connect)
        sock.send_multipart(protocol.ready_frames(self.spec.name, self.settings.gpu, os.getpid()))
        log.info("worker %s ready for model %s at %s", self.name, self.spec.name, self.settings.connect)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self.signals.fd, zmq.POLLIN)
        try:
            while not self.signals.count and self._parent_alive():
                events = dict(poller.poll(TICK_MS))
                if sock in events:
                    self._drain(sock)
            sock.send_multipart([protocol.WORKER_PROTOCOL, protocol.CMD_DISCONNECT])
        finally:
            sock.close()
            self.signals.close()
        log.info("worker %s stopped after %d batches", self.name, self.batches)

    def _drain(self, sock: zmq.Socket[Any]) -> None:
        assert self.model is not None
        while not self.signals.count:
            try:
                frames = recv_frames(sock)
            except zmq.Again:
                return
            if len(frames) != 4 or frames[0] != protocol.WORKER_PROTOCOL or frames[1] != protocol.CMD_BATCH:
                log.warning("ignored a broker message of %d frames", len(frames))
                continue
            try:
                reply = run_batch(self.model, frames[2], frames[3], self.name)
            except Exception:
                # Undecodable batch: an empty REPLY makes the broker fail all its requests.
                log.exception("could not decode a batch")
                batch_id = protocol.unpack(frames[2])[0]
                reply = protocol.reply_frames(batch_id, 0.0, [])
            send_frames(sock, reply)
            self.batches += 1

    def _parent_alive(self) -> bool:
        parent = self.settings.parent_pid
        return parent is None or os.getppid() == parent


def run_worker(settings: WorkerSettings) -> None:
    """The `batcher worker` body: load, serve, stop cleanly on SIGINT/SIGTERM."""
    worker = Worker(settings)
    worker.signals.install()
    if settings.parent_pid is not None:
        # Started by `serve`: a terminal's Ctrl-C is for `serve`, which drains the broker
        # first and then sends us SIGTERM.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        worker.run()
    finally:
        worker.ctx.term()
