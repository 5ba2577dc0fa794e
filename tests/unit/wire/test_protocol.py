"""Wire protocol v1: request parsing and validation, envelopes, replies, backend framing."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st
from msgspec.structs import astuple

from batcher.wire import codec, protocol
from batcher.wire.protocol import EnvelopeError, ErrorCode, Heartbeat, ProtocolError, RequestHeader


def body(msg: object) -> bytes:
    """A request body as any msgpack client would encode it."""
    return msgpack.packb(msg, use_bin_type=True)


def bad_request(raw: bytes) -> ProtocolError:
    """Parse `raw`, expecting a bad_request rejection; returns the error."""
    with pytest.raises(ProtocolError) as info:
        protocol.parse_request(raw)
    assert info.value.code == ErrorCode.BAD_REQUEST
    assert str(info.value) == info.value.message
    return info.value


# --- parse_request: accepted requests ----------------------------------------------------------


def test_parse_minimal_request_fills_defaults() -> None:
    header, msg = protocol.parse_request(body({"input": "hello"}))
    assert header == RequestHeader(id=None, model=None, timeout_ms=None, priority=0, op="infer")
    assert msg == {"input": "hello"}


def test_parse_full_request_returns_every_field_and_keeps_unknown_keys() -> None:
    request = {
        "id": "req-1",
        "model": "resnet",
        "input": {"pixels": b"\x00\x01\x02", "shape": [1, 3]},
        "timeout_ms": 250.5,
        "priority": -2,
        "trace": {"span": 7},
    }
    header, msg = protocol.parse_request(body(request))
    assert header == RequestHeader(id="req-1", model="resnet", timeout_ms=250.5, priority=-2, op="infer")
    assert msg == request
    assert isinstance(msg["input"]["pixels"], bytes)  # bin stays bytes, str stays str


@pytest.mark.parametrize("req_id", [0, -1, 2**63, "", "abc", "é"])
def test_parse_accepts_int_and_str_ids(req_id: int | str) -> None:
    header, _ = protocol.parse_request(body({"id": req_id, "input": 1}))
    assert header.id == req_id


@pytest.mark.parametrize("value", [None, 0, [], {}, b""])
def test_parse_accepts_any_input_value_including_nil(value: object) -> None:
    header, msg = protocol.parse_request(body({"id": 1, "input": value}))
    assert msg["input"] == value
    assert header.id == 1


@pytest.mark.parametrize("timeout_ms", [0, 0.0, 1, 1500.25])
def test_parse_accepts_non_negative_timeouts(timeout_ms: float) -> None:
    header, _ = protocol.parse_request(body({"input": 1, "timeout_ms": timeout_ms}))
    assert header.timeout_ms == timeout_ms


@pytest.mark.parametrize("priority", [0, 5, -3, 0.5, -1e9])
def test_parse_accepts_numeric_priorities(priority: float) -> None:
    header, _ = protocol.parse_request(body({"input": 1, "priority": priority}))
    assert header.priority == priority


def test_parse_control_op_needs_no_input() -> None:
    header, _ = protocol.parse_request(body({"id": 9, "op": "stats"}))
    assert header.op == "stats"
    assert header.id == 9


def test_parse_accepts_non_str_map_keys_in_payload() -> None:
    _, msg = protocol.parse_request(body({"input": {1: "one", 2: "two"}}))
    assert msg["input"] == {1: "one", 2: "two"}


# --- parse_request: every bad_request case ------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"\xc1", id="reserved-byte"),
        pytest.param(b"not msgpack at all", id="text"),
        pytest.param(body({"id": 1, "input": "hello"}) + b"\x01", id="trailing-data"),
    ],
)
def test_body_not_msgpack(raw: bytes) -> None:
    err = bad_request(raw)
    assert err.message.startswith("body is not valid msgpack")


@pytest.mark.parametrize("cut", [1, 5, -1])
def test_truncated_msgpack(cut: int) -> None:
    whole = body({"id": 1, "model": "sim", "input": "a long enough input string"})
    err = bad_request(whole[:cut])
    assert err.message.startswith("body is not valid msgpack")


@pytest.mark.parametrize(
    ("msg", "type_name"),
    [([1, 2], "list"), (7, "int"), ("input", "str"), (None, "NoneType"), (b"\x80", "bytes")],
)
def test_body_not_a_map(msg: object, type_name: str) -> None:
    err = bad_request(body(msg))
    assert err.message == f"body must be a msgpack map, got {type_name}"


def test_missing_input() -> None:
    err = bad_request(body({"id": 1, "model": "sim"}))
    assert err.message == "request has no 'input'"


def test_missing_input_with_explicit_infer_op() -> None:
    err = bad_request(body({"id": 1, "op": "infer"}))
    assert err.message == "request has no 'input'"


@pytest.mark.parametrize(
    ("req_id", "type_name"),
    [(1.5, "float"), ([1], "list"), (True, "bool"), (False, "bool"), ({"a": 1}, "dict"), (b"id", "bytes")],
)
def test_id_of_wrong_type(req_id: object, type_name: str) -> None:
    err = bad_request(body({"id": req_id, "input": 1}))
    assert err.message == f"id must be an int or a str, got {type_name}"


@pytest.mark.parametrize(
    ("model", "type_name"), [(3, "int"), (["sim"], "list"), (b"sim", "bytes"), (True, "bool")]
)
def test_model_not_a_str(model: object, type_name: str) -> None:
    err = bad_request(body({"input": 1, "model": model}))
    assert err.message == f"model must be a str, got {type_name}"


@pytest.mark.parametrize(
    ("timeout_ms", "message"),
    [
        ("100", "timeout_ms must be a number, got str"),
        ([100], "timeout_ms must be a number, got list"),
        (True, "timeout_ms must be a number, got bool"),
        (False, "timeout_ms must be a number, got bool"),
        (-1, "timeout_ms must be >= 0, got -1"),
        (-0.5, "timeout_ms must be >= 0, got -0.5"),
        (math.nan, "timeout_ms must be >= 0, got nan"),
    ],
)
def test_timeout_ms_invalid(timeout_ms: object, message: str) -> None:
    err = bad_request(body({"input": 1, "timeout_ms": timeout_ms}))
    assert err.message == message


@pytest.mark.parametrize(
    ("priority", "message"),
    [
        ("high", "priority must be a number, got str"),
        (None, "priority must be a number, got NoneType"),
        ([1], "priority must be a number, got list"),
        (math.nan, "priority must be a number, got NaN"),
        (True, "priority must be a number, got bool"),
    ],
)
def test_priority_invalid(priority: object, message: str) -> None:
    err = bad_request(body({"input": 1, "priority": priority}))
    assert err.message == message


@pytest.mark.parametrize(("op", "type_name"), [(1, "int"), (None, "NoneType"), (b"stats", "bytes")])
def test_op_not_a_str(op: object, type_name: str) -> None:
    err = bad_request(body({"input": 1, "op": op}))
    assert err.message == f"op must be a str, got {type_name}"


def test_bad_request_can_be_answered_with_an_error_reply() -> None:
    err = bad_request(body([1, 2]))
    reply = protocol.unpack(protocol.error_reply(None, err.code, err.message))
    assert reply == {
        "id": None,
        "ok": False,
        "error": {"code": "bad_request", "message": "body must be a msgpack map, got list"},
    }


# --- split_envelope ----------------------------------------------------------------------------

BODY = body({"id": 1, "input": "x"})


def test_envelope_req_style() -> None:
    envelope, got = protocol.split_envelope([b"client", b"", BODY])
    assert envelope == [b"client", b""]
    assert got == BODY


def test_envelope_dealer_without_delimiter() -> None:
    envelope, got = protocol.split_envelope([b"client", BODY])
    assert envelope == [b"client"]
    assert got == BODY


def test_envelope_reply_goes_back_on_the_same_frames() -> None:
    frames = [b"\x00\x80\x00\x00\x29", b"", BODY]
    envelope, got = protocol.split_envelope(frames)
    assert [*envelope, got] == frames


def test_envelope_multi_hop() -> None:
    envelope, got = protocol.split_envelope([b"id1", b"id2", b"", BODY])
    assert envelope == [b"id1", b"id2", b""]
    assert got == BODY


@pytest.mark.parametrize(
    ("frames", "envelope", "bodies"),
    [
        pytest.param([b"client", b""], [b"client", b""], 0, id="no-body-after-delimiter"),
        pytest.param([b"client", b"", BODY, BODY], [b"client", b""], 2, id="two-bodies-after-delimiter"),
        pytest.param([b"client"], [b"client"], 0, id="only-identity"),
        # Without a delimiter, the reply goes on every frame but the last: a proxy routes
        # that back to its client (a DEALER without delimiter behind zmq.proxy).
        pytest.param([b"client", BODY, BODY], [b"client", BODY], 2, id="dealer-two-bodies"),
        pytest.param([b"proxy", b"client", BODY], [b"proxy", b"client"], 2, id="behind-proxy-no-delimiter"),
        pytest.param([b"id1", b"id2", b"", BODY, BODY], [b"id1", b"id2", b""], 2, id="multi-hop-two-bodies"),
        pytest.param([b"id1", b"id2", b""], [b"id1", b"id2", b""], 0, id="multi-hop-no-body"),
    ],
)
def test_envelope_wrong_frame_count(frames: list[bytes], envelope: list[bytes], bodies: int) -> None:
    with pytest.raises(EnvelopeError) as info:
        protocol.split_envelope(frames)
    err = info.value
    assert isinstance(err, ProtocolError)
    assert err.code == ErrorCode.BAD_REQUEST
    assert err.envelope == envelope
    assert err.message.startswith(f"expected exactly one body frame after the envelope, got {bodies}")


# --- replies -----------------------------------------------------------------------------------


def test_error_reply_shape() -> None:
    reply = protocol.unpack(protocol.error_reply(42, ErrorCode.MODEL_ERROR, "boom"))
    assert reply == {"id": 42, "ok": False, "error": {"code": "model_error", "message": "boom"}}


def test_error_reply_id_nil_when_absent() -> None:
    reply = protocol.unpack(protocol.error_reply(None, ErrorCode.OVERLOADED, "queue full"))
    assert reply["id"] is None
    assert "id" in reply
    assert reply["error"] == {"code": "overloaded", "message": "queue full"}


@pytest.mark.parametrize("code", list(ErrorCode))
def test_error_reply_code_is_the_plain_string(code: ErrorCode) -> None:
    reply = protocol.unpack(protocol.error_reply("r", code, "m"))
    assert reply["error"]["code"] == code.value
    assert type(reply["error"]["code"]) is str


def test_ok_reply_shape() -> None:
    reply = protocol.unpack(protocol.ok_reply("abc", [1.5, {"k": b"v"}]))
    assert reply == {"id": "abc", "ok": True, "output": [1.5, {"k": b"v"}]}


def test_ok_reply_id_nil_when_absent() -> None:
    reply = protocol.unpack(protocol.ok_reply(None, "out"))
    assert reply == {"id": None, "ok": True, "output": "out"}


def test_ok_reply_merges_metadata() -> None:
    meta = {"batch_size": 4, "worker": "host/gpu0/123", "queue_ms": 1.25, "infer_ms": 30.0}
    reply = protocol.unpack(protocol.ok_reply(7, None, meta))
    assert reply == {"id": 7, "ok": True, "output": None, **meta}


def test_ok_reply_empty_metadata_adds_nothing() -> None:
    assert protocol.ok_reply(1, 2, {}) == protocol.ok_reply(1, 2)


def test_ok_reply_unencodable_output_raises_and_next_reply_is_intact() -> None:
    with pytest.raises(TypeError):
        protocol.ok_reply(1, object())
    assert protocol.unpack(protocol.ok_reply(2, "fine")) == {"id": 2, "ok": True, "output": "fine"}


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text() | st.binary(),
        lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4),
        max_leaves=10,
    )
)
def test_pack_unpack_round_trip(value: Any) -> None:
    assert protocol.unpack(protocol.pack(value)) == value


# --- read_header: the broker's fast reader agrees with parse_request -----------------------------

_ANY_VALUE = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=6,
)
_FIELDS = ["id", "model", "timeout_ms", "priority", "op", "cost", "input", "extra"]


@given(
    st.dictionaries(st.sampled_from(_FIELDS), _ANY_VALUE | st.sampled_from(["infer", "stats", 5, 0.5, -1]))
)
def test_read_header_agrees_with_parse_request(fields: dict[str, Any]) -> None:
    raw = body(fields)
    try:
        expected: RequestHeader | ProtocolError = protocol.parse_request(raw)[0]
    except ProtocolError as exc:
        expected = exc
    try:
        got: RequestHeader | ProtocolError = protocol.read_header(raw)
    except ProtocolError as exc:
        got = exc
    if isinstance(expected, ProtocolError):
        assert isinstance(got, ProtocolError)
        assert (got.code, got.message, got.req_id) == (expected.code, expected.message, expected.req_id)
    else:
        assert got == expected
        assert [type(v) for v in astuple(got)] == [type(v) for v in astuple(expected)]


def test_read_header_never_decodes_input_so_a_bad_input_is_the_workers_to_refuse() -> None:
    # A map key that is an array, deep inside input: only a full decode refuses it.
    raw = b"\x82\xa2id\x07\xa5input\x81\x91\x01\x01"
    assert protocol.read_header(raw) == RequestHeader(7, None, None, 0, "infer", 1.0)
    assert bad_request(raw).req_id == 7


def test_read_header_reads_from_any_buffer_without_copying_input() -> None:
    raw = body({"id": "t", "model": "m", "input": b"\0" * (1 << 20), "cost": 3})
    assert protocol.read_header(memoryview(raw)) == RequestHeader("t", "m", None, 0, "infer", 3)


# --- backend framing ---------------------------------------------------------------------------


def test_batch_frames_join_small_bodies_in_one_frame_byte_for_byte() -> None:
    bodies = [body({"id": i, "input": [i] * i, "extra": "kept"}) for i in range(5)]
    queue_ms = [0.5, 1.0, 1.5, 2.0, 2.5]
    frames = protocol.batch_frames(17, queue_ms, bodies)
    assert frames[:2] == [protocol.WORKER_PROTOCOL, protocol.CMD_BATCH]
    assert len(frames) == 4
    assert protocol.unpack(frames[2]) == [17, queue_ms, [len(b) for b in bodies]]
    assert frames[3] == b"".join(bodies)  # forwarded byte for byte
    assert [bytes(b) for b in protocol.split_bodies([len(b) for b in bodies], frames[3:])] == bodies


def test_a_batch_with_a_large_body_goes_one_frame_per_body_uncopied() -> None:
    large = body({"id": 1, "input": b"x" * protocol.ZERO_COPY_BYTES})
    bodies = [body({"id": 0, "input": 1}), large, body({"id": 2, "input": 2})]
    frames = protocol.batch_frames(3, [0.0] * 3, bodies)
    assert len(frames) == 3 + 3
    assert all(f is b for f, b in zip(frames[3:], bodies, strict=True))  # the same objects
    assert protocol.split_bodies(protocol.unpack(frames[2])[2], frames[3:]) == bodies


def test_batch_frames_empty_batch() -> None:
    frames = protocol.batch_frames(1, [], [])
    assert protocol.unpack(frames[2]) == [1, [], []]
    assert protocol.split_bodies([], frames[3:]) == []


def test_reply_frames_split_replies_round_trip() -> None:
    replies = [protocol.ok_reply(i, "x" * i) for i in range(20)]
    frames = protocol.reply_frames(3, 12.5, replies, wait_ms=0.25)
    assert frames[:2] == [protocol.WORKER_PROTOCOL, protocol.CMD_REPLY]
    assert len(frames) == 4
    batch_id, infer_ms, lengths, errors, wait_ms = protocol.unpack(frames[2])
    assert (batch_id, infer_ms, errors, wait_ms) == (3, 12.5, 0, 0.25)
    assert lengths == [len(r) for r in replies]
    assert protocol.split_bodies(lengths, frames[3:]) == replies


@given(
    st.lists(st.sampled_from([0, 1, 40, protocol.ZERO_COPY_BYTES - 1, protocol.ZERO_COPY_BYTES]), max_size=8)
)
def test_split_bodies_inverts_reply_frames_whatever_the_sizes(sizes: list[int]) -> None:
    replies = [bytes([i % 256]) * n for i, n in enumerate(sizes)]
    frames = protocol.reply_frames(1, 0.0, replies)
    _, _, lengths, _ = protocol.unpack(frames[2])
    one_frame_each = any(n >= protocol.ZERO_COPY_BYTES for n in sizes)
    assert len(frames) - 3 == (len(sizes) if one_frame_each else 1)
    assert [bytes(r) for r in protocol.split_bodies(lengths, frames[3:])] == replies


@pytest.mark.parametrize(
    ("lengths", "frames", "message"),
    [
        pytest.param([1, 2, 3], [b"a", b"bb"], "2 body frames for 3 lengths", id="too-few-frames"),
        pytest.param([1, 2], [b"a", b"bbb"], "a body frame of 3 bytes where the header says 2", id="length"),
        pytest.param([1], [b"a", b""], "2 body frames for 1 lengths", id="one-length-two-frames"),
    ],
)
def test_split_bodies_rejects_frames_that_do_not_match(
    lengths: list[int], frames: list[bytes], message: str
) -> None:
    with pytest.raises(ValueError) as raised:
        protocol.split_bodies(lengths, frames)
    assert str(raised.value) == message


@pytest.mark.parametrize(
    ("lengths", "blob", "message"),
    [
        pytest.param([3], b"abcde", "reply lengths add up to 3 bytes, frame has 5", id="too-short"),
        pytest.param([3, 4], b"abcde", "reply length 4 does not fit a 5-byte frame", id="too-long"),
        pytest.param([], b"abc", "reply lengths add up to 0 bytes, frame has 3", id="no-lengths-but-bytes"),
        pytest.param([1], b"", "reply length 1 does not fit a 0-byte frame", id="bytes-missing"),
    ],
)
def test_split_replies_rejects_lengths_that_do_not_add_up(
    lengths: list[int], blob: bytes, message: str
) -> None:
    # Either way the message names the frame's real size, so a broken worker is diagnosable.
    with pytest.raises(ValueError) as raised:
        protocol.split_replies(lengths, blob)
    assert str(raised.value) == message


@pytest.mark.parametrize("lengths", [[-1, 6], [6, -1]])
def test_split_replies_rejects_negative_lengths(lengths: list[int]) -> None:
    with pytest.raises(ValueError):
        protocol.split_replies(lengths, b"abcde")


@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        pytest.param([0, 6], "reply length 6 does not fit a 5-byte frame", id="an-empty-reply-first"),
        pytest.param([5, -1], "reply length -1 does not fit a 5-byte frame", id="an-exact-fit-then-negative"),
        pytest.param([0, 0, 2, 4], "reply length 4 does not fit a 5-byte frame", id="empties-then-too-long"),
    ],
)
def test_split_replies_names_the_first_length_that_does_not_fit(lengths: list[int], message: str) -> None:
    with pytest.raises(ValueError) as raised:
        protocol.split_replies(lengths, b"abcde")
    assert str(raised.value) == message


def test_split_replies_cuts_empty_replies_and_any_buffer() -> None:
    assert protocol.split_replies([0, 2, 0, 3], b"abcde") == [b"", b"ab", b"", b"cde"]
    assert protocol.split_replies([2, 3], memoryview(b"abcde")) == [b"ab", b"cde"]
    assert protocol.split_replies([], b"") == []


@pytest.mark.parametrize("given_lengths", [False, True])
def test_body_frames_join_small_bodies_and_pass_large_ones_each_in_its_frame(given_lengths: bool) -> None:
    small, large = [b"ab", b"c"], [b"ab", b"x" * protocol.ZERO_COPY_BYTES, b"c"]
    for bodies, expected in ((small, [b"abc"]), (large, large)):
        lengths = [len(b) for b in bodies] if given_lengths else None
        assert protocol.body_frames(bodies, lengths) == expected
    assert protocol.body_frames([]) == [b""]


def test_a_multiplexed_batch_names_its_model_after_the_traceparent() -> None:
    bodies = [body({"id": 0, "input": 1})]
    frames = protocol.batch_frames(5, [0.25], bodies, None, "m2")
    assert protocol.unpack(frames[2]) == [5, [0.25], [len(bodies[0])], None, "m2"]
    traced = protocol.batch_frames(5, [0.25], bodies, "00-" + "1" * 32 + "-" + "2" * 16 + "-01")
    assert protocol.unpack(traced[2])[3:] == ["00-" + "1" * 32 + "-" + "2" * 16 + "-01"]


def test_ready_frames_layout() -> None:
    frames = protocol.ready_frames("sim", 2, 4242, 3)
    assert frames[:2] == [protocol.WORKER_PROTOCOL, protocol.CMD_READY]
    assert protocol.unpack(frames[2]) == {"model": "sim", "gpu": 2, "pid": 4242, "slots": 3}


def test_ready_frames_without_slots_leaves_them_to_the_broker() -> None:
    frames = protocol.ready_frames("echo", None, 1)
    assert protocol.unpack(frames[2]) == {"model": "echo", "gpu": None, "pid": 1}


# --- the documented values: what a client in another language hard-codes --------------------------
# Compared with the literals of docs/protocol.md, not with the module's own constants, so a
# changed code string or command byte fails here before it breaks a client.


def test_error_codes_are_the_documented_strings() -> None:
    assert {c.name: str(c) for c in ErrorCode} == {
        "BAD_REQUEST": "bad_request",
        "UNKNOWN_MODEL": "unknown_model",
        "MODEL_ERROR": "model_error",
        "DEADLINE_EXCEEDED": "deadline_exceeded",
        "OVERLOADED": "overloaded",
        "CANCELLED": "cancelled",
        "WORKER_FAILED": "worker_failed",
        "SHUTTING_DOWN": "shutting_down",
        "UNAVAILABLE": "unavailable",
        "TOO_LARGE": "too_large",
        "FORBIDDEN": "forbidden",
        "INTERNAL": "internal_error",
    }


def test_backend_commands_are_the_documented_bytes() -> None:
    assert protocol.WORKER_PROTOCOL == b"BATCHER-W2"
    assert [protocol.CMD_READY, protocol.CMD_BATCH, protocol.CMD_REPLY, protocol.CMD_HEARTBEAT] == [
        b"\x01",
        b"\x02",
        b"\x03",
        b"\x04",
    ]
    assert protocol.CMD_DISCONNECT == b"\x05"
    assert protocol.CMD_EXIT == b"\x06"


def test_every_error_code_is_documented_in_protocol_md() -> None:
    doc = (Path(__file__).parents[3] / "docs" / "protocol.md").read_text()
    assert [str(c) for c in ErrorCode if f"`{c}`" not in doc] == []


# --- heartbeat settings -------------------------------------------------------------------------------


def test_heartbeat_default_is_500_ms_times_3() -> None:
    hb = Heartbeat()
    assert (hb.interval_ms, hb.liveness, hb.interval_s, hb.expiry_s) == (500.0, 3, 0.5, 1.5)


def test_heartbeat_expiry_is_interval_times_liveness() -> None:
    hb = Heartbeat(interval_ms=40.0, liveness=5)
    assert hb.interval_s == pytest.approx(0.04)
    assert hb.expiry_s == pytest.approx(0.2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"interval_ms": 0.0}, "heartbeat_ms must be > 0, got 0.0"),
        ({"interval_ms": -5.0}, "heartbeat_ms must be > 0, got -5.0"),
        ({"interval_ms": math.nan}, "heartbeat_ms must be > 0, got nan"),
        ({"liveness": 0}, "heartbeat_liveness must be >= 1, got 0"),
        ({"liveness": 2.5}, "heartbeat_liveness must be >= 1, got 2.5"),
    ],
)
def test_heartbeat_rejects_bad_values_saying_which(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError) as raised:
        Heartbeat(**kwargs)  # type: ignore[arg-type]
    assert str(raised.value) == message


def test_heartbeat_accepts_the_smallest_values() -> None:
    hb = Heartbeat(interval_ms=0.001, liveness=1)
    assert hb.expiry_s == pytest.approx(0.000001)


# --- a bad_request echoes the id, whatever broke ----------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"id": 7, "input": 1, "model": 3}, id="model"),
        pytest.param({"id": 7, "input": 1, "timeout_ms": -1}, id="timeout"),
        pytest.param({"id": 7, "op": 5}, id="op"),
        pytest.param({"id": 7}, id="no-input"),
        pytest.param({"id": 7, "input": 1, "priority": "high"}, id="priority"),
    ],
)
def test_bad_request_after_a_valid_id_carries_that_id(body: dict[str, object]) -> None:
    with pytest.raises(ProtocolError) as raised:
        protocol.parse_request(protocol.pack(body))
    assert raised.value.code == "bad_request"
    assert raised.value.req_id == 7


def test_undecodable_body_still_echoes_an_id_read_before_the_fault() -> None:
    truncated = protocol.pack({"id": "abc", "input": [1, 2, 3]})[:-2]
    with pytest.raises(ProtocolError) as raised:
        protocol.parse_request(truncated)
    assert raised.value.req_id == "abc"


def test_unpack_takes_non_string_map_keys() -> None:
    data = protocol.pack({1: "one", 2.5: "two and a half", b"k": "bytes", None: 0})
    assert protocol.unpack(data) == {1: "one", 2.5: "two and a half", b"k": "bytes", None: 0}


def test_an_id_after_keys_of_any_type_is_still_echoed() -> None:
    """Keys before the id may be ints, or even a map with an array key (which is what
    makes the body unacceptable): the id is read all the same."""
    body = b"\x83" + b"\x81\x91\x01\x02" + protocol.pack("x") + protocol.pack("id") + protocol.pack(5)
    body += protocol.pack("input") + protocol.pack(1)
    error = bad_request(body)
    assert error.message.startswith("body has a map key that is an array or a map, which is not supported")
    assert error.req_id == 5
    truncated = b"\x83" + protocol.pack(1) + protocol.pack("x") + protocol.pack("id") + protocol.pack("abc")
    assert bad_request(truncated).req_id == "abc"


@pytest.mark.parametrize("req_id", [[1], True, 1.5, None, {"a": 1}])
def test_an_id_of_the_wrong_type_in_a_broken_body_is_not_echoed(req_id: object) -> None:
    body = b"\x82" + protocol.pack("id") + protocol.pack(req_id) + protocol.pack("input") + b"\xc1"
    assert bad_request(body).req_id is None


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\xc1", "body is not valid msgpack: FormatError"),  # an exception without text
        (b"", "body is not valid msgpack: ValueError: Unpack failed: incomplete input"),
        (
            body({"id": 1, "input": 1}) + b"\x00",
            "body is not valid msgpack: ExtraData: unpack(b) received extra data.",
        ),
    ],
)
def test_an_undecodable_body_is_described_by_its_error(raw: bytes, message: str) -> None:
    assert bad_request(raw).message == message


def test_a_map_key_that_is_an_array_is_refused_echoing_the_id() -> None:
    raw = body({"id": 8, "input": {(1, 2): 3}})
    error = bad_request(raw)
    assert error.message == (
        "body has a map key that is an array or a map, which is not supported (unhashable type: 'list')"
    )
    assert error.req_id == 8


def test_frames_without_a_delimiter_are_refused_saying_how_to_send_them() -> None:
    with pytest.raises(EnvelopeError) as raised:
        protocol.split_envelope([b"id", b"a", b"b"])
    assert raised.value.message == (
        "expected exactly one body frame after the envelope, got 2 (without an empty delimiter the "
        "envelope is the identity alone; behind a proxy, send the empty delimiter frame before the body)"
    )
    assert raised.value.envelope == [b"id", b"a"]


# --- REPLY headers: every number a worker sends is checked ----------------------------------------


SHAPE = "REPLY header must be [batch_id, infer_ms, lengths, errors], got "
WAIT_MS = "REPLY wait_ms must be a number in [0, 86400000] or nil, got "
PADDING = "REPLY padding must be [padded, real] ints >= 0 or nil, got "
LOAD = "REPLY load must be {ms: a number in [0, 86400000], unloaded: [names], held: [names]} or nil, got "
ERRORS = (
    "REPLY errors must be an int in [0, 2] or a map of model_error and bad_request counts "
    "adding up to at most 2, got "
)
INFER_MS = "REPLY infer_ms must be a number in [0, 86400000], got "


def reply_header(*fields: object) -> bytes:
    return protocol.pack(list(fields))


def test_reply_header_with_and_without_the_optional_fields() -> None:
    assert protocol.parse_reply_header(reply_header(7, 2.5, [3, 4])) == (
        7,
        2.5,
        [3, 4],
        0,
        None,
        None,
        0,
        None,
    )
    assert protocol.parse_reply_header(reply_header(7, 2, [3, 4], 1)) == (
        7,
        2.0,
        [3, 4],
        1,
        None,
        None,
        0,
        None,
    )
    got = protocol.parse_reply_header(reply_header(2**63 - 1, 0, [], 0, 86_400_000))
    assert got == (2**63 - 1, 0.0, [], 0, 86_400_000.0, None, 0, None)
    counted = protocol.parse_reply_header(reply_header(7, 1, [3, 4, 5], {"model_error": 1, "bad_request": 2}))
    assert (counted.errors, counted.refused) == (3, 2)
    assert isinstance(got.infer_ms, float) and isinstance(got.wait_ms, float)
    padded = protocol.parse_reply_header(reply_header(7, 1, [3], 0, None, [12, 40]))
    assert (padded.wait_ms, padded.padding) == (None, (12, 40))
    frames = protocol.reply_frames(7, 1.0, [b"abc"], padding=(0, 5))
    assert protocol.parse_reply_header(frames[2]).padding == (0, 5)


@pytest.mark.parametrize(
    ("frame", "message", "batch_id"),
    [
        (b"\xc1", "REPLY header is not valid msgpack: FormatError", None),
        (reply_header(1, 2), SHAPE + "[1, 2]", None),
        (
            protocol.pack({"id": 1}),
            SHAPE + "{'id': 1}",
            None,
        ),
        (
            reply_header(1, 0, [], 0, 0, [0, 0], None, 0),
            SHAPE + "[1, 0, [], 0, 0, [0, 0], None, 0]",
            None,
        ),
        (reply_header(5, 1, [1], 0, 0, None, 0), LOAD + "0", 5),
        (
            reply_header(5, 1, [1], 0, 0, None, {"ms": -1, "unloaded": []}),
            LOAD + "{'ms': -1, 'unloaded': []}",
            5,
        ),
        (
            reply_header(5, 1, [1], 0, 0, None, {"ms": 1, "unloaded": [1]}),
            LOAD + "{'ms': 1, 'unloaded': [1]}",
            5,
        ),
        (
            reply_header(5, 1, [1], 0, 0, None, {"ms": 1, "unloaded": []}),
            LOAD + "{'ms': 1, 'unloaded': []}",
            5,
        ),
        (reply_header(5, 1, [1], 0, 0, [1]), PADDING + "[1]", 5),
        (reply_header(5, 1, [1], 0, 0, [-1, 2]), PADDING + "[-1, 2]", 5),
        (reply_header(5, 1, [1], 0, 0, [1, True]), PADDING + "[1, True]", 5),
        (reply_header(5, 1, [1], 0, 0, [2**63, 1]), PADDING + f"[{2**63}, 1]", 5),
        (reply_header(5, 1, [1], 0, 0, 3), PADDING + "3", 5),
        (reply_header(-1, 0, []), "REPLY batch id must be an int in [0, 2**63), got -1", None),
        (reply_header(2**63, 0, []), f"REPLY batch id must be an int in [0, 2**63), got {2**63}", None),
        (reply_header(True, 0, []), "REPLY batch id must be an int in [0, 2**63), got True", None),
        (reply_header(1.0, 0, []), "REPLY batch id must be an int in [0, 2**63), got 1.0", None),
        (reply_header(5, -0.5, []), INFER_MS + "-0.5", 5),
        (
            reply_header(5, 86_400_000.5, []),
            INFER_MS + "86400000.5",
            5,
        ),
        (reply_header(5, math.nan, []), INFER_MS + "nan", 5),
        (reply_header(5, False, []), INFER_MS + "False", 5),
        (reply_header(5, "1", []), INFER_MS + "'1'", 5),
        (reply_header(5, 1, [1, -1]), "REPLY lengths must be a list of ints >= 0, got [1, -1]", 5),
        (reply_header(5, 1, [True]), "REPLY lengths must be a list of ints >= 0, got [True]", 5),
        (reply_header(5, 1, 3), "REPLY lengths must be a list of ints >= 0, got 3", 5),
        (reply_header(5, 1, [1, 2], 3), ERRORS + "3", 5),
        (reply_header(5, 1, [1, 2], -1), ERRORS + "-1", 5),
        (reply_header(5, 1, [1, 2], True), ERRORS + "True", 5),
        (reply_header(5, 1, [1, 2], {"bad_request": 3}), ERRORS + "{'bad_request': 3}", 5),
        (reply_header(5, 1, [1, 2], {"model_error": -1}), ERRORS + "{'model_error': -1}", 5),
        (reply_header(5, 1, [1, 2], {"ok": 1}), ERRORS + "{'ok': 1}", 5),
        (reply_header(5, 1, [1, 2], {"bad_request": True}), ERRORS + "{'bad_request': True}", 5),
        (reply_header(5, 1, [1], 0, -1), WAIT_MS + "-1", 5),
        (reply_header(5, 1, [1], 0, math.inf), WAIT_MS + "inf", 5),
        (reply_header(5, 1, [1], 0, "1"), WAIT_MS + "'1'", 5),
    ],
)
def test_reply_header_refuses_what_no_worker_sends_naming_the_batch_when_it_can(
    frame: bytes, message: str, batch_id: int | None
) -> None:
    with pytest.raises(protocol.WorkerProtocolError) as raised:
        protocol.parse_reply_header(frame)
    assert str(raised.value) == message
    assert raised.value.batch_id == batch_id


def test_reply_header_takes_batch_id_zero_and_empty_replies() -> None:
    assert protocol.parse_reply_header(reply_header(0, 0, [0, 3, 0])) == (
        0,
        0.0,
        [0, 3, 0],
        0,
        None,
        None,
        0,
        None,
    )


def test_a_broken_body_over_100_mib_still_has_its_id_echoed() -> None:
    """msgpack's default buffer is 100 MiB, and a body may reach --max-message-bytes (1 GiB
    at most): the id reader takes a buffer the size of the body."""
    big = protocol.pack({"id": "big", "input": b"\x00" * (100 * 1024 * 1024 + 1)})
    assert bad_request(big[:-1]).req_id == "big"


# --- cost: a request's share of max_batch_cost ---------------------------------------------------


@pytest.mark.parametrize(("cost", "parsed"), [(None, 1.0), (1, 1), (0.25, 0.25), (4096, 4096)])
def test_parse_reads_cost_and_defaults_it_to_1(cost: object, parsed: float) -> None:
    msg = {"id": 1, "input": 0} if cost is None else {"id": 1, "input": 0, "cost": cost}
    header, _ = protocol.parse_request(body(msg))
    assert header.cost == parsed


@pytest.mark.parametrize(
    ("cost", "message"),
    [
        (0, "cost must be a number in (0, 1e+15], got 0"),
        (-2, "cost must be a number in (0, 1e+15], got -2"),
        (math.inf, "cost must be a number in (0, 1e+15], got inf"),
        (math.nan, "cost must be a number in (0, 1e+15], got nan"),
        (True, "cost must be a number in (0, 1e+15], got True"),
        ("3", "cost must be a number in (0, 1e+15], got '3'"),
        (None, "cost must be a number in (0, 1e+15], got None"),
        (2e15, "cost must be a number in (0, 1e+15], got 2000000000000000.0"),
    ],
)
def test_a_bad_cost_is_a_bad_request_with_the_id(cost: object, message: str) -> None:
    error = bad_request(body({"id": 5, "input": 0, "cost": cost}))
    assert (error.message, error.req_id) == (message, 5)


def test_heartbeat_settings_frame_round_trips_and_refuses_garbage() -> None:
    hb = Heartbeat(250.0, 4)
    assert Heartbeat.from_frame(hb.frame()) == hb
    for frame, message in [
        (b"\xc1", "heartbeat settings are not msgpack"),
        (protocol.pack([1, 2]), "heartbeat settings must be a map"),
        (protocol.pack({"heartbeat_ms": "5", "liveness": 3}), "heartbeat_ms must be a number up to one day"),
        (protocol.pack({"heartbeat_ms": 5.0, "liveness": 2.5}), "liveness must be an int up to 1000"),
        (protocol.pack({"heartbeat_ms": 0, "liveness": 3}), "heartbeat_ms must be > 0, got 0.0"),
        (protocol.pack({"heartbeat_ms": 5, "liveness": 0}), "heartbeat_liveness must be >= 1, got 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            Heartbeat.from_frame(frame)


def test_heartbeat_settings_at_their_limits() -> None:
    day = Heartbeat(86_400_000.0, 1000)
    assert Heartbeat.from_frame(day.frame()) == day
    with pytest.raises(ValueError, match="liveness must be an int up to 1000, got 1001"):
        Heartbeat.from_frame(protocol.pack({"heartbeat_ms": 5.0, "liveness": 1001}))
    with pytest.raises(ValueError, match="heartbeat_ms must be a number up to one day"):
        Heartbeat.from_frame(protocol.pack({"heartbeat_ms": 86_400_000.5, "liveness": 3}))


def test_the_id_of_a_too_large_body_is_read_from_its_head_only() -> None:
    head_id = protocol.pack({"id": "early", "input": b"\0" * 100_000})
    late_id = protocol.pack({"input": b"\0" * 100_000, "id": "late"})
    assert protocol.id_of_refused(head_id) == "early"
    assert protocol.id_of_refused(late_id) is None  # past the first 64 KiB
    assert protocol.id_of_refused(protocol.pack({"input": b"\0" * 100, "id": 4})) == 4


# --- input_length: the broker's only look inside a tensor (--bucket-by length) ------------------


def _tensor_like(shape: Any) -> dict[str, Any]:
    return {"datatype": "FP32", "shape": shape, "data": b""}


@pytest.mark.parametrize(
    ("given", "length"),
    [
        (_tensor_like([7, 3]), 7),
        (_tensor_like([0]), 0),
        ({"a": _tensor_like([4]), "b": _tensor_like([9, 1])}, 9),
        ([_tensor_like([2]), _tensor_like([5, 5])], 5),
    ],
)
def test_input_length_is_the_longest_first_axis(given: Any, length: int) -> None:
    assert protocol.input_length(body({"id": 1, "input": given})) == length


@pytest.mark.parametrize(
    "given",
    [
        [1, 2, 3],
        "text",
        _tensor_like([]),
        _tensor_like(["7"]),
        _tensor_like([-1]),
        _tensor_like([True]),
        {"a": _tensor_like([3]), "b": 5},
        [],
        {},
    ],
)
def test_input_length_refuses_an_input_without_a_first_axis(given: Any) -> None:
    with pytest.raises(ProtocolError) as raised:
        protocol.input_length(body({"id": "x", "input": given}), "x")
    assert raised.value.code == ErrorCode.BAD_REQUEST and raised.value.req_id == "x"
    assert "groups requests by length" in raised.value.message


@given(st.binary(max_size=200) | _ANY_VALUE.map(lambda v: body({"input": v})))
def test_input_length_of_any_bytes_is_a_length_or_bad_request(raw: bytes) -> None:
    try:
        length = protocol.input_length(raw)
    except ProtocolError as exc:
        assert exc.code == ErrorCode.BAD_REQUEST
    else:
        assert isinstance(length, int) and length >= 0


_FUZZED_TENSOR = st.fixed_dictionaries(
    {
        "datatype": st.sampled_from(["FP32", "X", 3]),
        "shape": st.lists(st.integers(-(2**63), 2**64 - 1) | st.booleans() | st.text(max_size=2), max_size=4)
        | _ANY_VALUE,
        "data": st.binary(max_size=8) | _ANY_VALUE,
    }
)


@given(
    _FUZZED_TENSOR
    | st.lists(_FUZZED_TENSOR, max_size=3)
    | st.dictionaries(st.text(max_size=3), _FUZZED_TENSOR)
)
def test_input_length_of_fuzzed_tensor_headers_is_their_first_axis_or_bad_request(given: Any) -> None:
    try:
        length = protocol.input_length(body({"input": given}))
    except ProtocolError as exc:
        assert exc.code == ErrorCode.BAD_REQUEST
        return
    tensors = [given] if "shape" in given else list(given.values()) if isinstance(given, dict) else given
    firsts = [t["shape"][0] for t in tensors]
    assert length == max(firsts) and all(type(n) is int and n >= 0 for n in firsts)


# --- read_header: the fast reader and its fallback, told apart ---------------------------------


def test_read_header_takes_a_plain_body_without_the_full_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(body: bytes) -> Any:
        raise AssertionError("the full parser ran for a plain body")

    monkeypatch.setattr(protocol, "parse_request", refuse)
    raw = body({"id": "a", "model": "m", "timeout_ms": 5, "priority": 2, "cost": 3.5, "input": b"x" * 100})
    assert protocol.read_header(raw) == RequestHeader("a", "m", 5, 2, "infer", 3.5)
    assert protocol.read_header(body({"id": 1, "op": "stats"})) == RequestHeader(
        1, None, None, 0, "stats", 1.0
    )


@pytest.mark.parametrize(
    "fields",
    [
        {1: "an int key", "id": 4, "input": 1},  # msgspec takes str keys only: the full parser decides
        {"id": 4, "input": 1, "timeout_ms": math.nan},
        {"id": 4, "input": 1, "priority": math.nan},
        {"id": 4, "input": 1, "cost": 0},
        {"id": 4, "input": 1, "cost": 2e15},
        {"id": 4, "op": "infer"},
        {"id": 4, "input": 1, "timeout_ms": -1},
    ],
)
def test_read_header_falls_back_to_the_full_parser_with_its_answer(fields: dict[Any, Any]) -> None:
    raw = msgpack.packb(fields)
    try:
        expected: Any = protocol.parse_request(raw)[0]
    except ProtocolError as exc:
        expected = (exc.code, exc.message, exc.req_id)
    try:
        got: Any = protocol.read_header(raw)
    except ProtocolError as exc:
        got = (exc.code, exc.message, exc.req_id)
    assert got == expected


def test_read_header_of_a_body_too_deep_for_msgspec_is_the_full_parsers() -> None:
    raw = b"\x82\xa2id\x09\xa5input" + b"\x91" * 3000 + b"\xc0"
    with pytest.raises(ProtocolError) as raised:
        protocol.parse_request(raw)
    with pytest.raises(ProtocolError) as got:
        protocol.read_header(raw)
    assert (got.value.message, got.value.req_id) == (raised.value.message, raised.value.req_id)


@pytest.mark.parametrize(
    ("errors", "counted"),
    [
        ({"model_error": 2}, (2, 0)),
        ({"bad_request": 1}, (1, 1)),
        ({"model_error": 1, "bad_request": 2}, (3, 2)),
        ({}, (0, 0)),
        (3, (3, 0)),
        (0, (0, 0)),
    ],
)
def test_reply_errors_as_a_count_or_a_map_of_codes(errors: Any, counted: tuple[int, int]) -> None:
    header = protocol.parse_reply_header(reply_header(5, 1, [1, 2, 3], errors))
    assert (header.errors, header.refused) == counted


@pytest.mark.parametrize(
    ("payload", "plain"),
    [
        (b"x", True),
        (bytearray(b"x"), True),
        (memoryview(b"x"), True),
        ({"a": b"x", "b": b"y"}, True),
        ([b"x", b"y"], True),
        ([bytearray(b"x"), memoryview(b"y")], True),
        ({"a": memoryview(b"x"), "b": bytearray(b"y")}, True),
        ({}, True),
        ([], True),
        ("text", False),
        (1, False),
        ({1: b"x"}, False),
        ({"a": "text"}, False),
        ({"a": [b"x"]}, False),
        ([b"x", 1], False),
        (msgpack.ExtType(1, b"x"), False),
        ((b"x",), False),
    ],
)
def test_only_plain_payloads_go_through_msgspec(payload: Any, plain: bool) -> None:
    assert codec._plain_payload(payload) is plain
    # Either way the bytes are msgpack's own: the choice only saves a copy.
    fields = {"id": 1, "ok": True, "output": payload}
    assert protocol.unpack(protocol.pack_carrying(fields, payload)) == protocol.unpack(protocol.pack(fields))


def test_arrays_are_plain_payloads_alone_and_in_flat_maps_and_lists() -> None:
    np = pytest.importorskip("numpy")
    a = np.zeros(3, np.float32)
    assert all(codec._plain_payload(p) for p in (a, {"x": a}, [a, b"raw"]))
    assert not codec._plain_payload({"x": {"y": a}})


# --- protocol: `stream` ------------------------------------------------------------------------


@pytest.mark.parametrize("value", [True, False])
def test_stream_true_or_false_is_read(value: bool) -> None:
    body = protocol.pack({"id": 1, "input": 1, "stream": value})
    assert protocol.read_header(body).stream is value
    assert protocol.parse_request(body)[0].stream is value
    assert protocol.read_header(protocol.pack({"id": 1, "input": 1})).stream is False


@pytest.mark.parametrize("value", [1, 0, "yes", "true", None, [True], 1.0])
def test_stream_must_be_a_bool(value: Any) -> None:
    body = protocol.pack({"id": 9, "input": 1, "stream": value})
    for read in (protocol.read_header, lambda b: protocol.parse_request(b)[0]):
        with pytest.raises(ProtocolError) as info:
            read(body)
        assert info.value.code == ErrorCode.BAD_REQUEST
        assert info.value.message.startswith("stream must be true or false")
        assert info.value.req_id == 9


def test_an_error_reply_ending_a_stream_says_more_false() -> None:
    reply = protocol.unpack(protocol.error_reply(3, ErrorCode.CANCELLED, "gone", stream=True))
    assert reply == {"id": 3, "ok": False, "error": {"code": "cancelled", "message": "gone"}, "more": False}
    assert "more" not in protocol.unpack(protocol.error_reply(3, ErrorCode.CANCELLED, "gone"))


# --- the survivors of mutation testing -------------------------------------------------------


def test_a_worker_answers_only_int_and_str_ids() -> None:
    assert protocol.answer_id({"id": 7}) == 7 and protocol.answer_id({"id": "a"}) == "a"
    for bad in (True, 1.5, None, [1]):
        assert protocol.answer_id({"id": bad}) is None
    assert protocol.answer_id({}) is None


def test_a_body_that_cannot_be_read_whole_still_says_it_wants_a_stream() -> None:
    body = protocol.pack({"id": 1, "stream": True})[:-1] + b"\xc1"  # broken after the key
    assert protocol.wants_stream(protocol.pack({"id": 1, "stream": True, "input": 1}))
    assert not protocol.wants_stream(protocol.pack({"id": 1, "stream": 1}))  # true only
    assert not protocol.wants_stream(protocol.pack({"id": 1}))
    assert not protocol.wants_stream(b"\xc1")
    assert protocol.wants_stream(protocol.pack({"stream": True}) + b"junk")
    assert isinstance(protocol.wants_stream(body), bool)


def test_a_request_without_a_length_axis_is_refused_in_so_many_words() -> None:
    with pytest.raises(ProtocolError) as info:
        protocol.input_length(protocol.pack({"id": 3, "input": "text"}), 3)
    assert info.value.message == (
        "this model groups requests by length (--bucket-by length): the input must be a tensor, "
        "a map of tensors or a list of tensors, each with a first axis (its length)"
    )
    assert info.value.code == ErrorCode.BAD_REQUEST and info.value.req_id == 3


def test_the_largest_cost_is_a_cost() -> None:
    body = protocol.pack({"id": 1, "input": 1, "cost": protocol.MAX_COST})
    assert protocol.read_header(body).cost == protocol.MAX_COST
    assert protocol.parse_request(body)[0].cost == protocol.MAX_COST


def test_a_bad_stream_or_version_names_its_type() -> None:
    for field, value, message in (
        ("stream", 1, "stream must be true or false, got int"),
        ("version", 1.5, "version must be an int or a str, got float"),
    ):
        with pytest.raises(ProtocolError, match=f"^{message}"):
            protocol.parse_request(protocol.pack({"id": 1, "input": 1, field: value}))


def test_the_full_decode_keeps_the_trace_state_and_the_version() -> None:
    body = protocol.pack(
        {"id": 1, "input": 1, "traceparent": "tp", "tracestate": "a=1", "version": 2, "k": {1: 2}}
    )  # the int key sends it through parse_request
    header = protocol.parse_request(body)[0]
    assert (header.traceparent, header.tracestate, header.version) == ("tp", "a=1", 2)
    assert protocol.read_header(body) == header


def test_a_reply_says_its_multiplexed_worker_loaded_the_model_first() -> None:
    for header in ([4, 1.5, [2]], [4, 1.5, [2], 0], [4, 1.5, [2], 0, 0.25], [4, 1.5, [2], 0, 0.25, [3, 2]]):
        reply = protocol.with_load(
            [b"W1", b"\x03", protocol.pack(header), b"xy"], 12.3456, ["a/1", "b"], ["c"]
        )
        assert reply[0::3] == [b"W1", b"xy"] and reply[1] == b"\x03"
        got = protocol.parse_reply_header(reply[2])
        assert got.load == (12.346, ("a/1", "b"), ("c",))
        assert got[:3] == (4, 1.5, [2])
        assert got.wait_ms == (0.25 if len(header) > 4 else None)
        assert got.padding == ((3, 2) if len(header) > 5 else None)
    assert protocol.parse_reply_header(reply_header(4, 1, [2], 0, None, None, None)).load is None
