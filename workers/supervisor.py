"""Starting and stopping worker processes for `batcher serve`.

Workers are fresh interpreters (subprocesses running `python -m batcher worker`),
never forks of a process that holds a zmq context. Each gets its GPU id and
CUDA_VISIBLE_DEVICES before its model loads, and a pipe on its stdin whose only
writer is `serve`: closing it is how `serve` stops a worker (the workers ignore
SIGINT/SIGTERM, which reach them too when the whole process group is signalled), and
the kernel closes it when `serve` dies, so no worker outlives the `serve` that
started it. At most `max_starting` workers start at once, so a large pool does not
start hundreds of interpreters together.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from batcher.core.link import Backoff, Drop, GiveUp, PeerLink
from batcher.core.multiplex import POOL_NAME
from batcher.errors import SettingsError
from batcher.settings import MAX_THREADS, MAX_WORKERS, MAX_WORKERS_PER_GPU, bounds, check, setting
from batcher.transport.stopping import stop_signals_blocked
from batcher.wire.protocol import Heartbeat
from workers.exit_codes import EXIT_HUNG
from workers.exit_codes import EXIT_MODEL_LOAD_FAILED as EXIT_MODEL_LOAD_FAILED  # its old home
from workers.models import ModelSpec, SimSettings, max_padded_elements_setting
from workers.placement import (
    CpuPlan,
    pinned_threads_per_worker,
    place_workers,
    plan_cpus,
    threads_per_worker,
    usable_cpus,
    visible_gpus,
)

log = logging.getLogger("batcher.supervisor")


@dataclass(frozen=True)
class PoolSettings:
    """Which workers `serve` runs and where (workers/placement.py): `workers_per_model` of
    each model (None: one per device, or 2 without devices) on `gpus` (None: the visible
    ones), at most `workers_per_gpu` of a model on one device."""

    backend: str
    models: tuple[str, ...]
    workers_per_model: int | None = setting(
        None,
        kind=int,
        min=0,
        max=MAX_WORKERS,
        optional=True,
        label="workers",
        help="Worker processes per model. Default: --workers-per-gpu on each GPU serve may use "
        "(--gpus), or 2 when it sees no GPU.",
    )
    sim: SimSettings = field(default_factory=SimSettings)
    heartbeat: Heartbeat = field(default_factory=Heartbeat)
    log_level: str = "INFO"
    log_format: str = "text"
    curve_secret_key: str | None = None  # the broker's: its local workers use its key pair
    #: Worker processes starting at once; None: default_max_starting().
    max_starting: int | None = setting(None, kind=int, min=1, optional=True)
    gpus: tuple[int, ...] | None = None
    workers_per_gpu: int = setting(
        1,
        kind=int,
        min=1,
        max=MAX_WORKERS_PER_GPU,
        help="Most workers of one model on one GPU; without --workers, each model gets this many per GPU.",
    )
    model_gpus: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # pinned models, by name
    model_workers: Mapping[str, int] = field(default_factory=dict)  # worker counts, by model name
    #: Intra-op threads of each worker's ONNX session; None: the cores divided among the workers.
    threads_per_worker: int | None = setting(None, kind=int, min=1, max=MAX_THREADS, optional=True)
    #: By model name, the batch sizes its workers' warm-up runs; None: no warm-up (--no-warmup).
    warmup_sizes: Mapping[str, tuple[int, ...]] | None = field(default_factory=dict)
    #: A step-level model's most sequences per worker, and when it admits new ones.
    max_active: int = 32
    batching_level: str = "step"
    #: --pin-cpus: each worker on cores of its own, the broker on the rest (CpuPlan).
    pin_cpus: bool = False
    #: The most elements a stacked model's padded batch may hold (--max-padded-elements).
    max_padded_elements: int = max_padded_elements_setting()
    #: By model name, the file of the input its warm-up runs on (a table's warmup_sample).
    warmup_samples: Mapping[str, str] = field(default_factory=dict)
    #: The pool of multiplexed workers (workers/multiplexed.py): its `--multiplex` JSON
    #: (None: no pool) and its size (None: default_count()).
    multiplex: str | None = None
    multiplex_workers: int | None = setting(
        None,
        kind=int,
        min=1,
        max=MAX_WORKERS,
        optional=True,
        help="Multiplexed workers, each serving any model marked `multiplexed` in the model "
        "repository. Default: as many as --workers gives a model.",
    )

    def __post_init__(self) -> None:
        check(self)
        each = replace(bounds(PoolSettings, "workers_per_model"), optional=False)
        for name, count in self.model_workers.items():  # a [models.NAME] table's `workers`
            problem = replace(each, label=f"workers of model {name!r}").problem(count)
            if problem is not None:
                raise SettingsError(problem)
        self.placement()  # raises, naming the model, when the workers do not fit
        if self.pin_cpus:
            self.cpu_plan()  # raises when no core would be left to the broker

    def default_count(self) -> int:
        """Workers per model when nothing says: --workers, else one per device (times
        --workers-per-gpu), else 2."""
        if self.workers_per_model is not None:
            return self.workers_per_model
        devices = visible_gpus() if self.gpus is None else self.gpus
        return len(devices) * self.workers_per_gpu if devices else 2

    def threads(self) -> int:
        """Each worker's intra-op threads: --threads-per-worker, or the cores (but the
        broker's one, when pinned) divided among this serve's workers."""
        if self.threads_per_worker is not None:
            return self.threads_per_worker
        workers = len(self.placement())
        if self.pin_cpus:
            return pinned_threads_per_worker(usable_cpus(), workers)
        return threads_per_worker(workers)

    def cpu_plan(self) -> CpuPlan | None:
        """With --pin-cpus, the cores of the broker and of each worker; else None."""
        if not self.pin_cpus:
            return None
        return plan_cpus(usable_cpus(), len(self.placement()), self.threads())

    def placement(self) -> list[tuple[str, int | None]]:
        """(model spec, GPU id or None) of every worker, in start order."""
        specs = {ModelSpec.parse(m).name: m for m in self.models}
        devices = visible_gpus() if self.gpus is None else self.gpus
        plan = place_workers(
            list(specs),
            devices,
            self.workers_per_model,
            self.workers_per_gpu,
            self.model_gpus,
            self.model_workers,
        )
        pooled: list[tuple[str, int | None]] = []
        if self.multiplex is not None:  # on the devices in turn, as a model's workers are
            count = self.multiplex_workers or self.default_count()
            pooled = [(POOL_SPEC, devices[i % len(devices)] if devices else None) for i in range(count)]
        return [(specs[name], gpu) for name, gpu in plan] + pooled


def default_max_starting() -> int:
    """One starting interpreter per CPU (at least 2, so the default pool starts at once)."""
    return max(2, os.cpu_count() or 1)


#: A worker that dies sooner than this after starting, before it joined the broker,
#: counts as failing at start-up (one that joined had loaded its model: its death is a
#: request's doing, or the machine's, and the broker retries or quarantines its requests).
EARLY_DEATH_S = 10.0
#: Start-up failures in a row after which a GPU's worker is given up.
MAX_EARLY_DEATHS = 5
RESPAWN_MIN_S = 0.5
RESPAWN_MAX_S = 10.0
#: The wait before a respawn: RESPAWN_MIN_S, doubling with each start-up failure in a row.
RESPAWN_BACKOFF = Backoff(initial_s=RESPAWN_MIN_S, cap_s=RESPAWN_MAX_S)
#: A worker counts as starting (interpreter, imports) for this long after its process starts.
STARTING_S = 1.0


@dataclass
class WorkerProcess:
    """One worker slot: what it runs, on which GPU, its current process and its restart
    history."""

    model: str  # the --model spec, NAME=pkg.mod:attr or a plain name
    gpu: int | None  # None: no GPU
    process: subprocess.Popen[bytes] | None  # None until first started
    started_at: float = 0.0
    restarts: int = 0
    respawn_at: float | None = None  # when to (re)start it; it waits longer for a free start slot
    given_up: bool = False
    retired: bool = False  # replaced by a reload: told to stop, never respawned
    cpus: tuple[int, ...] | None = None  # --pin-cpus: its own cores, kept across respawns
    joined: bool = False  # its current process announced itself to the broker (READY)
    #: Started by a reload: until it joins, its exit fails that reload, not serve (the old
    #: workers serve on), and it is not respawned.
    replacing: bool = False
    failure: str | None = None  # why a replacing worker did not start, for the reload's reply
    load_error_fd: int | None = None  # a replacing worker's pipe: why its model did not load
    #: Its respawns' back-off and give-up rule (batcher/core/link.py): a death after it
    #: started (it joined, lived EARLY_DEATH_S, or was killed hung) is not counted.
    link: PeerLink = field(
        default_factory=lambda: PeerLink(
            RESPAWN_BACKOFF, give_up_after=MAX_EARLY_DEATHS, count_stable_failure=False
        )
    )

    def died(self, code: int | None, now: float, hung: bool) -> Drop | GiveUp:
        """Its process exited: when to respawn it, or give up. One that joined the broker,
        lived EARLY_DEATH_S or was stopped for a hung model (a poison request) did start:
        its death is not a start-up failure, and one client's poison requests cannot make
        serve give up on the model."""
        if self.joined or hung or now - self.started_at >= EARLY_DEATH_S:
            self.link.heard(now)
        return self.link.refused(f"exit code {code}", now)

    @property
    def early_deaths(self) -> int:
        """Deaths in a row within EARLY_DEATH_S of starting, before joining the broker."""
        return self.link.failures

    def load_error(self) -> str | None:
        """What the exited worker wrote on its load-error pipe (None: nothing)."""
        if self.load_error_fd is None:
            return None
        try:
            said = os.read(self.load_error_fd, 4096)
        except OSError:  # nothing written (BlockingIOError) or unreadable
            return None
        return said.decode("utf-8", "replace").strip() or None

    def close_load_error(self) -> None:
        if self.load_error_fd is not None:
            os.close(self.load_error_fd)
            self.load_error_fd = None

    @property
    def name(self) -> str:
        """The model name the worker announces (the broker knows models by it)."""
        return ModelSpec.parse(self.model).name


#: The `--model` of a multiplexed worker (it loads the models of its --multiplex catalog).
POOL_SPEC = f"{POOL_NAME}=sim"


def add_model_workers(spec: str, count: int, now: float, gpus: tuple[int, ...] | None) -> list[WorkerProcess]:
    """`count` worker slots of a model `serve` did not start with (a model repository's new
    version), spread over `gpus` (None: the visible ones). Like a reload's new workers,
    one that exits before it joined is given up (its reason kept), never respawned, and
    does not stop serve."""
    devices = visible_gpus() if gpus is None else gpus
    where = [devices[i % len(devices)] if devices else None for i in range(count)]
    return [WorkerProcess(spec, gpu, None, respawn_at=now, replacing=True) for gpu in where]


def _start_failure(code: int | None, load_error: str | None) -> str:
    """Why a worker process that exited with `code` before joining did not start (with
    the error it wrote on its load-error pipe, if any)."""
    if load_error is not None:
        return f"could not load the model (exit code {code}): {load_error}"
    if code == EXIT_MODEL_LOAD_FAILED:
        return f"could not load the model (exit code {code}; its error is in serve's log)"
    return f"exited with code {code} before it joined the broker (its error is in serve's log)"


def connect_address(bind_address: str) -> str:
    """The address a local worker connects to for the broker's bind address: a wildcard
    host (`tcp://*:5556`, every interface) cannot be connected to; loopback can."""
    if bind_address.startswith("tcp://*:"):
        return "tcp://127.0.0.1:" + bind_address[len("tcp://*:") :]
    return bind_address


def child_environment(**extra: str) -> dict[str, str]:
    """os.environ plus `extra`, with this checkout on PYTHONPATH so `python -m batcher`
    works in the child even when batcher is run from a checkout (bin/batcher)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=root + (os.pathsep + path if path else ""), **extra)


class Supervisor:
    """Owns the worker processes of one `serve`."""

    def __init__(
        self,
        settings: PoolSettings,
        cpu_plan: CpuPlan | None = None,
        on_event: Callable[[str, str], None] | None = None,
    ) -> None:
        self.settings = settings
        #: --pin-cpus: planned once, from serve's cores before serve pinned itself.
        self.cpu_plan = cpu_plan if cpu_plan is not None else settings.cpu_plan()
        plan = self.cpu_plan
        #: Fixed now: once serve is pinned, its own cores no longer say what the workers get.
        self.threads_per_worker = len(plan.workers[0]) if plan and plan.workers else settings.threads()
        self.workers: list[WorkerProcess] = []
        self.on_event = on_event or (lambda model, event: None)  # (model, "respawned"|"given_up")
        #: (pid, exit code) of each worker process found exited, once: `serve` tells its
        #: broker, which then takes that worker for dead at once.
        self.on_exit: Callable[[int, int | None], None] = lambda pid, code: None
        self._exits_told: set[int] = set()
        self._killed_hung: set[int] = set()  # pids killed for a hung model: not start-up deaths

    def command(
        self,
        model: str,
        gpu: int | None,
        cpus: tuple[int, ...] | None = None,
        load_error_fd: int | None = None,
    ) -> list[str]:
        """The command line of one worker process; `load_error_fd`: where it writes why its
        model did not load (a pipe serve reads)."""
        s = self.settings
        return [
            sys.executable,
            "-m",
            "batcher",
            "worker",
            "--connect",
            connect_address(s.backend),
            "--model",
            model,
            *(["--gpu", str(gpu)] if gpu is not None else []),
            "--sim-base-ms",
            repr(s.sim.base_ms),
            "--sim-per-item-ms",
            repr(s.sim.per_item_ms),
            "--simlm-step-base-ms",
            repr(s.sim.step_base_ms),
            "--simlm-step-per-seq-ms",
            repr(s.sim.step_per_seq_ms),
            "--max-active",
            str(s.max_active),
            "--batching-level",
            s.batching_level,
            "--heartbeat-ms",
            repr(s.heartbeat.interval_ms),
            "--heartbeat-liveness",
            str(s.heartbeat.liveness),
            "--log-level",
            s.log_level,
            "--log-format",
            s.log_format,
            "--parent-pid",
            str(os.getpid()),
            "--threads-per-worker",
            str(self.threads_per_worker),
            *self._warmup_args(model),
            "--max-padded-elements",
            str(s.max_padded_elements),
            *self._warmup_sample_args(model),
            *(["--cpus", ",".join(map(str, cpus))] if cpus else []),
            *(["--load-error-fd", str(load_error_fd)] if load_error_fd is not None else []),
            *(["--multiplex", s.multiplex] if model == POOL_SPEC and s.multiplex is not None else []),
        ] + (
            ["--curve-server-key", s.curve_secret_key, "--curve-secret-key", s.curve_secret_key]
            if s.curve_secret_key
            else []
        )

    def _warmup_sample_args(self, model: str) -> list[str]:
        path = self.settings.warmup_samples.get(ModelSpec.parse(model).name)
        return [] if path is None or self.settings.warmup_sizes is None else ["--warmup-sample", path]

    def _warmup_args(self, model: str) -> list[str]:
        sizes = self.settings.warmup_sizes
        if sizes is None:
            return ["--no-warmup"]
        own = sizes.get(ModelSpec.parse(model).name)
        return [] if own is None else ["--warmup-sizes", ",".join(map(str, own))]

    @property
    def max_starting(self) -> int:
        return self.settings.max_starting or default_max_starting()

    def start(self, now: float | None = None) -> None:
        """Start the workers where placement puts them: `max_starting` now, the others from
        `check` as those have been up for STARTING_S."""
        now = time.monotonic() if now is None else now
        plan = self.cpu_plan
        for i, (model, gpu) in enumerate(self.settings.placement()):
            cpus = plan.workers[i] if plan is not None else None
            self.workers.append(WorkerProcess(model, gpu, None, respawn_at=now, cpus=cpus))
        self._start_due(now)

    def starting(self, now: float) -> int:
        """Worker processes started less than STARTING_S ago and still running."""
        return sum(
            1
            for w in self.workers
            if w.process is not None and now - w.started_at < STARTING_S and w.process.poll() is None
        )

    def _start_due(self, now: float) -> None:
        """Start the workers whose time has come, oldest due first, while start slots are free."""
        due = sorted(
            (w for w in self.workers if not w.given_up and w.respawn_at is not None and w.respawn_at <= now),
            key=lambda w: (w.respawn_at, -1 if w.gpu is None else w.gpu),
        )
        free = self.max_starting - self.starting(now)
        for w in due[: max(0, free)]:
            restart = w.process is not None
            self._spawn(w, now)
            if restart:
                w.restarts += 1
                self.on_event(w.name, "respawned")

    def _spawn(self, w: WorkerProcess, now: float) -> None:
        if w.process is not None and w.process.stdin is not None:
            w.process.stdin.close()  # the dead predecessor's pipe
        # A worker without a GPU keeps the environment it inherits (there is none to hide).
        env = child_environment() if w.gpu is None else child_environment(CUDA_VISIBLE_DEVICES=str(w.gpu))
        env.pop("BATCHER_CPUS", None)  # a lone worker's option: serve gives cores by --pin-cpus
        w.close_load_error()
        # A reload's new worker says why its model did not load, for the reload's reply.
        write_fd = None
        if w.replacing:
            w.load_error_fd, write_fd = os.pipe()
            os.set_blocking(w.load_error_fd, False)
        command = self.command(w.model, w.gpu, w.cpus, load_error_fd=write_fd)
        # Same process group as `serve` (so SIGKILL to the group leaves nothing behind).
        # The worker ignores SIGINT/SIGTERM; it starts with them blocked, so one sent to
        # the group before it could ignore them waits instead of killing it.
        try:
            with stop_signals_blocked():
                w.process = subprocess.Popen(
                    command, env=env, stdin=subprocess.PIPE, pass_fds=() if write_fd is None else (write_fd,)
                )
        finally:
            if write_fd is not None:
                os.close(write_fd)  # the worker holds the only write end: its exit ends the pipe
        w.started_at = now
        w.respawn_at = None
        w.joined = False
        w.link.connected(now)
        where = "" if w.cpus is None else f", cpus {','.join(map(str, w.cpus))}"
        log.info("started worker for model %s on gpu %s%s (pid %d)", w.model, w.gpu, where, w.process.pid)

    def all_given_up(self, model: str) -> bool:
        """Whether every worker of `model` kept dying at start-up and was given up."""
        mine = [w for w in self.workers if w.name == model and not w.retired]
        return bool(mine) and all(w.given_up for w in mine)

    def current(self, model: str) -> list[WorkerProcess]:
        """The workers of `model` (by name) that are not being replaced."""
        return [w for w in self.workers if w.name == model and not w.retired and not w.given_up]

    def start_generation(self, model: str, now: float) -> list[WorkerProcess]:
        """New workers for every current worker of `model`, on the same GPUs, started now
        (within the start limit); the old ones serve on until `retire`d."""
        fresh = [
            WorkerProcess(w.model, w.gpu, None, respawn_at=now, cpus=w.cpus, replacing=True)
            for w in self.current(model)
        ]
        self.workers.extend(fresh)
        self._start_due(now)
        return fresh

    def retire(self, workers: list[WorkerProcess]) -> None:
        """Stop these workers for good: each finishes its batch and exits; none respawns."""
        for w in workers:
            w.retired = True
            w.respawn_at = None
            if w.process is not None and w.process.stdin is not None:
                w.process.stdin.close()

    def running(self, w: WorkerProcess) -> bool:
        return w.process is not None and w.process.poll() is None

    def joined(self, pid: int) -> None:
        """The broker heard READY from the worker process `pid`: it loaded its model and
        started, so its death is no start-up failure (and no reload's)."""
        for w in self.workers:
            if w.process is not None and w.process.pid == pid:
                w.joined = True
                w.replacing = False

    def check(self, now: float) -> None:
        """Respawn dead workers with back-off; give up on one that keeps dying at start-up;
        start the workers waiting for a start slot. Called from the broker's loop (its
        timer heap, also while it drains), so it never blocks."""
        self._tell_exits()
        gone = [w for w in self.workers if w.retired and not self.running(w)]
        for w in gone:
            w.close_load_error()
        self.workers = [w for w in self.workers if w not in gone]
        for w in self.workers:
            if w.retired or w.given_up or w.respawn_at is not None or w.process is None:
                continue
            if w.process.poll() is None:
                continue
            code = w.process.returncode
            lived_s = now - w.started_at
            if w.replacing:
                # A reload's new worker that exited before it joined: the new version does
                # not start. The reload fails (workers/rollout.py), serve and the old
                # workers go on, and respawning it could not fix it.
                w.given_up = True
                w.failure = _start_failure(code, w.load_error())
                w.close_load_error()
                log.error(
                    "new worker for model %s on gpu %s (pid %d) %s; the reload fails",
                    w.model, w.gpu, w.process.pid, w.failure,
                )  # fmt: skip
                self.on_event(w.name, "reload_failed")
                continue
            if code == EXIT_MODEL_LOAD_FAILED and w.restarts == 0:
                # A model that does not load on the first try is a configuration error
                # (a typo in --model, a missing package): respawning cannot fix it.
                w.given_up = True
                self.on_event(w.name, "load_failed")
                continue
            hung = w.process.pid in self._killed_hung or code == EXIT_HUNG
            self._killed_hung.discard(w.process.pid)
            outcome = w.died(code, now, hung)
            if isinstance(outcome, GiveUp):
                w.given_up = True
                self.on_event(w.name, "given_up")
                log.error(
                    "worker for model %s on gpu %s died %d times in a row within %.0fs of starting "
                    "(last exit code %s); giving up on it",
                    w.model, w.gpu, outcome.failures, EARLY_DEATH_S, code,
                )  # fmt: skip
                continue
            delay = outcome.retry_in_s
            w.respawn_at = now + delay
            log.warning(
                "worker for model %s on gpu %s (pid %d) exited with code %s after %.1fs; respawning in %.1fs",
                w.model,
                w.gpu,
                w.process.pid,
                code,
                lived_s,
                delay,
            )
        self._start_due(now)

    def kill(self, pid: int) -> None:
        """SIGKILL the worker process `pid` (its model hung); it is respawned as after a
        crash."""
        for w in self.workers:
            if w.process is not None and w.process.pid == pid and w.process.poll() is None:
                self._killed_hung.add(pid)
                log.warning(
                    "killing worker for model %s on gpu %s (pid %d): its model hung", w.model, w.gpu, pid
                )
                w.process.kill()

    def _tell_exits(self) -> None:
        live = set()
        for w in self.workers:
            proc = w.process
            if proc is None:
                continue
            live.add(proc.pid)
            if proc.pid not in self._exits_told and proc.poll() is not None:
                self._exits_told.add(proc.pid)
                self.on_exit(proc.pid, proc.returncode)
        self._exits_told &= live  # only the current processes' (a pid may be reused)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close every worker's pipe (each finishes its batch and exits), SIGKILL those
        still up after `timeout_s`, and reap them all."""
        procs = [w.process for w in self.workers if w.process is not None]
        for p in procs:
            if p.stdin is not None:
                p.stdin.close()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker pid %d did not stop in %.1fs; killing it", p.pid, timeout_s)
                p.kill()
                p.wait()
        for w in self.workers:
            w.close_load_error()
        self.workers.clear()
