"""The backend messages' frames (batcher/wire/frames.py): READY, START, CANCEL, CHUNK and
REPLY headers as the worker writes them and the broker reads them, every number checked."""

from __future__ import annotations

from typing import Any

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from batcher.wire import frames, protocol
from batcher.wire.codes import CMD_CANCEL, CMD_READY, CMD_START, MAX_COST, WORKER_PROTOCOL
from batcher.wire.frames import MAX_WARMUP_ERROR_CHARS, parse_reply_header, split_bodies, split_replies
from batcher.wire.protocol import (
    CHUNK_DROPPED,
    CHUNK_ERROR,
    CHUNK_FINAL,
    CHUNK_MORE,
    WorkerProtocolError,
)

# --- protocol: CHUNK headers ------------------------------------------------------------------


def test_chunk_frames_round_trip() -> None:
    frames = protocol.chunk_frames(
        [1, 2, 3],
        [CHUNK_MORE, CHUNK_DROPPED, CHUNK_ERROR],
        [b"ab", b"", b"cde"],
        {"active": 2, "step_ms": 1.5},
    )
    header = protocol.parse_chunk_header(frames[2])
    assert header == (
        [1, 2, 3],
        [CHUNK_MORE, CHUNK_DROPPED, CHUNK_ERROR],
        [2, 0, 3],
        {"active": 2, "step_ms": 1.5},
    )
    assert protocol.split_bodies(header.lengths, frames[3:]) == [b"ab", b"", b"cde"]


@pytest.mark.parametrize(
    "header",
    [
        [[1], [CHUNK_FINAL], [0], {}],  # an empty final reply
        [[1], [CHUNK_MORE], [0], {}],
        [[1], [CHUNK_ERROR], [0], {}],
        [[1], [CHUNK_DROPPED], [3], {}],  # a dropped entry has no body
        [[1], [4], [3], {}],
        [[1], [-1], [3], {}],
        [[1], [True], [3], {}],
        [[1], [1.0], [3], {}],
        [[1], [CHUNK_FINAL, CHUNK_FINAL], [3], {}],  # counts disagree
        [[1, 2], [CHUNK_FINAL], [3], {}],
        [[1], [CHUNK_FINAL], [3, 3], {}],
        [[1], [CHUNK_FINAL], [True], {}],
        [[1], [CHUNK_FINAL], [3.0], {}],
        [[-1], [CHUNK_FINAL], [3], {}],
        [[2**63], [CHUNK_FINAL], [3], {}],
        [["1"], [CHUNK_FINAL], [3], {}],
        [[1], [CHUNK_FINAL], [3], {"bogus": 1}],
        [[1], [CHUNK_FINAL], [3], {"active": -1}],
        [[1], [CHUNK_FINAL], [3], {"active": True}],
        [[1], [CHUNK_FINAL], [3], {"active": "x"}],
        [[1], [CHUNK_FINAL], [3], {"active": float("nan")}],
        [[1], [CHUNK_FINAL], [3], {"step_ms": 1e16}],
        [[1], [CHUNK_FINAL], [3], []],
        [[1], [CHUNK_FINAL], [3]],
        [[1], [CHUNK_FINAL], [3], {}, 0],
        {"seq_ids": [1]},
        5,
        None,
        [1, [CHUNK_FINAL], [3], {}],
        [[1], CHUNK_FINAL, [3], {}],
        [[1], [CHUNK_FINAL], 3, {}],
    ],
)
def test_parse_chunk_header_rejects(header: Any) -> None:
    with pytest.raises(WorkerProtocolError, match="CHUNK"):
        protocol.parse_chunk_header(protocol.pack(header))


def test_parse_chunk_header_rejects_broken_msgpack() -> None:
    with pytest.raises(WorkerProtocolError, match="not valid msgpack"):
        protocol.parse_chunk_header(b"\xc1")


@pytest.mark.parametrize("flag", [CHUNK_FINAL, CHUNK_MORE, CHUNK_ERROR])
def test_parse_chunk_header_rejects_a_negative_length(flag: int) -> None:
    with pytest.raises(WorkerProtocolError):
        protocol.parse_chunk_header(protocol.pack([[1], [flag], [-1], {}]))


# --- READY, START, CANCEL ----------------------------------------------------------------------


def test_ready_carries_every_field_it_is_given_and_only_those() -> None:
    frames = protocol.ready_frames(
        "m", 1, 42, slots=2, signature={"inputs": []}, cost_ms=[20.0, 2.5], max_active=8,
        warmup_error="x" * (MAX_WARMUP_ERROR_CHARS + 10), deterministic=False,
    )  # fmt: skip
    assert frames[:2] == [WORKER_PROTOCOL, CMD_READY]
    assert protocol.unpack(frames[2]) == {
        "model": "m", "gpu": 1, "pid": 42, "slots": 2, "signature": {"inputs": []},
        "cost_ms": [20.0, 2.5], "max_active": 8, "warmup_error": "x" * MAX_WARMUP_ERROR_CHARS,
        "deterministic": False,
    }  # fmt: skip
    assert protocol.unpack(protocol.ready_frames("m", None, 7)[2]) == {"model": "m", "gpu": None, "pid": 7}


def test_start_and_cancel_carry_their_sequences() -> None:
    frames = protocol.start_frames([4, 5], [None, 12.5], [b"ab", b"cde"])
    assert frames[:2] == [WORKER_PROTOCOL, CMD_START]
    assert protocol.unpack(frames[2]) == [[4, 5], [None, 12.5], [2, 3]]
    assert split_bodies([2, 3], frames[3:]) == [b"ab", b"cde"]
    assert protocol.cancel_frames([4, 9]) == [WORKER_PROTOCOL, CMD_CANCEL, protocol.pack([4, 9])]


# --- REPLY headers and bodies ------------------------------------------------------------------


def test_a_reply_header_may_count_zero_of_one_kind_of_error() -> None:
    header = parse_reply_header(protocol.pack([1, 2.0, [3, 3], {"model_error": 0, "bad_request": 1}]))
    assert header.errors == 1 and header.refused == 1


def test_a_reply_header_takes_large_padding_counts() -> None:
    header = parse_reply_header(protocol.pack([1, 2.0, [3], 0, None, [10**12, 10**6]]))
    assert header.padding == (10**12, 10**6)
    with pytest.raises(WorkerProtocolError, match="padding"):
        parse_reply_header(protocol.pack([1, 2.0, [3], 0, None, [2**63, 1]]))


_NUMBERS = (
    st.integers(-2, 2**64 - 1) | st.sampled_from([0, 2**63 - 1, 2**63, 86_400_000, 86_400_001])
    | st.floats() | st.sampled_from([-0.0, 86_400_000.0, 86_400_000.5]) | st.booleans()
)  # fmt: skip
_ANY = st.none() | _NUMBERS | st.text(max_size=3) | st.binary(max_size=3)
_ERRORS = _NUMBERS | st.dictionaries(
    st.sampled_from(["model_error", "bad_request", "other"]), _NUMBERS, max_size=3
)
_NATURAL = st.integers(0, 2**63 - 1) | st.sampled_from([0, 1, 2**63 - 1])
_MS = st.floats(0, 86_400_000) | st.integers(0, 86_400_000) | st.sampled_from([-0.0, 86_400_000.0])


@st.composite
def _headers(draw: st.DrawFn) -> list[Any]:
    """A REPLY header of the protocol's (3 to 7 elements), with one element made anything
    at all half the time."""
    lengths = draw(st.lists(st.integers(0, 99), max_size=4))
    errors = draw(
        st.integers(0, len(lengths))
        | st.fixed_dictionaries(
            {}, optional={"model_error": st.integers(0, 2), "bad_request": st.integers(0, 2)}
        )
    )
    padding = draw(st.none() | st.lists(_NATURAL, min_size=2, max_size=2))
    load = draw(
        st.none() | st.fixed_dictionaries({"ms": _MS, "unloaded": st.just(["a"]), "held": st.just([])})
    )
    full = [draw(_NATURAL), draw(_MS), lengths, errors, draw(st.none() | _MS), padding, load, draw(_ANY)]
    header = full[: draw(st.integers(3, 7))]
    if draw(st.booleans()):
        header[draw(st.integers(0, len(header) - 1))] = draw(_ANY | st.lists(_NUMBERS, max_size=3) | _ERRORS)
    return header


#: Headers of the protocol, headers with one element of another kind, and anything at all.
_HEADERS = _headers() | st.lists(_ANY, max_size=8)


@given(_HEADERS)
def test_the_common_reply_header_read_in_c_gets_the_verdict_the_checks_give(header: list[Any]) -> None:
    frame = protocol.pack(header)
    try:
        expected: Any = frames._parse_reply_header(frame)
    except WorkerProtocolError as exc:
        expected = str(exc)
    try:
        got: Any = parse_reply_header(frame)
    except WorkerProtocolError as exc:
        got = str(exc)
    assert got == expected
    if not isinstance(got, str):  # the same types too (a bool is not an int)
        assert [type(v) for v in got] == [type(v) for v in expected]


def test_the_usual_reply_header_is_read_in_c() -> None:
    usual = protocol.pack([123456, 22.512, [40] * 24, 0, 0.052])
    common = frames._decode_common_reply_header(usual)
    assert (common.batch_id, common.lengths, common.wait_ms) == (123456, [40] * 24, 0.052)
    assert parse_reply_header(usual) == frames._parse_reply_header(usual)


def test_joined_replies_are_cut_from_a_zmq_frame_too() -> None:
    for blob in (b"abcdef", zmq.Frame(b"abcdef")):
        assert split_replies([1, 2, 3], blob) == [b"a", b"bc", b"def"]
        assert split_bodies([1, 2, 3], [blob]) == [b"a", b"bc", b"def"]


def test_chunk_headers_at_their_limits_are_read() -> None:
    assert protocol.parse_chunk_header(protocol.pack([[], [], [], {}])) == ([], [], [], {})
    header = [[0, 2**63 - 1], [CHUNK_MORE, CHUNK_FINAL], [1, 1], {"active": 0, "step_ms": MAX_COST}]
    assert protocol.parse_chunk_header(protocol.pack(header)) == tuple(header)


def test_a_bad_chunk_header_says_what_in_200_characters_at_most() -> None:
    long_ids = list(range(10**6, 10**6 + 100))
    cases = [
        ([long_ids], "CHUNK header must be [seq_ids, flags, lengths, counters], got "),
        ([[-1, *long_ids], [], [], {}], "CHUNK seq_ids must be ints in [0, 2**63), got "),
        ([long_ids, [9] * 100, [], {}], "CHUNK flags must be 100 of 0, 1, 2 or 3, got "),
        ([[1], [CHUNK_MORE], [-1, *long_ids], {}], "CHUNK lengths must be 1 ints, 0 for a dropped entry"),
        ([[1], [CHUNK_MORE], [1], {"bogus": long_ids}], "CHUNK counters must map active, waiting, steps, "),
    ]
    for header, start in cases:
        with pytest.raises(WorkerProtocolError) as info:
            protocol.parse_chunk_header(protocol.pack(header))
        assert str(info.value).startswith(start) and len(str(info.value)) == 200, str(info.value)
    with pytest.raises(WorkerProtocolError, match="not valid msgpack: ") as broken:
        protocol.parse_chunk_header(b"\xc1")
    assert "None" not in str(broken.value)  # says what msgpack found wrong


def _nested(depth: int) -> bytes:
    """`depth` msgpack arrays, one in another: past Python's recursion limit at 1010 (repr
    stops there), which msgpack still reads (1024 levels)."""
    return b"\x91" * depth + b"\x00"


@pytest.mark.parametrize("place", [1, 2, 3, 4, 5, 6])
def test_a_reply_header_nested_past_the_recursion_limit_is_refused_naming_its_batch(place: int) -> None:
    """repr of the value that is wrong recursed past the limit: RecursionError, which the
    broker takes for a bug of its own, so the batch was not failed (its clients waited for
    the batch time limit) and the fallback's verdict was no protocol error."""
    fields = [protocol.pack(v) for v in (5, 1.0, [1], 0, None, None, None)]
    fields[place] = _nested(1010)
    frame = b"\x97" + b"".join(fields)
    with pytest.raises(WorkerProtocolError, match="nested too deeply to show") as raised:
        parse_reply_header(frame)
    assert raised.value.batch_id == 5


def test_a_reply_headers_huge_value_makes_no_huge_message() -> None:
    """The message goes to each client of the batch: a 4 MB element is not repeated in it."""
    for header in ([5, 1.0, [b"\x00" * 4_000_000]], [5, 1.0, [1], 0, None, None, {"ms": "x" * 4_000_000}]):
        with pytest.raises(WorkerProtocolError) as raised:
            parse_reply_header(protocol.pack(header))
        assert raised.value.batch_id == 5 and len(str(raised.value)) < 500


def test_a_heartbeat_or_chunk_nested_past_the_recursion_limit_is_refused() -> None:
    """A broker's HEARTBEAT is read by the worker, which ignores a bad one (ValueError): a
    RecursionError killed it."""
    for frame in (_nested(1010), b"\x82\xacheartbeat_ms\x01\xa8liveness" + _nested(1010)):
        with pytest.raises(ValueError, match="nested too deeply"):
            frames.Heartbeat.from_frame(frame)
    with pytest.raises(WorkerProtocolError, match="nested too deeply"):
        frames.parse_chunk_header(b"\x94" + _nested(1010) + b"\x90\x90\x80")


def _message_at_stack_depth(frame: bytes, frames_deeper: int) -> str:
    """parse_reply_header's message for `frame`, called `frames_deeper` frames down."""
    if frames_deeper:
        return _message_at_stack_depth(frame, frames_deeper - 1)
    with pytest.raises(WorkerProtocolError) as raised:
        parse_reply_header(frame)
    return str(raised.value)


def test_a_deep_reply_header_gets_one_message_from_any_caller() -> None:
    """Whether repr reached the bottom of a value nested near Python's recursion limit
    depended on the caller's stack: the fast path (a frame deeper than the checks called
    alone) or any other caller could get another message for the same bytes."""
    named = "REPLY lengths must be a list of ints >= 0, got <a list nested too deeply to show>"
    for depth in (101, *range(700, 1024, 5)):
        frame = b"\x93\x05\xcb" + bytes(8) + _nested(depth)
        assert _message_at_stack_depth(frame, 0) == _message_at_stack_depth(frame, 60) == named, depth
