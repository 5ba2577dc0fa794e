"""Wire protocol v1: frame layouts, request parsing and reply building.

Everything that knows how bytes look on a socket lives here, so the broker, the
workers and the clients agree by construction. docs/protocol.md is the prose
version of this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NamedTuple

import msgpack
import msgspec

from batcher.errors import BatcherError
from batcher.wire import aligned, tensor

#: First frame of every backend message, so a peer speaking anything else is spotted.
WORKER_PROTOCOL = b"BATCHER-W2"

#: Backend commands (second frame of every backend message).
CMD_READY = b"\x01"
CMD_BATCH = b"\x02"
CMD_REPLY = b"\x03"
CMD_HEARTBEAT = b"\x04"
CMD_DISCONNECT = b"\x05"
CMD_EXIT = b"\x06"  # broker -> worker: your batch ran past its time limit; exit now
# Step-level (generative) workers, docs/generative.md:
CMD_START = b"\x07"  # broker -> worker: new sequences, one per free slot it announced
CMD_CANCEL = b"\x08"  # broker -> worker: stop generating these sequences
CMD_CHUNK = b"\x09"  # worker -> broker: a step's chunks (and the sequences that ended)

#: A CHUNK entry's flag: a chunk with more to follow, the sequence's final reply (ok), its
#: final reply as an error, or the end of a sequence the broker had already answered
#: (cancelled, past its deadline), which has no body.
CHUNK_FINAL, CHUNK_MORE, CHUNK_DROPPED, CHUNK_ERROR = 0, 1, 2, 3
CHUNK_FLAGS = (CHUNK_FINAL, CHUNK_MORE, CHUNK_DROPPED, CHUNK_ERROR)
#: The most sequences one step-level worker may hold (--max-active's largest).
MAX_ACTIVE = 4096

#: The largest `cost` a request may carry (as --max-batch-cost's largest): sums of many stay exact.
MAX_COST = 1e15

#: A body or frame this large is passed on by reference, never copied (zero copy);
#: smaller ones are copied, which costs them less (measured: docs/benchmarks.md,
#: "One frame per batch or one frame per request").
ZERO_COPY_BYTES = 64 * 1024

#: The types a request `id` may have (everything else in a body is forwarded untouched).
ID_TYPES = (int, str)


@dataclass(frozen=True)
class Heartbeat:
    """How often broker and workers tell each other they are alive, and how many silent
    intervals make a peer dead: with 500 ms x 3, a silent worker is taken for dead after
    more than 1.5 s of silence, found on the broker's next heartbeat tick, so 1.5 to 2.0 s
    after it froze (a crashed one sooner: the next send to it fails)."""

    interval_ms: float = 500.0
    liveness: int = 3

    def __post_init__(self) -> None:
        if not self.interval_ms > 0:
            raise ValueError(f"heartbeat_ms must be > 0, got {self.interval_ms}")
        if not isinstance(self.liveness, int) or self.liveness < 1:
            raise ValueError(f"heartbeat_liveness must be >= 1, got {self.liveness}")

    @property
    def interval_s(self) -> float:
        return self.interval_ms / 1000.0

    def frame(self) -> bytes:
        """The settings as the broker's HEARTBEAT carries them (6.6), for workers to adopt."""
        return _packer_pack({"heartbeat_ms": self.interval_ms, "liveness": self.liveness})

    @classmethod
    def from_frame(cls, frame: bytes) -> Heartbeat:
        """The settings a broker's HEARTBEAT carries; ValueError for anything else."""
        try:
            fields = unpack(frame)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ValueError(f"heartbeat settings are not msgpack: {exc!r}") from None
        if not isinstance(fields, dict):
            raise ValueError(f"heartbeat settings must be a map, got {fields!r}")
        interval, liveness = fields.get("heartbeat_ms"), fields.get("liveness")
        if (
            isinstance(interval, bool)
            or not isinstance(interval, int | float)
            or not interval <= MAX_REPORTED_MS
        ):
            raise ValueError(f"heartbeat_ms must be a number up to one day, got {interval!r}")
        if isinstance(liveness, bool) or not isinstance(liveness, int) or liveness > 1000:
            raise ValueError(f"liveness must be an int up to 1000, got {liveness!r}")
        return cls(float(interval), liveness)

    @property
    def expiry_s(self) -> float:
        """Silence after which the peer is taken for dead."""
        return self.interval_s * self.liveness


class ErrorCode(StrEnum):
    """Error codes that can appear in `error.code` of a reply."""

    BAD_REQUEST = "bad_request"
    UNKNOWN_MODEL = "unknown_model"
    MODEL_ERROR = "model_error"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    OVERLOADED = "overloaded"
    CANCELLED = "cancelled"
    WORKER_FAILED = "worker_failed"
    SHUTTING_DOWN = "shutting_down"
    UNAVAILABLE = "unavailable"
    TOO_LARGE = "too_large"
    FORBIDDEN = "forbidden"  # a control op that changes the service, from a key not in --curve-admins
    INTERNAL = "internal_error"


class ProtocolError(BatcherError):
    """A message that breaks the protocol; carries the code to answer with and, when the
    body's `id` could be read, that id, so the client can match the error reply."""

    code: ErrorCode

    def __init__(self, code: ErrorCode, message: str, req_id: int | str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.req_id = req_id


class RequestHeader(NamedTuple):
    """The fields of a request body that the broker needs to schedule it."""

    id: int | str | None
    model: str | None
    timeout_ms: float | None
    priority: float
    op: str
    cost: float = 1.0  # its share of the model's max_batch_cost
    stream: bool = False  # one reply per chunk, each but the last with "more": true


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
    return RequestHeader(h.id, h.model, timeout_ms, priority, h.op, cost, h.stream)


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


def clip(value: object, limit: int = 80) -> str:
    """A value's repr cut to `limit` characters, for a log line or an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def describe(exc: Exception) -> str:
    """An exception as a message that never ends in an empty colon."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


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
    return RequestHeader(req_id, model, timeout_ms, priority, op, cost, stream), msg


# --- replies -------------------------------------------------------------------------------

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
    the large payloads, which msgspec encodes exactly as the Packer would."""
    kind = type(value)
    if kind is bytes or kind is bytearray or kind is memoryview or tensor.is_array(value):
        return True
    if kind is dict:
        return all(type(k) is str and _plain_leaf(v) for k, v in value.items())  # type: ignore[attr-defined]
    if kind is list:
        return all(_plain_leaf(v) for v in value)  # type: ignore[attr-defined]
    return False


def _plain_leaf(value: object) -> bool:
    kind = type(value)
    return kind is bytes or kind is bytearray or kind is memoryview or tensor.is_array(value)


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


# --- backend framing -----------------------------------------------------------------------


def body_frames(bodies: list[Any]) -> list[Any]:
    """The bodies of a BATCH or REPLY as frames: one frame holding them all when every
    one is small (one send, one copy of little), or one frame each when any is a large
    zmq.Frame or bytes (sent on by reference, never copied). docs/benchmarks.md
    ("One frame per batch or per request") has the measurement behind the size."""
    if any(len(b) >= ZERO_COPY_BYTES for b in bodies):
        return bodies
    return [b"".join(bodies)]


def batch_frames(batch_id: int, queue_ms: list[float], bodies: list[Any]) -> list[Any]:
    """Backend BATCH message (after the worker's routing id): a header with each body's
    length, then the bodies, joined in one frame or one frame each (`body_frames`)."""
    header = _packer_pack([batch_id, queue_ms, [len(b) for b in bodies]])
    return [WORKER_PROTOCOL, CMD_BATCH, header, *body_frames(bodies)]


def error_counts(model_errors: int, refused: int) -> int | dict[str, int]:
    """A REPLY header's `errors`: the count of model_error replies, or, when the worker
    also refused requests itself (bad_request), the count of each."""
    if not refused:
        return model_errors
    return {str(ErrorCode.MODEL_ERROR): model_errors, str(ErrorCode.BAD_REQUEST): refused}


#: The error codes a worker's REPLY header may count.
WORKER_ERROR_CODES = (str(ErrorCode.MODEL_ERROR), str(ErrorCode.BAD_REQUEST))


def reply_frames(
    batch_id: int,
    infer_ms: float,
    replies: list[bytes],
    errors: int | dict[str, int] = 0,
    wait_ms: float | None = None,
    padding: tuple[int, int] | None = None,
) -> list[Any]:
    """Backend REPLY message: a header with each reply's length (how many replies are
    errors, for the broker's counters, the batch's wait in the worker and its padding
    when known), then the replies, joined in one frame or one frame each (`body_frames`)."""
    fields: list[Any] = [batch_id, infer_ms, [len(r) for r in replies], errors]
    if wait_ms is not None or padding is not None:
        fields.append(wait_ms)
    if padding is not None:
        fields.append(list(padding))
    return [WORKER_PROTOCOL, CMD_REPLY, _packer_pack(fields), *body_frames(replies)]


def split_bodies(lengths: list[int], frames: list[Any]) -> list[Any]:
    """The bodies of a BATCH or REPLY, one per length: `frames` is one frame holding them
    all (cut into memoryviews, not copied) or one frame each. ValueError when the frames
    do not match the lengths."""
    if len(frames) == 1 and len(lengths) != 1:
        return split_replies(lengths, frames[0])
    if len(frames) != len(lengths):
        raise ValueError(f"{len(frames)} body frames for {len(lengths)} lengths")
    for length, frame in zip(lengths, frames, strict=True):
        if len(frame) != length:
            raise ValueError(f"a body frame of {len(frame)} bytes where the header says {length}")
    return frames


class WorkerProtocolError(BatcherError, ValueError):
    """A backend message that breaks the protocol; `batch_id` is the batch it names, when
    that much could be read, so only that batch fails."""

    def __init__(self, message: str, batch_id: int | None = None) -> None:
        super().__init__(message)
        self.batch_id = batch_id


class ReplyHeader(NamedTuple):
    """A REPLY's header, every number checked: the broker changes no state before this."""

    batch_id: int
    infer_ms: float
    lengths: list[int]
    errors: int
    wait_ms: float | None  # how long the batch waited in the worker before its model ran
    padding: tuple[int, int] | None = None  # (padded, real) elements of a stacked batch
    refused: int = 0  # of the `errors`, replies the worker refused itself (bad_request)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_reply_header(frame: bytes) -> ReplyHeader:
    """Decode and check `[batch_id, infer_ms, lengths, errors, wait_ms, padding]` (errors,
    wait_ms and padding may be absent, wait_ms and padding nil).

    Raises WorkerProtocolError for anything else: a batch id that is not an int in
    [0, 2**63), an infer_ms or wait_ms that is not a number in [0, one day], a length that is not an
    int >= 0, or an errors count outside [0, len(lengths)].
    """
    try:
        header = unpack(frame)
    except Exception as exc:  # msgpack raises several unrelated types
        raise WorkerProtocolError(f"REPLY header is not valid msgpack: {describe(exc)}") from None
    if not isinstance(header, list) or len(header) not in (3, 4, 5, 6):
        raise WorkerProtocolError(
            f"REPLY header must be [batch_id, infer_ms, lengths, errors], got {header!r}"
        )
    batch_id, infer_ms, lengths = header[:3]
    if not _is_int(batch_id) or not 0 <= batch_id < 2**63:
        raise WorkerProtocolError(f"REPLY batch id must be an int in [0, 2**63), got {batch_id!r}")

    def bad(message: str) -> WorkerProtocolError:
        return WorkerProtocolError(message, batch_id)

    if not _is_finite_ms(infer_ms):
        raise bad(f"REPLY infer_ms must be a number in [0, {MAX_REPORTED_MS:.0f}], got {infer_ms!r}")
    # type() is int: msgpack decodes an int as exactly int (a bool as bool), and this runs
    # once per reply of every batch (no call per length).
    if not isinstance(lengths, list) or not all(type(n) is int and n >= 0 for n in lengths):
        raise bad(f"REPLY lengths must be a list of ints >= 0, got {lengths!r}")
    errors, refused = _errors(header[3] if len(header) >= 4 else 0, len(lengths), bad)
    wait_ms = header[4] if len(header) >= 5 else None
    if wait_ms is not None and not _is_finite_ms(wait_ms):
        raise bad(f"REPLY wait_ms must be a number in [0, {MAX_REPORTED_MS:.0f}] or nil, got {wait_ms!r}")
    padding = header[5] if len(header) >= 6 else None
    if padding is not None and not (
        isinstance(padding, list)
        and len(padding) == 2
        and all(_is_int(n) and 0 <= n < 2**63 for n in padding)
    ):
        raise bad(f"REPLY padding must be [padded, real] ints >= 0 or nil, got {padding!r}")
    return ReplyHeader(
        batch_id,
        float(infer_ms),
        lengths,
        errors,
        None if wait_ms is None else float(wait_ms),
        None if padding is None else (padding[0], padding[1]),
        refused,
    )


def _errors(value: object, n: int, bad: Callable[[str], WorkerProtocolError]) -> tuple[int, int]:
    """(errors, of them refused) from a REPLY header's `errors`: an int in [0, n], or a map
    of model_error and bad_request counts adding up to at most n."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= n:
        return value, 0
    if (
        isinstance(value, dict)
        and all(k in WORKER_ERROR_CODES and _is_int(v) and v >= 0 for k, v in value.items())
        and sum(value.values()) <= n
    ):
        refused = value.get(str(ErrorCode.BAD_REQUEST), 0)
        return value.get(str(ErrorCode.MODEL_ERROR), 0) + refused, refused
    raise bad(
        f"REPLY errors must be an int in [0, {n}] or a map of model_error and bad_request counts "
        f"adding up to at most {n}, got {value!r}"
    )


#: The longest time a worker may report (one day): past it, a number is a lie that would
#: skew the learned batch cost for thousands of batches.
MAX_REPORTED_MS = 86_400_000.0


#: A number of the protocol (a tuple: `int | float` would build a union at each call).
_NUMBER = (int, float)


def _is_finite_ms(value: object) -> bool:
    return isinstance(value, _NUMBER) and not isinstance(value, bool) and 0 <= value <= MAX_REPORTED_MS


def split_replies(lengths: list[int], blob: Any) -> list[bytes]:
    """Cut a frame of joined bodies (bytes, or a zmq.Frame) back into one bytes per
    length. Only small bodies are ever joined (`body_frames`), so the copies are small."""
    out = []
    pos = 0
    view = blob if isinstance(blob, bytes) else memoryview(blob)
    for length in lengths:
        end = pos + length
        if length < 0 or end > len(blob):
            raise ValueError(f"reply length {length} does not fit a {len(blob)}-byte frame")
        out.append(bytes(view[pos:end]))
        pos = end
    if pos != len(blob):
        raise ValueError(f"reply lengths add up to {pos} bytes, frame has {len(blob)}")
    return out


def ready_frames(
    model: str,
    gpu: int | None,
    pid: int,
    slots: int | None = None,
    signature: dict[str, Any] | None = None,
    cost_ms: list[float] | None = None,
    max_active: int | None = None,
    warmup_error: str | None = None,
) -> list[bytes]:
    """Backend READY message, a worker's first words: what it serves (and, optionally, how
    many batches it accepts at once, the broker's --worker-prefetch applying otherwise,
    its model's signature in wire form, batcher.wire.signature, the [a, b] ms of the
    t(n) = a + b*n its warm-up measured, or why its warm-up failed, and, for a step-level
    worker, the sequences it holds at once: its credit)."""
    info: dict[str, Any] = {"model": model, "gpu": gpu, "pid": pid}
    if slots is not None:
        info["slots"] = slots
    if signature is not None:
        info["signature"] = signature
    if cost_ms is not None:
        info["cost_ms"] = cost_ms
    if max_active is not None:  # a step-level worker: it takes sequences, not batches
        info["max_active"] = max_active
    if warmup_error is not None:
        info["warmup_error"] = warmup_error[:MAX_WARMUP_ERROR_CHARS]
    return [WORKER_PROTOCOL, CMD_READY, _packer_pack(info)]


#: The longest `warmup_error` a READY carries (characters).
MAX_WARMUP_ERROR_CHARS = 500


# --- step-level workers (docs/generative.md) ------------------------------------------------


def start_frames(seq_ids: list[int], remaining_ms: list[float | None], bodies: list[Any]) -> list[Any]:
    """Backend START message (after the worker's routing id): each new sequence's id and
    the time left before its deadline (nil: none), then the request bodies untouched."""
    header = _packer_pack([seq_ids, remaining_ms, [len(b) for b in bodies]])
    return [WORKER_PROTOCOL, CMD_START, header, *body_frames(bodies)]


def cancel_frames(seq_ids: list[int]) -> list[bytes]:
    """Backend CANCEL message: stop these sequences (the broker has answered them)."""
    return [WORKER_PROTOCOL, CMD_CANCEL, _packer_pack(seq_ids)]


def chunk_frames(
    seq_ids: list[int], flags: list[int], bodies: list[bytes], counters: dict[str, float]
) -> list[Any]:
    """Backend CHUNK message: a header with each entry's sequence id, flag (CHUNK_FLAGS)
    and body length, and the worker's counters (WORKER_COUNTERS); then the reply bodies
    (none for a dropped entry), joined or one frame each (`body_frames`)."""
    header = _packer_pack([seq_ids, flags, [len(b) for b in bodies], counters])
    return [WORKER_PROTOCOL, CMD_CHUNK, header, *body_frames(bodies)]


class ChunkHeader(NamedTuple):
    """A CHUNK's header, every number checked."""

    seq_ids: list[int]
    flags: list[int]
    lengths: list[int]
    counters: dict[str, float]


#: The counters a CHUNK header may carry, each a number >= 0.
WORKER_COUNTERS = ("active", "waiting", "steps", "chunks", "cancelled", "expired", "step_ms")


def parse_chunk_header(frame: bytes) -> ChunkHeader:
    """Decode and check `[seq_ids, flags, lengths, counters]`; WorkerProtocolError else."""
    try:
        header = unpack(frame)
    except Exception as exc:  # msgpack raises several unrelated types
        raise WorkerProtocolError(f"CHUNK header is not valid msgpack: {describe(exc)}") from None
    if not isinstance(header, list) or len(header) != 4:
        raise WorkerProtocolError(
            f"CHUNK header must be [seq_ids, flags, lengths, counters], got {header!r}"[:200]
        )
    seq_ids, flags, lengths, counters = header
    n = len(seq_ids) if isinstance(seq_ids, list) else -1
    if n < 0 or not all(_is_int(s) and 0 <= s < 2**63 for s in seq_ids):
        raise WorkerProtocolError(f"CHUNK seq_ids must be ints in [0, 2**63), got {seq_ids!r}"[:200])
    if (
        not isinstance(flags, list)
        or len(flags) != n
        or not all(_is_int(f) and f in CHUNK_FLAGS for f in flags)
    ):
        raise WorkerProtocolError(f"CHUNK flags must be {n} of 0, 1, 2 or 3, got {flags!r}"[:200])
    if (
        not isinstance(lengths, list)
        or len(lengths) != n
        or not all(
            _is_int(x) and x >= 0 and (x == 0) == (f == CHUNK_DROPPED)
            for x, f in zip(lengths, flags, strict=False)
        )
    ):
        raise WorkerProtocolError(
            f"CHUNK lengths must be {n} ints, 0 for a dropped entry and > 0 for any other, got {lengths!r}"[
                :200
            ]
        )
    if not isinstance(counters, dict) or not all(
        k in WORKER_COUNTERS and isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v <= MAX_COST
        for k, v in counters.items()
    ):
        raise WorkerProtocolError(
            f"CHUNK counters must map {', '.join(WORKER_COUNTERS)} to numbers, got {counters!r}"[:200]
        )
    return ChunkHeader(seq_ids, flags, lengths, counters)
