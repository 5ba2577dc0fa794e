"""The link core on a float clock (batcher/core/link.py): the back-off's waits, a link's
beats, expiry, reconnects and give-up, and the rules of the four links that drive it (a
worker's, the gateway's, a MultiClient frontend's, serve's respawns). No sockets."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batcher.core.link import Backoff, Beat, Drop, GiveUp, PeerLink, Reconnect

WORKER = Backoff(initial_s=0.25, cap_s=8.0)


# --- Backoff --------------------------------------------------------------------------------


def test_the_waits_double_from_initial_up_to_the_cap() -> None:
    assert [WORKER.delay_s(n) for n in range(1, 9)] == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert WORKER.delay_s(10_000) == 8.0  # no overflow after a long run of failures


def test_a_factor_of_one_waits_the_same_each_time() -> None:
    b = Backoff(initial_s=1.5, cap_s=4.0, factor=1.0)
    assert [b.delay_s(n) for n in (1, 2, 50)] == [1.5, 1.5, 1.5]


def test_jitter_shortens_a_wait_by_up_to_its_fraction() -> None:
    b = Backoff(initial_s=1.0, cap_s=10.0, jitter=0.5)
    assert b.delay_s(2, 0.0) == 2.0
    assert b.delay_s(2, 0.5) == 1.5
    assert b.delay_s(2, 0.999) == pytest.approx(1.001)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"initial_s": 0, "cap_s": 1}, "initial_s must be > 0, got 0"),
        ({"initial_s": -1.0, "cap_s": 1}, "initial_s must be > 0, got -1.0"),
        ({"initial_s": float("nan"), "cap_s": 1}, "initial_s must be > 0, got nan"),
        ({"initial_s": 2, "cap_s": 1}, "cap_s must be finite and >= initial_s (2), got 1"),
        ({"initial_s": 1, "cap_s": float("inf")}, "cap_s must be finite and >= initial_s (1), got inf"),
        ({"initial_s": 1, "cap_s": 2, "factor": 0.5}, "factor must be >= 1, got 0.5"),
        ({"initial_s": 1, "cap_s": 2, "jitter": 1.0}, "jitter must be in [0, 1), got 1.0"),
        ({"initial_s": 1, "cap_s": 2, "jitter": -0.1}, "jitter must be in [0, 1), got -0.1"),
    ],
)
def test_bad_settings_are_refused_with_a_precise_message(fields: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError) as info:
        Backoff(**fields)
    assert str(info.value) == message


def test_a_wait_is_for_a_failure_count_of_one_or_more_and_a_draw_below_one() -> None:
    with pytest.raises(ValueError, match="failures must be an int >= 1, got 0"):
        WORKER.delay_s(0)
    with pytest.raises(ValueError, match=r"draw must be in \[0, 1\), got 1"):
        WORKER.delay_s(1, 1)


@st.composite
def valid_backoffs(draw: st.DrawFn) -> Backoff:
    initial = draw(st.floats(0.001, 100))
    cap = initial + draw(st.floats(0, 1000))
    return Backoff(initial, cap, draw(st.floats(1, 10)), draw(st.floats(0, 0.99)))


@given(valid_backoffs(), st.integers(1, 3000), st.floats(0, 0.999))
def test_a_wait_never_exceeds_the_cap_nor_falls_below_its_jitter(b: Backoff, n: int, draw: float) -> None:
    wait = b.delay_s(n, draw)
    assert wait <= b.cap_s
    assert wait >= b.delay_s(n) * (1 - b.jitter) - 1e-12
    assert wait > 0


@given(valid_backoffs(), st.integers(1, 3000))
def test_without_jitter_the_waits_never_go_down(b: Backoff, n: int) -> None:
    assert b.delay_s(n + 1) >= b.delay_s(n)
    assert b.delay_s(1) == b.initial_s


# --- PeerLink: a worker's link to its broker ------------------------------------------------


def worker_link() -> PeerLink:
    link = PeerLink(WORKER, beat_s=1.0, expiry_s=3.0)
    link.connected(0.0)
    return link


def test_a_connected_link_beats_every_beat_s() -> None:
    link = worker_link()
    assert link.next_wakeup() == 1.0
    assert link.due(0.5) is None
    assert link.due(1.0) == Beat()
    assert link.due(1.0) is None
    assert link.next_wakeup() == 2.0


def test_a_peer_unheard_for_expiry_s_is_dropped_and_reconnected_after_the_back_off() -> None:
    link = worker_link()
    link.heard(1.5)
    assert link.due(4.4) == Beat()  # 4.4 - 1.5 < 3: not expired yet
    drop = link.due(4.5)
    assert isinstance(drop, Drop) and drop.retry_in_s == 0.25 and drop.failures == 1
    assert drop.why == "no word from the peer in 3s"  # what the worker logs
    assert not link.up and link.next_wakeup() == 4.75
    assert link.due(4.7) is None
    assert link.due(4.75) == Reconnect()
    assert link.up and link.next_wakeup() == 5.75  # a fresh connection: its own beat and expiry


def test_failures_in_a_row_double_the_wait_and_a_word_heard_resets_it() -> None:
    link = worker_link()
    waits = []
    now = 0.0
    for _ in range(7):
        drop = link.refused("CURVE key not listed", now)
        assert isinstance(drop, Drop)
        waits.append(drop.retry_in_s)
        now += drop.retry_in_s
        assert link.due(now) == Reconnect()
    assert waits == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
    link.heard(now)
    assert link.failures == 0
    drop = link.refused("lost", now + 1)
    assert isinstance(drop, Drop) and drop.retry_in_s == 0.25
    again = link.refused("still lost", now + 2)  # not heard in between: doubled
    assert isinstance(again, Drop) and again.retry_in_s == 0.5


def test_a_shorter_heartbeat_said_by_the_peer_is_due_within_its_interval() -> None:
    link = PeerLink(WORKER, beat_s=10.0, expiry_s=30.0)
    link.connected(0.0)
    link.heard(2.0)
    link.retime(0.5, 1.5, 2.0)
    assert link.next_wakeup() == 2.5
    link.retime(0.5, 0.25, 2.0)  # the expiry counts from the last word heard
    assert link.next_wakeup() == 2.25
    link.retime(0.5, 1.5, 2.0)
    link.retime(5.0, 15.0, 2.1)  # longer: the beat already due stays
    assert link.next_wakeup() == 2.5


def test_a_fresh_link_is_down_and_waits_until_it_is_connected_or_heard() -> None:
    link = PeerLink(WORKER, beat_s=1.0, expiry_s=3.0)
    assert link.up is False and link.given_up is False and link.failures == 0
    assert link.next_wakeup() is None and link.due(100.0) is None
    link.heard(5.0)  # a peer that speaks first is up: its beats and expiry count from then
    assert link.up is True and link.next_wakeup() == 6.0
    assert link.due(6.0) == Beat()
    assert isinstance(link.due(8.0), Drop)  # 3 s after the word heard at 5.0


def test_heartbeats_turned_off_and_on_by_the_peer() -> None:
    link = worker_link()
    link.retime(None, 3.0, 0.5)  # no beats: only the expiry wakes it
    assert link.next_wakeup() == 3.0 and link.due(2.9) is None
    link.heard(2.9)
    link.retime(1.0, 3.0, 4.0)  # beats again: the first within beat_s of now
    assert link.next_wakeup() == 5.0
    assert link.due(5.0) == Beat()


def test_a_link_without_heartbeats_never_wakes_by_itself_while_up() -> None:
    link = PeerLink(WORKER)
    link.connected(0.0)
    assert link.next_wakeup() is None and link.due(1e9) is None


def test_bad_link_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="beat_s must be > 0 or None, got 0"):
        PeerLink(WORKER, beat_s=0)
    with pytest.raises(ValueError, match="stable_s must be >= 0, got -1"):
        PeerLink(WORKER, stable_s=-1)
    with pytest.raises(ValueError, match="give_up_after must be an int >= 1 or None, got 0"):
        PeerLink(WORKER, give_up_after=0)
    with pytest.raises(ValueError, match=r"^expiry_s must be > 0 or None, got 0$"):
        PeerLink(WORKER, expiry_s=0)


def test_heartbeat_settings_a_peer_says_are_checked_as_at_the_start() -> None:
    link = worker_link()
    with pytest.raises(ValueError, match=r"^beat_s must be > 0 or None, got 0$"):
        link.retime(0, 3.0, 1.0)
    with pytest.raises(ValueError, match=r"^expiry_s must be > 0 or None, got -1.0$"):
        link.retime(1.0, -1.0, 1.0)


def test_a_link_that_gives_up_after_one_failure_gives_up_at_the_first() -> None:
    link = PeerLink(WORKER, give_up_after=1)
    assert link.refused("refused", 0.0) == GiveUp("refused", 1)
    assert link.given_up and link.next_wakeup() is None and link.due(1e9) is None


def test_without_a_source_of_draws_a_jittered_wait_is_exact() -> None:
    link = PeerLink(Backoff(1.0, 10.0, jitter=0.5))
    assert link.refused("x", 0.0) == Drop("x", 1.0, 1)


def test_jitter_is_drawn_from_the_injected_source() -> None:
    link = PeerLink(Backoff(1.0, 10.0, jitter=0.5), rand=lambda: 0.5)
    drop = link.refused("x", 0.0)
    assert isinstance(drop, Drop) and drop.retry_in_s == 0.75


# --- the gateway's rule: a connection counts as stable once it lasted stable_s -------------


def test_a_connection_that_lasted_stable_s_restarts_the_back_off() -> None:
    link = PeerLink(Backoff(0.1, 2.0), stable_s=1.0)
    link.connected(0.0)
    waits = []
    for t in (0.0, 1.0, 2.0, 3.0):
        link.connected(t)
        link.heard(t + 0.01)  # the handshake
        waits.append(link.refused("lost", t + 0.5).retry_in_s)  # type: ignore[union-attr]
    assert waits == [0.1, 0.2, 0.4, 0.8]
    link.connected(10.0)
    link.heard(10.0)
    assert link.refused("lost", 11.0) == Drop("lost", 0.1, 1)  # lasted: from the start again
    assert link.refused("lost", 11.5) == Drop("lost", 0.2, 2)


# --- serve's rule: deaths after a start are not start-up failures; give up after N ---------


def respawns() -> PeerLink:
    return PeerLink(Backoff(0.5, 10.0), give_up_after=5, count_stable_failure=False)


def test_start_up_failures_back_off_and_are_given_up_after_give_up_after() -> None:
    link = respawns()
    results = []
    for t in range(5):
        link.connected(float(t))
        results.append(link.refused("exit 3", t + 0.1))
    assert [r.retry_in_s for r in results[:4]] == [0.5, 1.0, 2.0, 4.0]  # type: ignore[union-attr]
    assert results[4] == GiveUp("exit 3", 5)
    assert link.given_up and link.due(1e9) is None and link.next_wakeup() is None


def test_a_process_that_started_and_then_died_is_retried_at_once_and_not_counted() -> None:
    link = respawns()
    for t in range(20):
        link.connected(float(t))
        link.heard(t + 0.1)  # it joined
        assert link.refused("exit 1", t + 0.2) == Drop("exit 1", 0.5, 0)
    link.connected(100.0)
    assert link.refused("exit 1", 100.1) == Drop("exit 1", 0.5, 1)
    link.connected(101.0)
    assert link.refused("exit 1", 101.1) == Drop("exit 1", 1.0, 2)


# --- properties -----------------------------------------------------------------------------

events = st.lists(
    st.tuples(st.sampled_from(["heard", "refused", "due", "retime"]), st.floats(0, 5)), max_size=60
)


@given(valid_backoffs(), events, st.floats(0, 3), st.integers(0, 2**32))
def test_a_link_keeps_its_rules_whatever_happens(
    b: Backoff, script: list[tuple[str, float]], stable_s: float, seed: int
) -> None:
    """The waits never exceed the cap and, from one failure to the next in a row, never
    go down (without jitter); due() acts from next_wakeup() on, never before it."""
    rng = random.Random(seed)
    exact = Backoff(b.initial_s, b.cap_s, b.factor)
    link = PeerLink(exact, beat_s=1.0, expiry_s=2.5, stable_s=stable_s, rand=rng.random)
    link.connected(0.0)
    now, last = 0.0, (0, 0.0)  # (failures in a row, the wait after the last of them)

    def check(drop: Drop) -> tuple[int, float]:
        assert 0 < drop.retry_in_s <= exact.cap_s
        if drop.failures == last[0] + 1:
            assert drop.retry_in_s >= last[1]
        assert link.next_wakeup() == now + drop.retry_in_s
        return drop.failures, drop.retry_in_s

    for event, step in script:
        now += step
        wake = link.next_wakeup()
        if event == "heard" and link.up:
            link.heard(now)
        elif event == "refused":
            drop = link.refused("x", now)
            assert isinstance(drop, Drop)
            last = check(drop)
        elif event == "retime":
            link.retime(rng.choice([0.5, 1.0, 2.0]), 2.5, now)
        else:
            action = link.due(now)
            assert (action is None) == (wake is None or now < wake)
            while action is not None:  # taken as done: the calls end
                if isinstance(action, Drop):
                    last = check(action)
                action = link.due(now)
            assert link.next_wakeup() is None or link.next_wakeup() > now  # type: ignore[operator]


@given(st.integers(1, 40), st.floats(0.001, 10), st.floats(0.001, 100))
def test_heard_resets_the_back_off(failures: int, initial: float, extra: float) -> None:
    link = PeerLink(Backoff(initial, initial + extra))
    for i in range(failures):
        link.refused("x", float(i))
    link.connected(100.0)
    link.heard(100.0)
    assert link.failures == 0
    assert link.refused("x", 101.0) == Drop("x", initial, 1)


def test_a_peer_heard_while_down_is_up_again_and_its_back_off_starts_over() -> None:
    """A MultiClient frontend's rule: down after a timeout, probed after each wait
    (doubling while the probes go unanswered), and any answer brings it back."""
    link = PeerLink(Backoff(1.0, 30.0))
    assert [link.refused("no reply", t).retry_in_s for t in (0.0, 1.0, 3.0)] == [1.0, 2.0, 4.0]  # type: ignore[union-attr]
    link.heard(7.0)
    assert link.up and link.failures == 0
    assert link.refused("no reply", 8.0) == Drop("no reply", 1.0, 1)
