"""Rolling model updates for `batcher serve`: new workers first, old ones drained after.

`batcher reload MODEL` (the `reload` control request) or SIGHUP starts one per model:
1. start a new worker for each current one, on the same GPU (the code and weights are
   loaded afresh by the new processes);
2. once every new worker has announced itself (its pid is among the model's workers at
   the broker), send the old ones no more batches;
3. once the old ones hold no batch, tell them to stop (they leave with DISCONNECT,
   holding nothing), and answer the request when they are gone.
Queued requests keep flowing to the old workers until the new ones are ready, and to
the new ones after, so no request is refused or lost during the switch. New workers
that do not all get ready within READY_TIMEOUT_S, or of which one exits before it is
ready (the new version does not load), are stopped and the old ones serve on: the
reload fails alone, saying why.

Driven from the broker's loop by `step(now)` on its timer heap: nothing here blocks. The
phases and what moves them are the pure state machine of batcher.core.reload; this module
gathers its facts and carries out its steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from batcher.core.reload import ReloadFacts, ReloadPhase, ReloadStep, advance, finished
from workers.supervisor import Supervisor, WorkerProcess

log = logging.getLogger("batcher.rollout")

#: How long new workers may take to load their model and announce themselves.
READY_TIMEOUT_S = 300.0

Reply = Callable[[bool, Any], None]


class BrokerView(Protocol):
    """What a rollout needs of the broker (batcher.broker.control.Controls has it)."""

    def workers_of(self, model: str) -> list[tuple[bytes, object, int]]: ...

    def drain_worker(self, worker_id: bytes) -> int: ...


@dataclass
class Rollout:
    """One model's reload in progress."""

    model: str
    started_at: float
    old: list[WorkerProcess]
    new: list[WorkerProcess]
    replies: list[Reply] = field(default_factory=list)
    phase: ReloadPhase = ReloadPhase.STARTING


class Rollouts:
    """The reloads of one `serve`: starts them, moves them on, answers who asked."""

    def __init__(self, broker: BrokerView, supervisor: Supervisor) -> None:
        self.broker = broker
        self.supervisor = supervisor
        self.active: dict[str, Rollout] = {}
        self.completed = 0

    def start(self, model: str, reply: Reply | None, now: float) -> None:
        """Begin replacing `model`'s workers; a reload already under way for it is joined."""
        if model in self.active:
            if reply is not None:
                self.active[model].replies.append(reply)
            return
        old = self.supervisor.current(model)
        if not old:
            if reply is not None:
                reply(False, ("unavailable", f"model {model!r} has no worker of this serve to replace"))
            return
        new = self.supervisor.start_generation(model, now)
        log.info("reloading model %s: starting %d new workers", model, len(new))
        self.adopt(model, old, new, reply, now)

    def adopt(
        self, model: str, old: list[WorkerProcess], new: list[WorkerProcess], reply: Reply | None, now: float
    ) -> None:
        """Move `model` from workers `old` to `new`, already started (by `start`, or by serve
        for the first workers of its multiplexed pool, `old` then empty)."""
        self.active[model] = Rollout(model, now, old, new, [reply] if reply is not None else [])

    def step(self, now: float) -> None:
        """Move every reload on as far as it can go now."""
        for model, r in list(self.active.items()):
            while not finished(r.phase):
                phase, step = advance(r.phase, self._facts(r, now), READY_TIMEOUT_S)
                if phase is r.phase:
                    break
                r.phase = phase
                if finished(phase):  # before its answer, which may start the model's next one
                    del self.active[model]
                self._carry_out(r, step)

    def _pids(self, model: str) -> dict[object, tuple[bytes, int]]:
        return {pid: (wid, held) for wid, pid, held in self.broker.workers_of(model)}

    def _facts(self, r: Rollout, now: float) -> ReloadFacts:
        at_broker = self._pids(r.model)
        return ReloadFacts(
            new_failed=any(w.given_up for w in r.new),
            new_ready=all(w.process is not None and w.process.pid in at_broker for w in r.new),
            waited_s=now - r.started_at,
            old_idle=all(w.process is None or at_broker.get(w.process.pid, (b"", 0))[1] == 0 for w in r.old),
            old_running=any(self.supervisor.running(w) for w in r.old),
        )

    def _carry_out(self, r: Rollout, step: ReloadStep) -> None:
        if step is ReloadStep.DRAIN_OLD:
            log.info("reloading model %s: new workers ready, draining the old ones", r.model)
            at_broker = self._pids(r.model)
            for w in r.old:
                if w.process is not None and w.process.pid in at_broker:
                    self.broker.drain_worker(at_broker[w.process.pid][0])
        elif step is ReloadStep.RETIRE_OLD:
            self.supervisor.retire(r.old)
        elif step is ReloadStep.ANSWER_DONE:
            log.info("reloaded model %s: %d workers replaced", r.model, len(r.old))
            self._answer(r, True, {"model": r.model, "replaced": len(r.old), "workers": len(r.new)})
        elif step is ReloadStep.FAIL_NEW_EXITED or step is ReloadStep.FAIL_NEW_LATE:
            self.supervisor.retire(r.new)
            if step is ReloadStep.FAIL_NEW_EXITED:
                failed = next(w for w in r.new if w.given_up)
                message = f"a new worker of {r.model!r} {failed.failure or 'did not start'}"
            else:
                message = f"the new workers of {r.model!r} were not ready within {READY_TIMEOUT_S:.0f}s"
            log.error("reload failed: %s; the old workers serve on", message)
            self._answer(r, False, ("worker_failed", message + "; the old workers serve on"))

    def _answer(self, r: Rollout, ok: bool, result: Any) -> None:
        self.completed += ok
        for reply in r.replies:
            reply(ok, result)


def serve_tick(
    signals: Any, supervisor: Supervisor, rollouts: Rollouts, on_hangup: Callable[[float], None]
) -> Callable[[float], None]:
    """`serve`'s periodic step on the broker's timer heap: respawn dead workers, act on a
    SIGHUP (`on_hangup`, which reloads), move reloads on."""
    seen = signals.hangups

    def tick(now: float) -> None:
        nonlocal seen
        supervisor.check(now)
        if signals.hangups != seen:
            seen = signals.hangups
            on_hangup(now)
        rollouts.step(now)

    return tick
