"""The autoscaling signal (batcher.core.scaling, batcher.broker.autoscale): the formula on
its own, the offered rate over a fake clock, and a Scheduler's views turned into the
signal as the broker's timer does it."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batcher.broker.autoscale import Autoscale
from batcher.broker.loop import BrokerSettings
from batcher.core.limits import BatchSettings
from batcher.core.scaling import (
    ArrivalWindow,
    Desire,
    desire,
    desired_cells,
    desired_workers,
    round_up_workers,
    scaling_batch_size,
    workers_needed,
)
from batcher.core.scheduler import QueueFull, Scheduler
from batcher.errors import SettingsError
from tests.scheduler_builders import START_S, rq

#: The issue's example: t(n) = 20 + 2.5 n ms.
A_S, B_S = 0.020, 0.0025


def test_the_issues_example_four_workers_serve_1280_and_640_needs_three() -> None:
    # 4 workers at B = 32: t(32) = 100 ms, so 4 * 32 / 0.1 = 1,280 req/s at full use
    assert desired_workers(1280.0, A_S, B_S, 32, 1.0) == 4
    assert desired_workers(1280.0 + 1, A_S, B_S, 32, 1.0) == 5
    # 640 req/s at a 0.7 target: 640 * 0.1 / (32 * 0.7) = 2.86 -> 3
    assert desired_workers(640.0, A_S, B_S, 32, 0.7) == 3
    assert desired_workers(0.0, A_S, B_S, 32, 0.7) == 0
    assert desired_workers(0.01, A_S, B_S, 32, 0.7) == 1  # any load needs a worker
    assert workers_needed(640.0, A_S, B_S, 32, 0.7) == pytest.approx(640 * 0.1 / (32 * 0.7))


def test_summed_over_cells_the_unrounded_need_scales_in() -> None:
    """Four cells with a little load each: each rounds up to one worker, but together
    they need one; the sum a ScaledObject takes is of workers_needed."""
    per_cell = [workers_needed(50.0, A_S, B_S, 32, 0.7) for _ in range(4)]
    assert sum(desired_workers(50.0, A_S, B_S, 32, 0.7) for _ in range(4)) == 4
    assert math.ceil(sum(per_cell)) == 1


def test_the_issues_example_through_a_fake_clock_and_a_scheduler() -> None:
    """640 req/s offered to a Scheduler for 12 s of fake time, sampled each second as the
    broker's timer does, with the cost learned from workers' reports: 3 workers desired,
    and 2 cells of 2 workers."""
    s = Scheduler(BatchSettings(max_batch_size=32, max_queue=100_000), models=["m"])
    s.seed_cost("m", A_S, B_S)
    auto = Autoscale(0.7, {"m": 2})
    now = START_S
    for _ in range(12):
        auto.tick(now, s.views())
        for i in range(640):
            s.enqueue("m", rq(now + i / 640))
        now += 1.0
        assert len(s.take("m", 640)) == 640  # served: the queue never fills
    auto.tick(now, s.views())
    d = auto.desires["m"]
    assert d.rate_per_s == pytest.approx(640.0)
    assert (d.batch_size, d.workers, d.cells) == (32, 3, 2)
    wire = auto.wire("m")
    assert wire["desired_workers"] == 3 and wire["target_utilization"] == 0.7
    assert wire["workers_needed"] == pytest.approx(640 * 0.1 / (32 * 0.7), abs=1e-3)
    assert wire["cell_workers"] == 2


def test_refused_requests_count_as_offered() -> None:
    """A full queue's refusals are load too: the signal must see them, or an overloaded
    model would look as busy as its capacity and never scale past it."""
    s = Scheduler(BatchSettings(max_queue=5), models=["m"])
    for i in range(8):
        try:
            s.enqueue("m", rq(START_S))
        except QueueFull:
            assert i >= 5
    assert s.views()["m"].offered == 8


def test_no_signal_before_the_cost_is_learned_unless_idle() -> None:
    settings = BatchSettings(max_batch_size=16)
    assert desire(100.0, None, settings, 0.7, 4).workers is None
    assert desire(100.0, None, settings, 0.7, 4).cells is None
    assert desire(0.0, None, settings, 0.7, 4).workers == 0
    assert desire(100.0, (A_S, B_S), settings, 0.7, None).cells is None  # a plain broker


def test_the_batch_size_is_the_largest_the_policy_may_cut() -> None:
    assert scaling_batch_size(BatchSettings(max_batch_size=32)) == 32
    assert scaling_batch_size(BatchSettings(max_batch_size=24, batch_sizes=(1, 8, 16))) == 16


def test_arrival_window_over_a_fake_clock() -> None:
    w = ArrivalWindow(10.0)
    assert w.per_second() == 0.0
    w.observe(0.0, 0)
    assert w.per_second() == 0.0  # one sample spans no time
    total = 0
    for t in range(1, 31):  # 100/s for 20 s, then 300/s for 10 s
        total += 100 if t <= 20 else 300
        w.observe(float(t), total)
        if t == 5:
            assert w.per_second() == pytest.approx(100.0)  # over what the first samples span
    assert w.per_second() == pytest.approx(300.0)  # the window holds the last 10 s only
    w.observe(31.0, total)  # nothing more offered
    assert w.per_second() == pytest.approx(270.0)
    w.observe(32.0, 5)  # a count that went back (a restart): start over
    assert w.per_second() == 0.0


@given(
    rate=st.floats(0.001, 1e6),
    a=st.floats(0.0, 1.0),
    b=st.floats(0.0, 0.1),
    n=st.integers(1, 512),
    target=st.floats(0.05, 1.0),
)
def test_desired_workers_serve_the_rate_at_the_target_and_one_fewer_does_not(
    rate: float, a: float, b: float, n: int, target: float
) -> None:
    """The desired count is the fewest workers whose full-batch capacity, taken at the
    target share, carries the rate."""
    if a + b * n <= 0:
        return
    w = desired_workers(rate, a, b, n, target)
    per_worker = n / (a + b * n) * target  # requests a second one worker takes at the target
    assert w >= 1
    assert w * per_worker >= rate * (1 - 1e-6)
    if w > 1:
        assert (w - 1) * per_worker < rate * (1 + 1e-6)


@given(
    rate=st.floats(1.0, 1e5),
    low=st.floats(0.1, 1.0),
    high=st.floats(0.1, 1.0),
    more=st.floats(0.0, 1e5),
)
def test_desired_workers_grow_with_the_rate_and_fall_with_the_target(
    rate: float, low: float, high: float, more: float
) -> None:
    low, high = min(low, high), max(low, high)
    assert desired_workers(rate, A_S, B_S, 32, low) >= desired_workers(rate, A_S, B_S, 32, high)
    assert desired_workers(rate + more, A_S, B_S, 32, 0.7) >= desired_workers(rate, A_S, B_S, 32, 0.7)


@given(workers=st.integers(0, 10_000), per_cell=st.integers(1, 64))
def test_desired_cells_hold_the_workers(workers: int, per_cell: int) -> None:
    cells = desired_cells(workers, per_cell)
    assert cells * per_cell >= workers
    assert cells == 0 or (cells - 1) * per_cell < workers
    assert cells == math.ceil(workers / per_cell)


@pytest.mark.parametrize("target", [0, -0.1, 1.01, math.nan, math.inf, True, "0.7"])
def test_a_bad_target_is_refused_with_its_value(target: object) -> None:
    with pytest.raises(SettingsError, match="target_utilization must be a number > 0 and <= 1"):
        BrokerSettings(target_utilization=target)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="target_utilization"):
        desired_workers(1.0, A_S, B_S, 8, target)  # type: ignore[arg-type]


def test_bad_cell_workers_are_refused() -> None:
    with pytest.raises(SettingsError, match="cell_workers of model 'm' must be an int >= 0, got -1"):
        BrokerSettings(cell_workers={"m": -1})


def test_the_stats_table_shows_the_signal_once_there_is_one() -> None:
    from batcher.cli.stats_table import format_stats

    entry = {
        "target_utilization": 0.7, "offered_per_s": 640.0, "scaling_batch_size": 32,
        "desired_workers": 3, "workers_needed": 2.857, "desired_cells": 2, "cell_workers": 2,
    }  # fmt: skip
    snapshot = {"models": {"m": {"scaling": entry}}}
    lines = format_stats(snapshot).splitlines()
    assert (
        "m: scaling: 640.0 req/s offered needs 3 workers (2.86 before rounding up) "
        "at target 0.7: 2 cells of 2" in lines
    )
    quiet = {"models": {"m": {"scaling": {**entry, "desired_workers": None}}}}
    assert not any("scaling" in line for line in format_stats(quiet).splitlines())
    odd = {"models": {"m": {"scaling": {**entry, "target_utilization": "x", "desired_cells": True}}}}
    assert "at target -" in format_stats(odd)  # a value of the wrong type is shown as none


def test_a_load_in_workers_rounds_up_to_whole_workers_and_none_to_none() -> None:
    assert [round_up_workers(x) for x in (0.0, -1.0, 1e-12, 0.4, 2.0, 2.0000000001, 2.01)] == [
        0,
        0,
        1,
        1,
        2,
        2,
        3,
    ]


def test_the_signal_of_a_learned_cost_uses_both_coefficients() -> None:
    settings = BatchSettings(max_batch_size=32)
    signal = desire(640.0, (A_S, B_S), settings, 0.7, 2)
    assert signal.workers == 3 and signal.cells == 2
    assert signal.needed == pytest.approx(640 * (A_S + 32 * B_S) / (32 * 0.7))
    assert desire(1000.0, (A_S, B_S), settings, 0.7, 2).workers == 5  # ceil(4.46): a counts
    # With no cost learned, only no load at all says something: none needed.
    assert desire(0.5, None, settings, 0.7, 2).workers is None
    quiet = desire(0.0, None, settings, 0.7, 2)
    assert quiet.workers == 0 and quiet.needed == 0.0 and quiet.cells == 0


def test_the_signal_on_the_wire_names_and_rounds_every_field() -> None:
    assert Desire(640.12345, 32, 3, 2.857142857, 2).wire() == {
        "offered_per_s": 640.123,
        "scaling_batch_size": 32,
        "desired_workers": 3,
        "workers_needed": 2.8571,
        "desired_cells": 2,
    }
    assert Desire(0.0, 8, None, None, None).wire()["workers_needed"] is None


def test_bad_counts_and_windows_are_refused_with_their_values() -> None:
    with pytest.raises(ValueError, match=r"^workers_per_cell must be >= 1, got 0$"):
        desired_cells(3, 0)
    with pytest.raises(ValueError, match=r"^batch_size must be >= 1, got 0$"):
        workers_needed(1.0, A_S, B_S, 0, 0.7)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match=f"^window_s must be a finite number > 0, got {bad}$"):
            ArrivalWindow(bad)
    assert ArrivalWindow(0.5).window_s == 0.5  # under a second is a window too


def test_the_window_keeps_one_sample_at_or_before_its_start() -> None:
    w = ArrivalWindow(10.0)
    w.observe(0.0, 0)
    w.observe(1.0, 10)
    assert w.per_second() == pytest.approx(10.0)  # two samples are enough
    w.observe(5.0, 50)
    w.observe(20.0, 100)  # (0, 0) and (1, 10) fall out; (5, 50) is the one before the start
    assert w.per_second() == pytest.approx(50 / 15)


def test_a_sample_at_the_same_time_is_kept_and_spans_no_time() -> None:
    w = ArrivalWindow(10.0)
    w.observe(1.0, 5)
    w.observe(1.0, 7)  # the same instant, a higher count: not a clock gone back
    assert w.per_second() == 0.0
    w.observe(2.0, 17)
    assert w.per_second() == pytest.approx(12.0)  # from the first sample, kept
