"""Batched arrays for models: the worker stacks a batch's tensors, pads what differs,
and splits the model's output back into one reply per request.

A model asks for it with an attribute (docs/protocol.md, "Tensors"; examples/python):

    class Tagger:
        stack = Stack(pad_axes=(0,), pad_value=0, unpad_axes=(0,))
        def __call__(self, tokens, lengths): ...   # tokens: (n, longest); lengths: (n, 1)

Without padding (`stack = True`, or `Stack()`) the model is called with one array of
shape (n, ...), or a dict of them when each input is a map of named tensors, of
requests whose tensors have the same dtype and shape. With `pad_axes`, the shapes may
differ along those axes of a request's tensor (axis 0 is the first axis after the batch
axis): each is padded with `pad_value` to the batch's longest, and the model gets a
second argument, `lengths`, an int64 array (n, len(pad_axes)) of each request's true
lengths. The model returns an array (or a dict of arrays) whose first axis is the
batch; each request gets its row, cut back to its own length along `unpad_axes` (the
output axes matching `pad_axes`, one for one).

A batch's requests of different forms (dtype, rank, shape outside `pad_axes`, map
names) are stacked apart, one model call per form, and no call's padded arrays hold
more than `max_padded_elements` elements (`plan_runs`; --max-padded-elements): a
request's answer never depends on its batch-mates. A request that cannot be stacked at
all (not a tensor or a map of them, its rank without the padded axes), or that is over
the budget alone, is answered `bad_request` on its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from batcher.wire.tensor import TensorError
from workers.models import MAX_PADDED_ELEMENTS, check_max_padded_elements


class BadInput(TensorError):
    """An input that does not fit the model's declared batch: answered bad_request."""


@dataclass(frozen=True)
class Stack:
    """How a model wants its batch: stacked, and padded along `pad_axes`."""

    pad_axes: tuple[int, ...] = ()
    pad_value: float = 0
    unpad_axes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("pad_axes", "unpad_axes"):
            axes = getattr(self, name)
            if not all(isinstance(a, int) and not isinstance(a, bool) and a >= 0 for a in axes):
                raise ValueError(f"{name} must be axes >= 0, got {axes!r}")
            if len(set(axes)) != len(axes):
                raise ValueError(f"{name} must not repeat an axis, got {axes!r}")
        if self.unpad_axes and len(self.unpad_axes) != len(self.pad_axes):
            raise ValueError(
                f"unpad_axes must match pad_axes one for one, got {self.unpad_axes!r} for {self.pad_axes!r}"
            )


def stacking_of(model: object) -> Stack | None:
    """The Stack a model declares (its `stack` attribute), or None."""
    declared = getattr(model, "stack", None)
    if declared is None or declared is False:
        return None
    if declared is True:
        return Stack()
    if not isinstance(declared, Stack):
        raise TypeError(f"a model's `stack` must be True or a Stack, got {declared!r}")
    return declared


def pad(arrays: list[np.ndarray], axes: tuple[int, ...], value: float) -> tuple[np.ndarray, np.ndarray]:
    """Stack `arrays` (of one form: `_form`) into one array, each padded with
    `value` to the largest along `axes`; and their lengths along `axes`, (n, len(axes))."""
    first = arrays[0]
    lengths = np.array([[a.shape[d] for d in axes] for a in arrays], dtype=np.int64)
    lengths = lengths.reshape(len(arrays), len(axes))
    shape = list(first.shape)
    for k, d in enumerate(axes):
        shape[d] = int(lengths[:, k].max())
    out = np.full((len(arrays), *shape), value, dtype=first.dtype)
    for i, a in enumerate(arrays):
        index: tuple[Any, ...] = (i, *[slice(0, n) for n in a.shape])
        out[index] = a
    return out, lengths


def unpad(batch: np.ndarray, lengths: np.ndarray, axes: tuple[int, ...]) -> list[np.ndarray]:
    """Each row of `batch`, cut back along `axes` to that row's `lengths`."""
    rows = []
    for i in range(batch.shape[0]):
        index: list[slice] = [slice(None)] * (batch.ndim - 1)
        for k, d in enumerate(axes):
            index[d] = slice(0, int(lengths[i, k]))
        rows.append(batch[i][tuple(index)])
    return rows


def wrap(model: Callable[..., Any], stack: Stack, max_padded_elements: int = MAX_PADDED_ELEMENTS) -> Stacked:
    """A list-in, list-out model (what the worker calls) around a model that takes and
    returns batched arrays; inputs that cannot be stacked get BadInput instances."""
    return Stacked(model, stack, max_padded_elements)


class Stacked:
    """A stacked model as the worker calls it. After each batch, `last_padding` holds
    (padded elements, real elements) of its inputs, which the worker reports to the
    broker (stats and Prometheus show padded / real as the padding waste).

    A batch's inputs are grouped by form (`_form`: dtype, rank, the shape outside the
    padded axes, the names of a map), and each group is cut into runs whose padded
    arrays hold at most `max_padded_elements` elements (`plan_runs`): the model is called
    once per run. So a request's answer never depends on its batch-mates: requests of
    different forms never share a stacked array, and no mate's long axis can pad another
    request past the budget. A request alone over the budget is answered bad_request."""

    def __init__(
        self, model: Callable[..., Any], stack: Stack, max_padded_elements: int = MAX_PADDED_ELEMENTS
    ) -> None:
        self.model = model
        self.stack = stack
        self.max_padded_elements = check_max_padded_elements(max_padded_elements)
        self.last_padding: tuple[int, int] | None = None

    @property
    def signature(self) -> Any:
        """The wrapped model's declared signature (batcher.wire.signature), if any."""
        return getattr(self.model, "signature", None)

    @property
    def warmup_sample(self) -> Any:
        """The wrapped model's warm-up input (workers/warmup.py), if it gives one."""
        return getattr(self.model, "warmup_sample", None)

    def __call__(self, inputs: list[Any]) -> list[Any]:
        stack = self.stack
        self.last_padding = None
        out: list[Any] = [None] * len(inputs)
        groups: dict[object, list[int]] = {}
        extents: list[tuple[tuple[int, ...], ...]] = [()] * len(inputs)
        for i, x in enumerate(inputs):
            why = _why_not(x, stack.pad_axes)
            if why is not None:
                out[i] = BadInput(why)
                continue
            groups.setdefault(_form(x, stack.pad_axes), []).append(i)
            extents[i] = _extent(x)
        runs: list[list[int]] = []
        for members in groups.values():
            planned, alone_over = plan_runs([extents[i] for i in members], self.max_padded_elements)
            runs.extend([members[k] for k in run] for run in planned)
            for k in alone_over:
                out[members[k]] = BadInput(
                    f"its stacked array would hold {padded_size([extents[members[k]]])} elements, more than "
                    f"the {self.max_padded_elements} a batch may (--max-padded-elements)"
                )
        padded = real = 0
        for run in runs:
            try:
                rows, run_padded, run_real = self._run([inputs[i] for i in run])
            except Exception as exc:
                if len(runs) == 1:
                    raise  # the whole batch failed: the worker answers each request model_error
                rows, run_padded, run_real = [exc] * len(run), 0, 0
            for i, row in zip(run, rows, strict=True):
                out[i] = row
            padded += run_padded
            real += run_real
        if runs:
            self.last_padding = (padded, real)
        return out

    def _run(self, arrays: list[Any]) -> tuple[list[Any], int, int]:
        """One model call on inputs of one form: each one's output, and the padded and real
        elements of the stacked inputs."""
        stack = self.stack
        lengths: np.ndarray | None = None
        first = arrays[0]
        if isinstance(first, dict):
            batch: Any = {}
            real = 0
            for k in first:
                named = [a[k] for a in arrays]
                batch[k], lengths = pad(named, stack.pad_axes, stack.pad_value)
                real += sum(a.size for a in named)
            padded = sum(b.size for b in batch.values()) - real
        else:
            batch, lengths = pad(arrays, stack.pad_axes, stack.pad_value)
            real = sum(a.size for a in arrays)
            padded = batch.size - real
        result = self.model(batch, lengths) if stack.pad_axes else self.model(batch)
        return _split(result, len(arrays), lengths, stack.unpad_axes), int(padded), int(real)


def _extent(x: Any) -> tuple[tuple[int, ...], ...]:
    """An input's shapes, one per tensor (by name, for a map), as `plan_runs` takes them."""
    if isinstance(x, dict):
        return tuple(tuple(x[k].shape) for k in sorted(x, key=repr))
    return (tuple(x.shape),)


def padded_size(extents: list[tuple[tuple[int, ...], ...]]) -> int:
    """The elements of the arrays that inputs of one form, of these extents (`_extent`),
    are stacked into: per tensor, n x the product of the longest length along each axis."""
    n = len(extents)
    total = 0
    for shapes in zip(*extents, strict=True):
        longest = [max(axis) for axis in zip(*shapes, strict=True)]
        total += n * math.prod(longest)
    return total


def plan_runs(
    extents: list[tuple[tuple[int, ...], ...]], max_padded_elements: int
) -> tuple[list[list[int]], list[int]]:
    """(runs, alone_over): the inputs of one form (by their positions in `extents`) cut
    into runs whose stacked arrays hold at most `max_padded_elements` elements
    (`padded_size`), and the inputs over it even alone. Inputs are taken by their lengths
    (so that like lengths share a run and pad each other least), each joining the current
    run while the run's padded size stays within the budget, else starting the next."""
    order = sorted(range(len(extents)), key=lambda i: extents[i])
    runs: list[list[int]] = []
    alone_over: list[int] = []
    current: list[int] = []
    longest: list[tuple[int, ...]] = []  # the current run's longest lengths, per tensor
    for i in order:
        if padded_size([extents[i]]) > max_padded_elements:
            alone_over.append(i)
            continue
        grown = (
            [tuple(map(max, a, b)) for a, b in zip(longest, extents[i], strict=True)]
            if current
            else list(extents[i])
        )
        if current and (len(current) + 1) * sum(math.prod(t) for t in grown) > max_padded_elements:
            runs.append(sorted(current))
            current, grown = [], list(extents[i])
        current.append(i)
        longest = grown
    if current:
        runs.append(sorted(current))
    return runs, sorted(alone_over)


def _form(x: Any, axes: tuple[int, ...]) -> object:
    """What inputs must share to be stacked together: dtype, rank and the shape outside the
    padded axes (per name, for a map of tensors)."""
    if isinstance(x, dict):
        return tuple(sorted(((repr(k), _form(v, axes)) for k, v in x.items()), key=repr))
    return (x.dtype.str, x.ndim, tuple(n for d, n in enumerate(x.shape) if d not in axes))


def _is_tensors(x: object) -> bool:
    """A tensor, or a non-empty map of them."""
    if isinstance(x, dict):
        return bool(x) and all(isinstance(v, np.ndarray) for v in x.values())
    return isinstance(x, np.ndarray)


def _why_not(x: Any, axes: tuple[int, ...]) -> str | None:
    """Why input `x` cannot be stacked at all, or None: it is not a tensor or a map of
    them, its rank has not the padded axes, or its named tensors differ in length along
    them."""
    if not _is_tensors(x):
        return f"input must be a tensor or a map of tensors, got {type(x).__name__}"
    arrays = list(x.values()) if isinstance(x, dict) else [x]
    for a in arrays:
        if any(d >= a.ndim for d in axes):
            return f"the padded axes {list(axes)} do not fit a tensor of rank {a.ndim}"
    if len({tuple(a.shape[d] for d in axes) for a in arrays}) > 1:
        return f"its tensors differ in length along the padded axes {list(axes)}"
    return None


def _split(result: Any, n: int, lengths: np.ndarray | None, axes: tuple[int, ...]) -> list[Any]:
    """The model's batched output as one value per request."""
    if isinstance(result, dict):
        parts = {k: _split(v, n, lengths, axes) for k, v in result.items()}
        return [{k: parts[k][i] for k in parts} for i in range(n)]
    if not isinstance(result, np.ndarray):  # a tuple would be stacked along a new first axis
        raise TypeError(
            f"a stacked model must return an array or a dict of arrays, got {type(result).__name__}"
        )
    batch = result
    if batch.ndim == 0 or batch.shape[0] != n:
        raise ValueError(
            f"a stacked model must return a batch of {n} along axis 0, got shape {list(batch.shape)}"
        )
    if axes and lengths is not None:
        return unpad(batch, lengths, axes)
    return list(batch)
