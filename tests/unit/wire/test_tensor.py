"""Tensors on the wire (batcher/wire/tensor.py): every datatype and shape makes the round trip
equal, malformed tensor maps are refused saying why, and the worker hands a model arrays
and answers a malformed tensor alone with `bad_request`."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from batcher.wire import protocol, tensor
from batcher.wire.tensor import DATATYPES, TensorError
from tests.helpers import pack, unpack
from workers.worker import run_batch

#: The documented numpy equivalent of each datatype (docs/protocol.md, "Tensors").
NUMPY_OF = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}


def test_the_datatypes_are_the_open_inference_protocols_and_their_numpy_types() -> None:
    assert list(DATATYPES) == list(NUMPY_OF)
    for name, numpy_type in NUMPY_OF.items():
        assert np.dtype(DATATYPES[name]) == np.dtype(numpy_type).newbyteorder("<")


def round_trip(array: Any) -> Any:
    """Through the wire as a client sends it and as a client reads it back."""
    return tensor.unpack_arrays(protocol.pack({"output": array}))["output"]


@pytest.mark.parametrize("datatype", list(NUMPY_OF))
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 0, 4), (2, 3, 4), (1, 1, 1, 1, 5)])
def test_every_datatype_and_shape_round_trips_equal(datatype: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(7)
    sent = np.asarray(rng.random(shape) * 100).astype(NUMPY_OF[datatype])
    got = round_trip(sent)
    assert isinstance(got, np.ndarray)
    assert got.dtype == sent.dtype and got.shape == sent.shape
    assert np.array_equal(got, sent, equal_nan=datatype.startswith("FP"))


def test_a_large_tensor_round_trips_and_its_bytes_are_exactly_the_payload() -> None:
    sent = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)  # 4 MiB
    body = protocol.pack(sent)
    empty = protocol.pack({"datatype": "FP32", "shape": [1024, 1024], "data": b""})
    assert len(body) == len(empty) + 3 + sent.nbytes  # the bin header grows from 2 to 5 bytes
    assert np.array_equal(round_trip(sent), sent)


@given(
    hnp.arrays(
        hnp.scalar_dtypes().filter(lambda d: d.kind in "biuf" and d.itemsize <= 8),
        hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5),
    )
)
def test_any_array_round_trips_equal(sent: Any) -> None:
    got = round_trip(sent)
    assert got.shape == sent.shape and got.dtype == sent.dtype.newbyteorder("<")
    assert np.array_equal(got, sent, equal_nan=sent.dtype.kind == "f")


def test_big_endian_and_strided_arrays_go_as_little_endian_c_order() -> None:
    big = np.arange(6, dtype=">i4").reshape(2, 3)
    assert round_trip(big).tolist() == big.tolist()
    assert round_trip(big).dtype == np.dtype("<i4")
    strided = np.arange(12, dtype=np.int16).reshape(3, 4)[:, ::2].T
    assert round_trip(strided).tolist() == strided.tolist()


def test_numpy_scalars_go_as_plain_numbers_and_0_d_arrays_as_tensors() -> None:
    got = round_trip([np.float32(2.5), np.int64(-3), np.bool_(True), np.float64(0.25)])
    assert got == [2.5, -3, True, 0.25] and [type(x) for x in got] == [float, int, bool, float]
    zero_d = round_trip(np.array(7, dtype=np.uint16))
    assert zero_d.shape == () and zero_d.dtype == np.uint16 and int(zero_d) == 7


def test_tensors_anywhere_in_a_value() -> None:
    value = {"image": np.ones((2, 2), np.uint8), "masks": [np.zeros(3, np.bool_), 5, "x"], "n": 1}
    got = round_trip(value)
    assert got["n"] == 1 and got["masks"][1:] == [5, "x"]
    assert got["image"].tolist() == [[1, 1], [1, 1]] and got["masks"][0].tolist() == [False] * 3


def test_the_documented_byte_example() -> None:
    """docs/protocol.md's example, read from the doc: FP32 [2] holding 1.0 and 2.0."""
    doc = (Path(__file__).parents[3] / "docs" / "protocol.md").read_text()
    block = doc.split("Byte by byte, the FP32 tensor of shape `[2]`", 1)[1].split("```")[1]
    hex_bytes = [tok for line in block.splitlines() for tok in line.split("  ")[0].split()]
    assert protocol.pack(np.array([1.0, 2.0], dtype=np.float32)) == bytes.fromhex("".join(hex_bytes))


def test_a_map_that_is_not_exactly_a_tensor_stays_a_map() -> None:
    for value in (
        {"datatype": "FP32", "shape": [1]},
        {"datatype": "FP32", "shape": [1], "data": b"\0\0\0\0", "name": "x"},
    ):
        assert round_trip(value) == value


def test_unsupported_dtypes_are_refused_on_sending() -> None:
    with pytest.raises(TypeError, match="arrays of dtype complex128 have no tensor datatype"):
        protocol.pack(np.zeros(2, dtype=np.complex128))
    with pytest.raises(TypeError, match="can not serialize 'object' object"):
        protocol.pack(object())


# --- malformed tensor maps -----------------------------------------------------------------------


def t(datatype: object = "FP32", shape: object = [2], data: object = b"\0" * 8) -> dict[str, Any]:
    return {"datatype": datatype, "shape": shape, "data": data}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            t(datatype="FLOAT32"),
            "tensor datatype must be one of BOOL, UINT8, UINT16, UINT32, UINT64, "
            "INT8, INT16, INT32, INT64, FP16, FP32, FP64, got 'FLOAT32'",
        ),
        (t(datatype=3), "tensor datatype must be one of"),
        (t(shape=[2, -1]), "tensor shape must hold ints >= 0, got [2, -1]"),
        (t(shape=[2.0]), "tensor shape must hold ints >= 0, got [2.0]"),
        (t(shape=[True]), "tensor shape must hold ints >= 0, got [True]"),
        (t(shape=3), "tensor shape must be a list of at most 32 ints, got 3"),
        (t(shape=[1] * 33), "tensor shape must be a list of at most 32 ints"),
        (t(shape=[2**40, 2**40]), f"tensor shape [{2**40}, {2**40}] has {2**80} elements, more than {2**45}"),
        (t(data="abcdefgh"), "tensor data must be msgpack bin, got str"),
        (t(data=b"\0" * 7), "tensor data has 7 bytes, but FP32 [2] needs 8"),
        (t(shape=[3], data=b"\0" * 8), "tensor data has 8 bytes, but FP32 [3] needs 12"),
    ],
)
def test_malformed_tensors_are_refused_saying_what_is_wrong(value: dict[str, Any], message: str) -> None:
    with pytest.raises(TensorError) as raised:
        tensor.check(value)
    assert str(raised.value).startswith(message)
    assert round_trip(value) == value  # a client just gets the map back


@given(
    st.fixed_dictionaries(
        {
            "datatype": st.one_of(st.sampled_from(list(DATATYPES)), st.text(max_size=8), st.integers()),
            "shape": st.one_of(st.lists(st.integers(-3, 2**50), max_size=40), st.integers(), st.none()),
            "data": st.one_of(st.binary(max_size=64), st.text(max_size=8), st.none()),
        }
    )
)
def test_any_tensor_header_is_either_valid_or_refused_with_a_message(value: dict[str, Any]) -> None:
    try:
        datatype, shape = tensor.check(value)
    except TensorError as exc:
        assert str(exc).startswith("tensor ")
        return
    array = tensor.to_array(value)
    assert array.shape == shape and array.nbytes == len(value["data"])
    assert math.prod(shape) * tensor.ITEM_BYTES[datatype] == len(value["data"])


# --- the worker: arrays for the model, a malformed tensor answered alone ---------------------------


def batch(*inputs: object) -> tuple[bytes, list[Any]]:
    """(header, body frames) of a BATCH of `inputs`, as the broker frames them."""
    bodies = [pack({"id": i, "input": x}) for i, x in enumerate(inputs)]
    frames = protocol.batch_frames(1, [0.0] * len(bodies), bodies)
    return frames[2], frames[3:]


def replies_of(frames: list[Any]) -> list[dict[str, Any]]:
    _, _, lengths, *_ = unpack(frames[2])
    return [tensor.unpack_arrays(r) for r in protocol.split_bodies(lengths, frames[3:])]


def test_the_model_gets_arrays_and_its_arrays_go_back_as_tensors() -> None:
    seen: list[Any] = []

    def double(inputs: list[Any]) -> list[Any]:
        seen.extend(inputs)
        return [x * 2 for x in inputs]

    a, b = np.arange(3, dtype=np.int32), np.ones((2, 2), dtype=np.float16)
    out = replies_of(run_batch(double, *batch(tensor.from_array(a), tensor.from_array(b)), "w"))
    assert all(isinstance(x, np.ndarray) for x in seen)
    assert [r["output"].tolist() for r in out] == [[0, 2, 4], [[2.0, 2.0], [2.0, 2.0]]]
    assert [r["output"].dtype for r in out] == [np.int32, np.float16]


def test_a_malformed_tensor_is_answered_bad_request_and_its_batch_mates_are_served() -> None:
    seen: list[Any] = []

    def echo(inputs: list[Any]) -> list[Any]:
        seen.extend(inputs)
        return inputs

    good = tensor.from_array(np.arange(2, dtype=np.uint8))
    bad = t(datatype="FP32", shape=[3], data=b"\0" * 8)
    frames = run_batch(echo, *batch(good, bad, "plain"), "w")
    out = replies_of(frames)
    assert [r["ok"] for r in out] == [True, False, True]
    assert out[1]["id"] == 1
    assert out[1]["error"] == {
        "code": "bad_request",
        "message": "tensor data has 8 bytes, but FP32 [3] needs 12",
    }
    assert len(seen) == 2 and seen[1] == "plain"  # the malformed one never reached the model
    assert out[0]["batch_size"] == 2
    assert unpack(frames[2])[3] == {"model_error": 0, "bad_request": 1}  # counted for the broker


@pytest.mark.parametrize("numpy_loaded", [True, False])
def test_a_bool_tensor_holding_a_byte_other_than_0_or_1_is_refused_saying_where(
    numpy_loaded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 28 item 11: protocol.md 3.1 defines BOOL as 0 or 1; a byte 2 once reached the
    model as a third truth value. Checked with numpy where it is loaded, without it else."""
    import sys

    if not numpy_loaded:
        monkeypatch.delitem(sys.modules, "numpy")
    for data in (b"\x00\x01\x01", bytearray(b"\x01"), memoryview(b"\x00\x00"), b""):
        tensor.check({"datatype": "BOOL", "shape": [len(data)], "data": data})
    for data, byte, at in (
        (b"\x00\x02\x01", 2, 1),
        (memoryview(b"\x01\x01\xff"), 255, 2),
        (bytearray(b"\x07"), 7, 0),
    ):
        with pytest.raises(TensorError) as caught:
            tensor.check({"datatype": "BOOL", "shape": [len(data)], "data": data})
        assert (
            str(caught.value) == f"tensor data of BOOL must hold only bytes 0 and 1, got {byte} at byte {at}"
        )


@pytest.mark.parametrize("uniform", [True, False])
def test_a_bool_tensor_with_a_bad_byte_is_answered_alone_and_its_batch_mates_served(uniform: bool) -> None:
    """Both batch paths: the uniform fast path (every request one tensor of one shape) and
    the general one."""
    seen: list[Any] = []

    def echo(inputs: list[Any]) -> list[Any]:
        seen.extend(inputs)
        return list(inputs)

    good = t(datatype="BOOL", shape=[3], data=b"\x01\x00\x01")
    bad = t(datatype="BOOL", shape=[3], data=b"\x01\x02\x01")
    inputs = [good, bad, good] if uniform else [good, bad, "plain"]
    out = replies_of(run_batch(echo, *batch(*inputs), "w"))
    assert [r["ok"] for r in out] == [True, False, True]
    assert out[1]["error"] == {
        "code": "bad_request",
        "message": "tensor data of BOOL must hold only bytes 0 and 1, got 2 at byte 1",
    }
    assert out[0]["output"].tolist() == [True, False, True] and len(seen) == 2


def test_a_batch_of_only_malformed_tensors_never_calls_the_model() -> None:
    def never(inputs: list[Any]) -> list[Any]:
        raise AssertionError("the model was called")

    out = replies_of(run_batch(never, *batch(t(datatype="X"), t(shape=[-1])), "w"))
    assert [r["error"]["code"] for r in out] == ["bad_request", "bad_request"]


LARGE = protocol.ZERO_COPY_BYTES // 4  # FP32 elements: a body past the zero-copy size


def _address_range(buffer: Any) -> tuple[int, int]:
    start = np.frombuffer(buffer, np.uint8).ctypes.data
    return start, start + len(buffer)


@pytest.mark.parametrize(
    "form",
    [
        pytest.param(lambda a: a, id="alone"),
        pytest.param(lambda a: {"x": a, "y": a[:3]}, id="named"),
        pytest.param(lambda a: [a, a[:2]], id="list"),
    ],
)
def test_a_large_requests_tensors_reach_the_model_as_views_of_the_received_frame(form: Any) -> None:
    seen: list[Any] = []

    def keep(inputs: list[Any]) -> list[Any]:
        seen.extend(inputs)
        return inputs

    sent = np.arange(LARGE, dtype=np.float32)
    body = protocol.pack({"id": 1, "input": form(sent)})
    frames = protocol.batch_frames(1, [0.0], [body])
    assert frames[3] is body  # one frame per body: what the worker receives as a zmq.Frame
    out = replies_of(run_batch(keep, frames[2], frames[3:], "w"))
    start, end = _address_range(body)
    got = seen[0]
    arrays = [got] if isinstance(got, np.ndarray) else list(got.values()) if isinstance(got, dict) else got
    for array in arrays:
        assert isinstance(array, np.ndarray) and not array.flags.writeable
        assert start <= array.ctypes.data and array.ctypes.data + array.nbytes <= end, "the tensor was copied"
    assert out[0]["ok"]
    echoed = out[0]["output"]
    if isinstance(echoed, np.ndarray):
        np.testing.assert_array_equal(echoed, sent)
    else:
        np.testing.assert_array_equal(echoed["x"] if isinstance(echoed, dict) else echoed[0], sent)


def test_a_large_requests_malformed_tensor_is_answered_alone_whatever_the_form() -> None:
    good = protocol.pack({"id": 0, "input": np.zeros(LARGE, np.float32)})
    short = protocol.pack(
        {"id": 1, "input": {"a": t(datatype="FP32", shape=[LARGE + 1], data=b"\0" * LARGE * 4)}}
    )
    unknown = protocol.pack({"id": 2, "input": [t(datatype="FP128", shape=[LARGE], data=b"\0" * LARGE * 4)]})
    frames = protocol.batch_frames(1, [0.0] * 3, [good, short, unknown])
    out = replies_of(run_batch(lambda xs: xs, frames[2], frames[3:], "w"))
    assert out[0]["ok"] and out[0]["output"].shape == (LARGE,)
    assert out[1]["error"] == {
        "code": "bad_request",
        "message": f"tensor data has {LARGE * 4} bytes, but FP32 [{LARGE + 1}] needs {(LARGE + 1) * 4}",
    }
    assert out[2]["error"]["code"] == "bad_request" and "FP128" in out[2]["error"]["message"]


def test_the_broker_side_never_needs_numpy_to_read_a_tensor_request() -> None:
    body = protocol.pack({"id": 3, "model": "m", "input": np.zeros(4, np.float32)})
    header, msg = protocol.parse_request(body)
    assert header.id == 3 and isinstance(msg["input"]["data"], bytes)
    assert msgpack.unpackb(body)["input"]["shape"] == [4]


# --- end to end: Python clients and `batcher send` through serve's echo model ---------------------


def _arrays() -> list[Any]:
    rng = np.random.default_rng(3)
    return [(rng.random((2, 3)) * 10).astype(NUMPY_OF[name]) for name in NUMPY_OF] + [
        np.zeros((0, 4), np.float32),
        np.array(5, np.int64),
        np.arange(1 << 18, dtype=np.float64),
    ]


def _same(got: Any, sent: Any) -> bool:
    return (
        isinstance(got, np.ndarray)
        and got.dtype == sent.dtype
        and got.shape == sent.shape
        and np.array_equal(got, sent)
    )


def test_a_batch_that_only_mentions_datatype_is_decoded_as_usual() -> None:
    """The worker looks for tensors only in batches whose bytes hold "datatype"; one that
    holds it as plain text goes through the tensor-aware decode unchanged."""
    inputs = ["datatype", {"datatype": "FP32"}, [1, 2]]
    out = replies_of(run_batch(lambda xs: xs, *batch(*inputs), "w"))
    assert [r["output"] for r in out] == inputs


# --- edges of the encoding ----------------------------------------------------------------------


def test_32_axes_and_2_to_the_45_elements_are_the_limits() -> None:
    assert tensor.check(t(shape=[1] * 32, data=b"\0" * 4)) == ("FP32", (1,) * 32)
    assert tensor.check_header("UINT8", [2**45]) == ("UINT8", (2**45,))
    with pytest.raises(TensorError, match="more than 35184372088832"):
        tensor.check_header("UINT8", [2**45 + 1])


def test_an_array_of_a_dtype_without_datatype_is_refused_naming_the_datatypes() -> None:
    with pytest.raises(TypeError) as raised:
        tensor.from_array(np.zeros(1, dtype="U3"))
    assert str(raised.value) == (
        "arrays of dtype <U3 have no tensor datatype (one of BOOL, UINT8, UINT16, UINT32, UINT64, "
        "INT8, INT16, INT32, INT64, FP16, FP32, FP64)"
    )


def test_other_objects_with_a_dtype_are_not_taken_for_numpy() -> None:
    class LooksLikeAnArray:
        dtype = "float32"

    with pytest.raises(TypeError, match="can not serialize 'LooksLikeAnArray' object"):
        protocol.pack(LooksLikeAnArray())
    assert not tensor.is_array(LooksLikeAnArray()) and tensor.is_array(np.zeros(1))
    assert not tensor.is_array(np.float32(1.0))  # a numpy scalar is not an array


def test_only_numpy_arrays_themselves_are_arrays_not_subclasses_or_lookalikes() -> None:
    class Subclass(np.ndarray):
        pass

    class ndarray:  # the name of numpy's type
        pass

    assert tensor.is_array(np.zeros((2, 3)))
    assert not tensor.is_array(np.zeros(1).view(Subclass))  # its own name: sent as the Packer may
    assert not tensor.is_array(ndarray()) and not tensor.is_array(np.ndarray)


def test_replies_with_non_string_keys_decode_with_arrays() -> None:
    assert tensor.unpack_arrays(protocol.pack({1: np.arange(2, dtype=np.int8), b"k": None}))[1].tolist() == [
        0,
        1,
    ]


# --- the JSON form of `batcher send` ---------------------------------------------------------------


@pytest.mark.parametrize("datatype", list(NUMPY_OF))
def test_json_tensors_round_trip_through_the_binary_form(datatype: str) -> None:
    values = [True, False] if datatype == "BOOL" else [0, 1, 100]
    as_json = {"datatype": datatype, "shape": [len(values), 1], "data": values}
    binary = tensor.from_json(as_json)
    assert tensor.to_array(binary).tolist() == [[v] for v in values]
    assert tensor.to_json(binary) == as_json
    assert tensor.to_json(tensor.to_array(binary)) == as_json  # from an array too


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"datatype": "INT8", "shape": [2], "data": [1]}, "tensor data has 1 values, but INT8 [2] needs 2"),
        ({"datatype": "UINT8", "shape": [1], "data": [-1]}, "tensor data does not fit UINT8"),
        ({"datatype": "INT32", "shape": [1], "data": ["x"]}, "tensor data does not fit INT32"),
        ({"datatype": "FP32", "shape": [1], "data": [1e300]}, "tensor data does not fit FP32"),
        ({"datatype": "FP8", "shape": [1], "data": [1]}, "tensor datatype must be one of"),
        ({"datatype": "FP32", "shape": [-1], "data": [1]}, "tensor shape must hold ints >= 0, got [-1]"),
    ],
)
def test_malformed_json_tensors_are_refused_saying_why(value: dict[str, Any], message: str) -> None:
    with pytest.raises(TensorError) as raised:
        tensor.from_json(value)
    assert str(raised.value).startswith(message)


def test_json_tensors_are_found_anywhere_and_nothing_else_changes() -> None:
    j = {"datatype": "FP64", "shape": [1], "data": [0.5]}
    value = {"a": [j, {"b": j}], "c": {"datatype": "FP64", "shape": [1], "data": "not a list"}, "d": 1}
    out = tensor.json_tensors(value)
    assert out["a"][0] == out["a"][1]["b"] == {"datatype": "FP64", "shape": [1], "data": b"\0\0\0\0\0\0\xe0?"}
    assert out["c"] == value["c"] and out["d"] == 1
    assert tensor.is_json_tensor(j) and not tensor.is_json_tensor(out["a"][0])


# --- fuzzing tensor headers through real processes; payloads up to the size limit ---------------


def _random_tensor(rng: Any) -> dict[str, Any]:
    """A tensor map, valid or not: every field is drawn from valid and invalid values."""
    datatype = rng.choice([*DATATYPES, "FP8", "", "fp32", 7, None])
    shape = rng.choice([[], [0], [3], [2, 2], [1] * 33, [-1], [2**50], "3", [1.5], None])
    size = rng.choice([0, 1, 3, 4, 8, 12, 16, 32])
    data = rng.choice([bytes(size), "text", None, [1, 2]])
    return {"datatype": datatype, "shape": shape, "data": data}


def test_a_huge_axis_beside_a_zero_is_refused_and_strided_arrays_go_whole() -> None:
    with pytest.raises(TensorError, match="has an axis of more than"):
        tensor.check(t(shape=[2**64 - 1, 0], data=b""))
    for sent in (np.arange(10, dtype=np.uint8)[::2], np.asfortranarray(np.eye(3, dtype=np.bool_))[:, 1:]):
        got = round_trip(sent)
        assert got.dtype == sent.dtype and np.array_equal(got, sent)


def test_a_large_replys_tensors_come_back_as_views_of_the_received_bytes() -> None:
    sent = np.arange(LARGE, dtype=np.float32)
    reply = protocol.ok_reply(3, {"a": sent, "b": sent[:5]}, {"batch_size": 1})
    got = tensor.unpack_arrays(reply)
    start, end = _address_range(reply)
    for array in (got["output"]["a"], got["output"]["b"]):
        assert start <= array.ctypes.data and array.ctypes.data + array.nbytes <= end, "the tensor was copied"
    np.testing.assert_array_equal(got["output"]["a"], sent)
    assert (got["id"], got["ok"], got["batch_size"]) == (3, True, 1)


def test_a_large_replys_map_that_is_no_valid_tensor_keeps_bytes_not_a_view() -> None:
    odd = {"datatype": "BF16", "shape": [LARGE], "data": b"\0" * (2 * LARGE)}
    got = tensor.unpack_arrays(protocol.ok_reply(1, odd))
    assert got["output"] == odd and type(got["output"]["data"]) is bytes


def test_a_large_replys_output_of_any_other_form_decodes_as_usual() -> None:
    big = b"z" * (2 * LARGE)
    for output in (big, {"raw": big, "n": 3}, [big, "text"], {"nested": {"t": np.zeros(LARGE, np.float32)}}):
        reply = protocol.ok_reply(9, output, {"batch_size": 2})
        got = tensor.unpack_arrays(reply)
        assert (got["id"], got["ok"], got["batch_size"]) == (9, True, 2)
        expected = msgpack.unpackb(reply, raw=False, object_hook=tensor.arrays_hook)["output"]
        if isinstance(output, dict) and "nested" in output:
            np.testing.assert_array_equal(got["output"]["nested"]["t"], expected["nested"]["t"])
        else:
            assert got["output"] == expected


def test_a_large_reply_with_a_list_of_tensors_views_each() -> None:
    arrays = [np.arange(LARGE, dtype=np.float32), np.ones(LARGE, np.int32)]
    reply = protocol.ok_reply(1, arrays)
    got = tensor.unpack_arrays(reply)["output"]
    start, end = _address_range(reply)
    assert [a.dtype for a in got] == [np.float32, np.int32]
    for array, sent in zip(got, arrays, strict=True):
        np.testing.assert_array_equal(array, sent)
        assert start <= array.ctypes.data < end


def test_a_large_body_msgspec_cannot_read_as_a_map_of_str_keys_decodes_as_usual() -> None:
    reply = msgpack.packb({1: b"x" * (2 * LARGE), "id": 4})
    assert tensor.unpack_arrays(reply) == {1: b"x" * (2 * LARGE), "id": 4}
    with pytest.raises(msgspec.ValidationError):
        tensor.unpack_viewing(reply, "output", tensor.arrays_hook)


# --- the survivors of mutation testing -------------------------------------------------------


def test_without_numpy_a_tensor_as_an_array_says_what_installs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "numpy", None)  # `import numpy` now fails
    with pytest.raises(ModuleNotFoundError) as info:
        tensor.to_array({"datatype": "FP32", "shape": [1], "data": b"\0\0\0\0"})
    assert str(info.value).startswith("tensors as arrays need numpy: pip install 'batcher[tensors]' (")
    assert info.value.name == "numpy"


def test_bool_data_is_checked_without_numpy_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(__import__("sys").modules, "numpy")  # the broker's case: none loaded
    tensor.check_bool(b"\x00\x01\x01")
    tensor.check_bool(memoryview(b"\x01\x00"))
    for data in (b"\x00\x01\x02", memoryview(b"\x00\x01\x02")):
        with pytest.raises(TensorError, match="only bytes 0 and 1, got 2 at byte 2"):
            tensor.check_bool(data)
    with pytest.raises(TensorError, match="got 88 at byte 0"):
        tensor.check_bool(b"X\x01")  # a byte of the mark's own letters is no truth value either


def test_a_viewed_body_keeps_int_keys_and_views_only_its_key() -> None:
    body = protocol.ok_reply(1, np.arange(LARGE, dtype=np.float32), {"meta": {1: "a"}})
    got = tensor.unpack_viewing(body, "output", tensor.arrays_hook)
    assert got["meta"] == {1: "a"}  # int keys, as protocol.unpack reads them
    start, end = _address_range(body)
    assert start <= got["output"].ctypes.data < end
    other = protocol.pack(
        {"output": 1, "input": {"datatype": "FP32", "shape": [LARGE], "data": b"\0" * 4 * LARGE}}
    )
    kept = tensor.unpack_viewing(other, "output", tensor.arrays_hook)["input"]
    s, e = _address_range(other)
    assert not s <= kept.ctypes.data < e  # not the key: decoded the usual way, not viewed


def test_a_tensor_the_hook_leaves_a_map_gets_its_data_as_bytes() -> None:
    body = protocol.ok_reply(1, np.arange(LARGE, dtype=np.float32))
    got = tensor.unpack_viewing(body, "output", lambda value: value)["output"]
    assert type(got["data"]) is bytes and len(got["data"]) == 4 * LARGE


def test_a_reply_of_exactly_the_view_size_is_viewed() -> None:
    def reply(n: int) -> bytes:
        return protocol.ok_reply(1, np.zeros(n, dtype=np.uint8))

    n = tensor.VIEW_BYTES - (len(reply(tensor.VIEW_BYTES)) - tensor.VIEW_BYTES)
    body = reply(n)
    assert len(body) == tensor.VIEW_BYTES
    start, end = _address_range(body)
    assert start <= tensor.unpack_arrays(body)["output"].ctypes.data < end
