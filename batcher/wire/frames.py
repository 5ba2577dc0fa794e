"""The backend's messages between broker and workers (docs/protocol.md, section 6): each
one's frames, built (`batch_frames`, `reply_frames`, `ready_frames`, `start_frames`,
`cancel_frames`, `chunk_frames`) and checked (`parse_reply_header`, `parse_chunk_header`,
`split_bodies`), and the heartbeat settings a HEARTBEAT carries.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, NamedTuple

import msgspec

from batcher.errors import BatcherError, SettingsError
from batcher.wire.codec import _packer_pack, unpack
from batcher.wire.codes import (
    CHUNK_DROPPED,
    CHUNK_FLAGS,
    CMD_BATCH,
    CMD_CANCEL,
    CMD_CHUNK,
    CMD_READY,
    CMD_REPLY,
    CMD_START,
    MAX_COST,
    MAX_REPORTED_MS,
    WORKER_PROTOCOL,
    ZERO_COPY_BYTES,
    ErrorCode,
    clip,
    describe,
)

#: The most characters of a peer's value an error message shows (a REPLY's go to the
#: clients of its batch: a header of megabytes must not make each of them a message as long).
SHOWN_CHARS = 300


def _shown(value: object) -> str:
    """A peer's value as an error message shows it: its repr, clipped (codes.clip)."""
    return clip(value, SHOWN_CHARS)


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
            raise SettingsError(f"heartbeat_ms must be > 0, got {self.interval_ms}")
        if not isinstance(self.liveness, int) or self.liveness < 1:
            raise SettingsError(f"heartbeat_liveness must be >= 1, got {self.liveness}")

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
            raise ValueError(f"heartbeat settings must be a map, got {_shown(fields)}")
        interval, liveness = fields.get("heartbeat_ms"), fields.get("liveness")
        if (
            isinstance(interval, bool)
            or not isinstance(interval, int | float)
            or not interval <= MAX_REPORTED_MS
        ):
            raise ValueError(f"heartbeat_ms must be a number up to one day, got {_shown(interval)}")
        if isinstance(liveness, bool) or not isinstance(liveness, int) or liveness > 1000:
            raise ValueError(f"liveness must be an int up to 1000, got {_shown(liveness)}")
        return cls(float(interval), liveness)

    @property
    def expiry_s(self) -> float:
        """Silence after which the peer is taken for dead."""
        return self.interval_s * self.liveness


def body_frames(bodies: list[Any], lengths: list[int] | None = None) -> list[Any]:
    """The bodies of a BATCH or REPLY as frames: one frame holding them all when every
    one is small (one send, one copy of little), or one frame each when any is a large
    zmq.Frame or bytes (sent on by reference, never copied). docs/benchmarks.md
    ("One frame per batch or per request") has the measurement behind the size.
    `lengths`: the bodies' lengths, when the caller has them."""
    if lengths is None:
        lengths = list(map(len, bodies))  # map: no Python call per body
    if lengths and max(lengths) >= ZERO_COPY_BYTES:
        return bodies
    return [b"".join(bodies)]


def batch_frames(
    batch_id: int,
    queue_ms: list[float],
    bodies: list[Any],
    traceparent: str | None = None,
    model: str | None = None,
) -> list[Any]:
    """Backend BATCH message (after the worker's routing id): a header with each body's
    length (and, when the batch is traced, its span's traceparent as a 4th element, the
    parent of the worker's spans; for a multiplexed worker, the batch's model as a 5th),
    then the bodies, joined in one frame or one frame each (`body_frames`)."""
    lengths = list(map(len, bodies))
    if model is not None:
        fields = [batch_id, queue_ms, lengths, traceparent, model]
    elif traceparent is None:
        fields = [batch_id, queue_ms, lengths]
    else:
        fields = [batch_id, queue_ms, lengths, traceparent]
    header = _packer_pack(fields)
    return [WORKER_PROTOCOL, CMD_BATCH, header, *body_frames(bodies, lengths)]


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
    lengths = list(map(len, replies))
    fields: list[Any] = [batch_id, infer_ms, lengths, errors]
    if wait_ms is not None or padding is not None:
        fields.append(wait_ms)
    if padding is not None:
        fields.append(list(padding))
    return [WORKER_PROTOCOL, CMD_REPLY, _packer_pack(fields), *body_frames(replies, lengths)]


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
    #: A multiplexed worker loaded the batch's model first: (ms it took, models it
    #: unloaded, models it holds now, least recently used first).
    load: tuple[float, tuple[str, ...], tuple[str, ...]] | None = None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def naturals(values: list[Any]) -> bool:
    """Whether every value is an int (not a bool) >= 0, checked by C loops (a set of the
    types, a min): no Python call per value, for the lengths of every BATCH and REPLY."""
    return not values or (set(map(type, values)) == {int} and min(values) >= 0)


_BatchId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
_Natural = Annotated[int, msgspec.Meta(ge=0)]
_Ms = Annotated[float, msgspec.Meta(ge=0, le=MAX_REPORTED_MS)]


class _CommonReplyHeader(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """The common REPLY header, its errors a count and no `load`: decoded and checked in
    one call by msgspec, in C (0.8 against 7 us warm; on a lone request's cold path, the
    Python checks were a fifth of the broker's reply to its client)."""

    batch_id: _BatchId
    infer_ms: _Ms
    lengths: list[_Natural]
    errors: _Natural = 0
    wait_ms: _Ms | None = None
    padding: tuple[_BatchId, _BatchId] | None = None


_decode_common_reply_header = msgspec.msgpack.Decoder(_CommonReplyHeader).decode


def parse_reply_header(frame: bytes) -> ReplyHeader:
    """Decode and check `[batch_id, infer_ms, lengths, errors, wait_ms, padding, load]`
    (errors, wait_ms, padding and load may be absent, wait_ms, padding and load nil).

    Raises WorkerProtocolError for anything else: a batch id that is not an int in
    [0, 2**63), an infer_ms or wait_ms that is not a number in [0, one day], a length that is not an
    int >= 0, or an errors count outside [0, len(lengths)]. The common header is read by
    msgspec (`_CommonReplyHeader`); any other, and any msgspec refuses, by
    `_parse_reply_header`, whose checks say what is wrong (the same verdict either way: a
    property test).
    """
    try:
        common = _decode_common_reply_header(frame)
    except msgspec.DecodeError:  # (ValidationError is one)
        return _parse_reply_header(frame)
    if common.errors > len(common.lengths):
        return _parse_reply_header(frame)  # (which says so)
    return ReplyHeader(
        common.batch_id, common.infer_ms, common.lengths, common.errors, common.wait_ms, common.padding
    )


def _parse_reply_header(frame: bytes) -> ReplyHeader:
    """parse_reply_header's checks, one by one, in Python."""
    try:
        header = unpack(frame)
    except Exception as exc:  # msgpack raises several unrelated types
        raise WorkerProtocolError(f"REPLY header is not valid msgpack: {describe(exc)}") from None
    if not isinstance(header, list) or len(header) not in (3, 4, 5, 6, 7):
        raise WorkerProtocolError(
            f"REPLY header must be [batch_id, infer_ms, lengths, errors], got {_shown(header)}"
        )
    batch_id, infer_ms, lengths = header[:3]
    if not _is_int(batch_id) or not 0 <= batch_id < 2**63:
        raise WorkerProtocolError(f"REPLY batch id must be an int in [0, 2**63), got {_shown(batch_id)}")

    def bad(message: str) -> WorkerProtocolError:
        return WorkerProtocolError(message, batch_id)

    if not _is_finite_ms(infer_ms):
        raise bad(f"REPLY infer_ms must be a number in [0, {MAX_REPORTED_MS:.0f}], got {_shown(infer_ms)}")
    # type() is int: msgpack decodes an int as exactly int (a bool as bool); checked by
    # C loops (map, min), as this runs once per reply of every batch.
    if not isinstance(lengths, list) or not naturals(lengths):
        raise bad(f"REPLY lengths must be a list of ints >= 0, got {_shown(lengths)}")
    errors, refused = _errors(header[3] if len(header) >= 4 else 0, len(lengths), bad)
    wait_ms = header[4] if len(header) >= 5 else None
    if wait_ms is not None and not _is_finite_ms(wait_ms):
        raise bad(
            f"REPLY wait_ms must be a number in [0, {MAX_REPORTED_MS:.0f}] or nil, got {_shown(wait_ms)}"
        )
    padding = header[5] if len(header) >= 6 else None
    if padding is not None and not (
        isinstance(padding, list)
        and len(padding) == 2
        and all(_is_int(n) and 0 <= n < 2**63 for n in padding)
    ):
        raise bad(f"REPLY padding must be [padded, real] ints >= 0 or nil, got {_shown(padding)}")
    load = _load(header[6], bad) if len(header) >= 7 and header[6] is not None else None
    return ReplyHeader(
        batch_id,
        float(infer_ms),
        lengths,
        errors,
        None if wait_ms is None else float(wait_ms),
        None if padding is None else (padding[0], padding[1]),
        refused,
        load,
    )


#: The most models one REPLY may say its worker unloaded, or holds.
MAX_UNLOADED = 1024


def _load(
    value: object, bad: Callable[[str], WorkerProtocolError]
) -> tuple[float, tuple[str, ...], tuple[str, ...]]:
    """(ms, unloaded, held) from a REPLY header's `load`: {"ms": a number in [0, one day],
    "unloaded": the models it unloaded, "held": those it holds now, least recent first}."""
    if isinstance(value, dict) and set(value) == {"ms", "unloaded", "held"}:
        ms, unloaded, held = value["ms"], value["unloaded"], value["held"]
        if _is_finite_ms(ms) and _names(unloaded) and _names(held):
            return float(ms), tuple(unloaded), tuple(held)
    wanted = f"{{ms: a number in [0, {MAX_REPORTED_MS:.0f}], unloaded: [names], held: [names]}} or nil"
    raise bad(f"REPLY load must be {wanted}, got {_shown(value)}")


def _names(value: object) -> bool:
    return isinstance(value, list) and len(value) <= MAX_UNLOADED and all(isinstance(k, str) for k in value)


def with_load(reply: list[Any], load_ms: float, unloaded: list[str], held: list[str]) -> list[Any]:
    """A REPLY (from `reply_frames`) saying its worker loaded the batch's model first (or
    tried to), taking `load_ms`, unloaded `unloaded` to make room and now holds `held`
    (least recently used first): its header's 7th element."""
    header = unpack(reply[2])
    header += [0, None, None][len(header) - 3 :] if len(header) < 6 else []
    header.append({"ms": round(load_ms, 3), "unloaded": unloaded, "held": held})
    return [reply[0], reply[1], _packer_pack(header), *reply[3:]]


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
        f"adding up to at most {n}, got {_shown(value)}"
    )


#: A number of the protocol (a tuple: `int | float` would build a union at each call).
_NUMBER = (int, float)


def _is_finite_ms(value: object) -> bool:
    return isinstance(value, _NUMBER) and not isinstance(value, bool) and 0 <= value <= MAX_REPORTED_MS


def split_replies(lengths: list[int], blob: Any) -> list[bytes]:
    """Cut a frame of joined bodies (bytes, or a zmq.Frame) back into one bytes per
    length, in one pass; ValueError naming the first length that does not fit. Only small
    bodies are ever joined (`body_frames`), so the copies are small."""
    if (not lengths or min(lengths) >= 0) and sum(lengths) == len(blob):
        ends = itertools.accumulate(lengths)
        if type(blob) is bytes:  # (its slices are bytes: no call to make them so)
            return [blob[end - length : end] for length, end in zip(lengths, ends, strict=True)]
        view = memoryview(blob)
        return [bytes(view[end - length : end]) for length, end in zip(lengths, ends, strict=True)]
    raise ValueError(_misfit(lengths, len(blob)))


def _misfit(lengths: list[int], size: int) -> str:
    """Why `lengths` do not cut a frame of `size` bytes: the first that does not fit, or their sum."""
    pos = 0
    for length in lengths:
        end = pos + length
        if length < 0 or end > size:
            return f"reply length {length} does not fit a {size}-byte frame"
        pos = end
    return f"reply lengths add up to {pos} bytes, frame has {size}"


def ready_frames(
    model: str,
    gpu: int | None,
    pid: int,
    slots: int | None = None,
    signature: dict[str, Any] | None = None,
    cost_ms: list[float] | None = None,
    max_active: int | None = None,
    warmup_error: str | None = None,
    deterministic: bool = True,
    multiplexed: dict[str, Any] | None = None,
    signatures: dict[str, Any] | None = None,
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
    if not deterministic:  # its replies are never cached (docs/protocol.md)
        info["deterministic"] = False
    if multiplexed is not None:  # the models it may serve and its budget (batcher.core.multiplex)
        info["multiplexed"] = multiplexed
    if signatures:  # a multiplexed worker's models' signatures, by model
        info["signatures"] = signatures
    return [WORKER_PROTOCOL, CMD_READY, _packer_pack(info)]


#: The longest `warmup_error` a READY carries (characters).
MAX_WARMUP_ERROR_CHARS = 500


# --- step-level workers (docs/generative.md) ------------------------------------------------


def start_frames(
    seq_ids: list[int],
    remaining_ms: list[float | None],
    bodies: list[Any],
    traceparents: list[str | None] | None = None,
) -> list[Any]:
    """Backend START message (after the worker's routing id): each new sequence's id and
    the time left before its deadline (nil: none), then the request bodies untouched; a
    4th header element, each sequence's traceparent (nil: not traced), when any is traced."""
    fields: list[Any] = [seq_ids, remaining_ms, [len(b) for b in bodies]]
    if traceparents is not None:
        fields.append(traceparents)
    header = _packer_pack(fields)
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
            f"CHUNK header must be [seq_ids, flags, lengths, counters], got {_shown(header)}"[:200]
        )
    seq_ids, flags, lengths, counters = header
    n = len(seq_ids) if isinstance(seq_ids, list) else -1
    if n < 0 or not all(_is_int(s) and 0 <= s < 2**63 for s in seq_ids):
        raise WorkerProtocolError(f"CHUNK seq_ids must be ints in [0, 2**63), got {_shown(seq_ids)}"[:200])
    if (
        not isinstance(flags, list)
        or len(flags) != n
        or not all(_is_int(f) and f in CHUNK_FLAGS for f in flags)
    ):
        raise WorkerProtocolError(f"CHUNK flags must be {n} of 0, 1, 2 or 3, got {_shown(flags)}"[:200])
    if (
        not isinstance(lengths, list)
        or len(lengths) != n
        or not all(
            _is_int(x) and x >= 0 and (x == 0) == (f == CHUNK_DROPPED)
            for x, f in zip(lengths, flags, strict=False)
        )
    ):
        wanted = f"{n} ints, 0 for a dropped entry and > 0 for any other"
        raise WorkerProtocolError(f"CHUNK lengths must be {wanted}, got {_shown(lengths)}"[:200])
    if not isinstance(counters, dict) or not all(
        k in WORKER_COUNTERS and isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v <= MAX_COST
        for k, v in counters.items()
    ):
        raise WorkerProtocolError(
            f"CHUNK counters must map {', '.join(WORKER_COUNTERS)} to numbers, got {_shown(counters)}"[:200]
        )
    return ChunkHeader(seq_ids, flags, lengths, counters)
