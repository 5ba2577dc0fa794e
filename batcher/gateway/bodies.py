"""The batcher request bodies the gateway sends: `pack_request`, the fast path for a row
whose input is one tensor (protocol.pack_carrying for anything else).
`batcher.gateway.core` re-exports it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from batcher.wire import aligned, protocol, tensor

_encode = msgspec.msgpack.Encoder().encode
_NIL = 0xC0  # msgpack's nil


def pack_request(message: dict[str, Any]) -> bytes:
    """A request body as protocol.pack_carrying writes it (every tensor aligned), faster
    for the rows the gateway sends: when `input` is the map's last key and a valid tensor
    or a map of fewer than 16 of them, the other fields are encoded by msgspec and the
    tensors written after them (4.9 us a row against 9.3, measured in one run).
    Anything else (BYTES rows, a tensor that does not check) goes to pack_carrying."""
    payload = message.get("input")
    if type(payload) is dict and next(reversed(message)) == "input":
        body = _pack_tensors_last(message, payload)
        if body is not None:
            return body
    return protocol.pack_carrying(message, payload)


def _pack_tensors_last(message: dict[str, Any], payload: dict[str, Any]) -> bytes | None:
    single = tensor.is_tensor(payload)
    named = [("", payload)] if single else list(payload.items())
    if not named or len(named) >= 16 or not all(type(k) is str and tensor.is_tensor(t) for k, t in named):
        return None
    try:
        checked = [tensor.check(t) for _, t in named]
        head = _encode({**message, "input": None})
    except (tensor.TensorError, TypeError, ValueError, OverflowError):
        return None
    if head[-1] != _NIL:
        return None
    parts: list[Any] = [head[:-1]]
    pos = len(head) - 1
    if not single:
        parts.append(bytes([0x80 | len(named)]))  # fixmap
        pos += 1
    for (name, t), (datatype, shape) in zip(named, checked, strict=True):
        if not single:
            key = _encode(name)
            parts.append(key)
            pos += len(key)
        data = t["data"]
        size = memoryview(data).nbytes
        tensor_head = aligned.tensor_head(pos, datatype, shape, size)
        parts += [tensor_head, data]
        pos += len(tensor_head) + size
    return b"".join(parts)
