"""The protocol's shared words: the frame markers and commands of the backend, the
limits every side checks, the error codes of replies, and how an error is worded.

batcher.wire.protocol (requests), batcher.wire.codec (msgpack bodies) and
batcher.wire.frames (backend messages) build on these; docs/protocol.md is their prose.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

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

#: The longest time a worker may report (one day): past it, a number is a lie that would
#: skew the learned batch cost for thousands of batches.
MAX_REPORTED_MS = 86_400_000.0


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


def clip(value: object, limit: int = 80) -> str:
    """A value's repr cut to `limit` characters, for a log line or an error message. A
    peer's msgpack may nest containers deeper than repr can go (msgpack decodes 1024
    levels, repr stops at Python's recursion limit, and where depends on the caller's
    stack): a value nested past MAX_SHOWN_DEPTH is named, not shown, the same from any
    caller (a fast path and its fallback give the same message)."""
    if _nested_past(value, MAX_SHOWN_DEPTH):
        text = f"<a {type(value).__name__} nested too deeply to show>"
    else:
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


#: The deepest nesting of containers `clip` shows (none the protocol sends is past 3).
MAX_SHOWN_DEPTH = 100


def _nested_past(value: object, depth: int) -> bool:
    """Whether `value` holds lists, tuples or dicts nested more than `depth` deep (a walk
    with a stack of its own: no recursion)."""
    todo: list[tuple[object, int]] = [(value, 1)] if isinstance(value, _CONTAINERS) else []
    while todo:
        item, level = todo.pop()
        if level > depth:
            return True
        children: Any = (*item, *item.values()) if isinstance(item, dict) else item
        # only the containers among them are kept: a flat list of millions costs no memory
        todo.extend((child, level + 1) for child in children if isinstance(child, _CONTAINERS))
    return False


_CONTAINERS = (list, tuple, dict)


def describe(exc: Exception) -> str:
    """An exception as a message that never ends in an empty colon."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
