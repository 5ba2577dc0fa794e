"""batcher.core.cost_model on its own: which fit a model's batch cost is learned over
(`batch_cost_basis` in `stats`, docs/protocol.md 4.4), and how it scales with the unit of
a request's `cost` (the rules through a whole Scheduler are in
tests/unit/core/test_scheduler_policy.py, section 8)."""

from __future__ import annotations

import math
import random

import pytest

from batcher.core.cost_model import RATE_QUANTUM_S, RATE_TAU_S, ArrivalRate, CostModel


def _jitter(rng: random.Random) -> float:
    """A batch's time varies by up to 2 ms for reasons neither fit sees (the machine)."""
    return rng.uniform(-0.002, 0.002)


def _history_without_costs(cm: CostModel, rng: random.Random, batches: int) -> None:
    """Batches of requests without a `cost`, whose time follows their count (jittered)."""
    for _ in range(batches):
        n = rng.randint(1, 8)
        cm.observe(n, 0.020 + 0.0025 * n + _jitter(rng))


@pytest.mark.parametrize("history", [0, 50, 400])
def test_a_model_whose_time_follows_the_count_keeps_the_count_fit_when_costs_come(history: int) -> None:
    """Requests start sending a `cost` that follows their count only roughly (sizes vary
    by up to 10%), while the time still follows the count: the cost fit, a little worse,
    is never taken, whatever the model ran before and however long it runs after."""
    rng = random.Random(7)
    cm = CostModel()
    _history_without_costs(cm, rng, history)
    for _ in range(300):
        n = rng.randint(1, 8)
        cost = n * rng.uniform(0.9, 1.1)
        cm.observe(n, 0.020 + 0.0025 * n + _jitter(rng), cost)
        assert not cm.by_cost
    assert cm.predict(4, 4.4) == pytest.approx(0.030, abs=0.001)


@pytest.mark.parametrize("history", [0, 400])
def test_a_model_whose_time_follows_the_costs_takes_the_cost_fit_soon_after_costs_come(
    history: int,
) -> None:
    """Requests of a model that ran long without costs (each request then costs 1) start
    sending a `cost` around 1 that sets the time: the model takes the cost fit within 20
    batches (its old errors decay like any others) and predicts by cost."""
    rng = random.Random(11)
    cm = CostModel()
    for _ in range(history):
        n = rng.randint(1, 8)
        cm.observe(n, 0.002 + 0.01 * n + _jitter(rng))
    for _ in range(20):
        n = rng.randint(1, 8)
        cost = sum(rng.uniform(0.2, 1.8) for _ in range(n))
        cm.observe(n, 0.002 + 0.01 * cost + _jitter(rng), cost)
    assert cm.by_cost
    assert cm.predict(3, 1.0) == pytest.approx(0.002 + 0.01, abs=0.002)
    assert cm.predict(3, 5.0) == pytest.approx(0.002 + 0.05, abs=0.002)


@pytest.mark.parametrize("unit", [1e-6, 1e-4, 1e-2, 1.0, 1e3, 1e6])
def test_the_cost_fit_does_not_depend_on_the_unit_of_cost(unit: float) -> None:
    """A request's `cost` is in any unit the model's work follows (tokens, kilotokens,
    pixels: docs/protocol.md 4.1): the same batches with their costs in another unit give
    the same choice of fit, the same predictions, and a cost slope scaled by the unit."""
    rng = random.Random(3)
    batches = []
    for _ in range(60):
        n = rng.randint(1, 8)
        batches.append((n, float(sum(rng.randint(1, 200) for _ in range(n)))))
    in_units, reference = CostModel(), CostModel()
    for n, cost in batches:
        seconds = 0.002 + 0.0001 * cost
        reference.observe(n, seconds, cost)
        in_units.observe(n, seconds, cost * unit)
    assert reference.by_cost and in_units.by_cost
    assert in_units.predict(3, 500.0 * unit) == pytest.approx(reference.predict(3, 500.0), rel=1e-6)
    assert in_units.coefficients() == pytest.approx(reference.coefficients(), rel=1e-6)
    a, b = in_units._cost.coefficients()
    assert (a, b * unit) == pytest.approx(reference._cost.coefficients(), rel=1e-6)


@pytest.mark.parametrize("cost", [1e-300, 1e-4, 0.37, 1.0, 5000.0, 1e6, 1.23456789e9, 1e15])
def test_batches_of_one_summed_cost_give_the_mean_time_and_no_cost_slope(cost: float) -> None:
    """Batches that all sum to the same `cost`, however large or small (a request's cost is
    any number in (0, 1e15]): the cost fit has one x, so its line is the recent mean time,
    flat, never a slope fitted to rounding noise of its sums (nor a division by a variance
    of 0, where a tiny cost's square is 0)."""
    cm = CostModel()
    times = (0.010, 0.011, 0.012, 0.013, 0.0105)
    for seconds in times:
        cm.observe(2, seconds, cost)
    d = CostModel.DECAY
    weights = [d**k for k in range(len(times) - 1, -1, -1)]
    mean = sum(w * t for w, t in zip(weights, times, strict=True)) / sum(weights)
    assert cm._cost.coefficients() == pytest.approx((mean, 0.0), abs=1e-12)


def test_arrivals_within_a_quantum_share_the_first_ones_time() -> None:
    """The rate decays once a RATE_QUANTUM_S, not once a request: arrivals closer than
    that to the last decay count at its time (at most 0.5% low)."""
    rate = ArrivalRate()
    rate.arrive(5.0)
    rate.arrive(5.0 + RATE_QUANTUM_S / 2)
    assert rate.per_second(5.0) == 2 / RATE_TAU_S
    exact = (math.exp(-RATE_QUANTUM_S / 2 / RATE_TAU_S) + 1) / RATE_TAU_S
    assert rate.per_second(5.0 + RATE_QUANTUM_S / 2) == pytest.approx(exact, rel=0.005)


def test_an_arrival_a_whole_quantum_later_decays_the_count() -> None:
    rate = ArrivalRate()
    rate.arrive(0.0)
    rate.arrive(RATE_QUANTUM_S)
    decayed = math.exp(-RATE_QUANTUM_S / RATE_TAU_S) + 1
    assert rate.per_second(RATE_QUANTUM_S) == pytest.approx(decayed / RATE_TAU_S)
