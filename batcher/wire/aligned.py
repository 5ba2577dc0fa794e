"""msgpack bodies whose tensors' data start at a multiple of tensor.ALIGN_BYTES from the
body's first byte, so that a receiver can view them in place with the alignment their
elements need (a JavaScript Float64Array, a C `double *`): docs/protocol.md 3.1,
"Alignment".

A tensor map is written with its keys in the order `datatype`, `shape`, `data` (the
data last), and its data is moved to the next multiple of 8 by writing some of those
keys with a wider str header than the shortest: `datatype` as str 8 (1 byte more),
`shape` as str 16 (2 more), `data` as str 32 (4 more), for a shift of 0 to 7 bytes.
msgpack allows every str format for any string (the shortest is only a "should"), so
every decoder reads the same three keys: the map is the same map, byte for byte in its
values. Everything that is not a tensor is written as protocol's Packer writes it.
"""

from __future__ import annotations

from typing import Any

import msgpack
import msgspec

from batcher.wire import tensor

#: msgpack's encoding of the key "datatype" (fixstr): a body without it holds no tensor map.
DATATYPE_KEY = b"\xa8datatype"

_packer = msgpack.Packer(use_bin_type=True, default=tensor.msgpack_default)


def _pack(value: object) -> bytes:
    """`value` as protocol's Packer writes it."""
    return _packer.pack(value)  # type: ignore[no-any-return]


def _key(name: str, extra: int) -> bytes:
    """The str `name` (under 32 bytes) with a header `extra` bytes longer than fixstr's."""
    raw = name.encode()
    size = len(raw)
    header = {
        0: bytes([0xA0 | size]),
        1: b"\xd9" + size.to_bytes(1),
        2: b"\xda" + size.to_bytes(2),
        4: b"\xdb" + size.to_bytes(4),
    }[extra]
    return header + raw


#: The keys' encodings, by the bytes they add: one of the three per bit of the shift.
_DATATYPE = (_key("datatype", 0), _key("datatype", 1))
_SHAPE = (_key("shape", 0), _key("shape", 2))
_DATA = (_key("data", 0), _key("data", 4))


def bin_header(size: int) -> bytes:
    """msgpack's bin header for `size` bytes (bin 8, 16 or 32), as any encoder writes it.
    (msgpack's numbers are big-endian: `int.to_bytes`'s order unless told otherwise.)"""
    if size < 1 << 8:
        return b"\xc4" + size.to_bytes(1)
    if size < 1 << 16:
        return b"\xc5" + size.to_bytes(2)
    return b"\xc6" + size.to_bytes(4)


def tensor_head(offset: int, datatype: str, shape: tuple[int, ...] | list[int], size: int) -> bytes:
    """A tensor map's bytes up to its data (map header, `datatype`, `shape`, the `data`
    key and bin header), for a map that starts `offset` bytes into the body and `size`
    bytes of data: its keys widened so that the data starts at a multiple of ALIGN_BYTES."""
    datatype_value, shape_value, data_header = _pack(datatype), _pack(list(shape)), bin_header(size)
    shortest = 1 + len(_DATATYPE[0]) + len(datatype_value) + len(_SHAPE[0]) + len(shape_value)
    shortest += len(_DATA[0]) + len(data_header)
    shift = -(offset + shortest) % tensor.ALIGN_BYTES
    return b"".join(
        (
            b"\x83",
            _DATATYPE[shift & 1],
            datatype_value,
            _SHAPE[(shift >> 1) & 1],
            shape_value,
            _DATA[(shift >> 2) & 1],
            data_header,
        )
    )


def pack(obj: object) -> bytes:
    """`obj` as msgpack, with every tensor in it (a numpy array, or a valid tensor map)
    aligned, any other value as protocol's Packer writes it; TypeError (and what else
    msgpack raises) for a value it cannot write."""
    writer = _Writer()
    writer.value(obj)
    return b"".join(writer.parts)


#: Stands for a tensor while the rest of a body is encoded at C speed (`pack_plain`): a
#: byte msgpack never uses (0xc1), then 14 fixed random bytes. The marks are replaced in
#: the order they stand in the body, which is the order the tensors were met.
_MARK = b"\xc1\x9e\x1b\x7f\xd2\x05\x8a\x33\xe0\x6c\x51\xb4\x0f\xa7\x28"
_MARKED = msgspec.Raw(_MARK)
_encode = msgspec.msgpack.Encoder(enc_hook=tensor.msgpack_default).encode


def pack_plain(fields: dict[str, Any], payload: Any) -> bytes | None:
    """`pack(fields)` for a map whose `payload` value is an array, or a flat map or list
    of arrays and bytes (protocol's plain payloads), the rest protocol's scalars: the map
    encoded by msgspec with each array's place marked, then each mark replaced by the
    aligned tensor. None when that cannot be done (pack does it then)."""
    key = next((k for k, v in fields.items() if v is payload), None)
    if key is None:
        return None
    tensors: list[dict[str, Any]] = []

    def mark(value: Any) -> Any:
        if not tensor.is_array(value):
            return value
        tensors.append(tensor.from_array(value))
        return _MARKED

    if type(payload) is dict:
        marked: Any = {k: mark(v) for k, v in payload.items()}
    elif type(payload) is list:
        marked = [mark(v) for v in payload]
    else:
        marked = mark(payload)
    try:
        body = _encode({**fields, key: marked})
    except (TypeError, ValueError, OverflowError, RecursionError):
        return None
    if body.count(_MARK) != len(tensors):
        return None  # the mark's bytes also stand elsewhere (a field's value, say)
    parts: list[Any] = []
    done = pos = 0
    for t in tensors:
        at = body.index(_MARK, done)
        parts.append(body[done:at])
        pos += at - done
        size = memoryview(t["data"]).nbytes
        head = tensor_head(pos, t["datatype"], t["shape"], size)
        parts += [head, t["data"]]
        pos += len(head) + size
        done = at + len(_MARK)
    parts.append(body[done:])
    return b"".join(parts)


class _HoldsTensor(Exception):
    """Raised by the plain packer's hook: the value holds an array, so it is written here."""


def _refuse_arrays(value: object) -> Any:
    if tensor.is_array(value):
        raise _HoldsTensor
    return tensor.msgpack_default(value)


_plain = msgpack.Packer(use_bin_type=True, default=_refuse_arrays)


class _Writer:
    """The body's parts in order, and how many bytes they hold so far."""

    def __init__(self) -> None:
        self.parts: list[Any] = []
        self.pos = 0

    def put(self, part: Any) -> None:
        self.parts.append(part)
        self.pos += len(part)

    def value(self, value: object) -> None:
        kind = type(value)
        if tensor.is_array(value):
            t = tensor.from_array(value)
            self.tensor(t["datatype"], tuple(t["shape"]), t["data"])
        elif kind is dict:
            self.mapping(value)  # type: ignore[arg-type]
        elif kind is list or kind is tuple:
            self.sequence(value)  # type: ignore[arg-type]
        else:
            self.put(_pack(value))

    def mapping(self, value: dict[Any, Any]) -> None:
        if tensor.is_tensor(value):
            try:
                datatype, shape = tensor.check(value)
            except tensor.TensorError:  # no tensor a receiver could view: written as it is
                self.put(_pack(value))
                return
            self.tensor(datatype, shape, value["data"])
            return
        if self.plain(value):
            return
        self.put(_map_header(len(value)))
        for k, v in value.items():
            self.put(_pack(k))
            self.value(v)

    def sequence(self, value: list[Any] | tuple[Any, ...]) -> None:
        if self.plain(value):
            return
        self.put(_array_header(len(value)))
        for v in value:
            self.value(v)

    def plain(self, value: object) -> bool:
        """Write `value` whole, at C speed, when it holds no tensor; else write nothing."""
        try:
            packed = _plain.pack(value)
        except _HoldsTensor:
            return False
        if DATATYPE_KEY in packed:
            return False  # perhaps a tensor map: written key by key
        self.put(packed)
        return True

    def tensor(self, datatype: str, shape: tuple[int, ...], data: bytes | bytearray | memoryview) -> None:
        size = memoryview(data).nbytes
        self.put(tensor_head(self.pos, datatype, shape, size))
        self.put(data)


def _map_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x80 | n])
    if n < 1 << 16:
        return b"\xde" + n.to_bytes(2)
    return b"\xdf" + n.to_bytes(4)


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2)
    return b"\xdd" + n.to_bytes(4)
