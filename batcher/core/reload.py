"""A rolling reload's phases as a pure state machine: what the facts of this moment
(new workers ready or failed, old ones idle or gone, the time waited) make of the phase,
and the one thing to do about it. workers/rollout.py gathers the facts and does it."""

from __future__ import annotations

import enum
from typing import NamedTuple


class ReloadPhase(enum.Enum):
    """starting -> draining -> stopping -> done; starting -> failed."""

    STARTING = "starting"  # new workers load their model; the old ones serve
    DRAINING = "draining"  # the new ones serve; the old ones get no more batches
    STOPPING = "stopping"  # the old ones hold nothing and are told to stop
    DONE = "done"
    FAILED = "failed"  # the new ones were stopped; the old ones serve on


class ReloadStep(enum.Enum):
    """What the rollout does on entering a phase."""

    WAIT = "wait"
    DRAIN_OLD = "drain_old"  # send the old workers no more batches
    RETIRE_OLD = "retire_old"  # tell the old workers to stop
    ANSWER_DONE = "answer_done"  # answer who asked: replaced
    FAIL_NEW_EXITED = "fail_new_exited"  # stop the new workers: one exited before it was ready
    FAIL_NEW_LATE = "fail_new_late"  # stop the new workers: not ready within the time allowed


class ReloadFacts(NamedTuple):
    """What a rollout sees now."""

    new_failed: bool  # a new worker gave up before it was ready
    new_ready: bool  # every new worker has announced itself to the broker
    waited_s: float  # since the reload began
    old_idle: bool  # no old worker holds a batch
    old_running: bool  # an old worker's process still runs


def advance(phase: ReloadPhase, facts: ReloadFacts, ready_timeout_s: float) -> tuple[ReloadPhase, ReloadStep]:
    """The phase `facts` lead to from `phase`, one transition at most, and its step
    (WAIT, with `phase` unchanged, when nothing moves)."""
    if phase is ReloadPhase.STARTING:
        if facts.new_failed:
            return ReloadPhase.FAILED, ReloadStep.FAIL_NEW_EXITED
        if facts.new_ready:
            return ReloadPhase.DRAINING, ReloadStep.DRAIN_OLD
        if facts.waited_s > ready_timeout_s:
            return ReloadPhase.FAILED, ReloadStep.FAIL_NEW_LATE
    elif phase is ReloadPhase.DRAINING and facts.old_idle:
        return ReloadPhase.STOPPING, ReloadStep.RETIRE_OLD
    elif phase is ReloadPhase.STOPPING and not facts.old_running:
        return ReloadPhase.DONE, ReloadStep.ANSWER_DONE
    return phase, ReloadStep.WAIT


def finished(phase: ReloadPhase) -> bool:
    """A reload in this phase has answered and is over."""
    return phase in (ReloadPhase.DONE, ReloadPhase.FAILED)
