"""Warm-up and cost profiling: before READY, a worker runs its model at each batch size
it may get, on zero inputs of its signature, and fits t(n) = a + b*n to the times.

Two things come of it. The first real request does not pay for the model's first run
(memory allocation, kernel selection, lazy initialisation), and the broker's adaptive
policy knows the model's cost from the first request on, instead of learning it from
live batches (READY carries `cost_ms`: [a, b] in milliseconds). Only a model with a
signature can be warmed up: its zero inputs are built from it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from batcher.signature import Signature
from batcher.tensor import DATATYPES

#: Runs per batch size; the fastest counts (the others pay for the first run's set-up).
RUNS = 3


def warmup_sizes(max_batch_size: int, batch_sizes: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The batch sizes to run: the allowed ones, or 1, 2, 4, ... up to max_batch_size."""
    if batch_sizes:
        return tuple(batch_sizes)
    sizes, n = [], 1
    while n < max_batch_size:
        sizes.append(n)
        n *= 2
    return (*sizes, max_batch_size)


def zero_input(signature: Signature) -> Any:
    """One request's input of zeros: its tensor (a map of them for several inputs), each
    without the batch axis, a dynamic axis taken as 1."""
    import numpy as np

    def zeros(shape: tuple[int, ...], datatype: str) -> Any:
        return np.zeros([1 if d < 0 else d for d in shape[1:]], dtype=np.dtype(DATATYPES[datatype]))

    arrays = {s.name: zeros(s.shape, s.datatype) for s in signature.inputs}
    return next(iter(arrays.values())) if len(arrays) == 1 else arrays


def profile(
    model: Callable[[list[Any]], list[Any]],
    signature: Signature,
    sizes: tuple[int, ...],
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, float]:
    """Run `model` RUNS times at each size on zero inputs; (a, b) in ms of the least
    squares line through the fastest time of each size (b = 0 with one size)."""
    x = zero_input(signature)
    points = []
    for n in sizes:
        best = float("inf")
        for _ in range(RUNS):
            t0 = clock()
            model([x] * n)
            best = min(best, clock() - t0)
        points.append((n, best * 1000.0))
    return fit(points)


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) of t(n) = a + b*n by least squares, both >= 0."""
    count = len(points)
    mean_n = sum(n for n, _ in points) / count
    mean_t = sum(t for _, t in points) / count
    var = sum((n - mean_n) ** 2 for n, _ in points)
    if var == 0:
        return max(0.0, mean_t), 0.0
    b = max(0.0, sum((n - mean_n) * (t - mean_t) for n, t in points) / var)
    return max(0.0, mean_t - b * mean_n), b
