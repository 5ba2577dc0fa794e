"""A broker's drain on a float clock (batcher/core/drain.py, sans-I/O): serve what was
taken within the grace, then answer the rest; a second signal ends it at once."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batcher.core.drain import Drain, DrainVerdict


def test_work_left_within_the_grace_is_served() -> None:
    d = Drain(since=100.0, grace_s=10.0)
    assert d.grace_end == 110.0
    assert d.verdict(109.9, busy=True, forced=False) is DrainVerdict.WAIT
    assert d.verdict(110.0, busy=True, forced=False) is DrainVerdict.ANSWER_ALL


def test_a_second_signal_answers_everything_at_once() -> None:
    assert Drain(0.0, 10.0).verdict(0.0, busy=True, forced=True) is DrainVerdict.ANSWER_ALL


def test_a_grace_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="grace_s must be >= 0, got -1"):
        Drain(0.0, -1.0)


@given(since=st.floats(0, 1e6), grace_s=st.floats(0, 1e4), later_s=st.floats(0, 2e4), forced=st.booleans())
def test_nothing_left_is_done_and_the_verdict_never_goes_back(
    since: float, grace_s: float, later_s: float, forced: bool
) -> None:
    d = Drain(since, grace_s)
    now = since + later_s
    assert d.verdict(now, busy=False, forced=forced) is DrainVerdict.DONE
    if d.verdict(now, busy=True, forced=forced) is DrainVerdict.ANSWER_ALL:
        assert d.verdict(now + 1.0, busy=True, forced=forced) is DrainVerdict.ANSWER_ALL
    else:
        assert not forced and now < d.grace_end
