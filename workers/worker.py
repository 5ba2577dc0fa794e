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
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from batcher.core.multiplex import POOL_NAME
from batcher.core.stalls import STALL_MIN_S, overslept
from batcher.core.versions import split_key
from batcher.errors import ModelLoadError, SettingsError
from batcher.extras import extra_of, install_command
from batcher.observe.settings import TraceSettings
from batcher.observe.tracer import start_tracing
from batcher.settings import MAX_GPU, MAX_PID, MAX_THREADS, check, setting
from batcher.transport.allocator import TRIM_INTERVAL_S, heap_trimmer, keep_freed_memory
from batcher.transport.security import secure_client
from batcher.transport.stopping import ignore_stop_signals
from batcher.wire import protocol, tensor
from batcher.wire.protocol import Heartbeat
from batcher.wire.signature import signature_of
from workers import warmup
from workers.batch_runner import (  # re-exported: workers.worker.run_batch is the documented name
    OUTBOX_WAIT_MS,
    OVERLAP_BATCHES,
    BatchRunner,
    MalformedBatch,
    ModelOutcome,
    PreparedBatch,
    _decode_request,
    _decode_requests,
    _prepare_tensors,
    call_model,
    finish_batch,
    prepare_batch,
    run_batch,
    set_tracer,
)
from workers.catalog_signatures import read_catalog
from workers.connection import (  # re-exported, as before the split
    RECONNECT_BACKOFF,
    RECONNECT_MAX_S,
    RECONNECT_MIN_S,
    BrokerConnection,
    goodbye,
)
from workers.exit_codes import EXIT_BAD_ADDRESS, EXIT_HUNG
from workers.models import (
    ModelFn,
    ModelSpec,
    SimSettings,
    load_model,
    max_padded_elements_setting,
    release_model,
)
from workers.multiplexed import MultiplexSpec, Shelf
from workers.overlap import ModelThread
from workers.placement import pin_to
from workers.refusals import REFUSAL_LOG_EVERY_S
from workers.steps import BATCHING_LEVELS, BatchingLevel, StepRunner, is_step_model

log = logging.getLogger("batcher.worker")


@dataclass(frozen=True)
class WorkerSettings:
    """Everything a worker process needs; the CLI builds one of these."""

    connect: str = "tcp://127.0.0.1:5556"
    model: str = "sim"
    gpu: int | None = setting(
        None, kind=int, min=0, max=MAX_GPU, optional=True, help="GPU id (sets CUDA_VISIBLE_DEVICES)."
    )
    sim: SimSettings = field(default_factory=SimSettings)
    parent_pid: int | None = setting(None, kind=int, min=1, max=MAX_PID, optional=True)
    heartbeat: Heartbeat = field(default_factory=Heartbeat)
    curve_server_key: str | None = None  # the broker's public key file: turns CURVE on
    curve_secret_key: str | None = None  # this worker's key pair (.key_secret)
    #: An ONNX session's intra-op threads; None: every core.
    threads: int | None = setting(
        None, kind=int, min=1, max=MAX_THREADS, optional=True, label="threads_per_worker"
    )
    #: Before READY, run the model at these batch sizes on zero inputs of its signature
    #: and announce the fitted cost (workers/warmup.py); () skips it (--no-warmup).
    warmup_sizes: tuple[int, ...] = (1, 2, 4, 8)
    #: A step-level model's most sequences at once: its credit at the broker.
    max_active: int = setting(
        32,
        kind=int,
        min=1,
        max=protocol.MAX_ACTIVE,
        message="max_active must be an int in [{min}, {max}], got {value!r}",
        help="Step-level models: most sequences a worker generates at once (its credit at the "
        "broker, which sends it a request per free slot).",
    )
    #: When a step-level model admits new sequences (workers/steps.py): "step", between
    #: any two steps; "request", once all it holds have ended (the baseline).
    batching_level: str = BatchingLevel.STEP.value
    #: The CPUs this worker and every thread it starts run on (--cpus); None: not pinned.
    cpus: tuple[int, ...] | None = None
    #: The most elements a stacked model's padded batch may hold (workers/stacking.py).
    max_padded_elements: int = max_padded_elements_setting()
    #: A JSON file of one request's input for the warm-up (--warmup-sample); None: the
    #: model's own warmup_sample, else zeros of its signature.
    warmup_sample: str | None = None
    #: OpenTelemetry traces (docs/tracing.md): off unless an endpoint is given.
    trace: TraceSettings = field(default_factory=TraceSettings)
    #: Many models in one worker (workers/multiplexed.py): the JSON of its catalog and
    #: budget; `model` is then not loaded. None: a worker of `model` alone.
    multiplex: str | None = None

    def __post_init__(self) -> None:
        ModelSpec.parse(self.model)  # raises with a precise message
        if self.multiplex is not None:
            MultiplexSpec.parse(self.multiplex)
        check(self)
        if self.batching_level not in BATCHING_LEVELS:
            raise SettingsError(
                f"batching_level must be one of {', '.join(BATCHING_LEVELS)}, got {self.batching_level!r}"
            )
        if not all(type(n) is int and n >= 1 for n in self.warmup_sizes):
            raise SettingsError(f"warmup sizes must be ints >= 1, got {list(self.warmup_sizes)}")
        if self.cpus is not None and (not self.cpus or not all(type(c) is int and c >= 0 for c in self.cpus)):
            raise SettingsError(f"cpus must be a non-empty list of ids >= 0, got {self.cpus!r}")


__all__ = [
    "EXIT_BAD_ADDRESS",
    "EXIT_HUNG",
    "OUTBOX_WAIT_MS",
    "OVERLAP_BATCHES",
    "RECONNECT_BACKOFF",
    "RECONNECT_MAX_S",
    "RECONNECT_MIN_S",
    "REFUSAL_LOG_EVERY_S",
    "BatchRunner",
    "BrokerConnection",
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


class Worker(BatchRunner):
    """Connects to the broker's backend and serves batches until told to stop.

    The model runs in the main thread, right where the batch arrives (no hand-off to
    another thread on the hot path), unless it releases the GIL (`releases_gil`, as the
    ONNX model does): then it runs on a model thread of its own (workers/overlap.py) and
    the main thread decodes and encodes around it. The connection, its heartbeats and
    reconnects are `BrokerConnection`'s (workers/connection.py), the batch path
    `BatchRunner`'s (workers/batch_runner.py): this is the loop over both.
    """

    # Set by `load` (each instance its own); None until then.
    model: ModelFn | None = None
    signature: dict[str, Any] | None = None  # the model's, as READY carries it
    signatures: dict[str, dict[str, Any]] | None = None  # a multiplexed worker's, by model
    cost_ms: list[float] | None = None  # t(n) = a + b*n from the warm-up, for READY
    warmup_error: str | None = None  # why the warm-up failed, for READY

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
            raise SettingsError(f"cannot connect to {self.settings.connect!r}: {why}") from None
        finally:
            sock.close(linger=0)

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

    def load(self) -> None:
        """Load the model, with CUDA_VISIBLE_DEVICES set first as a real GPU would need."""
        if self.settings.gpu is not None:  # --gpu N means device N, whatever was inherited
            os.environ["CUDA_VISIBLE_DEVICES"] = str(self.settings.gpu)
        s = self.settings
        if s.multiplex is not None:  # its models load on their first batch (workers/multiplexed.py)
            spec = MultiplexSpec.parse(s.multiplex)
            self.spec = ModelSpec(POOL_NAME, "sim")  # its name in logs; it loads its catalog's
            load = functools.partial(
                load_model, gpu=s.gpu, sim=s.sim, threads=s.threads, max_padded_elements=s.max_padded_elements
            )
            self.shelf = Shelf(spec, load, release_model)
            _prepare_tensors()
            read = read_catalog(spec.targets, load)  # in a child: a model may end its process
            self.signatures, self.shelf.fatal = read.signatures, read.fatal
            log.info(
                "multiplexed worker: %d models, a budget of %d MB", len(spec.targets), spec.catalog.budget_mb
            )
            return
        parts = split_key(self.spec.name)  # a repository's version: NAME/V (batcher.core.versions)
        self.reply_version = None if parts is None else str(parts[1])
        self.model = load_model(self.spec, s.gpu, s.sim, s.threads, s.max_padded_elements)
        if is_step_model(self.model):
            s = self.settings
            self._steps = StepRunner(
                self.model,  # type: ignore[arg-type]
                s.max_active,
                BatchingLevel(s.batching_level),
                self.name,
                _decode_requests,
                self.reply_version,
            )
            if self.tracer is not None:  # a span per traced request stream (workers.step_spans)
                from workers.step_spans import StepSpans

                self._steps.spans = StepSpans(self.tracer)
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
            raise SettingsError(f"--warmup-sample {path}: {exc}") from None
        request, why = _decode_request(protocol.pack({"input": value}))
        if why is not None:
            raise SettingsError(f"--warmup-sample {path}: {why}")
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

    def run(self) -> None:
        """Serve until told to stop (see the class), finishing the batch at hand first."""
        if self.model is None and self.shelf is None:
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
            began = time.monotonic()
            timeout_ms = -1 if wake is None else max(0, math.ceil((wake - began) * 1000))
            events = dict(self._poller.poll(timeout_ms))
            now = time.monotonic()
            stall = overslept(began, timeout_ms / 1000.0, now) if now - began > STALL_MIN_S else None
            if stall is not None or self._stalls.pending(now):
                self._count_stalls(stall, now)
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
        # Batches received but not run go back to the broker's queue when it reads this;
        # it carries the spans dropped since the last HEARTBEAT (6.5).
        self._send(goodbye(self.tracer))

    def _ready(self) -> list[bytes]:
        if self.shelf is not None:
            catalog = self.shelf.spec.catalog.wire()
            return protocol.ready_frames(
                POOL_NAME, self.settings.gpu, os.getpid(), multiplexed=catalog, signatures=self.signatures
            )
        max_active = self.settings.max_active if self._steps is not None else None
        return protocol.ready_frames(
            self.spec.name,
            self.settings.gpu,
            os.getpid(),
            signature=self.signature,
            cost_ms=self.cost_ms,
            max_active=max_active,
            warmup_error=self.warmup_error,
            deterministic=getattr(self.model, "deterministic", True) is not False,
        )


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
    attributes = {
        "batcher.model": settings.model,
        "batcher.gpu": -1 if settings.gpu is None else settings.gpu,
    }
    tracer = start_tracing(settings.trace, "batcher-worker", attributes)
    set_tracer(tracer)
    worker.tracer = tracer
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
        if tracer is not None:
            tracer.shutdown()
