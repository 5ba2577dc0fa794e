"""Wire protocol v1: request parsing, and the face of the whole protocol.

Everything that knows how bytes look on a socket lives in batcher.wire, so the broker,
the workers and the clients agree by construction; docs/protocol.md is the prose version.
This module reads requests (the broker's `read_header`, `parse_request`, the envelope of
a ROUTER message, the id of a body it refuses unread); its parts are modules of their own:
the shared constants and error codes (batcher.wire.codes), msgpack bodies and replies
(batcher.wire.codec) and the backend's messages (batcher.wire.frames). Every name of
those parts is importable from here too, as it always was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import msgspec

from batcher.errors import BatcherError
from batcher.wire.codec import error_reply, ok_reply, pack, pack_carrying, unpack
from batcher.wire.codes import (
    CHUNK_DROPPED,
    CHUNK_ERROR,
    CHUNK_FINAL,
    CHUNK_FLAGS,
    CHUNK_MORE,
    CMD_BATCH,
    CMD_CANCEL,
    CMD_CHUNK,
    CMD_DISCONNECT,
    CMD_EXIT,
    CMD_HEARTBEAT,
    CMD_READY,
    CMD_REPLY,
    CMD_START,
    ID_TYPES,
    MAX_ACTIVE,
    MAX_COST,
    MAX_REPORTED_MS,
    WORKER_PROTOCOL,
    ZERO_COPY_BYTES,
    ErrorCode,
    clip,
    describe,
)
from batcher.wire.frames import (
    MAX_WARMUP_ERROR_CHARS,
    WORKER_COUNTERS,
    WORKER_ERROR_CODES,
    ChunkHeader,
    Heartbeat,
    ReplyHeader,
    WorkerProtocolError,
    batch_frames,
    body_frames,
    cancel_frames,
    chunk_frames,
    error_counts,
    naturals,
    parse_chunk_header,
    parse_reply_header,
    ready_frames,
    reply_frames,
    split_bodies,
    split_replies,
    start_frames,
    with_load,
)

__all__ = [
    "CHUNK_DROPPED",
    "CHUNK_ERROR",
    "CHUNK_FINAL",
    "CHUNK_FLAGS",
    "CHUNK_MORE",
    "CMD_BATCH",
    "CMD_CANCEL",
    "CMD_CHUNK",
    "CMD_DISCONNECT",
    "CMD_EXIT",
    "CMD_HEARTBEAT",
    "CMD_READY",
    "CMD_REPLY",
    "CMD_START",
    "ID_PREFIX_BYTES",
    "ID_TYPES",
    "MAX_ACTIVE",
    "MAX_COST",
    "MAX_REPORTED_MS",
    "MAX_WARMUP_ERROR_CHARS",
    "WORKER_COUNTERS",
    "WORKER_ERROR_CODES",
    "WORKER_PROTOCOL",
    "ZERO_COPY_BYTES",
    "ChunkHeader",
    "EnvelopeError",
    "ErrorCode",
    "Heartbeat",
    "ProtocolError",
    "ReplyHeader",
    "RequestHeader",
    "WorkerProtocolError",
    "answer_id",
    "batch_frames",
    "body_frames",
    "cancel_frames",
    "chunk_frames",
    "clip",
    "describe",
    "error_counts",
    "error_reply",
    "id_of",
    "id_of_refused",
    "input_length",
    "naturals",
    "ok_reply",
    "pack",
    "pack_carrying",
    "parse_chunk_header",
    "parse_reply_header",
    "parse_request",
    "read_header",
    "ready_frames",
    "reply_frames",
    "split_bodies",
    "split_envelope",
    "split_replies",
    "start_frames",
    "unpack",
    "wants_stream",
    "with_load",
]


class ProtocolError(BatcherError):
    """A message that breaks the protocol; carries the code to answer with and, when the
    body's `id` could be read, that id, so the client can match the error reply."""

    code: ErrorCode

    def __init__(self, code: ErrorCode, message: str, req_id: int | str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.req_id = req_id


class RequestHeader(msgspec.Struct, frozen=True, gc=False):
    """The fields of a request body that the broker needs to schedule it (a Struct: made
    for every request, in 0.09 us where a NamedTuple took 0.31)."""

    id: int | str | None
    model: str | None
    timeout_ms: float | None
    priority: float
    op: str
    cost: float = 1.0  # its share of the model's max_batch_cost
    stream: bool = False  # one reply per chunk, each but the last with "more": true
    # W3C trace context as the client sent it, unchecked (batcher.wire.tracecontext reads
    # it, and only when tracing is on): any value, never a reason to refuse a request.
    traceparent: Any = None
    tracestate: Any = None
    version: int | str | None = None  # a repository model's version (None: its newest or split)


class _Header(msgspec.Struct):
    """The request fields the broker reads, typed for msgspec: every other key, `input`'s
    value included, is skipped without being decoded or copied."""

    id: int | str | None = None
    model: str | None = None
    timeout_ms: int | float | None = None
    priority: int | float = 0
    op: str = "infer"
    cost: int | float = 1.0
    stream: bool = False
    traceparent: Any = None
    tracestate: Any = None
    version: int | str | None = None
    input: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


_read_header = msgspec.msgpack.Decoder(_Header).decode


def read_header(body: Any) -> RequestHeader:
    """The broker's view of a request body (bytes, or any buffer such as a zmq.Frame):
    the header fields, read without decoding or copying `input` (a 1 MiB tensor costs
    what a 16-byte string does). Anything the fast reader does not take as it is (a
    wrong type, a non-str key, broken msgpack) goes through `parse_request`, which
    raises the ProtocolError with the precise message, or accepts what it may.

    A body accepted here may still hold something only a full decode refuses inside
    `input` (a map key that is an array, invalid UTF-8): the worker decodes each body on
    its own and answers such a request `bad_request`, alone."""
    try:
        h = _read_header(body)
    except (msgspec.DecodeError, RecursionError):
        return parse_request(bytes(body))[0]
    timeout_ms, priority, cost = h.timeout_ms, h.priority, h.cost
    if (
        (h.op == "infer" and h.input is msgspec.UNSET)
        or (timeout_ms is not None and not timeout_ms >= 0)
        or priority != priority
        or not 0 < cost <= MAX_COST
    ):
        return parse_request(bytes(body))[0]  # raises with the precise message
    return RequestHeader(
        h.id, h.model, timeout_ms, priority, h.op, cost, h.stream, h.traceparent, h.tracestate, h.version
    )


class _TensorHeader(msgspec.Struct):
    """A tensor's shape, its data skipped unread."""

    shape: Any


class _OneTensorInput(msgspec.Struct):
    input: _TensorHeader


class _NamedTensorsInput(msgspec.Struct):
    input: dict[str, _TensorHeader]


class _TensorListInput(msgspec.Struct):
    input: list[_TensorHeader]


_SHAPE_READERS: list[Callable[[Any], _OneTensorInput | _NamedTensorsInput | _TensorListInput]] = [
    msgspec.msgpack.Decoder(_OneTensorInput).decode,
    msgspec.msgpack.Decoder(_NamedTensorsInput).decode,
    msgspec.msgpack.Decoder(_TensorListInput).decode,
]


def input_length(body: Any, req_id: int | str | None = None) -> int:
    """A request's length for `--bucket-by length`: the first axis of its input tensor
    (of the longest, for a map or a list of tensors), read from the tensor headers alone.
    ProtocolError (bad_request) when the input has no such tensor."""
    for read in _SHAPE_READERS:
        try:
            given = read(body).input
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            continue
        if isinstance(given, _TensorHeader):
            headers = [given]
        elif isinstance(given, dict):
            headers = list(given.values())
        else:
            headers = given
        lengths = [_first_axis(h.shape) for h in headers]
        if lengths and all(n is not None for n in lengths):
            return max(n for n in lengths if n is not None)
    raise ProtocolError(
        ErrorCode.BAD_REQUEST,
        "this model groups requests by length (--bucket-by length): the input must be a tensor, "
        "a map of tensors or a list of tensors, each with a first axis (its length)",
        req_id,
    )


def _first_axis(shape: object) -> int | None:
    if isinstance(shape, list) and shape and type(shape[0]) is int and shape[0] >= 0:
        return shape[0]
    return None


def split_envelope(frames: list[bytes]) -> tuple[list[bytes], bytes]:
    """Split a ROUTER message into (envelope, body).

    The envelope is the routing identity plus, when present, everything up to and
    including the first empty delimiter frame; exactly one body frame must follow.
    Raises ProtocolError with the envelope in `.envelope` so the sender is answered.
    """
    n = len(frames)
    if n == 3 and not frames[1]:  # REQ, or DEALER with delimiter: the common case
        return frames[:2], frames[2]
    if n == 2 and frames[1]:  # DEALER without delimiter
        return frames[:1], frames[1]
    try:
        end = frames.index(b"", 1) + 1
    except ValueError:
        # No delimiter and more than one frame after the identity: either several bodies
        # or a DEALER without delimiter behind a proxy. Refused either way; answered on
        # every frame but the last, which a proxy routes back to its client (and a direct
        # DEALER gets as a reply whose last frame is the error).
        envelope = frames[:-1] if n > 2 else frames[:1]
        raise EnvelopeError(
            envelope,
            f"expected exactly one body frame after the envelope, got {n - 1} "
            "(without an empty delimiter the envelope is the identity alone; "
            "behind a proxy, send the empty delimiter frame before the body)",
        ) from None
    envelope = frames[:end]
    rest = n - end
    if rest == 1:  # a multi-hop envelope (the request came through proxies)
        return envelope, frames[end]
    raise EnvelopeError(envelope, f"expected exactly one body frame after the envelope, got {rest}")


class EnvelopeError(ProtocolError):
    """Wrong frame count; keeps the envelope so the sender can still be answered."""

    def __init__(self, envelope: list[bytes], message: str) -> None:
        super().__init__(ErrorCode.BAD_REQUEST, message)
        self.envelope = envelope


def _type_name(value: object) -> str:
    return type(value).__name__


def answer_id(request: dict[str, Any]) -> int | str | None:
    """The id a worker answers a decoded request with: the broker only forwards int and
    str ids (nil for any other)."""
    req_id = request.get("id")
    return req_id if isinstance(req_id, ID_TYPES) and not isinstance(req_id, bool) else None


#: How much of a too-large body is read for its id (an id after a big input is not found).
ID_PREFIX_BYTES = 64 * 1024


def id_of_refused(body: bytes) -> int | str | None:
    """The `id` of a body the broker refuses unread (too large), if its first
    ID_PREFIX_BYTES hold it: no copy of the rest is made."""
    return id_of(memoryview(body)[:ID_PREFIX_BYTES])


def id_of(body: Any) -> int | str | None:
    """The `id` of a body that cannot be decoded whole (the broker's refusals, a worker's
    bad_request), read as far as the body allows: key by key, values skipped, maps
    decoded as lists of pairs (so no key needs to be hashable), stopping at the first
    fault. Wherever the id stands before the fault, it is echoed."""
    value = _key_of(body, "id")
    return value if isinstance(value, ID_TYPES) and not isinstance(value, bool) else None


def wants_stream(body: Any) -> bool:
    """Whether a body that cannot be decoded whole says `"stream": true` (read as `id_of`
    reads the id): its refusal then says `"more": false`, as every stream's last reply does."""
    return _key_of(body, "stream") is True


def _key_of(body: Any, key: str) -> Any:
    """The value of a top-level `key`, read key by key as far as the body allows (None if
    it is not found before a fault)."""
    unpacker = msgpack.Unpacker(
        raw=False, strict_map_key=False, object_pairs_hook=list, max_buffer_size=max(len(body), 1)
    )
    unpacker.feed(body)
    try:
        for _ in range(unpacker.read_map_header()):
            if unpacker.unpack() != key:
                unpacker.skip()
                continue
            return unpacker.unpack()
    except Exception:  # msgpack raises several unrelated types
        return None
    return None


def parse_request(body: bytes) -> tuple[RequestHeader, dict[str, Any]]:
    """Decode a request body once and check the fields the broker relies on."""
    try:
        # Decoded inside a one-element array, as the worker will see it (one level
        # deeper): a body that fits msgpack's nesting limit here fits it there too.
        msg = msgpack.unpackb(b"\x91" + body, raw=False, strict_map_key=False)[0]
    except TypeError as exc:  # valid msgpack, but a map key that is an array or a map
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"body has a map key that is an array or a map, which is not supported ({exc})",
            id_of(body),
        ) from None
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"body is not valid msgpack: {describe(exc)}", id_of(body)
        ) from None
    if not isinstance(msg, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"body must be a msgpack map, got {_type_name(msg)}")
    req_id = msg.get("id")
    if (req_id is not None and not isinstance(req_id, ID_TYPES)) or isinstance(req_id, bool):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"id must be an int or a str, got {_type_name(req_id)}")

    def bad(message: str) -> ProtocolError:
        return ProtocolError(ErrorCode.BAD_REQUEST, message, req_id)

    op = msg.get("op", "infer")
    if not isinstance(op, str):
        raise bad(f"op must be a str, got {_type_name(op)}")
    if op == "infer" and "input" not in msg:
        raise bad("request has no 'input'")
    model = msg.get("model")
    if model is not None and not isinstance(model, str):
        raise bad(f"model must be a str, got {_type_name(model)}")
    timeout_ms = msg.get("timeout_ms")
    if timeout_ms is not None:
        if not isinstance(timeout_ms, int | float) or isinstance(timeout_ms, bool):
            raise bad(f"timeout_ms must be a number, got {_type_name(timeout_ms)}")
        if not timeout_ms >= 0:
            raise bad(f"timeout_ms must be >= 0, got {timeout_ms}")
    priority = msg.get("priority", 0)
    if not isinstance(priority, int | float) or isinstance(priority, bool):
        raise bad(f"priority must be a number, got {_type_name(priority)}")
    if priority != priority:  # NaN
        raise bad("priority must be a number, got NaN")
    cost = msg.get("cost", 1.0)
    if isinstance(cost, bool) or not isinstance(cost, int | float) or not 0 < cost <= MAX_COST:
        raise bad(f"cost must be a number in (0, {MAX_COST:.0e}], got {cost!r}")
    stream = msg.get("stream", False)
    if not isinstance(stream, bool):
        raise bad(f"stream must be true or false, got {_type_name(stream)}")
    version = msg.get("version")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int | str)):
        raise bad(f"version must be an int or a str, got {_type_name(version)}")
    header = RequestHeader(
        req_id,
        model,
        timeout_ms,
        priority,
        op,
        cost,
        stream,
        msg.get("traceparent"),
        msg.get("tracestate"),
        version,
    )
    return header, msg
