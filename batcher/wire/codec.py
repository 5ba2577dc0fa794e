"""msgpack bodies with the protocol's settings: `pack` and `unpack` (str as str, bytes as
bin, numpy arrays as tensors), requests and replies that carry tensors (`pack_carrying`,
aligned: batcher.wire.aligned), and the reply bodies (`ok_reply`, `error_reply`).
"""

from __future__ import annotations

from typing import Any

import msgpack
import msgspec

from batcher.wire import aligned, tensor

# numpy arrays and scalars (from clients and models) go as tensors; the broker has none.
_packer = msgpack.Packer(use_bin_type=True, default=tensor.msgpack_default)
# msgspec writes a value's bytes once (msgpack's Packer copies them twice: into its
# buffer, then out to bytes). It encodes some values otherwise (msgpack.ExtType as an
# array, no Timestamp, no str or float subclasses), so it is used only for the maps
# whose payload it encodes exactly as the Packer does: `_plain_payload`.
_encode = msgspec.msgpack.Encoder(enc_hook=tensor.msgpack_default).encode


def _packer_pack(obj: object) -> bytes:
    return _packer.pack(obj)  # type: ignore[no-any-return]


def _plain_payload(value: object) -> bool:
    """Whether `value` is bytes, a numpy array, or a flat map (str keys) or list of them:
    the large payloads, which msgspec encodes exactly as the Packer would. Loops, not
    `all()` over a generator: a lone reply pays each call on a cold CPU (a few us each)."""
    kind = type(value)
    if kind is dict:
        for key, leaf in value.items():  # type: ignore[attr-defined]
            if type(key) is not str or (type(leaf) not in _BINARY and not tensor.is_array(leaf)):
                return False
        return True
    if kind is list:
        for leaf in value:  # type: ignore[attr-defined]  # noqa: SIM110 (a loop, not all(): see above)
            if type(leaf) not in _BINARY and not tensor.is_array(leaf):
                return False
        return True
    return kind in _BINARY or tensor.is_array(value)


#: The binary types a payload's leaf may be (exactly: no subclass).
_BINARY = frozenset({bytes, bytearray, memoryview})


def pack_carrying(fields: dict[str, Any], payload: object) -> bytes:
    """A request or reply map whose `input` or `output` is `payload`, encoded with every
    tensor in it aligned (batcher.wire.aligned: its data at a multiple of 8 bytes from the
    body's start, docs/protocol.md 3.1). A payload without tensors is encoded by msgspec
    when it is plain (`_plain_payload`; the other fields are the protocol's own scalars),
    by msgpack's Packer otherwise."""
    if _plain_payload(payload):
        if _holds_array(payload):
            body = aligned.pack_plain(fields, payload)
            return body if body is not None else aligned.pack(fields)
        try:
            return _encode(fields)
        except (TypeError, ValueError, OverflowError, RecursionError):
            pass  # the Packer says what is wrong, as for any other payload
    body = _packer_pack(fields)
    if aligned.DATATYPE_KEY in body:  # perhaps a tensor inside: written again, aligned
        return aligned.pack(fields)
    return body


def _holds_array(payload: object) -> bool:
    """Whether a plain payload (`_plain_payload`) is or holds a numpy array."""
    if tensor.is_array(payload):
        return True
    if type(payload) is dict:
        return any(tensor.is_array(v) for v in payload.values())
    if type(payload) is list:
        return any(tensor.is_array(v) for v in payload)
    return False


def error_reply(req_id: object, code: str, message: str, stream: bool = False) -> bytes:
    """Body of an error reply, as the broker or a worker sends it; one that ends a stream
    says `"more": false`."""
    reply: dict[str, Any] = {"id": req_id, "ok": False, "error": {"code": str(code), "message": message}}
    if stream:
        reply["more"] = False
    return _packer_pack(reply)


def ok_reply(req_id: object, output: object, meta: dict[str, Any] | None = None) -> bytes:
    """Body of a successful reply; `meta` adds metadata keys such as batch_size."""
    reply: dict[str, Any] = {"id": req_id, "ok": True, "output": output}
    if meta:
        reply.update(meta)
    return pack_carrying(reply, output)


def pack(obj: object) -> bytes:
    """msgpack-encode with the protocol's settings (str as str, bytes as bin, numpy arrays
    as tensors)."""
    return _packer_pack(obj)


def unpack(data: bytes) -> Any:
    """msgpack-decode with the protocol's settings; a fresh decoder on every call."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False)
