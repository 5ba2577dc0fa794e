"""Tensors on the wire: one msgpack encoding any language can write and read.

A tensor is a msgpack map of exactly three keys (docs/protocol.md, "Tensors"):

    {"datatype": "FP32", "shape": [2, 3], "data": <bin: the C-order little-endian bytes>}

Everything batcher writes puts the data at a multiple of ALIGN_BYTES from the body's
first byte (batcher/wire/aligned.py), so a receiver may view it with the alignment its
elements need.

The datatype names are the Open Inference Protocol's. A receiver wraps `data` without
copying it (`np.frombuffer`). A tensor may stand anywhere in a request's `input` or a
reply's `output`: alone, as a value of a map, or in a list.

This module never imports numpy at import time: the broker imports it (to check a
tensor's header) and must run without numpy. Converting to and from arrays imports
numpy on first use, so only code that meets an array or wants one back needs it.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable
from typing import Any

import msgspec

from batcher.errors import BatcherError
from batcher.extras import install_command

#: Open Inference Protocol datatype -> the numpy dtype string (little-endian).
DATATYPES: dict[str, str] = {
    "BOOL": "|b1",
    "UINT8": "|u1",
    "UINT16": "<u2",
    "UINT32": "<u4",
    "UINT64": "<u8",
    "INT8": "|i1",
    "INT16": "<i2",
    "INT32": "<i4",
    "INT64": "<i8",
    "FP16": "<f2",
    "FP32": "<f4",
    "FP64": "<f8",
}
#: Bytes per element of each datatype.
ITEM_BYTES: dict[str, int] = {name: int(code[2:]) for name, code in DATATYPES.items()}
#: The keys of a tensor map; a map with exactly these keys is a tensor.
TENSOR_KEYS = frozenset({"datatype", "shape", "data"})
#: Writers put a tensor's data at a multiple of this many bytes from the body's start: the
#: largest element (INT64, UINT64, FP64) is 8 bytes.
ALIGN_BYTES = 8
#: At most this many axes (numpy's own limit is 64).
MAX_RANK = 32
#: At most this many elements (2**48 bytes of FP64 is far past any message).
MAX_ELEMENTS = 2**45


class TensorError(BatcherError, ValueError):
    """A tensor map that breaks the encoding; the message names what is wrong."""


class NotEncodable(BatcherError, TypeError):
    """A value msgpack cannot carry (an object of no msgpack type, an array of a dtype with
    no tensor datatype); a TypeError, as msgpack's own refusal is."""


def is_tensor(value: object) -> bool:
    """Whether `value` (as msgpack decoded it) is meant as a tensor: a map of exactly the
    three tensor keys. Whether it is a *valid* tensor is `check`'s question."""
    return isinstance(value, dict) and len(value) == 3 and value.keys() == TENSOR_KEYS


def check_header(datatype: object, shape: object) -> tuple[str, tuple[int, ...]]:
    """(datatype, shape) if they name a tensor the protocol has, else TensorError."""
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        names = ", ".join(DATATYPES)
        raise TensorError(f"tensor datatype must be one of {names}, got {datatype!r}")
    if not isinstance(shape, list | tuple) or len(shape) > MAX_RANK:
        raise TensorError(f"tensor shape must be a list of at most {MAX_RANK} ints, got {shape!r}")
    for dim in shape:
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
            raise TensorError(f"tensor shape must hold ints >= 0, got {list(shape)!r}")
        if dim > MAX_ELEMENTS:  # even beside a 0 (an empty tensor), no array has such an axis
            raise TensorError(f"tensor shape {list(shape)} has an axis of more than {MAX_ELEMENTS}")
    elements = math.prod(shape)
    if elements > MAX_ELEMENTS:
        raise TensorError(f"tensor shape {list(shape)} has {elements} elements, more than {MAX_ELEMENTS}")
    return datatype, tuple(shape)


def check(value: dict[Any, Any]) -> tuple[str, tuple[int, ...]]:
    """(datatype, shape) of a tensor map, or TensorError saying what is wrong with it."""
    datatype, shape = check_header(value["datatype"], value["shape"])
    data = value["data"]
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TensorError(f"tensor data must be msgpack bin, got {type(data).__name__}")
    expected = math.prod(shape) * ITEM_BYTES[datatype]
    if len(data) != expected:
        raise TensorError(f"tensor data has {len(data)} bytes, but {datatype} {list(shape)} needs {expected}")
    if datatype == "BOOL":
        check_bool(data)
    return datatype, shape


#: A byte that is no BOOL: anything but 0 (false) and 1 (true).
_NOT_BOOL = re.compile(rb"[^\x00\x01]")


def check_bool(data: bytes | bytearray | memoryview) -> None:
    """TensorError unless every byte of a BOOL tensor's data is 0 or 1 (docs/protocol.md
    3.1): any other byte would reach a model as a third truth value (numpy keeps it as
    it is). Vectorised by numpy where it is loaded already (1 ms for 16 MiB); without
    it, bytes.translate in C (12 ms), which builds nothing for valid data, or, for a
    view, the regex engine in place (no copy)."""
    if not data:
        return
    np = sys.modules.get("numpy")
    if np is not None:
        as_bytes = np.frombuffer(data, dtype=np.uint8)
        if as_bytes.max() <= 1:
            return
        at = int((as_bytes > 1).argmax())
        byte = int(as_bytes[at])
    else:
        if isinstance(data, bytes):
            if not data.translate(None, b"\x00\x01"):
                return
        elif _NOT_BOOL.search(data) is None:
            return
        found = _NOT_BOOL.search(data)
        assert found is not None
        at, byte = found.start(), found.group()[0]
    raise TensorError(f"tensor data of BOOL must hold only bytes 0 and 1, got {byte} at byte {at}")


# --- numpy, imported on first use -------------------------------------------------------------


def _numpy() -> Any:
    try:
        import numpy
    except ModuleNotFoundError as exc:  # say which pip install brings it
        raise ModuleNotFoundError(
            f"tensors as arrays need numpy: {install_command('tensors')} ({exc})", name=exc.name
        ) from None
    return numpy


def to_array(value: dict[Any, Any]) -> Any:
    """A tensor map as a numpy array viewing its `data` (read-only, no copy)."""
    datatype, shape = check(value)
    np = _numpy()
    return np.frombuffer(value["data"], dtype=np.dtype(DATATYPES[datatype])).reshape(shape)


#: numpy dtype string -> datatype, for the arrays a sender or a model hands over.
DATATYPES_BY_DTYPE: dict[str, str] = {code: name for name, code in DATATYPES.items()}


def from_array(array: Any) -> dict[str, Any]:
    """A numpy array as a tensor map; its bytes are copied only when they are
    not C-ordered little-endian already. TypeError for a dtype the protocol has not."""
    np = _numpy()
    if type(array) is np.ndarray and array.flags.c_contiguous:  # the usual case, in short
        datatype = DATATYPES_BY_DTYPE.get(array.dtype.str)
        if datatype is not None:
            data = memoryview(array.reshape(-1).view(np.uint8))
            return {"datatype": datatype, "shape": list(array.shape), "data": data}
    array = np.asarray(array)
    dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    datatype = DATATYPES_BY_DTYPE.get(dtype.str)
    if datatype is None:
        names = ", ".join(DATATYPES)
        raise NotEncodable(f"arrays of dtype {array.dtype} have no tensor datatype (one of {names})")
    array = np.asarray(array, dtype=dtype, order="C")  # a copy only if not C-ordered little-endian
    data = memoryview(array.reshape(-1).view(np.uint8))  # the array's own bytes
    return {"datatype": datatype, "shape": list(array.shape), "data": data}


def is_array(value: object) -> bool:
    """Whether `value` is a numpy array (exactly one, no subclass), told without importing
    numpy: none exists before numpy is imported. Its type is compared with numpy's, not by
    its `__name__` and `__module__`, which a builtin type makes anew as strings: a third
    of a lone request's reply encoding on a cold CPU (docs/benchmarks-history.md)."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and type(value) is getattr(numpy, "ndarray", None)


def msgpack_default(value: object) -> Any:
    """msgpack's `default` hook: a numpy array (0-d too) goes as a tensor, a numpy scalar as
    the plain msgpack number or boolean it holds (as np.float64 does anyway, being a float)."""
    if type(value).__module__ == "numpy" and hasattr(value, "dtype"):
        np = _numpy()
        return value.item() if isinstance(value, np.generic) else from_array(value)
    raise NotEncodable(f"can not serialize {type(value).__name__!r} object")


def arrays_hook(value: dict[Any, Any]) -> Any:
    """msgpack's `object_hook` for clients that want arrays back: a valid tensor map
    becomes a numpy array; any other map (an invalid tensor too, or any tensor where numpy
    is not installed) stays as it is."""
    if is_tensor(value):
        try:
            return to_array(value)
        except (TensorError, ImportError, ValueError):
            return value
    return value


#: A reply this large has its output's tensors viewed in place (unpack_viewing).
VIEW_BYTES = 64 * 1024


def unpack_arrays(data: Any) -> Any:
    """protocol.unpack, with tensors as numpy arrays (a client's replies); a large
    reply's output tensors view the received bytes (`unpack_viewing`)."""
    import msgpack

    if len(data) >= VIEW_BYTES:
        try:
            return unpack_viewing(data, "output", arrays_hook)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            pass  # not a map of str keys: the plain decode says what is wrong
    return msgpack.unpackb(data, strict_map_key=False, object_hook=arrays_hook)  # (raw=False: the default)


# --- large bodies: tensors read in place -------------------------------------------------------


class _Tensor(msgspec.Struct, forbid_unknown_fields=True):
    """A tensor map whose `data` msgspec gives as a memoryview of the body, not a copy."""

    datatype: Any
    shape: Any
    data: memoryview


_read_fields = msgspec.msgpack.Decoder(dict[str, msgspec.Raw]).decode
_read_one = msgspec.msgpack.Decoder(_Tensor).decode
_read_named = msgspec.msgpack.Decoder(dict[str, _Tensor]).decode
_read_list = msgspec.msgpack.Decoder(list[_Tensor]).decode


def unpack_viewing(body: Any, key: str, object_hook: Callable[[dict[Any, Any]], Any]) -> dict[str, Any]:
    """A body (a map with str keys) decoded as protocol.unpack with `object_hook` would,
    except that the tensors of its `key` value (a tensor, a map of named tensors or a
    list of tensors) get their `data` as a memoryview of `body` itself: a large input or
    output is never copied. Raises what msgspec raises for a body that is no such map
    (decode it the usual way then)."""
    import msgpack

    def plain(raw: msgspec.Raw) -> Any:
        return msgpack.unpackb(raw, strict_map_key=False, object_hook=object_hook)  # (raw=False: the default)

    def hook(t: _Tensor) -> Any:
        value = {"datatype": t.datatype, "shape": t.shape, "data": t.data}
        converted = object_hook(value)
        if converted is value:  # left a map (not a valid tensor, or no numpy): bytes, as below 64 KiB
            value["data"] = t.data.tobytes()
        return converted

    out: dict[str, Any] = {}
    for name, raw in _read_fields(body).items():
        out[name] = _viewed(raw, hook) if name == key else plain(raw)
        if out[name] is _NOT_VIEWED:
            out[name] = plain(raw)
    return out


_NOT_VIEWED = object()


def _viewed(raw: msgspec.Raw, hook: Callable[[_Tensor], Any]) -> Any:
    """The tensors of `raw`, in one of the three usual forms, through `hook`; else _NOT_VIEWED."""
    try:
        return hook(_read_one(raw))
    except msgspec.ValidationError:
        pass
    try:
        return {name: hook(t) for name, t in _read_named(raw).items()}
    except msgspec.ValidationError:
        pass
    try:
        return [hook(t) for t in _read_list(raw)]
    except msgspec.ValidationError:
        return _NOT_VIEWED


# --- JSON form, for `batcher send` (no numpy needed) ---------------------------------------------

#: struct format character of each datatype, little-endian.
STRUCT_CODES: dict[str, str] = {
    "BOOL": "?",
    "UINT8": "B",
    "UINT16": "H",
    "UINT32": "I",
    "UINT64": "Q",
    "INT8": "b",
    "INT16": "h",
    "INT32": "i",
    "INT64": "q",
    "FP16": "e",
    "FP32": "f",
    "FP64": "d",
}


def is_json_tensor(value: object) -> bool:
    """A JSON tensor as `batcher send` reads and prints one: the tensor keys, with `data`
    a flat list of numbers in C order (the Open Inference Protocol's JSON form)."""
    return is_tensor(value) and isinstance(value["data"], list)  # type: ignore[index]


def from_json(value: dict[str, Any]) -> dict[str, Any]:
    """A JSON tensor as a tensor map; TensorError saying what is wrong."""
    import struct

    datatype, shape = check_header(value["datatype"], value["shape"])
    data, count = value["data"], math.prod(shape)
    if len(data) != count:
        raise TensorError(f"tensor data has {len(data)} values, but {datatype} {list(shape)} needs {count}")
    try:
        raw = struct.pack(f"<{count}{STRUCT_CODES[datatype]}", *data)
    except (struct.error, TypeError, OverflowError) as exc:
        raise TensorError(f"tensor data does not fit {datatype}: {exc}") from None
    return {"datatype": datatype, "shape": list(shape), "data": raw}


def json_tensors(value: Any) -> Any:
    """`value` (JSON) with each JSON tensor in it as a tensor map; TensorError if one is
    malformed."""
    if is_json_tensor(value):
        return from_json(value)
    if isinstance(value, dict):
        return {k: json_tensors(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_tensors(v) for v in value]
    return value


def to_json(value: Any) -> dict[str, Any]:
    """A tensor map or a numpy array in JSON form (data as a flat list of numbers);
    TensorError for a malformed tensor map."""
    import struct

    tensor_map = value if isinstance(value, dict) else from_array(value)
    datatype, shape = check(tensor_map)
    count = math.prod(shape)
    data = list(struct.unpack(f"<{count}{STRUCT_CODES[datatype]}", tensor_map["data"]))
    return {"datatype": datatype, "shape": list(shape), "data": data}
