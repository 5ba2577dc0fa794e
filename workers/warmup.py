"""Warm-up and cost profiling: before READY, a worker runs its model at each batch size
it may get, on one request's input repeated, and fits t(n) = a + b*n to the times.

Two things come of it. The first real request does not pay for the model's first run
(memory allocation, kernel selection, lazy initialisation), and the broker's adaptive
policy knows the model's cost from the first request on, instead of learning it from
live batches (READY carries `cost_ms`: [a, b] in milliseconds).

The input is a sample of one request's input, as Triton's model_warmup takes one from
the model's configuration: the JSON file `worker --warmup-sample` names (serve: a model
table's `warmup_sample`), else the model's own `warmup_sample` attribute (the input as
the model gets it: an array, a map of them, any value); else zeros of its signature,
each dynamic axis taken as 1.
A model with neither is not warmed up. A run that fails (the model raises, returns
the wrong count, or fails any input alone, as the ONNX model does per request) is
never measured: the warm-up stops there and says why (WarmupFailed), the worker
announces no cost and says so in READY (`warmup_error`), and the broker derives no
time limit from it (docs/reliability.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from batcher.errors import BatcherError
from batcher.wire.signature import Signature
from batcher.wire.tensor import DATATYPES

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


class WarmupFailed(BatcherError):
    """A warm-up run failed: nothing it measured is used; the message says why."""


def sample_of(model: object, signature: Signature | None) -> Any:
    """The input a model is warmed up on: its `warmup_sample`, else zeros of its signature;
    None when it has neither (it is not warmed up)."""
    sample = getattr(model, "warmup_sample", None)
    if sample is not None:
        return sample
    return None if signature is None else zero_input(signature)


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
    sample: Any,
    sizes: tuple[int, ...],
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, float]:
    """Run `model` RUNS times at each size on `sample` repeated; (a, b) in ms of the least
    squares line through the fastest time of each size (b = 0 with one size).
    WarmupFailed at the first run that fails: no failed run is ever measured."""
    points = []
    for n in sizes:
        best = float("inf")
        for _ in range(RUNS):
            t0 = clock()
            try:
                outputs = model([sample] * n)
            except Exception as exc:
                raise WarmupFailed(f"at batch size {n} the model raised {type(exc).__name__}: {exc}") from exc
            elapsed = clock() - t0
            why = _failure(outputs, n)
            if why is not None:
                raise WarmupFailed(f"at batch size {n} {why}")
            best = min(best, elapsed)
        points.append((n, best * 1000.0))
    return fit(points)


def _failure(outputs: object, n: int) -> str | None:
    """Why a run's outputs are no success (the worker would answer an error), or None."""
    if not isinstance(outputs, list | tuple) or len(outputs) != n:
        got = f"{len(outputs)} outputs" if isinstance(outputs, list | tuple) else repr(type(outputs))
        return f"the model returned {got} for a batch of {n}"
    failed = next((out for out in outputs if isinstance(out, BaseException)), None)
    if failed is not None:
        return f"the model failed its input: {type(failed).__name__}: {failed}"
    return None


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
