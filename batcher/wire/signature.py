"""Model signatures: the tensors a model takes and gives, as a worker announces them in
READY and the `metadata` control request returns them, and the broker's check of a
request against them before it is batched (docs/protocol.md, "Model signatures").

A signature lists each input and output as {"name", "datatype", "shape"}, the shape
with its batch axis first and -1 for a dynamic axis, as the Open Inference Protocol
has it. A request carries each tensor without the batch axis. The broker reads only
the tensors' headers (datatype and shape), never their data, and needs no numpy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from batcher.errors import SettingsError
from batcher.wire.codes import clip
from batcher.wire.tensor import DATATYPES, MAX_ELEMENTS, MAX_RANK

#: The longest tensor name a signature may hold.
MAX_NAME = 256
#: The most inputs (and outputs) a signature may list.
MAX_TENSORS = 1024


@dataclass(frozen=True)
class TensorSpec:
    """One input or output: its name, datatype and shape (batch axis first, -1 dynamic)."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        name = self.name
        if not isinstance(name, str) or not name or len(name) > MAX_NAME or not name.isprintable():
            raise SettingsError(
                f"a tensor's name must be a printable str of 1 to {MAX_NAME} characters, "
                f"got {clip(name, 200)}"
            )
        if not isinstance(self.datatype, str) or self.datatype not in DATATYPES:
            raise SettingsError(
                f"tensor {self.name!r}: datatype must be one of {', '.join(DATATYPES)}, "
                f"got {clip(self.datatype)}"
            )
        shape = self.shape
        if (
            not isinstance(shape, tuple)
            or not 1 <= len(shape) <= MAX_RANK + 1
            or not all(type(d) is int and -1 <= d <= MAX_ELEMENTS for d in shape)
        ):
            raise SettingsError(
                f"tensor {self.name!r}: shape must be 1 to {MAX_RANK + 1} ints >= -1 (the batch axis "
                f"first), got {clip(shape, 200)}"
            )

    def wire(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}

    def misfit(self, datatype: object, shape: object) -> str | None:
        """Why a request's tensor (without the batch axis) does not fit, or None."""
        want = list(self.shape[1:])
        if datatype != self.datatype:
            return f"input {self.name!r} must be {self.datatype}, got {clip(datatype)}"
        if (
            not isinstance(shape, list)
            or len(shape) != len(want)
            or not all(type(d) is int and (w == -1 or d == w) for d, w in zip(shape, want, strict=True))
        ):
            return (
                f"input {self.name!r} must have shape {want} (-1: any), without the batch axis; "
                f"got {clip(shape, 200)}"
            )
        return None


@dataclass(frozen=True)
class Signature:
    """A model's inputs and outputs."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def __post_init__(self) -> None:
        if not self.inputs:
            raise SettingsError("a signature must name at least one input")
        if len(self.inputs) > MAX_TENSORS or len(self.outputs) > MAX_TENSORS:
            raise SettingsError(f"a signature has at most {MAX_TENSORS} inputs and {MAX_TENSORS} outputs")
        for kind, specs in (("input", self.inputs), ("output", self.outputs)):
            names = [s.name for s in specs]
            if len(set(names)) != len(names):
                raise SettingsError(f"{kind} names must differ, got {names}")

    def wire(self) -> dict[str, Any]:
        """As READY and the `metadata` reply carry it."""
        return {"inputs": [s.wire() for s in self.inputs], "outputs": [s.wire() for s in self.outputs]}

    @classmethod
    def from_wire(cls, raw: object) -> Signature:
        """A signature from its wire form; ValueError naming what is wrong."""
        if not isinstance(raw, dict) or set(raw) - {"inputs", "outputs"}:
            raise SettingsError(f"a signature is a map of inputs and outputs, got {clip(raw, 145)}")

        def specs(key: str) -> tuple[TensorSpec, ...]:
            items = raw.get(key, [])
            if not isinstance(items, list):
                raise SettingsError(f"signature {key} must be a list, got {clip(items, 150)}")
            out = []
            for item in items:
                if not isinstance(item, dict) or set(item) != {"name", "datatype", "shape"}:
                    raise SettingsError(
                        f"a signature's tensor is a map of name, datatype and shape, got {clip(item, 130)}"
                    )
                shape = item["shape"]
                out.append(
                    TensorSpec(
                        item["name"], item["datatype"], tuple(shape) if isinstance(shape, list) else shape
                    )
                )
            return tuple(out)

        return cls(specs("inputs"), specs("outputs"))

    def misfit(self, body: Any) -> str | None:
        """Why a request body's `input` does not fit this signature, or None. A model of
        one input takes its tensor alone or in a map under its name; a model of several,
        a map of exactly its input names."""
        given = _read_input_headers(body)
        if given is None:
            return f"the input must be {self._expected()}"
        if isinstance(given, _TensorHeader):
            if len(self.inputs) != 1:
                return f"the input must be {self._expected()}, got one tensor"
            return self.inputs[0].misfit(given.datatype, given.shape)
        names = [s.name for s in self.inputs]
        missing = [n for n in names if n not in given]
        unknown = [n for n in given if n not in names]
        if missing or unknown:
            return f"the input must be {self._expected()}; missing {missing}, unknown {unknown}"
        for spec in self.inputs:
            why = spec.misfit(given[spec.name].datatype, given[spec.name].shape)
            if why is not None:
                return why
        return None

    def _expected(self) -> str:
        if len(self.inputs) == 1:
            s = self.inputs[0]
            return f"a {s.datatype} tensor of shape {list(s.shape[1:])} (or a map of {s.name!r} to it)"
        return f"a map of the tensors {[s.name for s in self.inputs]}"


class _TensorHeader(msgspec.Struct, forbid_unknown_fields=True):
    """A tensor map's header; its data is skipped, unread."""

    datatype: Any
    shape: Any
    data: msgspec.Raw


class _One(msgspec.Struct):
    input: _TensorHeader


class _Named(msgspec.Struct):
    input: dict[str, _TensorHeader]


_READERS: list[Callable[[Any], _One | _Named]] = [
    msgspec.msgpack.Decoder(_One).decode,
    msgspec.msgpack.Decoder(_Named).decode,
]


def _read_input_headers(body: Any) -> _TensorHeader | dict[str, _TensorHeader] | None:
    """The input's tensor header, or its map of them; None when the input is neither."""
    for read in _READERS:
        try:
            return read(body).input
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            continue
    return None


def signature_of(model: object) -> Signature | None:
    """The signature a model declares as its `signature` attribute: a Signature, or its
    wire form (a dict; ValueError when malformed). Anything else there (a method of the
    same name, say) is no declaration."""
    declared = getattr(model, "signature", None)
    if isinstance(declared, Signature):
        return declared
    if isinstance(declared, dict):
        return Signature.from_wire(declared)
    return None
