"""msgpack bodies whose tensors' data start at a multiple of tensor.ALIGN_BYTES from the
body's first byte, so that a receiver can view them in place with the alignment their
elements need (a JavaScript Float64Array, a C `double *`): docs/protocol.md 3.1,
"Alignment".

A tensor map is written as `datatype`, `shape`, then, when the data would not land on a
multiple of ALIGN_BYTES, a `pad` entry (a bin of 0 to 7 zero bytes: the entry takes 6 to
13 bytes), then `data` last. Any msgpack writer can do the same: it needs only to know
how many bytes it has written so far. Everything that is not a tensor is written as
protocol's Packer writes it, byte for byte.
"""

from __future__ import annotations

from typing import Any, cast

import msgpack

from batcher import tensor

#: msgpack's encoding of the key "datatype" (fixstr): a body without it holds no tensor map.
DATATYPE_KEY = b"\xa8datatype"

_packer = msgpack.Packer(use_bin_type=True, default=tensor.msgpack_default)


def _pack(value: object) -> bytes:
    """`value` as protocol's Packer writes it."""
    return cast(bytes, _packer.pack(value))


_KEY_DATATYPE = _pack("datatype")
_KEY_SHAPE = _pack("shape")
_KEY_DATA = _pack("data")
_KEY_PAD = _pack(tensor.PAD_KEY)
#: The bytes of a pad entry of each length, the key's 4 and the bin header's 2 included.
_PADS = [_KEY_PAD + b"\xc4" + bytes([k]) + bytes(k) for k in range(tensor.ALIGN_BYTES)]
#: The smallest pad entry: its key, a bin header, no bytes.
_PAD_ENTRY_MIN = len(_PADS[0])


class _HoldsTensor(Exception):
    """Raised by the plain packer's hook: the value holds an array, so it is written here."""


def _refuse_arrays(value: object) -> Any:
    if tensor.is_array(value):
        raise _HoldsTensor
    return tensor.msgpack_default(value)


_plain = msgpack.Packer(use_bin_type=True, default=_refuse_arrays)


def bin_header(size: int) -> bytes:
    """msgpack's bin header for `size` bytes (bin 8, 16 or 32), as any encoder writes it."""
    if size < 1 << 8:
        return b"\xc4" + size.to_bytes(1, "big")
    if size < 1 << 16:
        return b"\xc5" + size.to_bytes(2, "big")
    return b"\xc6" + size.to_bytes(4, "big")


def pad_entry(offset: int, data_size: int) -> bytes:
    """The pad entry (b"" when none is needed) that a tensor map, whose `shape` value ends
    `offset` bytes into the body, needs before its `data` entry for the data to start at
    a multiple of ALIGN_BYTES."""
    before_data = len(_KEY_DATA) + len(bin_header(data_size))
    if (offset + before_data) % tensor.ALIGN_BYTES == 0:
        return b""
    return _PADS[-(offset + _PAD_ENTRY_MIN + before_data) % tensor.ALIGN_BYTES]


def tensor_head(datatype: str, shape: tuple[int, ...]) -> bytes:
    """A tensor map's entries before its pad: `datatype` and `shape` (no map header)."""
    return _KEY_DATATYPE + _pack(datatype) + _KEY_SHAPE + _pack(list(shape))


def data_head(size: int) -> bytes:
    """The `data` key and its bin header, for `size` bytes of data."""
    return _KEY_DATA + bin_header(size)


def pack(obj: object) -> bytes:
    """`obj` as msgpack, with every tensor in it (a numpy array, or a valid tensor map)
    aligned, any other value as protocol's Packer writes it; TypeError (and what else
    msgpack raises) for a value it cannot write."""
    writer = _Writer()
    writer.value(obj)
    return b"".join(writer.parts)


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
        head = tensor_head(datatype, shape)
        size = memoryview(data).nbytes
        pad = pad_entry(self.pos + 1 + len(head), size)
        self.put(b"\x84" + head + pad if pad else b"\x83" + head)
        self.put(data_head(size))
        self.put(data)


def _map_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x80 | n])
    if n < 1 << 16:
        return b"\xde" + n.to_bytes(2, "big")
    return b"\xdf" + n.to_bytes(4, "big")


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")
