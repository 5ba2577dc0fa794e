"""W3C trace context (https://www.w3.org/TR/trace-context/) as values: a `traceparent`
read or refused, a `tracestate` kept or dropped, and the sampling rule every batcher
process applies. Pure: no OpenTelemetry, no clock, no randomness of its own (the caller
passes its random draw), so the broker reads a request's context without the SDK and the
rules are tested with property tests (tests/unit/wire/test_tracecontext.py).

Bad context is never an error: a malformed `traceparent` reads as None (the request
starts a new trace where sampling says so), a `tracestate` over MAX_TRACESTATE_CHARS or
with more than MAX_TRACESTATE_MEMBERS members is dropped, as the specification allows.
"""

from __future__ import annotations

import re
from typing import NamedTuple

#: The longest tracestate kept (the specification's propagation minimum: 512 characters).
MAX_TRACESTATE_CHARS = 512
#: The most list members a tracestate may have.
MAX_TRACESTATE_MEMBERS = 32
#: The longest traceparent read (a future version may append fields; none is this long).
MAX_TRACEPARENT_CHARS = 256

_HEX = frozenset("0123456789abcdef")
_INVALID_TRACE_ID = "0" * 32
_INVALID_SPAN_ID = "0" * 16
#: One list member, to its very end (`\Z`: `$` would also take a member ending in a newline).
_MEMBER = re.compile(
    r"^(?P<key>[a-z0-9][_0-9a-z\-*/]{0,255}|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]\Z"
)

#: The trace-flags bit saying the caller sampled (recorded) its span.
SAMPLED = 0x01


class TraceParent(NamedTuple):
    """A valid traceparent's fields: lowercase hex ids and the flags byte."""

    trace_id: str  # 32 hex digits, not all zero
    span_id: str  # 16 hex digits, not all zero: the caller's span, our spans' parent
    flags: int  # 0..255; bit 0 is `sampled`

    @property
    def sampled(self) -> bool:
        """Whether the caller recorded its span (and asks us to record ours)."""
        return bool(self.flags & SAMPLED)

    def header(self) -> str:
        """The traceparent as version 00 writes it."""
        return format_traceparent(self.trace_id, self.span_id, self.flags)


def _is_hex(text: str) -> bool:
    return all(c in _HEX for c in text)


def parse_traceparent(value: object) -> TraceParent | None:
    """The traceparent `value` (a str; bytes are read as ASCII) if it is valid, else None.

    Version 00 is exactly `00-<32 hex>-<16 hex>-<2 hex>`; a later version (not `ff`) may
    append `-`-separated fields, which are ignored; ids of all zeros are invalid; hex is
    lowercase only, as the specification says."""
    if isinstance(value, bytes | bytearray):
        try:
            value = bytes(value).decode("ascii")
        except UnicodeDecodeError:
            return None
    if not isinstance(value, str) or not 55 <= len(value) <= MAX_TRACEPARENT_CHARS:
        return None
    version, trace_id, span_id, flags = value[0:2], value[3:35], value[36:52], value[53:55]
    if value[2] != "-" or value[35] != "-" or value[52] != "-":
        return None
    if not (_is_hex(version) and _is_hex(trace_id) and _is_hex(span_id) and _is_hex(flags)):
        return None
    if version == "ff" or (version == "00" and len(value) != 55):
        return None
    if len(value) > 55 and value[55] != "-":
        return None
    if trace_id == _INVALID_TRACE_ID or span_id == _INVALID_SPAN_ID:
        return None
    return TraceParent(trace_id, span_id, int(flags, 16))


def format_traceparent(trace_id: str | int, span_id: str | int, flags: int) -> str:
    """A version 00 traceparent from ids given as hex text or as integers."""
    t = trace_id if isinstance(trace_id, str) else f"{trace_id:032x}"
    s = span_id if isinstance(span_id, str) else f"{span_id:016x}"
    return f"00-{t}-{s}-{flags & 0xFF:02x}"


def parse_tracestate(value: object) -> str | None:
    """The tracestate `value` to carry on, or None: dropped when it is not a str, longer
    than MAX_TRACESTATE_CHARS, has more than MAX_TRACESTATE_MEMBERS members, or holds a
    member that is not `key=value` as the specification writes them (empty members,
    from commas in a row, are allowed and removed)."""
    if not isinstance(value, str) or len(value) > MAX_TRACESTATE_CHARS:
        return None
    members = [m.strip(" \t") for m in value.split(",")]
    members = [m for m in members if m]
    if not members or len(members) > MAX_TRACESTATE_MEMBERS:
        return None
    keys = set()
    for member in members:
        match = _MEMBER.match(member)
        if match is None:
            return None
        key = match["key"]
        if key in keys:
            return None
        keys.add(key)
    return ",".join(members)


def should_sample(parent: TraceParent | None, ratio: float, draw: float, parent_based: bool = True) -> bool:
    """Whether to record a request's spans: a parent's `sampled` flag decides when there
    is one (and the sampler is parent-based, OpenTelemetry's default), else `ratio`:
    True when `draw` (uniform in [0, 1)) falls below it. Ratio 0 never samples a root,
    ratio 1 always does."""
    if parent is not None and parent_based:
        return parent.sampled
    return draw < ratio
