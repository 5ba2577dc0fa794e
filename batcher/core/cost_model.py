"""What a model's queue learns of its load: the batch time t(n) = a + b*n, fitted online
from the workers' reports (`CostModel`), and the requests' arrival rate (`ArrivalRate`).

The adaptive policy (batcher.core.policy) weighs waiting against dispatching with them,
and the default time limit of a batch follows the learned cost.
"""

from __future__ import annotations

import copy
import math

#: Time constant of the arrival-rate estimate (seconds).
RATE_TAU_S = 0.2
#: Arrivals this close together share one decay of the rate (ArrivalRate.arrive).
RATE_QUANTUM_S = 0.001


class _LinearFit:
    """y = a + b*x by exponentially weighted least squares (recent points count most)."""

    DECAY = 0.97

    def __init__(self) -> None:
        self._w = self._x = self._xx = self._y = self._xy = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.DECAY
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._xx = self._xx * d + x * x
        self._y = self._y * d + y
        self._xy = self._xy * d + x * y

    @property
    def known(self) -> bool:
        return self._w > 0

    def coefficients(self) -> tuple[float, float]:
        """(a, b); with a single x seen so far, b = 0 and a = the mean y."""
        w = self._w
        if w == 0:
            return 0.0, 0.0
        mean_x, mean_y = self._x / w, self._y / w
        var_x = self._xx / w - mean_x * mean_x
        if var_x <= 1e-6 * mean_x * mean_x:  # relative: the same fit in any unit of x
            return mean_y, 0.0
        b = max(0.0, (self._xy / w - mean_x * mean_y) / var_x)
        a = max(0.0, mean_y - b * mean_x)
        return a, b


class CostModel:
    """The batch cost of one model, learned online from worker reports: t(n) = a + b*n
    over the request count, and t(c) = a + b*c over the batch's summed request `cost`.
    Each fit's recent prediction error is kept; the cost fit is used once it predicts
    clearly better (requests of one model that differ in size: tokens, pixels)."""

    DECAY = 0.97
    #: The cost fit must err this much less than the count fit to be used.
    BETTER = 0.8
    #: Batches seen before the fits are judged.
    MIN_BATCHES = 8

    def __init__(self) -> None:
        self._count = _LinearFit()
        self._cost = _LinearFit()
        self._err_count = self._err_cost = 0.0
        self._batches = 0
        self._cost_per_request = 1.0  # recent mean of a request's cost
        # Until a batch's summed cost differs from its count (requests without a `cost`),
        # the cost fit would be the count fit point for point: it is not kept (on a lone
        # request's path its second fit cost 20 us), and copied from it the first time.
        self._costs_differ = False

    def observe(self, n: int, seconds: float, cost: float | None = None) -> None:
        """A batch of `n` requests (of summed `cost`, when known) took `seconds`."""
        if cost is None:
            cost = float(n)
        if cost == n and not self._costs_differ:
            if self._batches:
                miss = self._predict(self._count, n) - seconds
                self._err_count = self._err_count * self.DECAY + miss * miss
            self._batches += 1
            self._count.add(n, seconds)
            return
        if not self._costs_differ:
            self._costs_differ = True
            self._cost = copy.copy(self._count)
            self._err_cost = self._err_count
        d = self.DECAY
        if self._batches:
            self._err_count = self._err_count * d + (self._predict(self._count, n) - seconds) ** 2
            self._err_cost = self._err_cost * d + (self._predict(self._cost, cost) - seconds) ** 2
            self._cost_per_request = self._cost_per_request * d + (1 - d) * (cost / n if n else 1.0)
        else:
            self._cost_per_request = cost / n if n else 1.0
        self._batches += 1
        self._count.add(n, seconds)
        self._cost.add(cost, seconds)

    def seed(self, a_s: float, b_s: float, max_batch_size: int) -> None:
        """Learn t(n) = a + b*n as measured by a worker's warm-up, at n = 1 and at the
        largest batch, unless a cost was already learned from batches (which is kept)."""
        if self.known:
            return
        for n in sorted({1, max(2, max_batch_size)}):
            self.observe(n, a_s + b_s * n)

    @staticmethod
    def _predict(fit: _LinearFit, x: float) -> float:
        a, b = fit.coefficients()
        return a + b * x

    @property
    def known(self) -> bool:
        return self._batches > 0

    @property
    def by_cost(self) -> bool:
        """Whether the cost fit predicts clearly better than the count fit (and is used)."""
        return (
            self._costs_differ
            and self._batches >= self.MIN_BATCHES
            and self._err_cost < self.BETTER * self._err_count
        )

    def coefficients(self) -> tuple[float, float]:
        """(a, b) in seconds of t(n) = a + b*n: from the count fit, or from the cost fit at
        the recent mean cost of a request, when that fit is used."""
        if self.by_cost:
            a, b = self._cost.coefficients()
            return a, b * self._cost_per_request
        return self._count.coefficients()

    def predict(self, n: int, cost: float | None = None) -> float:
        """The expected time of a batch of `n` requests of summed `cost` (when known)."""
        if cost is not None and self.by_cost:
            return self._predict(self._cost, cost)
        a, b = self.coefficients()
        return a + b * n


class ArrivalRate:
    """Requests per second, an exponentially decaying count over about RATE_TAU_S."""

    def __init__(self) -> None:
        self._count = 0.0
        self._at = 0.0

    def arrive(self, now: float) -> None:
        # Arrivals within RATE_QUANTUM_S of the last decay are counted at its time (a
        # drain's requests each have their own arrival stamp): one exp() a quantum, not
        # one a request, for a rate at most 1 - exp(-QUANTUM/TAU) = 0.5% low.
        if now - self._at < RATE_QUANTUM_S:
            self._count += 1.0
            return
        self._count = self._count * math.exp(-(now - self._at) / RATE_TAU_S) + 1.0
        self._at = now

    def per_second(self, now: float) -> float:
        return self._count * math.exp(-max(0.0, now - self._at) / RATE_TAU_S) / RATE_TAU_S
