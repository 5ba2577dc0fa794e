"""The clients' expiry rule (batcher.core.expiry) on its own: plain floats for the time,
and property tests over every attempt count, retry count and wait."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batcher.core.expiry import Attempts, Resend, TimedOut, check_retries, expire
from batcher.errors import SettingsError


def test_a_request_is_resent_while_retries_last_with_a_deadline_one_wait_from_now() -> None:
    assert expire(Attempts(1, 5.0), 100.0, 2) == Resend(attempt=2, deadline=105.0)
    assert expire(Attempts(2, 5.0), 105.0, 2) == Resend(attempt=3, deadline=110.0)
    assert expire(Attempts(3, 5.0), 110.0, 2) == TimedOut(attempts=3)


def test_without_retries_the_first_expiry_answers_timeout() -> None:
    assert expire(Attempts(1, 0.25), 7.0, 0) == TimedOut(attempts=1)


def test_a_request_that_waits_forever_is_never_resent() -> None:
    assert expire(Attempts(1, None), 1e9, 10) == TimedOut(attempts=1)


def test_negative_retries_are_refused_with_the_value() -> None:
    check_retries(0)
    with pytest.raises(SettingsError, match="retries must be >= 0, got -1"):
        check_retries(-1)


@given(
    retries=st.integers(0, 50),
    wait_s=st.one_of(st.none(), st.floats(1e-6, 1e6)),
    now=st.floats(0, 1e9),
)
def test_a_request_goes_exactly_retries_plus_one_times_and_each_deadline_follows_now(
    retries: int, wait_s: float | None, now: float
) -> None:
    attempts, sends = 1, 1
    while True:
        verdict = expire(Attempts(attempts, wait_s), now, retries)
        if isinstance(verdict, TimedOut):
            assert verdict.attempts == attempts
            break
        assert verdict.attempt == attempts + 1 and verdict.deadline == now + wait_s  # type: ignore[operator]
        attempts, sends = verdict.attempt, sends + 1
        assert wait_s is not None
        now = verdict.deadline
    assert sends == (1 if wait_s is None else retries + 1)
