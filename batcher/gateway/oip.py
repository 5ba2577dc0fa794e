"""The Open Inference Protocol (KServe v2) in batcher's terms, without any I/O.

A v2 request carries the batch axis: an input of shape [k, ...] is k rows, and each row
becomes one batcher request, so the broker batches rows of many clients together; the
k replies are joined back into outputs of shape [k, ...] (docs/gateway.md says why the
gateway splits rather than the protocol growing requests of several items).

Both front ends (HTTP in `http_api`, gRPC in `grpc_api`) turn their wire form into an
`InferRequest` of `InputTensor`s holding raw little-endian bytes, and turn the joined
`OutputTensor`s back into theirs. Nothing here imports numpy: rows are slices of the
received bytes, and outputs are the replies' tensor bytes joined.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batcher.errors import BatcherError
from batcher.wire import tensor
from batcher.wire.protocol import ErrorCode

#: The one version each model has: batcher serves what its workers load.
MODEL_VERSION = "1"
#: The datatypes a v2 tensor may have here: batcher's tensor types and BYTES.
BYTES = "BYTES"
DATATYPES = frozenset(tensor.DATATYPES) | {BYTES}
#: Most rows in one request: each row is a request of the broker's, queued at once
#: (docs/gateway.md); a model's --max-queue bounds them too.
MAX_ROWS = 4096
#: Most BYTES cells (elements, or places of a 0-sized axis) in one input: each is a
#: Python object in the gateway, and a BYTES element takes 4 bytes or more on the wire.
MAX_BYTES_CELLS = 2**24
#: An output's name when the model gives one unnamed tensor and has no signature.
DEFAULT_OUTPUT = "output"


class OipError(BatcherError):
    """A request the gateway refuses, or a reply it cannot express; `code` is a batcher
    error code (docs/protocol.md, section 5), which the front ends map to a status."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def bad_request(message: str) -> OipError:
    return OipError(ErrorCode.BAD_REQUEST, message)


@dataclass(frozen=True)
class NamedTensor:
    """A named v2 tensor of a whole request (batch axis first): fixed-size types as raw
    little-endian bytes, BYTES as a flat list of elements."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: bytes | memoryview | list[bytes]


#: A request's input, and a response's output: the same form.
InputTensor = NamedTensor
OutputTensor = NamedTensor


@dataclass(frozen=True)
class InferRequest:
    """What both front ends ask of the broker; `outputs` None means every output."""

    model: str
    inputs: list[InputTensor]
    version: str = ""
    id: str = ""
    outputs: list[str] | None = None
    timeout_ms: float | None = None
    priority: float | None = None
    #: Whether a row whose broker is lost in flight may be sent once more to another
    #: (the `retry` parameter; docs/gateway.md, "Many brokers").
    retry: bool = True

    def response_version(self, answered: str = "") -> str:
        """OIP's response `model_version`: the version that `answered` (the replies say:
        Gateway.answer), else the one asked for, else `1` (a model outside a repository
        has that one version)."""
        return answered or self.version or MODEL_VERSION


# --- inputs -----------------------------------------------------------------------------------


def check_shape(name: str, shape: Sequence[Any]) -> tuple[int, ...]:
    """The shape as ints, with the batch axis first; a 0-d input has no rows to batch."""
    if type(shape) is not list and (not isinstance(shape, Sequence) or isinstance(shape, str | bytes)):
        raise bad_request(f"input '{name}': shape must be a list of ints, got {shape!r}")
    if not all(type(d) is int and d >= 0 for d in shape):
        raise bad_request(f"input '{name}': shape must be a list of ints >= 0, got {list(shape)}")
    if not shape:
        raise bad_request(f"input '{name}': shape [] has no batch axis; the first axis is the batch")
    if len(shape) > tensor.MAX_RANK + 1:
        raise bad_request(f"input '{name}': at most {tensor.MAX_RANK + 1} axes, got {len(shape)}")
    if shape[0] > MAX_ROWS:
        raise bad_request(f"input '{name}': {shape[0]} rows; a request takes at most {MAX_ROWS}")
    if any(d > tensor.MAX_ELEMENTS for d in shape) or elements(shape) > tensor.MAX_ELEMENTS:
        raise bad_request(f"input '{name}': shape {list(shape)} is over {tensor.MAX_ELEMENTS} elements")
    return tuple(shape)


def _check_cells(name: str, shape: tuple[int, ...]) -> None:
    """A BYTES input's rows are nested lists: bound them, even around a 0-sized axis."""
    if elements([max(d, 1) for d in shape]) > MAX_BYTES_CELLS:
        raise bad_request(f"input '{name}': BYTES shape {list(shape)} is over {MAX_BYTES_CELLS} cells")


def check_datatype(name: str, datatype: object) -> str:
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        raise bad_request(f"input '{name}': unknown datatype {datatype!r}; one of {sorted(DATATYPES)}")
    return str(datatype)


def elements(shape: Sequence[int]) -> int:
    return math.prod(shape)


def raw_input(name: str, datatype: object, shape: Sequence[Any], raw: bytes | memoryview) -> InputTensor:
    """An input sent as raw bytes (HTTP binary data, gRPC raw_input_contents), checked."""
    dtype = check_datatype(name, datatype)
    dims = check_shape(name, shape)
    count = elements(dims)
    if dtype == BYTES:
        _check_cells(name, dims)
        items = split_bytes_elements(name, raw, count)
        if len(items) != count:
            raise bad_request(
                f"input '{name}': {len(items)} BYTES elements, but shape {list(dims)} needs {count}"
            )
        return InputTensor(name, dtype, dims, items)
    need = count * tensor.ITEM_BYTES[dtype]
    if len(raw) != need:
        raise bad_request(f"input '{name}': {len(raw)} bytes of data, but {dtype} {list(dims)} needs {need}")
    return InputTensor(name, dtype, dims, raw)


def json_input(name: str, datatype: object, shape: Sequence[Any], data: object) -> InputTensor:
    """An input whose `data` is JSON: a flat or nested list of numbers, bools or strings.
    Nested lists must follow the shape (a list at each level as long as its axis, the
    innermost level flat): ragged data is refused, never flattened into another tensor."""
    dtype = check_datatype(name, datatype)
    dims = check_shape(name, shape)
    if dtype == BYTES:
        _check_cells(name, dims)
    values: list[Any] = data if isinstance(data, list) else [data]
    flat = _flatten_along(name, values, dims) if list in set(map(type, values)) else values
    if len(flat) != elements(dims):
        raise bad_request(
            f"input '{name}': {len(flat)} data elements, but shape {list(dims)} needs {elements(dims)}"
        )
    if dtype == BYTES:
        if not all(isinstance(x, str) for x in flat):
            raise bad_request(f"input '{name}': BYTES data must be strings")
        return InputTensor(name, dtype, dims, [x.encode() for x in flat])
    return InputTensor(name, dtype, dims, pack_numbers(name, dtype, flat))


def contents_input(name: str, datatype: object, shape: Sequence[Any], values: Sequence[Any]) -> InputTensor:
    """A gRPC input given in `contents` (typed repeated fields), checked like JSON data."""
    dtype = check_datatype(name, datatype)
    if dtype == BYTES:
        dims = check_shape(name, shape)
        _check_cells(name, dims)
        items = [bytes(v) for v in values]
        if len(items) != elements(dims):
            raise bad_request(
                f"input '{name}': {len(items)} elements, but shape {list(dims)} needs {elements(dims)}"
            )
        return InputTensor(name, dtype, dims, items)
    return json_input(name, dtype, shape, list(values))


def _flatten_along(name: str, data: list[Any], shape: tuple[int, ...]) -> list[Any]:
    """Nested `data` as a flat list, checked against `shape` level by level: a level of
    lists has as many as its axis, a level of values (the innermost) as many as the axes
    left hold. bad_request, saying where, for any other nesting."""
    flat: list[Any] = []
    # (the list, its path from data, its axis) to visit, depth first in row-major order
    todo: list[tuple[list[Any], tuple[int, ...], int]] = [(data, (), 0)]
    while todo:
        level, path, axis = todo.pop()
        kinds = set(map(type, level))
        where = "data" + "".join(f"[{i}]" for i in path)
        if list in kinds:
            if len(kinds) > 1:
                raise bad_request(f"input '{name}': {where} mixes lists and values")
            if axis >= len(shape) - 1 or len(level) != shape[axis]:
                raise bad_request(
                    f"input '{name}': {where} holds {len(level)} lists, but shape {list(shape)} "
                    f"{'has no axis left for them' if axis >= len(shape) - 1 else f'needs {shape[axis]}'}"
                )
            todo.extend((x, (*path, i), axis + 1) for i, x in reversed(list(enumerate(level))))
        else:
            need = elements(shape[axis:])
            if len(level) != need:
                raise bad_request(
                    f"input '{name}': {where} holds {len(level)} values, but shape {list(shape)} "
                    f"needs {need} there"
                )
            flat.extend(level)
    return flat


def pack_numbers(name: str, dtype: str, values: list[Any]) -> bytes:
    """JSON numbers as the datatype's little-endian bytes; a wrong kind is bad_request."""
    code = tensor.STRUCT_CODES[dtype]
    kinds = _BOOL if dtype == "BOOL" else (_NUMBER if dtype.startswith("FP") else _INT)
    if not kinds.issuperset(map(type, values)):
        want = "true/false" if dtype == "BOOL" else ("numbers" if dtype.startswith("FP") else "integers")
        raise bad_request(f"input '{name}': {dtype} data must be {want}")
    try:
        return struct.pack(f"<{len(values)}{code}", *values)
    except (struct.error, OverflowError) as exc:
        raise bad_request(f"input '{name}': a value does not fit {dtype}: {exc}") from None


#: The Python types JSON numbers of each kind of datatype may come as (bool is no int here).
_BOOL, _INT, _NUMBER = frozenset({bool}), frozenset({int}), frozenset({int, float})


def split_bytes_elements(name: str, raw: bytes | memoryview, most: int | None = None) -> list[bytes]:
    """BYTES elements from their wire form: each a 4-byte little-endian length, then it.
    More than `most` elements is bad_request at once, before the rest is read."""
    view = memoryview(raw).cast("B")
    items: list[bytes] = []
    at = 0
    while at < len(view):
        if most is not None and len(items) == most:
            raise bad_request(f"input '{name}': more than the {most} BYTES elements its shape holds")
        if at + 4 > len(view):
            raise bad_request(f"input '{name}': BYTES data ends inside an element's length")
        (size,) = struct.unpack_from("<I", view, at)
        at += 4
        if at + size > len(view):
            raise bad_request(f"input '{name}': a BYTES element of {size} bytes runs past the data")
        items.append(bytes(view[at : at + size]))
        at += size
    return items


def join_bytes_elements(items: Sequence[bytes]) -> bytes:
    """BYTES elements in their wire form (split_bytes_elements' inverse)."""
    return b"".join(struct.pack("<I", len(x)) + x for x in items)


# --- rows -------------------------------------------------------------------------------------


def batch_rows(inputs: Sequence[InputTensor]) -> int:
    """The number of rows k every input agrees on (the first axis)."""
    if not inputs:
        raise bad_request("a request needs at least one input")
    names = [t.name for t in inputs]
    if len(set(names)) != len(names):
        raise bad_request(f"input names repeat: {names}")
    counts = {t.shape[0] for t in inputs}
    if len(counts) != 1:
        raise bad_request(f"inputs disagree on the batch axis (the first): {[list(t.shape) for t in inputs]}")
    rows = counts.pop()
    if rows == 0:
        raise bad_request("the batch axis (the first) is 0: no rows to infer")
    return rows


def row_inputs(inputs: Sequence[InputTensor]) -> list[Any]:
    """One batcher `input` per row: a model of one input gets its tensor alone, one of
    several a map of name to tensor, as batcher's own clients send them."""
    rows = batch_rows(inputs)
    per_input = [_rows_of(t, rows) for t in inputs]
    if len(inputs) == 1:
        return per_input[0]
    names = [t.name for t in inputs]
    return [dict(zip(names, values, strict=True)) for values in zip(*per_input, strict=True)]


def _rows_of(t: InputTensor, rows: int) -> list[Any]:
    row_shape = list(t.shape[1:])
    if rows == 1 and t.datatype != BYTES:  # the common case: the tensor as it came
        return [{"datatype": t.datatype, "shape": row_shape, "data": t.data}]
    if t.datatype == BYTES:
        per_row = elements(row_shape)
        items = t.data
        assert isinstance(items, list)
        return [_nest(items[i * per_row : (i + 1) * per_row], row_shape) for i in range(rows)]
    data = memoryview(t.data).cast("B")  # type: ignore[arg-type]
    size = len(data) // rows
    return [
        {"datatype": t.datatype, "shape": row_shape, "data": data[i * size : (i + 1) * size]}
        for i in range(rows)
    ]


def _nest(items: list[bytes], shape: list[int]) -> Any:
    """A row of BYTES elements as batcher carries text: one element alone, else lists."""
    if not shape:
        return items[0]
    if len(shape) == 1:
        return list(items)
    step = elements(shape[1:])
    return [_nest(items[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


# --- outputs ----------------------------------------------------------------------------------


def named_outputs(value: Any) -> bool:
    """Whether a row's output names its outputs itself (a map that is not a tensor)."""
    return isinstance(value, dict) and not tensor.is_tensor(value)


def join_outputs(outputs: Sequence[Any], output_names: Sequence[str] | None) -> list[OutputTensor]:
    """The k rows' outputs joined into named outputs of k rows. A map gives outputs by
    key; a lone value is named after the model's one output (`output_names`), else
    `output`. Rows that differ in names, datatype or shape are a model_error."""
    first = outputs[0]
    if named_outputs(first):
        if not first:
            raise OipError(ErrorCode.MODEL_ERROR, "the model gave no outputs (an empty map)")
        names = list(first)
        for row in outputs:
            if not isinstance(row, dict) or row.keys() != first.keys():
                got = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise OipError(ErrorCode.MODEL_ERROR, f"the rows' outputs differ: {sorted(names)} and {got}")
        return [_join(str(n), [row[n] for row in outputs]) for n in names]
    name = output_names[0] if output_names and len(output_names) == 1 else DEFAULT_OUTPUT
    return [_join(name, list(outputs))]


def _join(name: str, rows: list[Any]) -> OutputTensor:
    if len(rows) == 1:  # the common case: nothing to compare or join
        dtype, shape, data = _describe(name, rows[0])
        return OutputTensor(name, dtype, (1, *shape), data)
    described = [_describe(name, r) for r in rows]
    dtype, shape, _ = described[0]
    for d, s, _ in described:
        if (d, s) != (dtype, shape):
            raise OipError(
                ErrorCode.MODEL_ERROR,
                f"output '{name}': rows differ ({dtype} {list(shape)} and {d} {list(s)}); "
                "a v2 output needs one datatype and shape for every row",
            )
    full = (len(rows), *shape)
    datas = [data for _, _, data in described]
    if dtype == BYTES:
        return OutputTensor(
            name, dtype, full, [x for items in datas if isinstance(items, list) for x in items]
        )
    raws = [data for data in datas if not isinstance(data, list)]
    return OutputTensor(name, dtype, full, raws[0] if len(raws) == 1 else b"".join(raws))


def _describe(name: str, value: Any) -> tuple[str, tuple[int, ...], bytes | memoryview | list[bytes]]:
    """(datatype, shape, data) of one row's output value."""
    if tensor.is_tensor(value):
        try:
            dtype, shape = tensor.check(value)
        except tensor.TensorError as exc:
            raise OipError(ErrorCode.MODEL_ERROR, f"output '{name}': {exc}") from None
        return dtype, shape, value["data"]
    if isinstance(value, str | bytes) or (isinstance(value, list) and _all_text(value)):
        shape, items = _text_shape(name, value)
        return BYTES, shape, items
    shape, flat = _number_shape(name, value)
    dtype = _number_type(name, flat)
    return dtype, shape, struct.pack(f"<{len(flat)}{tensor.STRUCT_CODES[dtype]}", *flat)


def _all_text(value: list[Any]) -> bool:
    return all(isinstance(x, str | bytes) or (isinstance(x, list) and _all_text(x)) for x in value) and bool(
        value
    )


def _text_shape(name: str, value: Any) -> tuple[tuple[int, ...], list[bytes]]:
    if isinstance(value, str):
        return (), [value.encode()]
    if isinstance(value, bytes):
        return (), [value]
    parts = [_text_shape(name, x) for x in value]
    inner = {s for s, _ in parts}
    if len(inner) != 1:
        raise OipError(ErrorCode.MODEL_ERROR, f"output '{name}': a ragged list is not a tensor")
    return (len(value), *inner.pop()), [x for _, items in parts for x in items]


def _number_shape(name: str, value: Any) -> tuple[tuple[int, ...], list[Any]]:
    if isinstance(value, bool | int | float):
        return (), [value]
    if not isinstance(value, list):
        raise OipError(
            ErrorCode.MODEL_ERROR,
            f"output '{name}': a {type(value).__name__} is not a tensor, a number, text, or a list of them",
        )
    parts = [_number_shape(name, x) for x in value]
    inner = {s for s, _ in parts}
    if len(inner) > 1:
        raise OipError(ErrorCode.MODEL_ERROR, f"output '{name}': a ragged list is not a tensor")
    return (len(value), *(inner.pop() if inner else ())), [x for _, flat in parts for x in flat]


def _number_type(name: str, flat: list[Any]) -> str:
    if flat and all(type(x) is bool for x in flat):
        return "BOOL"
    if any(type(x) is bool for x in flat):
        raise OipError(ErrorCode.MODEL_ERROR, f"output '{name}': mixes bools and numbers")
    if all(type(x) is int for x in flat):
        if all(-(2**63) <= x < 2**63 for x in flat):
            return "INT64"
        raise OipError(ErrorCode.MODEL_ERROR, f"output '{name}': an integer does not fit INT64")
    return "FP64"


def select_outputs(outputs: list[OutputTensor], wanted: Sequence[str] | None) -> list[OutputTensor]:
    """The requested outputs, in the order asked; an unknown name is bad_request."""
    if not wanted:
        return outputs
    if len(set(wanted)) != len(wanted):
        raise bad_request(f"outputs requested twice: {list(wanted)}")
    by_name = {o.name: o for o in outputs}
    missing = [n for n in wanted if n not in by_name]
    if missing:
        raise bad_request(f"unknown output {missing}; the model gives {sorted(by_name)}")
    return [by_name[n] for n in wanted]


def output_size(out: OutputTensor) -> int:
    """The bytes an output takes as raw data (BYTES: with its length prefixes)."""
    if isinstance(out.data, list):  # BYTES
        return sum(4 + len(x) for x in out.data)
    return memoryview(out.data).nbytes


def output_raw(out: OutputTensor) -> bytes | memoryview:
    """An output's raw bytes (binary data, raw_output_contents)."""
    if out.datatype == BYTES:
        return join_bytes_elements(out.data)  # type: ignore[arg-type]
    return out.data  # type: ignore[return-value]


def output_values(out: OutputTensor) -> list[Any]:
    """An output's elements as a flat list, for JSON: numbers, bools, or str (BYTES that
    are not UTF-8 raise UnicodeDecodeError: the front end sends those as binary)."""
    if out.datatype == BYTES:
        return [x.decode() for x in out.data]  # type: ignore[union-attr]
    raw = memoryview(out.data).cast("B")  # type: ignore[arg-type]
    count = len(raw) // tensor.ITEM_BYTES[out.datatype]
    return list(struct.unpack(f"<{count}{tensor.STRUCT_CODES[out.datatype]}", raw))


# --- parameters -------------------------------------------------------------------------------


def timeout_ms_of(parameters: dict[str, Any]) -> float | None:
    """The request's `timeout` parameter, in microseconds as Triton's clients send it,
    as batcher's `timeout_ms`; 0 or absent: none."""
    value = parameters.get("timeout")
    if value is None:
        return None
    if type(value) not in (int, float) or value < 0 or value != value:
        raise bad_request(f"parameter 'timeout' must be a number of microseconds >= 0, got {value!r}")
    return value / 1000.0 if value else None


def priority_of(parameters: dict[str, Any]) -> float | None:
    """The request's `priority` parameter in Triton's sense (1 is the highest, larger
    numbers go later, 0 is the default) as batcher's (higher goes first): p >= 1 becomes
    1/p, so every explicit priority goes before the default, in Triton's order."""
    value = parameters.get("priority")
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise bad_request(f"parameter 'priority' must be an integer >= 0, got {value!r}")
    return 1.0 / value if value else None


def retry_of(parameters: dict[str, Any]) -> bool:
    """The request's `retry` parameter: false keeps each row on the one broker it went to
    (a row whose broker is lost is answered 503, never run twice); true or absent: once more."""
    value = parameters.get("retry", True)
    if type(value) is not bool:
        raise bad_request(f"parameter 'retry' must be true or false, got {value!r}")
    return value


# --- errors -----------------------------------------------------------------------------------

#: batcher error code -> HTTP status (docs/gateway.md has the table).
HTTP_STATUS: dict[str, int] = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.UNKNOWN_MODEL: 404,
    ErrorCode.OVERLOADED: 503,
    ErrorCode.DEADLINE_EXCEEDED: 504,
    ErrorCode.MODEL_ERROR: 500,
    ErrorCode.WORKER_FAILED: 500,
    ErrorCode.SHUTTING_DOWN: 503,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.TOO_LARGE: 413,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.INTERNAL: 500,
    ErrorCode.CANCELLED: 499,
    "timeout": 504,  # the gateway's own wait for the broker ran out
    "request_timeout": 408,  # the client's body did not arrive in time
    "unsupported_encoding": 415,  # a Content-Encoding other than gzip or deflate
    "closed": 503,  # the gateway is closing its connection to the broker
}

#: batcher error code -> gRPC status code name (grpc.StatusCode's member).
GRPC_STATUS: dict[str, str] = {
    ErrorCode.BAD_REQUEST: "INVALID_ARGUMENT",
    ErrorCode.UNKNOWN_MODEL: "NOT_FOUND",
    ErrorCode.OVERLOADED: "UNAVAILABLE",
    ErrorCode.DEADLINE_EXCEEDED: "DEADLINE_EXCEEDED",
    ErrorCode.MODEL_ERROR: "INTERNAL",
    ErrorCode.WORKER_FAILED: "INTERNAL",
    ErrorCode.SHUTTING_DOWN: "UNAVAILABLE",
    ErrorCode.UNAVAILABLE: "UNAVAILABLE",
    ErrorCode.TOO_LARGE: "RESOURCE_EXHAUSTED",
    ErrorCode.FORBIDDEN: "PERMISSION_DENIED",
    ErrorCode.INTERNAL: "INTERNAL",
    ErrorCode.CANCELLED: "CANCELLED",
    "timeout": "DEADLINE_EXCEEDED",
    "closed": "UNAVAILABLE",
}


def http_status(code: str) -> int:
    return HTTP_STATUS.get(code, 500)


def grpc_status(code: str) -> str:
    return GRPC_STATUS.get(code, "INTERNAL")
