"""`batcher serve`'s body: a broker and the worker processes it supervises.

Next to run_broker (batcher/broker/loop.py) and run_worker (workers/worker.py): the command
line turns its options into settings and calls run_serve. The workers package is
imported when run_serve runs, so importing batcher does not import it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from batcher.broker.loop import Broker, BrokerSettings
from batcher.core.scheduler import BatchSettings
from batcher.errors import ModelLoadError

if TYPE_CHECKING:
    from batcher.gateway.process import GatewayProcess
    from batcher.serve.repository_control import RepositoryControl
    from workers.supervisor import PoolSettings

log = logging.getLogger("batcher.serve")

#: How often `serve` looks for dead workers to respawn.
SUPERVISE_INTERVAL_S = 0.2
#: How long `serve`, stopping, lets its workers finish (none after a second signal or a
#: model that could not be loaded: they are killed at once).
WORKER_STOP_TIMEOUT_S = 5.0


#: How long `serve`, stopping, lets its gateway finish (its own grace, 5 s, and a margin).
GATEWAY_STOP_TIMEOUT_S = 7.0


#: A model's first worker could not load it (a configuration error), or serve's gateway
#: process exited: `serve` stops (the child's own error is in the log). The older name of
#: batcher.errors.ModelLoadError, the one class for a model that will not load.
ModelLoadFailed = ModelLoadError


def run_serve(
    settings: BrokerSettings,
    pool: PoolSettings,
    reread_batching: Callable[[], dict[str, BatchSettings]] | None = None,
    gateway: GatewayProcess | None = None,
    repository: RepositoryControl | None = None,
) -> None:
    """Bind, start the workers, serve until SIGINT/SIGTERM, then drain and stop: the
    `batcher serve` body.

    `batcher reload MODEL`, or SIGHUP, replaces a model's workers: new ones first, then
    the old ones drained and stopped. SIGHUP reloads every model, after applying
    `reread_batching()` (the config file's batching settings, read again; a ValueError
    keeps the current ones). `gateway`, if given, starts once the broker is bound and
    stops after it; its exit stops serve; `repository`: a model repository served too.
    Raises BindError or KeyFileError if the broker cannot start, ModelLoadError (once everything
    has stopped) if a model could not be loaded.
    """
    from workers.models import ModelSpec
    from workers.placement import pin_to
    from workers.rollout import Rollouts, serve_tick
    from workers.supervisor import Supervisor

    plan = pool.cpu_plan()  # --pin-cpus: planned from serve's own cores, before pinning it
    if plan is not None:  # before the broker's context starts its I/O thread
        pin_to(plan.broker)
        log.info("broker pinned to cpus %s", ",".join(map(str, plan.broker)))
    broker = Broker(settings)  # bind before the workers start, so a busy port fails fast
    supervisor = Supervisor(pool, plan)
    fatal: list[str] = []

    def on_worker_event(model: str, event: str) -> None:
        broker.stats.metrics.worker_event(model, event)
        if event == "load_failed" and (repository is None or not repository.load_failed(model)):
            fatal.append(f"model {model!r} could not be loaded (the worker's error is above)")
            broker.stop(now=True)
        elif event == "given_up" and supervisor.all_given_up(model):
            broker.model_failed(model, f"every worker of model {model!r} failed to start (see serve's log)")

    supervisor.on_event = on_worker_event
    supervisor.on_exit = lambda pid, code: broker.workers.process_exited(pid, code, time.monotonic())
    broker.workers.on_hung = supervisor.kill  # a hung model: its worker killed, then respawned
    broker.workers.on_joined = supervisor.joined  # it started: its death is no start-up failure
    rollouts = Rollouts(broker.controls, supervisor)
    broker.controls.on_reload = lambda model, reply: rollouts.start(model, reply, time.monotonic())
    names = tuple(dict.fromkeys(ModelSpec.parse(m).name for m in pool.models))

    def on_hangup(now: float) -> None:
        """SIGHUP: read the CURVE allow-lists and the batching settings again, then reload
        every model."""
        broker.reload_allow_lists()
        if reread_batching is not None:
            try:
                broker.controls.apply_model_settings(reread_batching())
            except ValueError as exc:
                log.error("SIGHUP: %s; batching settings unchanged", exc)
        for name in names:
            rollouts.start(name, None, now)

    if repository is not None:  # its timer on the broker's heap too
        repository.attach(broker, supervisor, rollouts, time.monotonic())
    broker.signals.install()
    broker.signals.install_hangup()
    broker.call_every(SUPERVISE_INTERVAL_S, serve_tick(broker.signals, supervisor, rollouts, on_hangup))
    if gateway is not None:
        broker.call_every(SUPERVISE_INTERVAL_S, _watch_gateway(gateway, broker, fatal))
    try:
        supervisor.start()
        if gateway is not None:
            gateway.start()
        broker.run()
    finally:
        if gateway is not None:  # first: it may still be answering requests in flight
            gateway.stop(timeout_s=0.0 if broker.signals.count > 1 else GATEWAY_STOP_TIMEOUT_S)
        # After a second signal (or broker.stop(now=True)) nothing waits: workers still
        # in a batch are killed.
        supervisor.stop(timeout_s=0.0 if broker.signals.count > 1 else WORKER_STOP_TIMEOUT_S)
        broker.close()
    if fatal:
        raise ModelLoadError(fatal[0])


def _watch_gateway(gateway: GatewayProcess, broker: Broker, fatal: list[str]) -> Callable[[float], None]:
    """A timer that stops serve when its gateway process has exited: with an error (a
    port taken, a crash) serve fails, saying why, rather than serving deaf to HTTP; with
    exit 0 (someone stopped it), serve drains as well."""
    reported = False

    def tick(now: float) -> None:
        nonlocal reported
        code = gateway.exit_code()
        if code is None or reported:
            return
        reported = True
        if code == 0:
            if not broker.signals.count:  # else serve is stopping already: not a second signal
                log.info("the gateway process stopped; serve stops too")
                broker.stop()
        else:
            fatal.append(f"the gateway process exited with code {code} (its error is above)")
            broker.stop(now=True)

    return tick
