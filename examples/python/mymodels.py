"""User models as the README shows them ("a model of your own"). From this directory:

    batcher serve --model double=mymodels:Doubler --workers 2
    batcher send --model double 1 2 3

or, with a broker already running, `batcher worker --model double=mymodels:Doubler`.
"""

from __future__ import annotations

from typing import Any


class Doubler:
    """A class model: built once per worker, with the worker's GPU id (None without one)."""

    def __init__(self, gpu_id: int | None) -> None:
        # With a GPU id the worker has set CUDA_VISIBLE_DEVICES to it before building us,
        # so the one GPU this process sees is cuda:0. Without one, use the CPU.
        self.device = "cpu" if gpu_id is None else "cuda:0"

    def __call__(self, inputs: list[Any]) -> list[Any]:
        return [2 * x for x in inputs]


def reciprocal(inputs: list[Any]) -> list[Any]:
    """A function model that may fail single inputs: an exception returned in place of an
    output answers that request alone with `model_error`, the others are served."""
    outputs: list[Any] = []
    for x in inputs:
        try:
            outputs.append(1 / x)
        except (TypeError, ZeroDivisionError) as exc:
            outputs.append(exc)
    return outputs
