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


class MeanPool:
    """A stacked, padded model: it gets the whole batch as one array and each request's
    true length (docs/protocol.md 3.1, "Batched arrays"). A request's input is a tensor of
    shape (length, dim), its length its own; the worker pads the batch to the longest
    with zeros, and the model returns one row per request: the mean over its own rows.

        batcher serve --model pool=mymodels:MeanPool --workers 1
    """

    from workers.stacking import Stack  # here, so that the models above need no numpy

    stack = Stack(pad_axes=(0,), pad_value=0)

    def __init__(self, gpu_id: int | None) -> None:
        self.gpu_id = gpu_id

    def __call__(self, batch: Any, lengths: Any) -> Any:
        # batch: (n, longest, dim), zeros past each request's length; lengths: (n, 1)
        return batch.sum(axis=1) / lengths


class TokenDoubler:
    """Padded in, cut back out: a (length,) tensor of token ids comes back doubled, its own
    length again (`unpad_axes`), though the model saw the batch padded to the longest."""

    from workers.stacking import Stack

    stack = Stack(pad_axes=(0,), pad_value=-1, unpad_axes=(0,))

    def __init__(self, gpu_id: int | None) -> None:
        self.gpu_id = gpu_id

    def __call__(self, tokens: Any, lengths: Any) -> Any:
        return tokens * 2
