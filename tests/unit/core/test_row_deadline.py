"""The gateway's timing of a row past its deadline (batcher.core.row_deadline) with plain
floats for the time: the cancel at the broker comes after the broker's own deadline and
before the client is given up on."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batcher.core.row_deadline import CANCEL_AFTER_S, REPLY_GRACE_S, RowDeadline, RowStep


def test_rows_are_cancelled_half_a_second_past_their_deadline_and_given_up_on_at_one() -> None:
    t = RowDeadline(10.0)
    assert (CANCEL_AFTER_S, REPLY_GRACE_S) == (0.5, 1.0)  # docs/gateway.md's figures
    assert (t.cancel_at, t.give_up_at) == (10.5, 11.0)
    assert [t.step(now) for now in (9.0, 10.0, 10.49, 10.5, 10.99, 11.0, 50.0)] == [
        RowStep.WAIT,
        RowStep.WAIT,
        RowStep.WAIT,
        RowStep.CANCEL_AT_BROKER,
        RowStep.CANCEL_AT_BROKER,
        RowStep.GIVE_UP,
        RowStep.GIVE_UP,
    ]
    assert [t.next_wakeup(now) for now in (9.0, 10.49, 10.5, 10.7)] == [10.5, 10.5, 11.0, 11.0]


def test_a_cancel_that_would_not_come_before_the_give_up_is_refused() -> None:
    with pytest.raises(
        ValueError, match=re.escape("need 0 <= cancel_after_s < reply_grace_s, got 1.0 and 1.0")
    ):
        RowDeadline(0.0, cancel_after_s=1.0, reply_grace_s=1.0)
    with pytest.raises(ValueError, match=re.escape("got -0.1 and 1.0")):
        RowDeadline(0.0, cancel_after_s=-0.1)


@given(
    deadline=st.floats(0, 1e9),
    cancel=st.floats(0, 10),
    extra=st.floats(1e-3, 10),
    nows=st.lists(st.floats(0, 1e9 + 30), min_size=1, max_size=20),
)
def test_steps_only_move_forward_and_each_wakeup_is_when_the_step_changes(
    deadline: float, cancel: float, extra: float, nows: list[float]
) -> None:
    t = RowDeadline(deadline, cancel_after_s=cancel, reply_grace_s=cancel + extra)
    order = [RowStep.WAIT, RowStep.CANCEL_AT_BROKER, RowStep.GIVE_UP]
    steps = [order.index(t.step(now)) for now in sorted(nows)]
    assert steps == sorted(steps)
    for now in nows:
        assert deadline <= t.cancel_at < t.give_up_at
        if t.step(now) is not RowStep.GIVE_UP:
            wake = t.next_wakeup(now)
            assert wake > now and t.step(wake) is not t.step(now)
