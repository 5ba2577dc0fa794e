"""Models for the unit tests of workers/models.py, loaded as `tests.unit_models:NAME`."""

from __future__ import annotations

from typing import Any

#: Not a model at all: loading it must fail with a clear TypeError.
NOT_CALLABLE = 42


def double(inputs: list[Any]) -> list[Any]:
    """A plain user function: every input times two."""
    return [x * 2 for x in inputs]


class GpuModel:
    """A user class: built once per worker with the worker's GPU id."""

    instances = 0

    def __init__(self, gpu: int | None) -> None:
        self.gpu = gpu
        GpuModel.instances += 1

    def __call__(self, inputs: list[Any]) -> list[Any]:
        return [{"input": x, "gpu": self.gpu} for x in inputs]


class Namespace:
    """Holds a model one attribute deep, for `module:Namespace.shout`."""

    @staticmethod
    def shout(inputs: list[Any]) -> list[Any]:
        return [str(x).upper() for x in inputs]
