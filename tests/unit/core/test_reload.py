"""A rolling reload's phases on plain facts (batcher/core/reload.py, sans-I/O)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from batcher.core.reload import ReloadFacts, ReloadPhase, ReloadStep, advance, finished

P, S = ReloadPhase, ReloadStep
TIMEOUT_S = 300.0


def facts(**changes: object) -> ReloadFacts:
    base = ReloadFacts(new_failed=False, new_ready=False, waited_s=0.0, old_idle=False, old_running=True)
    return base._replace(**changes)


def test_a_reload_goes_new_ready_then_old_drained_then_old_gone() -> None:
    assert advance(P.STARTING, facts(), TIMEOUT_S) == (P.STARTING, S.WAIT)
    assert advance(P.STARTING, facts(new_ready=True), TIMEOUT_S) == (P.DRAINING, S.DRAIN_OLD)
    assert advance(P.DRAINING, facts(new_ready=True), TIMEOUT_S) == (P.DRAINING, S.WAIT)
    assert advance(P.DRAINING, facts(old_idle=True), TIMEOUT_S) == (P.STOPPING, S.RETIRE_OLD)
    assert advance(P.STOPPING, facts(old_idle=True), TIMEOUT_S) == (P.STOPPING, S.WAIT)
    assert advance(P.STOPPING, facts(old_running=False), TIMEOUT_S) == (P.DONE, S.ANSWER_DONE)


def test_new_workers_that_exit_or_are_late_fail_the_reload_and_a_failure_wins_over_ready() -> None:
    assert advance(P.STARTING, facts(new_failed=True, new_ready=True), TIMEOUT_S) == (
        P.FAILED,
        S.FAIL_NEW_EXITED,
    )
    assert advance(P.STARTING, facts(waited_s=TIMEOUT_S), TIMEOUT_S) == (P.STARTING, S.WAIT)
    assert advance(P.STARTING, facts(waited_s=TIMEOUT_S + 0.1), TIMEOUT_S) == (P.FAILED, S.FAIL_NEW_LATE)
    assert advance(P.STARTING, facts(waited_s=1e9, new_ready=True), TIMEOUT_S) == (P.DRAINING, S.DRAIN_OLD)


@given(
    phase=st.sampled_from(ReloadPhase),
    f=st.builds(ReloadFacts, st.booleans(), st.booleans(), st.floats(0, 1e4), st.booleans(), st.booleans()),
)
def test_every_move_is_forward_and_an_ended_reload_never_moves(phase: ReloadPhase, f: ReloadFacts) -> None:
    order = [P.STARTING, P.DRAINING, P.STOPPING, P.DONE]
    new_phase, step = advance(phase, f, TIMEOUT_S)
    if finished(phase):
        assert (new_phase, step) == (phase, S.WAIT)
    elif new_phase is phase:
        assert step is S.WAIT
    elif new_phase is P.FAILED:
        assert phase is P.STARTING and step in (S.FAIL_NEW_EXITED, S.FAIL_NEW_LATE)
    else:
        assert order.index(new_phase) == order.index(phase) + 1 and step is not S.WAIT
