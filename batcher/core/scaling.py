"""The autoscaling signal: how many workers a model needs for the load it is offered.

A worker running batches of n requests, each taking t(n) = a + b*n (the cost model's fit,
batcher.core.cost_model), serves at most n / t(n) requests a second. For an offered
arrival rate r and a target utilization rho (0 < rho <= 1, `--target-utilization`):

    desired workers = ceil( r * t(n) / (n * rho) )

with n the batch the policy cuts at that rate once the workers run at the target: under
load the adaptive policy sizes batches so that the workers stay busy (n = r*a / (W*rho -
r*b) for W workers, batcher.core.policy), and the fewest workers whose batch for r still
fits in the model's largest batch are the ones for n = max_batch_size (rounded down to an
allowed `batch_sizes` value): solving r*a / (W*rho - r*b) <= n_max for W gives the formula.
So rho is the share of the full-batch capacity the load may take: 4 workers at B = 32
with t(n) = 20 + 2.5n ms serve 4 * 32 / 0.1 s = 1,280 req/s; at 640 req/s and rho = 0.7,
ceil(640 * 0.1 / (32 * 0.7)) = ceil(2.86) = 3 workers are desired. With fewer requests the
batches shrink and the same workers serve them with room to spare.

`desired cells` = ceil(desired workers / workers of the model in one cell), where a cell
(a `batcher serve`) knows that count. Pure functions and values: the broker passes the
time and the counts in (no clock is read here).
"""

from __future__ import annotations

import math
import sys
from collections import deque
from dataclasses import dataclass

from batcher.core.limits import BatchSettings

#: The window over which the offered arrival rate of the signal is measured (seconds):
#: long enough that one burst does not scale a deployment, short against the minutes a
#: new pod takes to be ready.
SCALING_WINDOW_S = 10.0
#: How often the broker samples its models' offered-request counts for the signal.
SCALING_TICK_S = 1.0
#: The default share of the full-batch capacity the load may take.
DEFAULT_TARGET_UTILIZATION = 0.7
#: Slack for float rounding: 3.0000000001 workers are 3, not 4.
_EPSILON = 1e-9

__all__ = [
    "DEFAULT_TARGET_UTILIZATION",
    "SCALING_TICK_S",
    "SCALING_WINDOW_S",
    "ArrivalWindow",
    "Desire",
    "check_target_utilization",
    "desire",
    "desired_cells",
    "desired_workers",
    "round_up_workers",
    "scaling_batch_size",
    "workers_needed",
]


def check_target_utilization(target: float) -> str | None:
    """Why `target` is no target utilization (0 < target <= 1), or None when it is one."""
    if isinstance(target, bool) or not isinstance(target, int | float) or not 0 < target <= 1:
        return f"target_utilization must be a number > 0 and <= 1, got {target!r}"
    return None


def workers_needed(rate_per_s: float, a_s: float, b_s: float, batch_size: int, target: float) -> float:
    """rate * t(n) / (n * target) with t(n) = a + b*n in seconds, not rounded: the load in
    workers at the target. Summed over cells it is what a deployment needs (a sum of each
    cell's rounded-up count would keep a cell per loaded cell, and never scale in)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if problem := check_target_utilization(target):
        raise ValueError(problem)
    batch_s = a_s + b_s * batch_size
    if rate_per_s <= 0 or batch_s <= 0:
        return 0.0
    # A load too small for a float (5e-324 s batches) is still a load: some worker takes it.
    return max(rate_per_s * batch_s / (batch_size * target), sys.float_info.min)


def desired_workers(rate_per_s: float, a_s: float, b_s: float, batch_size: int, target: float) -> int:
    """ceil(rate * t(n) / (n * target)) (module docstring); 0 for no load, else >= 1."""
    return round_up_workers(workers_needed(rate_per_s, a_s, b_s, batch_size, target))


def round_up_workers(needed: float) -> int:
    """Workers for a load of `needed` workers (a broker's, or a deployment's sum): 0 for
    none, else at least 1, and 3.0000000001 is 3."""
    return 0 if needed <= 0 else max(1, math.ceil(needed - _EPSILON))


def desired_cells(workers: int, workers_per_cell: int) -> int:
    """The cells that hold `workers` of a model, `workers_per_cell` in each."""
    if workers_per_cell < 1:
        raise ValueError(f"workers_per_cell must be >= 1, got {workers_per_cell}")
    return -(-workers // workers_per_cell)


def scaling_batch_size(settings: BatchSettings) -> int:
    """The batch the policy cuts when the workers run at the target: the model's largest
    (its largest allowed `batch_sizes` value, when it lists them)."""
    return settings.cut_size(settings.max_batch_size)


class ArrivalWindow:
    """Requests offered per second over the last `window_s`, from a running total of
    requests offered sampled now and then (`observe`); the first samples give the rate
    over what they span."""

    def __init__(self, window_s: float = SCALING_WINDOW_S) -> None:
        if not 0 < window_s < math.inf:
            raise ValueError(f"window_s must be a finite number > 0, got {window_s}")
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def observe(self, now: float, total: int) -> None:
        """The running total of offered requests at `now` (times never go back)."""
        samples = self._samples
        if samples and (now < samples[-1][0] or total < samples[-1][1]):
            samples.clear()  # a clock or a count that went back: start over
        samples.append((now, total))
        # Keep one sample at or before the window's start, so the rate spans all of it.
        while len(samples) > 2 and samples[1][0] <= now - self.window_s:
            samples.popleft()

    def per_second(self) -> float:
        """The offered rate over the window (0 before two samples)."""
        samples = self._samples
        if len(samples) < 2:
            return 0.0
        (t0, n0), (t1, n1) = samples[0], samples[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0


@dataclass(frozen=True, slots=True)
class Desire:
    """A model's signal as `stats` and the metrics show it."""

    rate_per_s: float
    batch_size: int
    #: None while the model's batch time is not learned yet (no batch answered).
    workers: int | None
    #: workers before rounding up (workers_needed); None when workers is.
    needed: float | None
    #: None where the cell's worker count is not known (a plain broker) or workers is None.
    cells: int | None

    def wire(self) -> dict[str, object]:
        """As `stats` carries it (docs/protocol.md, 4.4)."""
        return {
            "offered_per_s": round(self.rate_per_s, 3),
            "scaling_batch_size": self.batch_size,
            "desired_workers": self.workers,
            "workers_needed": None if self.needed is None else round(self.needed, 4),
            "desired_cells": self.cells,
        }


def desire(
    rate_per_s: float,
    cost: tuple[float, float] | None,
    settings: BatchSettings,
    target: float,
    cell_workers: int | None,
) -> Desire:
    """The signal of a model offered `rate_per_s`, of learned `cost` (a, b) or None, with
    `cell_workers` of its workers in one cell (None or 0: not known)."""
    n = scaling_batch_size(settings)
    workers = needed = None
    if cost is not None:
        needed = workers_needed(rate_per_s, cost[0], cost[1], n, target)
        workers = desired_workers(rate_per_s, cost[0], cost[1], n, target)
    elif rate_per_s <= 0:
        workers, needed = 0, 0.0
    cells = None
    if workers is not None and cell_workers:
        cells = desired_cells(workers, cell_workers)
    return Desire(rate_per_s, n, workers, needed, cells)
