"""serve's rules about its worker processes (workers/supervisor.py, workers/rollout.py), on
real short-lived processes and a float clock: a worker that joined the broker and then
died is respawned however often it dies (one client's poison requests cannot make serve
give up on a model), one that dies before joining is given up after MAX_EARLY_DEATHS,
and a reload's new worker that cannot load its model fails that reload alone."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from workers.rollout import Rollouts
from workers.supervisor import (
    EXIT_MODEL_LOAD_FAILED,
    MAX_EARLY_DEATHS,
    RESPAWN_MIN_S,
    PoolSettings,
    Supervisor,
    WorkerProcess,
)


class ScriptedSupervisor(Supervisor):
    """Each worker is `sh -c "exit CODE"` (it dies at once), or `cat` (it lives until its
    pipe is closed) when `exit_code` is None."""

    exit_code: int | None = 3
    says: str = ""  # what a worker given a load-error pipe writes there before it exits

    def __init__(self, settings: PoolSettings) -> None:
        super().__init__(settings)
        self.events: list[tuple[str, str]] = []
        self.on_event = lambda model, event: self.events.append((model, event))

    def command(
        self,
        model: str,
        gpu: int | None,
        cpus: tuple[int, ...] | None = None,
        load_error_fd: int | None = None,
    ) -> list[str]:
        if self.exit_code is None:
            cat = shutil.which("cat")
            assert cat is not None
            return [cat]
        sh = shutil.which("sh")
        assert sh is not None
        if load_error_fd is not None and self.says:
            script = (
                "import os, sys; os.write(int(sys.argv[1]), sys.argv[2].encode()); sys.exit(int(sys.argv[3]))"
            )
            return [sys.executable, "-c", script, str(load_error_fd), self.says, str(self.exit_code)]
        return [sh, "-c", f"exit {self.exit_code}"]


@pytest.fixture
def sup() -> Iterator[ScriptedSupervisor]:
    s = ScriptedSupervisor(PoolSettings("tcp://127.0.0.1:1", ("sim",), 1, gpus=()))
    yield s
    s.stop(timeout_s=5)


def dead(w: WorkerProcess) -> int:
    """Wait until the worker's process has exited; its pid."""
    assert w.process is not None
    w.process.wait(timeout=10)
    return w.process.pid


def test_a_worker_that_joined_and_then_died_is_respawned_however_often_it_dies(sup: Any) -> None:
    """Each start joins the broker (READY), then dies within a second: a request killed it,
    not a failed start. Twice MAX_EARLY_DEATHS deaths later it is still respawned, each
    time after the shortest back-off."""
    sup.start(now=0.0)
    (w,) = sup.workers
    now = 0.0
    for _ in range(2 * MAX_EARLY_DEATHS):
        sup.joined(dead(w))
        now += 0.5
        sup.check(now)
        assert not w.given_up and w.early_deaths == 0
        assert w.respawn_at == pytest.approx(now + RESPAWN_MIN_S)
        now = w.respawn_at
        sup.check(now)  # respawned
        assert w.respawn_at is None and not w.joined
    assert w.restarts == 2 * MAX_EARLY_DEATHS
    assert ("sim", "given_up") not in sup.events


def test_a_worker_that_dies_before_it_joins_is_given_up_after_max_early_deaths(sup: Any) -> None:
    sup.start(now=0.0)
    (w,) = sup.workers
    now = 0.0
    for deaths in range(1, MAX_EARLY_DEATHS + 1):
        dead(w)
        now += 0.5
        sup.check(now)
        assert w.early_deaths == deaths
        if deaths < MAX_EARLY_DEATHS:
            assert not w.given_up
            now = w.respawn_at
            sup.check(now)
    assert w.given_up and sup.all_given_up("sim")
    assert sup.events[-1] == ("sim", "given_up")


def reload_that_fails(sup: ScriptedSupervisor) -> tuple[WorkerProcess, list[tuple[bool, Any]], Rollouts]:
    """Start one worker that lives, then reload it to workers exiting with EXIT_MODEL_LOAD_FAILED."""
    sup.exit_code = None
    sup.start(now=0.0)
    (old,) = sup.workers
    sup.joined(old.process.pid)
    replies: list[tuple[bool, Any]] = []

    class Broker:
        def workers_of(self, model: str) -> list[tuple[bytes, object, int]]:
            return [(b"old", old.process.pid, 0)]

        def drain_worker(self, worker_id: bytes) -> int:
            raise AssertionError("the old worker was drained for a reload that failed")

    rollouts = Rollouts(Broker(), sup)
    sup.exit_code = EXIT_MODEL_LOAD_FAILED
    rollouts.start("sim", lambda ok, result: replies.append((ok, result)), 1.0)
    (new,) = [w for w in sup.workers if w is not old]
    dead(new)
    sup.check(1.5)
    rollouts.step(1.5)
    return old, replies, rollouts


def test_a_reload_worker_that_cannot_load_its_model_fails_the_reload_not_serve(sup: Any) -> None:
    """At serve's start, exit 78 is a configuration error (serve stops); from a reload's new
    worker it fails that reload: no `load_failed`, no respawn, and the old worker serves on."""
    old, replies, rollouts = reload_that_fails(sup)
    assert replies == [
        (
            False,
            (
                "worker_failed",
                "a new worker of 'sim' could not load the model (exit code 78; its error is in serve's log); "
                "the old workers serve on",
            ),
        )
    ]
    assert ("sim", "load_failed") not in sup.events and ("sim", "reload_failed") in sup.events
    assert not rollouts.active
    sup.check(2.0)
    assert sup.workers == [old] and sup.running(old) and not old.retired  # the new one is gone
    assert sup.current("sim") == [old] and not sup.all_given_up("sim")


def test_a_first_start_that_cannot_load_its_model_is_still_a_configuration_error(sup: Any) -> None:
    sup.exit_code = EXIT_MODEL_LOAD_FAILED
    sup.start(now=0.0)
    dead(sup.workers[0])
    sup.check(0.5)
    assert sup.events == [("sim", "load_failed")]


def test_a_failed_reload_says_the_error_its_new_worker_wrote(sup: Any) -> None:
    sup.says = "cannot load model 'sim=pkg.mod:Net': FileNotFoundError: weights.bin"
    _, replies, _ = reload_that_fails(sup)
    assert replies == [
        (
            False,
            (
                "worker_failed",
                "a new worker of 'sim' could not load the model (exit code 78): cannot load model "
                "'sim=pkg.mod:Net': FileNotFoundError: weights.bin; the old workers serve on",
            ),
        )
    ]


def test_a_reload_answered_may_start_the_models_next_reload_at_once(sup: Any) -> None:
    """A reload's answer can begin the same model's next one (a multiplexed pool whose
    catalog grows again, batcher.serve.multiplexed_pool): that one is under way, not
    taken for the one that ended."""
    old, _, rollouts = reload_that_fails(sup)
    assert not rollouts.active
    sup.exit_code = None
    chained: list[tuple[bool, Any]] = []

    def again(ok: bool, result: Any) -> None:
        rollouts.start("sim", lambda ok, result: chained.append((ok, result)), 3.0)

    sup.exit_code = EXIT_MODEL_LOAD_FAILED
    rollouts.start("sim", again, 2.0)
    (new,) = [w for w in sup.workers if w is not old and not w.given_up and not w.retired]
    dead(new)
    sup.check(2.5)
    sup.exit_code = None
    rollouts.step(2.5)  # the second reload fails; its answer starts a third
    assert "sim" in rollouts.active and rollouts.active["sim"].started_at == 3.0
    assert chained == []  # the third is not answered with the second's outcome
