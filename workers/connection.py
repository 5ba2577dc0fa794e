"""A worker's connection to its broker (and to serve, its parent): the DEALER and its
monitor, READY, heartbeats, what the broker sends, refusals and reconnects, each timed by
the link core (batcher/core/link.py). The batch path (workers/batch_runner.py) and the
worker's loop (workers/worker.py) are built on it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import zmq

from batcher.core.link import Backoff, Beat, Drop, GiveUp, PeerLink, Reconnect
from batcher.core.stalls import Stalls, overslept
from batcher.transport.connection_watch import HANDSHAKE_FAILED, ConnectionWatch
from batcher.transport.security import secure_client
from batcher.transport.stopping import StopSignals
from batcher.transport.zmqio import readable, recv_frames, send_frames
from batcher.wire import protocol
from workers.exit_codes import EXIT_HUNG
from workers.models import ModelSpec
from workers.overlap import ModelThread
from workers.refusals import Refusals
from workers.steps import StepRunner

if TYPE_CHECKING:
    from workers.batch_runner import ModelOutcome, PreparedBatch
    from workers.worker import WorkerSettings

log = logging.getLogger("batcher.worker")

#: Back-off between attempts to reach a broker that stopped answering (seconds).
RECONNECT_MIN_S = 0.25
RECONNECT_MAX_S = 8.0
RECONNECT_BACKOFF = Backoff(initial_s=RECONNECT_MIN_S, cap_s=RECONNECT_MAX_S)


class BrokerConnection:
    """The socket side of a worker. The socket belongs to whichever thread holds
    `_socket_lock`: the main thread, except while the model runs or a batch is decoded
    or encoded, when a small thread may take it to send heartbeats, so a worker in a
    long batch is not taken for dead.

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
        self.tracer: Any = None  # this process's tracer when tracing is on (batcher.observe.spans)
        self._inbox: deque[tuple[float, list[Any]]] = deque()  # (arrived at, START or CANCEL) not read yet
        self._outbox: deque[list[Any]] = deque()  # CHUNKs the socket could not take yet
        self._poller = zmq.Poller()
        self._told_to_reconnect = False
        #: When to beat, when the broker is lost, when to try it again (batcher/core/link.py).
        self._link = PeerLink(
            RECONNECT_BACKOFF, beat_s=self.heartbeat.interval_s, expiry_s=self.heartbeat.expiry_s
        )
        self._stalls = Stalls()  # spans this process did not run (batcher.core.stalls)
        self._ready_sent = False
        self._refused: str | None = None  # why the current connection's handshake failed
        self._refusals = Refusals(self.name, settings.connect)
        self._socket_lock = threading.Lock()  # a full memory barrier when the socket changes thread
        self._in_model = False
        self._stopped = threading.Event()

    def _ready(self) -> list[bytes]:
        """The READY frames (the worker says what it serves)."""
        raise NotImplementedError

    def stop_requested(self) -> bool:
        """Whether a signal, serve (closing our pipe) or our parent's death says stop."""
        return bool(self.signals.count) or self._read_control() or not self._parent_alive()

    def _stop_known(self) -> bool:
        """stop_requested without reading serve's pipe: for the loop, which reads it when
        the poll says it is readable (an empty read raises BlockingIOError: 0.8 us, twice
        a request on a lone request's path)."""
        return bool(self.signals.count) or self._released or not self._parent_alive()

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

    def _parent_alive(self) -> bool:
        """Without a control pipe, a worker given --parent-pid polls for its parent instead."""
        parent = self.settings.parent_pid
        return parent is None or self.control_fd is not None or os.getppid() == parent

    def _follow_link(self, now: float) -> None:
        """Do what the link says: drop a connection the broker refused, lost or disowned
        (DISCONNECT), open a fresh one once its back-off is over, beat."""
        if self._sock is not None and self._refused is not None:
            drop = self._link.refused(self._refused, now)
            assert isinstance(drop, Drop)  # a worker never gives up on its broker
            self._refusals.failed(self._refused, now, drop.retry_in_s)
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
                self._send(heartbeat(self.tracer))

    def _count_stalls(self, stall: tuple[float, float] | None, now: float) -> None:
        """The stalls seen by the loop's poll (`stall`) and by the heartbeat thread: the
        broker's silence then does not count (it was not silent: we were not listening)."""
        if (by_s := self._stalls.count(stall, now)) > 0:
            log.warning(
                "worker %s did not run for %.1f s: the broker's silence then does not count", self.name, by_s
            )
            self._link.stalled(by_s, now)

    def _lost(self, drop: Drop | GiveUp) -> None:
        assert isinstance(drop, Drop)  # a worker never gives up on its broker
        log.warning("worker %s: lost the broker; reconnecting in %.1fs", self.name, drop.retry_in_s)
        self._disconnect()

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
        level = logging.DEBUG if self._refusals.count else logging.INFO  # retries after a refusal: quiet
        log.log(level, "worker %s ready for model %s at %s", self.name, self.spec.name, self.settings.connect)

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
                self._refusals.accepted()
                if not self._ready_sent:
                    self._ready_sent = self._send(self._ready())
        if watch.handshake_ok == self._watching:  # up: read at heartbeats; down: at once
            if self._watching:
                self._poller.unregister(watch.monitor)
            else:
                self._poller.register(watch.monitor, zmq.POLLIN)
            self._watching = not self._watching

    def _drain(self, now: float) -> bool:
        """Take every message from the broker (a BATCH noted with `now`, its arrival);
        returns whether any came. After the first message, ask the socket whether another
        waits (ZMQ_EVENTS), and only then read until zmq.Again (zmqio.readable): on a lone
        request's path, the exception after the BATCH cost 20-50 us of a cold CPU between
        the BATCH's arrival and the model."""
        sock = self._sock
        assert sock is not None
        heard = False
        first = True
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
            if first and not readable(sock):  # zmqio.readable: asked after the first only
                return True
            first = False

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

    def _beat_while_in_model(self) -> None:
        """Heartbeat while the main thread is inside the model and cannot; and, at any
        time, note a wait that overslept: the process was stopped (batcher.core.stalls),
        which the main thread may not see for itself if it was in the model then."""
        while True:
            wait_s, began = self.heartbeat.interval_s, time.monotonic()
            self._stalls.waiting(began, wait_s)
            stopped = self._stopped.wait(wait_s)
            if (stall := overslept(began, wait_s, time.monotonic())) is not None:
                self._stalls.seen(stall)
            self._stalls.woke()  # (it may then wait for the socket as long as the loop keeps it)
            if stopped:
                return
            if not self._in_model:
                continue
            with self._socket_lock:
                if self._in_model:
                    self._send(heartbeat(self.tracer))
                    # Read what came meanwhile: above all an EXIT, if the batch at hand ran
                    # past the broker's time limit (the model may never return).
                    if self._sock is not None and self._sock.poll(0, zmq.POLLIN):
                        self._drain(time.monotonic())


def heartbeat(tracer: Any) -> list[bytes]:
    """A HEARTBEAT; with tracing on, it carries the spans this process dropped (6.6)."""
    return _with_counters(protocol.CMD_HEARTBEAT, tracer)


def goodbye(tracer: Any) -> list[bytes]:
    """The DISCONNECT of a worker that stops; with tracing on, it carries the spans this
    process dropped, as a HEARTBEAT does (6.5), so those since its last HEARTBEAT count."""
    return _with_counters(protocol.CMD_DISCONNECT, tracer)


def _with_counters(command: bytes, tracer: Any) -> list[bytes]:
    if tracer is None:
        return [protocol.WORKER_PROTOCOL, command]
    from batcher.observe.counters import spans_dropped

    said = protocol.pack({"trace_spans_dropped": spans_dropped()})
    return [protocol.WORKER_PROTOCOL, command, said]
