"""The v2 gateway's protocol logic without any I/O (batcher/gateway/oip.py) and the HTTP
front end's pure functions (parse_infer, infer_response): inputs checked and split into
rows with exactly their bytes, replies joined back with the batch axis first, parameters
read in Triton's sense, and every refusal a batcher error code with a message naming
the fault."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batcher.gateway import http_api, oip
from batcher.gateway.oip import InferRequest, InputTensor, OipError, OutputTensor
from batcher.wire import tensor
from batcher.wire.protocol import ErrorCode

#: Every fixed-size datatype, its numpy type (the independent oracle for the bytes), and
#: values that are exact in it, including its extremes.
FIXED: dict[str, tuple[Any, list[Any]]] = {
    "BOOL": (np.bool_, [True, False, True]),
    "UINT8": (np.uint8, [0, 255, 7]),
    "UINT16": (np.uint16, [0, 65535, 7]),
    "UINT32": (np.uint32, [0, 2**32 - 1, 7]),
    "UINT64": (np.uint64, [0, 2**64 - 1, 7]),
    "INT8": (np.int8, [-128, 127, 0]),
    "INT16": (np.int16, [-(2**15), 2**15 - 1, 0]),
    "INT32": (np.int32, [-(2**31), 2**31 - 1, 0]),
    "INT64": (np.int64, [-(2**63), 2**63 - 1, 0]),
    "FP16": (np.float16, [0.5, -2.0, 65504.0]),
    "FP32": (np.float32, [0.5, -2.0, 2.0**127]),
    "FP64": (np.float64, [0.1, -2.0, 1e300]),
}


def le_bytes(datatype: str, values: list[Any]) -> bytes:
    """The values as the datatype's little-endian C-order bytes, computed by numpy."""
    numpy_type = FIXED[datatype][0]
    return np.asarray(values, dtype=np.dtype(numpy_type).newbyteorder("<")).tobytes()


def wire(*items: bytes) -> bytes:
    """BYTES elements in the v2 wire form, written out by hand: u32 LE length, then bytes."""
    return b"".join(len(x).to_bytes(4, "little") + x for x in items)


@contextmanager
def refused(match: str, code: str = ErrorCode.BAD_REQUEST) -> Iterator[None]:
    """The block raises OipError with `code` and a message matching `match`."""
    with pytest.raises(OipError, match=match) as info:
        yield
    assert info.value.code == code


def fp32(shape: list[int], values: list[float]) -> dict[str, Any]:
    """A tensor map as a row's reply carries it."""
    return {"datatype": "FP32", "shape": shape, "data": le_bytes("FP32", values)}


# --- raw inputs -------------------------------------------------------------------------------


@pytest.mark.parametrize("datatype", list(FIXED))
def test_a_raw_input_of_every_fixed_datatype_keeps_its_bytes(datatype: str) -> None:
    raw = le_bytes(datatype, FIXED[datatype][1] * 2)
    got = oip.raw_input("x", datatype, [2, 3], raw)
    assert got == InputTensor("x", datatype, (2, 3), raw)
    assert len(raw) == 6 * tensor.ITEM_BYTES[datatype]


@pytest.mark.parametrize("datatype", list(FIXED))
@pytest.mark.parametrize("delta", [-1, 1])
def test_a_raw_input_of_the_wrong_length_is_refused_naming_it(datatype: str, delta: int) -> None:
    need = 6 * tensor.ITEM_BYTES[datatype]
    raw = b"\0" * (need + delta)
    with refused(rf"input 'pixels': {need + delta} bytes of data, but {datatype} \[2, 3\] needs {need}"):
        oip.raw_input("pixels", datatype, [2, 3], raw)


def test_a_raw_input_may_be_a_memoryview_and_is_not_copied() -> None:
    body = memoryview(b"head" + le_bytes("FP32", [1.0, 2.0]))
    got = oip.raw_input("x", "FP32", [2], body[4:])
    assert isinstance(got.data, memoryview) and got.data.obj is body.obj
    assert bytes(got.data) == le_bytes("FP32", [1.0, 2.0])


def test_an_unknown_datatype_is_refused_listing_the_known_ones() -> None:
    for bad in ("FLOAT32", "fp32", None, 3):
        with refused(rf"input 'x': unknown datatype {bad!r}; one of \[.*'BYTES'.*'UINT8'\]"):
            oip.raw_input("x", bad, [1], b"\0" * 4)
    assert frozenset(tensor.DATATYPES) | {"BYTES"} == oip.DATATYPES


# --- BYTES wire form --------------------------------------------------------------------------


def test_a_raw_bytes_input_is_split_into_its_elements() -> None:
    raw = wire(b"hello", b"", "€".encode(), b"\xff\x00")
    got = oip.raw_input("text", "BYTES", [2, 2], raw)
    assert got == InputTensor("text", "BYTES", (2, 2), [b"hello", b"", "€".encode(), b"\xff\x00"])


def test_a_raw_bytes_input_with_the_wrong_element_count_is_refused() -> None:
    with refused(r"input 'text': 3 BYTES elements, but shape \[2, 2\] needs 4"):
        oip.raw_input("text", "BYTES", [2, 2], wire(b"a", b"b", b"c"))
    with refused(r"input 'text': 0 BYTES elements, but shape \[1\] needs 1"):
        oip.raw_input("text", "BYTES", [1], b"")


@given(st.lists(st.binary(max_size=40), max_size=20))
def test_bytes_elements_round_trip_through_their_wire_form(items: list[bytes]) -> None:
    joined = oip.join_bytes_elements(items)
    assert joined == wire(*items)
    assert oip.split_bytes_elements("x", joined) == items
    assert oip.split_bytes_elements("x", memoryview(joined)) == items


@pytest.mark.parametrize("cut", [1, 2, 3])
def test_bytes_data_ending_inside_a_length_prefix_is_refused(cut: int) -> None:
    raw = wire(b"ab") + (5).to_bytes(4, "little")[:cut]
    with refused(r"input 'q': BYTES data ends inside an element's length"):
        oip.split_bytes_elements("q", raw)


def test_a_bytes_element_running_past_the_data_is_refused() -> None:
    raw = wire(b"ab") + (10).to_bytes(4, "little") + b"123"
    with refused(r"input 'q': a BYTES element of 10 bytes runs past the data"):
        oip.split_bytes_elements("q", raw)
    with refused(r"input 'q': a BYTES element of 4294967295 bytes runs past the data"):
        oip.raw_input("q", "BYTES", [1], b"\xff\xff\xff\xff")


# --- JSON inputs ------------------------------------------------------------------------------


@pytest.mark.parametrize("datatype", list(FIXED))
def test_json_data_of_every_fixed_datatype_packs_to_its_little_endian_bytes(datatype: str) -> None:
    values = FIXED[datatype][1]
    got = oip.json_input("x", datatype, [1, 3], values)
    assert got == InputTensor("x", datatype, (1, 3), le_bytes(datatype, values))


def test_nested_json_data_is_read_in_c_order() -> None:
    flat = oip.json_input("x", "INT32", [2, 3], [1, 2, 3, 4, 5, 6])
    nested = oip.json_input("x", "INT32", [2, 3], [[1, 2, 3], [4, 5, 6]])
    assert nested == flat
    assert nested.data == le_bytes("INT32", [1, 2, 3, 4, 5, 6])


def test_a_json_scalar_is_one_element() -> None:
    assert oip.json_input("x", "FP64", [1], 2.5).data == le_bytes("FP64", [2.5])


def test_json_bytes_data_is_utf8_encoded_strings() -> None:
    got = oip.json_input("s", "BYTES", [2], ["hé", ""])
    assert got == InputTensor("s", "BYTES", (2,), ["hé".encode(), b""])
    with refused(r"input 's': BYTES data must be strings"):
        oip.json_input("s", "BYTES", [2], ["a", 1])


@pytest.mark.parametrize(
    ("datatype", "value", "want"),
    [
        ("BOOL", 1, "true/false"),
        ("BOOL", 0, "true/false"),
        ("BOOL", "true", "true/false"),
        ("INT32", 1.5, "integers"),
        ("INT32", 1.0, "integers"),
        ("INT32", True, "integers"),
        ("UINT8", "7", "integers"),
        ("INT64", None, "integers"),
        ("FP32", True, "numbers"),
        ("FP64", "1.0", "numbers"),
        ("FP16", None, "numbers"),
    ],
)
def test_json_data_of_the_wrong_kind_is_refused(datatype: str, value: Any, want: str) -> None:
    with refused(rf"input 'x': {datatype} data must be {want}"):
        oip.json_input("x", datatype, [2], [value, value])


def test_ints_are_accepted_as_floating_point_data() -> None:
    assert oip.json_input("x", "FP32", [2], [1, 2]).data == le_bytes("FP32", [1.0, 2.0])


@pytest.mark.parametrize(
    ("datatype", "value"),
    [
        ("UINT8", 300),
        ("UINT8", 256),
        ("UINT8", -1),
        ("INT8", 128),
        ("INT8", -129),
        ("UINT16", 65536),
        ("INT16", 2**15),
        ("UINT32", 2**32),
        ("INT32", -(2**31) - 1),
        ("UINT64", 2**64),
        ("UINT64", -1),
        ("INT64", 2**63),
        ("FP16", 70000.0),
        ("FP32", 1e39),
    ],
)
def test_a_json_value_that_does_not_fit_its_datatype_is_refused(datatype: str, value: Any) -> None:
    with refused(rf"input 'x': a value does not fit {datatype}"):
        oip.json_input("x", datatype, [2], [0, value])


def test_a_json_element_count_that_misses_the_shape_is_refused() -> None:
    with refused(r"input 'x': data\[1\] holds 2 values, but shape \[2, 3\] needs 3 there"):
        oip.json_input("x", "FP32", [2, 3], [[1, 2, 3], [4, 5]])
    with refused(r"input 'x': 7 data elements, but shape \[2, 3\] needs 6"):
        oip.json_input("x", "FP32", [2, 3], [1, 2, 3, 4, 5, 6, 7])


# --- shapes -----------------------------------------------------------------------------------


def test_a_shape_is_a_tuple_of_ints_with_the_batch_axis_first() -> None:
    assert oip.check_shape("x", [3, 0, 2]) == (3, 0, 2)
    assert oip.check_shape("x", (1,)) == (1,)
    assert oip.check_shape("x", [1] * (tensor.MAX_RANK + 1)) == (1,) * (tensor.MAX_RANK + 1)


def test_a_shape_without_a_batch_axis_is_refused() -> None:
    with refused(r"input 'img': shape \[\] has no batch axis; the first axis is the batch"):
        oip.check_shape("img", [])


@pytest.mark.parametrize("shape", [[2, -1], [-3], [2, 1.0], [True, 2], [2, "3"], [2, None], [[2]]])
def test_a_shape_of_negative_or_non_int_dims_is_refused(shape: list[Any]) -> None:
    with refused(r"input 'img': shape must be a list of ints >= 0, got "):
        oip.check_shape("img", shape)


@pytest.mark.parametrize("shape", ["23", b"\x02", 2, None, {"a": 1}])
def test_a_shape_that_is_not_a_list_is_refused(shape: Any) -> None:
    with refused(r"input 'img': shape must be a list of ints, got "):
        oip.check_shape("img", shape)


def test_a_shape_of_too_many_axes_is_refused() -> None:
    with refused(rf"input 'x': at most {tensor.MAX_RANK + 1} axes, got {tensor.MAX_RANK + 2}"):
        oip.check_shape("x", [1] * (tensor.MAX_RANK + 2))


def test_an_axis_past_the_tensor_limit_is_refused_even_beside_a_0() -> None:
    huge = [1, tensor.MAX_ELEMENTS + 1, 0]
    with refused(r"input 'x'"):
        oip.json_input("x", "BYTES", huge, [])
    with refused(r"input 'x'"):
        oip.raw_input("x", "BYTES", huge, b"")


# --- rows -------------------------------------------------------------------------------------


def a(shape: list[int], datatype: str = "FP32", name: str = "a") -> InputTensor:
    """An input of zeros (BYTES: empty elements) of that shape."""
    count = int(np.prod(shape))
    if datatype == "BYTES":
        return InputTensor(name, datatype, tuple(shape), [b""] * count)
    return InputTensor(name, datatype, tuple(shape), b"\0" * count * tensor.ITEM_BYTES[datatype])


def test_the_batch_is_the_first_axis_every_input_agrees_on() -> None:
    assert oip.batch_rows([a([4, 2]), a([4], "BYTES", "b"), a([4, 0, 3], "INT8", "c")]) == 4


def test_inputs_disagreeing_on_the_batch_axis_are_refused() -> None:
    with refused(r"inputs disagree on the batch axis \(the first\): \[\[2, 3\], \[3, 2\]\]"):
        oip.batch_rows([a([2, 3]), a([3, 2], name="b")])


def test_a_batch_of_0_rows_is_refused() -> None:
    with refused(r"the batch axis \(the first\) is 0: no rows to infer"):
        oip.batch_rows([a([0, 3]), a([0], name="b")])


def test_repeated_input_names_are_refused() -> None:
    with refused(r"input names repeat: \['a', 'b', 'a'\]"):
        oip.batch_rows([a([1]), a([1], name="b"), a([1])])


def test_a_request_without_inputs_is_refused() -> None:
    with refused(r"a request needs at least one input"):
        oip.batch_rows([])
    with refused(r"a request needs at least one input"):
        oip.row_inputs([])


def test_one_input_gives_each_row_its_tensor_alone_with_its_bytes() -> None:
    raw = le_bytes("FP32", [0, 1, 2, 3, 4, 5])
    rows = oip.row_inputs([InputTensor("x", "FP32", (3, 2), raw)])
    assert len(rows) == 3
    for i, row in enumerate(rows):
        assert set(row) == {"datatype", "shape", "data"}
        assert row["datatype"] == "FP32" and row["shape"] == [2]
        assert bytes(row["data"]) == raw[i * 8 : (i + 1) * 8]
        assert tensor.check(row) == ("FP32", (2,))


def test_a_rank_1_input_gives_0_d_rows() -> None:
    raw = le_bytes("INT16", [7, -8])
    rows = oip.row_inputs([InputTensor("x", "INT16", (2,), raw)])
    assert [(r["shape"], bytes(r["data"])) for r in rows] == [([], raw[:2]), ([], raw[2:])]


def test_rows_view_the_received_bytes_without_copying() -> None:
    body = bytearray(le_bytes("UINT8", [1, 2, 3, 4]))
    rows = oip.row_inputs([oip.raw_input("x", "UINT8", [2, 2], memoryview(body))])
    body[0] = 99
    assert bytes(rows[0]["data"]) == b"\x63\x02"


def test_several_inputs_give_each_row_a_map_of_name_to_its_part() -> None:
    ids = InputTensor("ids", "INT64", (2, 3), le_bytes("INT64", [1, 2, 3, 4, 5, 6]))
    mask = InputTensor("mask", "BOOL", (2, 3), le_bytes("BOOL", [True, True, False, True, False, False]))
    text = InputTensor("text", "BYTES", (2,), [b"first", b"second"])
    rows = oip.row_inputs([ids, mask, text])
    assert len(rows) == 2
    for i, row in enumerate(rows):
        assert list(row) == ["ids", "mask", "text"]
        assert row["ids"]["shape"] == [3] and row["ids"]["datatype"] == "INT64"
        assert bytes(row["ids"]["data"]) == ids.data[i * 24 : (i + 1) * 24]  # type: ignore[index]
        assert bytes(row["mask"]["data"]) == mask.data[i * 3 : (i + 1) * 3]  # type: ignore[index]
    assert [r["text"] for r in rows] == [b"first", b"second"]


def test_bytes_rows_nest_as_their_row_shape() -> None:
    items = [bytes([i]) for i in range(12)]
    rows = oip.row_inputs([InputTensor("s", "BYTES", (2, 2, 3), items)])
    assert rows == [
        [[b"\x00", b"\x01", b"\x02"], [b"\x03", b"\x04", b"\x05"]],
        [[b"\x06", b"\x07", b"\x08"], [b"\x09", b"\x0a", b"\x0b"]],
    ]
    assert oip.row_inputs([InputTensor("s", "BYTES", (3, 1), [b"a", b"b", b"c"])]) == [[b"a"], [b"b"], [b"c"]]


def test_a_0_d_bytes_row_is_its_element_alone() -> None:
    assert oip.row_inputs([InputTensor("s", "BYTES", (3,), [b"a", b"", b"c"])]) == [b"a", b"", b"c"]


def test_an_empty_bytes_row_is_an_empty_list() -> None:
    assert oip.row_inputs([InputTensor("s", "BYTES", (2, 0), [])]) == [[], []]
    assert oip.row_inputs([InputTensor("s", "BYTES", (1, 2, 0), [])]) == [[[], []]]


fixed_inputs = st.sampled_from(list(FIXED)).flatmap(
    lambda datatype: st.tuples(
        st.just(datatype),
        st.lists(st.integers(0, 4), max_size=3),
        st.integers(1, 4),
    )
)


@given(fixed_inputs, st.data())
def test_rows_of_any_fixed_input_join_back_to_the_same_tensor(
    spec: tuple[str, list[int], int], data: st.DataObject
) -> None:
    """An echo model: each row's reply is its input, and the joined output is the request's."""
    datatype, row_shape, rows = spec
    size = rows * int(np.prod(row_shape)) * tensor.ITEM_BYTES[datatype]
    raw = data.draw(st.binary(min_size=size, max_size=size))
    if datatype == "BOOL":  # 0 and 1 only (docs/protocol.md 3.1): any other byte is refused
        raw = bytes(b & 1 for b in raw)
    sent = oip.raw_input("x", datatype, [rows, *row_shape], raw)
    per_row = oip.row_inputs([sent])
    assert len(per_row) == rows
    assert b"".join(bytes(r["data"]) for r in per_row) == raw
    (out,) = oip.join_outputs(per_row, ["y"])
    assert (out.name, out.datatype, out.shape, bytes(out.data)) == ("y", datatype, (rows, *row_shape), raw)  # type: ignore[arg-type]


# --- outputs ----------------------------------------------------------------------------------


def test_tensor_rows_are_joined_with_the_batch_axis_first() -> None:
    rows = [fp32([2], [1, 2]), fp32([2], [3, 4]), fp32([2], [5, 6])]
    (out,) = oip.join_outputs(rows, None)
    assert out == OutputTensor("output", "FP32", (3, 2), le_bytes("FP32", [1, 2, 3, 4, 5, 6]))


def test_a_single_row_keeps_its_bytes() -> None:
    data = memoryview(le_bytes("FP32", [1, 2]))
    (out,) = oip.join_outputs([{"datatype": "FP32", "shape": [2], "data": data}], None)
    assert out.shape == (1, 2) and bytes(out.data) == data.tobytes()  # type: ignore[arg-type]


def test_a_lone_output_is_named_after_the_signatures_one_output_else_output() -> None:
    rows = [fp32([], [1.0])]
    assert oip.join_outputs(rows, ["logits"])[0].name == "logits"
    assert oip.join_outputs(rows, None)[0].name == oip.DEFAULT_OUTPUT == "output"
    assert oip.join_outputs(rows, [])[0].name == "output"
    assert oip.join_outputs(rows, ["a", "b"])[0].name == "output"


def test_named_maps_give_one_output_per_name_in_their_order() -> None:
    rows = [{"scores": fp32([2], [1, 2]), "label": "cat"}, {"scores": fp32([2], [3, 4]), "label": "dog"}]
    scores, label = oip.join_outputs(rows, ["ignored"])
    assert scores == OutputTensor("scores", "FP32", (2, 2), le_bytes("FP32", [1, 2, 3, 4]))
    assert label == OutputTensor("label", "BYTES", (2,), [b"cat", b"dog"])


def test_rows_naming_different_outputs_are_a_model_error() -> None:
    with refused(r"the rows' outputs differ: \['a', 'b'\] and \['a'\]", ErrorCode.MODEL_ERROR):
        oip.join_outputs([{"a": 1, "b": 2}, {"a": 1}], None)
    with refused(r"the rows' outputs differ: \['a'\] and int", ErrorCode.MODEL_ERROR):
        oip.join_outputs([{"a": 1}, 5], None)


def test_rows_may_name_their_outputs_in_any_order() -> None:
    joined = oip.join_outputs([{"a": 1, "b": 2.5}, {"b": 3.5, "a": 4}], None)
    assert [(o.name, o.datatype, o.shape) for o in joined] == [("a", "INT64", (2,)), ("b", "FP64", (2,))]
    assert oip.output_values(joined[0]) == [1, 4] and oip.output_values(joined[1]) == [2.5, 3.5]


def test_rows_of_different_shapes_or_datatypes_are_a_model_error() -> None:
    with refused(
        r"output 'output': rows differ \(FP32 \[2\] and FP32 \[3\]\); a v2 output needs one datatype",
        ErrorCode.MODEL_ERROR,
    ):
        oip.join_outputs([fp32([2], [1, 2]), fp32([3], [1, 2, 3])], None)
    with refused(r"output 'y': rows differ \(FP32 \[\] and INT64 \[\]\)", ErrorCode.MODEL_ERROR):
        oip.join_outputs([fp32([], [1]), 7], ["y"])
    with refused(r"output 'y': rows differ \(BYTES \[\] and INT64 \[\]\)", ErrorCode.MODEL_ERROR):
        oip.join_outputs(["a", 7], ["y"])


def test_a_malformed_tensor_in_a_reply_is_a_model_error() -> None:
    bad = {"datatype": "FP32", "shape": [3], "data": b"\0" * 8}
    with refused(r"output 'y': tensor data has 8 bytes, but FP32 \[3\] needs 12", ErrorCode.MODEL_ERROR):
        oip.join_outputs([bad], ["y"])


@pytest.mark.parametrize(
    ("rows", "datatype", "shape", "data"),
    [
        ([1, -2], "INT64", (2,), le_bytes("INT64", [1, -2])),
        ([2**63 - 1, -(2**63)], "INT64", (2,), le_bytes("INT64", [2**63 - 1, -(2**63)])),
        ([0.5, 2.0], "FP64", (2,), le_bytes("FP64", [0.5, 2.0])),
        ([[1, 2.5], [3, 4.0]], "FP64", (2, 2), le_bytes("FP64", [1, 2.5, 3, 4])),
        ([True, False], "BOOL", (2,), le_bytes("BOOL", [True, False])),
        ([[[1, 2], [3, 4]]], "INT64", (1, 2, 2), le_bytes("INT64", [1, 2, 3, 4])),
        ([[], []], "INT64", (2, 0), b""),
        (["hé", "x"], "BYTES", (2,), ["hé".encode(), b"x"]),
        ([b"\xff", b""], "BYTES", (2,), [b"\xff", b""]),
        ([["a", "b"], ["c", "d"]], "BYTES", (2, 2), [b"a", b"b", b"c", b"d"]),
        ([[["a"], [b"b"]]], "BYTES", (1, 2, 1), [b"a", b"b"]),
    ],
)
def test_plain_values_become_int64_fp64_bool_or_bytes(
    rows: list[Any], datatype: str, shape: tuple[int, ...], data: Any
) -> None:
    (out,) = oip.join_outputs(rows, None)
    assert out == OutputTensor("output", datatype, shape, data)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([[1, 2], [3]], r"output 'output': rows differ \(INT64 \[2\] and INT64 \[1\]\)"),
        ([[1, 2.5], [3, 4]], r"output 'output': rows differ \(FP64 \[2\] and INT64 \[2\]\)"),
        ([[[1, 2], [3]]], r"output 'output': a ragged list is not a tensor"),
        ([[[1, 2], 3]], r"output 'output': a ragged list is not a tensor"),
        ([[["a", "b"], ["c"]]], r"output 'output': a ragged list is not a tensor"),
        ([[True, 1]], r"output 'output': mixes bools and numbers"),
        ([2**63], r"output 'output': an integer does not fit INT64"),
        ([None], r"output 'output': a NoneType is not a tensor, a number, text, or a list of them"),
        ([[fp32([1], [1.0])]], r"output 'output': a dict is not a tensor"),
        ([["a", 1]], r"output 'output': a str is not a tensor"),
    ],
)
def test_values_that_are_no_tensor_are_a_model_error(rows: list[Any], message: str) -> None:
    with refused(message, ErrorCode.MODEL_ERROR):
        oip.join_outputs(rows, None)


def out(name: str, values: list[float] | None = None) -> OutputTensor:
    values = values or [1.0]
    return OutputTensor(name, "FP32", (len(values),), le_bytes("FP32", values))


def test_the_requested_outputs_come_in_the_order_asked() -> None:
    outputs = [out("a"), out("b"), out("c")]
    assert [o.name for o in oip.select_outputs(outputs, ["c", "a"])] == ["c", "a"]
    assert oip.select_outputs(outputs, None) == outputs
    assert oip.select_outputs(outputs, []) == outputs


def test_an_unknown_requested_output_is_refused_naming_the_known_ones() -> None:
    with refused(r"unknown output \['z', 'y'\]; the model gives \['a', 'b'\]"):
        oip.select_outputs([out("b"), out("a")], ["a", "z", "y"])


@pytest.mark.parametrize("datatype", list(FIXED))
def test_an_outputs_values_and_raw_bytes_are_its_elements(datatype: str) -> None:
    values = FIXED[datatype][1]
    raw = le_bytes(datatype, values)
    output = OutputTensor("y", datatype, (3,), raw)
    assert oip.output_raw(output) == raw
    got = oip.output_values(output)
    assert got == values
    assert [type(v) for v in got] == [type(v) for v in values]
    assert oip.output_values(OutputTensor("y", datatype, (3,), memoryview(raw))) == values


def test_a_bytes_outputs_raw_form_is_the_wire_form_and_its_values_are_text() -> None:
    output = OutputTensor("s", "BYTES", (2,), ["hé".encode(), b""])
    assert oip.output_raw(output) == wire("hé".encode(), b"")
    assert oip.output_values(output) == ["hé", ""]
    with pytest.raises(UnicodeDecodeError):
        oip.output_values(OutputTensor("s", "BYTES", (1,), [b"\xff"]))


# --- parameters -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("timeout", "ms"),
    [(None, None), (0, None), (0.0, None), (1_500_000, 1500.0), (2500, 2.5), (1, 0.001), (750.0, 0.75)],
)
def test_the_timeout_parameter_is_microseconds(timeout: Any, ms: float | None) -> None:
    params = {} if timeout is None else {"timeout": timeout}
    assert oip.timeout_ms_of(params) == ms


@pytest.mark.parametrize("timeout", [-1, -0.5, float("nan"), "100", True, [100]])
def test_a_timeout_that_is_no_microsecond_count_is_refused(timeout: Any) -> None:
    with refused(r"parameter 'timeout' must be a number of microseconds >= 0, got "):
        oip.timeout_ms_of({"timeout": timeout})


@pytest.mark.parametrize(("priority", "batcher"), [(None, None), (0, None), (1, 1.0), (2, 0.5), (4, 0.25)])
def test_priority_is_tritons_1_highest_as_batchers_higher_first(priority: Any, batcher: float | None) -> None:
    params = {} if priority is None else {"priority": priority}
    assert oip.priority_of(params) == batcher


def test_every_explicit_priority_goes_before_the_default_in_tritons_order() -> None:
    ranks = [oip.priority_of({"priority": p}) for p in (1, 2, 3, 10, 1000)]
    assert all(r is not None and r > 0 for r in ranks)
    assert ranks == sorted(ranks, reverse=True)  # type: ignore[type-var]


@pytest.mark.parametrize("priority", [-1, 1.5, 2.0, "1", True, False, 0.0])
def test_a_priority_that_is_no_integer_from_0_is_refused(priority: Any) -> None:
    with refused(r"parameter 'priority' must be an integer >= 0, got "):
        oip.priority_of({"priority": priority})


# --- error codes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "http", "grpc"),
    [
        ("bad_request", 400, "INVALID_ARGUMENT"),
        ("unknown_model", 404, "NOT_FOUND"),
        ("overloaded", 503, "UNAVAILABLE"),
        ("deadline_exceeded", 504, "DEADLINE_EXCEEDED"),
        ("model_error", 500, "INTERNAL"),
        ("worker_failed", 500, "INTERNAL"),
        ("shutting_down", 503, "UNAVAILABLE"),
        ("unavailable", 503, "UNAVAILABLE"),
        ("too_large", 413, "RESOURCE_EXHAUSTED"),
        ("forbidden", 403, "PERMISSION_DENIED"),
        ("internal_error", 500, "INTERNAL"),
        ("cancelled", 499, "CANCELLED"),
        ("timeout", 504, "DEADLINE_EXCEEDED"),
        ("closed", 503, "UNAVAILABLE"),
        ("no_such_code", 500, "INTERNAL"),
        ("", 500, "INTERNAL"),
    ],
)
def test_each_error_code_has_its_http_and_grpc_status(code: str, http: int, grpc: str) -> None:
    assert oip.http_status(code) == http
    assert oip.grpc_status(code) == grpc


def test_every_batcher_error_code_has_a_status() -> None:
    for code in ErrorCode:
        assert code in oip.HTTP_STATUS and code in oip.GRPC_STATUS
        assert oip.http_status(str(code)) == oip.HTTP_STATUS[code]


# --- HTTP: parse_infer ------------------------------------------------------------------------


def parse(
    doc: Any, *binary: bytes, header: str | None = "auto"
) -> tuple[InferRequest, bool, dict[str, bool]]:
    """parse_infer of a JSON document, followed by binary parts with the header length
    set (or `header` itself when given, or none when there are no parts)."""
    head = json.dumps(doc).encode()
    if header == "auto":
        header = str(len(head)) if binary else None
    return http_api.parse_infer("m", "", head + b"".join(binary), header)


def test_a_json_only_request_is_parsed() -> None:
    infer, binary_default, binary_outputs = parse(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [[1, 2], [3, 4]]}]}
    )
    assert infer == InferRequest(
        model="m", version="", inputs=[InputTensor("x", "FP32", (2, 2), le_bytes("FP32", [1, 2, 3, 4]))]
    )
    assert infer.outputs is None and infer.timeout_ms is None and infer.priority is None and infer.id == ""
    assert binary_default is False and binary_outputs == {}


def test_the_model_version_and_id_are_kept() -> None:
    body = json.dumps(
        {"id": "r-1", "inputs": [{"name": "x", "datatype": "BOOL", "shape": [1], "data": [True]}]}
    )
    infer, _, _ = http_api.parse_infer("net", "1", body.encode(), None)
    assert (infer.model, infer.version, infer.id) == ("net", "1", "r-1")


def test_binary_inputs_are_read_in_order_after_the_json_header() -> None:
    a_raw = le_bytes("INT32", [1, 2, 3, 4])
    s_raw = wire(b"one", b"\xfftwo")
    doc = {
        "inputs": [
            {
                "name": "a",
                "datatype": "INT32",
                "shape": [2, 2],
                "parameters": {"binary_data_size": len(a_raw)},
            },
            {"name": "j", "datatype": "UINT8", "shape": [2], "data": [5, 6]},
            {"name": "s", "datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": len(s_raw)}},
        ]
    }
    infer, _, _ = parse(doc, a_raw, s_raw)
    assert [(t.name, t.datatype, t.shape) for t in infer.inputs] == [
        ("a", "INT32", (2, 2)),
        ("j", "UINT8", (2,)),
        ("s", "BYTES", (2,)),
    ]
    assert bytes(infer.inputs[0].data) == a_raw  # type: ignore[arg-type]
    assert infer.inputs[1].data == b"\x05\x06"
    assert infer.inputs[2].data == [b"one", b"\xfftwo"]


def test_a_binary_input_of_0_bytes_is_read() -> None:
    doc = {
        "inputs": [{"name": "e", "datatype": "FP32", "shape": [1, 0], "parameters": {"binary_data_size": 0}}]
    }
    infer, _, _ = parse(doc, header=str(len(json.dumps(doc))))
    assert bytes(infer.inputs[0].data) == b""  # type: ignore[arg-type]


def test_binary_data_belonging_to_no_input_is_refused() -> None:
    doc = {
        "inputs": [{"name": "a", "datatype": "UINT8", "shape": [2], "parameters": {"binary_data_size": 2}}]
    }
    with refused(r"3 bytes of binary data belong to no input"):
        parse(doc, b"\x01\x02", b"xyz")
    json_doc = {"inputs": [{"name": "a", "datatype": "UINT8", "shape": [1], "data": [1]}]}
    with refused(r"4 bytes of binary data belong to no input"):
        parse(json_doc, b"junk")


@pytest.mark.parametrize("size", [5, -1, 2.0, "2", True])
def test_a_binary_data_size_past_the_data_or_not_an_int_is_refused(size: Any) -> None:
    doc = {
        "inputs": [{"name": "a", "datatype": "UINT8", "shape": [2], "parameters": {"binary_data_size": size}}]
    }
    with refused(rf"input 'a': binary_data_size {size!r} runs past the binary data"):
        parse(doc, b"\x01\x02")


def test_a_binary_input_without_the_header_length_is_refused() -> None:
    doc = {
        "inputs": [{"name": "a", "datatype": "UINT8", "shape": [2], "parameters": {"binary_data_size": 2}}]
    }
    with refused(r"input 'a': binary_data_size 2 runs past the binary data"):
        parse(doc)


@pytest.mark.parametrize("header", ["abc", "", "1.5", "0x10"])
def test_a_header_length_that_is_not_an_integer_is_refused(header: str) -> None:
    with refused(rf"Inference-Header-Content-Length must be an integer, got {header!r}"):
        http_api.parse_infer("m", "", b"{}", header)


@pytest.mark.parametrize("header", ["-1", " 1_0 ", "+2"])
def test_a_header_length_of_anything_but_digits_is_refused(header: str) -> None:
    with refused(re.escape(f"Inference-Header-Content-Length must be an integer, got {header!r}")):
        http_api.parse_infer("m", "", b"{}", header)


@pytest.mark.parametrize("header", ["3", "1000"])
def test_a_header_length_outside_the_body_is_refused(header: str) -> None:
    with refused(rf"Inference-Header-Content-Length {header} is outside the body of 2 bytes"):
        http_api.parse_infer("m", "", b"{}", header)


@pytest.mark.parametrize("body", [b"", b"{", b'{"inputs": [}', b"\xff\xfe", b"inputs"])
def test_a_body_that_is_not_json_is_refused(body: bytes) -> None:
    with refused(r"the request is not valid JSON: "):
        http_api.parse_infer("m", "", body, None)


def test_a_header_length_cutting_the_json_short_is_refused_as_not_json() -> None:
    body = json.dumps({"inputs": [{"name": "x", "datatype": "UINT8", "shape": [1], "data": [1]}]}).encode()
    with refused(r"the request is not valid JSON"):
        http_api.parse_infer("m", "", body, str(len(body) - 1))


@pytest.mark.parametrize("doc", [[], [{"inputs": []}], "inputs", 3, None])
def test_a_request_that_is_not_a_json_object_is_refused(doc: Any) -> None:
    with refused(r"the request must be a JSON object"):
        parse(doc)


def test_a_null_id_is_no_id() -> None:
    infer, _, _ = parse(
        {"id": None, "inputs": [{"name": "x", "datatype": "UINT8", "shape": [1], "data": [1]}]}
    )
    assert infer.id == ""


@pytest.mark.parametrize("request_id", [7, ["a"], {"a": 1}])
def test_an_id_that_is_not_a_string_is_refused(request_id: Any) -> None:
    doc = {"id": request_id, "inputs": [{"name": "x", "datatype": "UINT8", "shape": [1], "data": [1]}]}
    with refused(re.escape(f"id must be a string, got {request_id!r}")):
        parse(doc)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({}, r"'inputs' must be a non-empty list"),
        ({"inputs": []}, r"'inputs' must be a non-empty list"),
        ({"inputs": {"name": "x"}}, r"'inputs' must be a non-empty list"),
        ({"inputs": [{"datatype": "FP32"}]}, r"each input must be an object with a string 'name'"),
        ({"inputs": ["x"]}, r"each input must be an object with a string 'name'"),
        (
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}]},
            r"input 'x' has neither 'data' nor a binary_data_size parameter",
        ),
        (
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "parameters": [1]}]},
            r"input 'x' parameters must be a JSON object",
        ),
        (
            {"inputs": [{"name": "x", "datatype": "FP32", "data": [1]}]},
            r"input 'x': shape \[\] has no batch axis",
        ),
        ({"inputs": [{"name": "x", "shape": [1], "data": [1]}]}, r"input 'x': unknown datatype None"),
        (
            {"inputs": [{"name": "x", "datatype": "UINT8", "shape": [1], "data": [300]}]},
            r"input 'x': a value does not fit UINT8",
        ),
        (
            {"parameters": "fast", "inputs": [{"name": "x", "datatype": "UINT8", "shape": [1], "data": [1]}]},
            r"request parameters must be a JSON object",
        ),
        (
            {
                "outputs": {"name": "y"},
                "inputs": [{"name": "x", "datatype": "UINT8", "shape": [1], "data": [1]}],
            },
            r"'outputs' must be a list",
        ),
        (
            {
                "outputs": [{"nom": "y"}],
                "inputs": [{"name": "x", "datatype": "UINT8", "shape": [1], "data": [1]}],
            },
            r"each requested output must be an object with a string 'name'",
        ),
    ],
)
def test_a_malformed_request_is_refused_naming_the_fault(doc: Any, message: str) -> None:
    with refused(message):
        parse(doc)


def test_request_parameters_give_timeout_priority_and_binary_output() -> None:
    doc = {
        "parameters": {"timeout": 250_000, "priority": 2, "binary_data_output": True},
        "inputs": [{"name": "x", "datatype": "UINT8", "shape": [1], "data": [1]}],
    }
    infer, binary_default, _ = parse(doc)
    assert infer.timeout_ms == 250.0 and infer.priority == 0.5 and binary_default is True


@pytest.mark.parametrize("value", [False, 1, "true", None])
def test_binary_data_output_must_be_true_itself(value: Any) -> None:
    doc = {
        "parameters": {"binary_data_output": value},
        "inputs": [{"name": "x", "datatype": "UINT8", "shape": [1], "data": [1]}],
    }
    assert parse(doc)[1] is False


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"timeout": -5}, r"parameter 'timeout' must be a number of microseconds >= 0, got -5"),
        ({"priority": 1.5}, r"parameter 'priority' must be an integer >= 0, got 1.5"),
    ],
)
def test_bad_request_parameters_are_refused(params: dict[str, Any], message: str) -> None:
    doc = {"parameters": params, "inputs": [{"name": "x", "datatype": "UINT8", "shape": [1], "data": [1]}]}
    with refused(message):
        parse(doc)


def test_requested_outputs_keep_their_order_and_own_binary_choice() -> None:
    doc = {
        "inputs": [{"name": "x", "datatype": "UINT8", "shape": [1], "data": [1]}],
        "outputs": [
            {"name": "b", "parameters": {"binary_data": True}},
            {"name": "a"},
            {"name": "c", "parameters": {"binary_data": False}},
        ],
    }
    infer, binary_default, binary_outputs = parse(doc)
    assert infer.outputs == ["b", "a", "c"]
    assert binary_default is False
    assert binary_outputs == {"b": True, "c": False}
    infer, _, _ = parse({**doc, "outputs": []})
    assert infer.outputs is None


def test_json_data_nested_too_deeply_is_a_bad_request() -> None:
    deep = "[" * 5000 + "1" + "]" * 5000
    body = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":' + deep.encode() + b"}]}"
    with refused(r"nested too deeply"):
        http_api.parse_infer("m", "", body, None)
    with refused(r"input 'x': data holds 1 lists, but shape \[1\] has no axis left for them"):
        oip.json_input("x", "FP32", [1], _nested(3000))


def _nested(depth: int) -> list[Any]:
    value: list[Any] = [1.0]
    for _ in range(depth):
        value = [value]
    return value


def test_rows_and_bytes_cells_are_bounded() -> None:
    """A request of more rows than a gateway splits, or BYTES cells that would be
    millions of Python objects around an empty axis, is refused before any work."""
    with refused(rf"input 'x': {oip.MAX_ROWS + 1} rows; a request takes at most {oip.MAX_ROWS}"):
        oip.json_input("x", "FP32", [oip.MAX_ROWS + 1, 0], [])
    with refused(r"input 'x': BYTES shape \[1, 16777217, 0\] is over 16777216 cells"):
        oip.json_input("x", "BYTES", [1, 2**24 + 1, 0], [])
    assert oip.json_input("x", "FP32", [1, 2**24 + 1, 0], []).shape == (1, 2**24 + 1, 0)


# --- HTTP: infer_response ---------------------------------------------------------------------


def request(request_id: str = "") -> InferRequest:
    return InferRequest(model="net", inputs=[], id=request_id)


def split_body(response: Any) -> tuple[dict[str, Any], bytes]:
    """A binary response's JSON header and the bytes after it."""
    size = int(response.headers[http_api.HEADER_LENGTH])
    body = bytes(response.body)
    return json.loads(body[:size]), body[size:]


SCORES = OutputTensor("scores", "FP32", (2, 2), le_bytes("FP32", [0.5, 1.5, -2.0, 4.0]))
LABELS = OutputTensor("labels", "BYTES", (2,), [b"cat", "chien é".encode()])
FLAGS = OutputTensor("flags", "BOOL", (2,), le_bytes("BOOL", [True, False]))


def test_a_json_response_holds_every_output_as_data() -> None:
    response = http_api.infer_response(request(), [SCORES, LABELS, FLAGS], False, {})
    assert response.status == 200 and response.content_type == "application/json"
    assert http_api.HEADER_LENGTH not in response.headers
    assert json.loads(bytes(response.body)) == {  # type: ignore[arg-type]
        "model_name": "net",
        "model_version": "1",
        "outputs": [
            {"name": "scores", "datatype": "FP32", "shape": [2, 2], "data": [0.5, 1.5, -2.0, 4.0]},
            {"name": "labels", "datatype": "BYTES", "shape": [2], "data": ["cat", "chien é"]},
            {"name": "flags", "datatype": "BOOL", "shape": [2], "data": [True, False]},
        ],
    }


def test_the_id_is_echoed_only_when_given() -> None:
    with_id = json.loads(bytes(http_api.infer_response(request("r-9"), [FLAGS], False, {}).body))  # type: ignore[arg-type]
    without = json.loads(bytes(http_api.infer_response(request(), [FLAGS], False, {}).body))  # type: ignore[arg-type]
    assert with_id["id"] == "r-9"
    assert "id" not in without


def test_binary_outputs_follow_the_json_header_in_order() -> None:
    response = http_api.infer_response(request("r"), [SCORES, LABELS, FLAGS], True, {})
    assert response.status == 200 and response.content_type == "application/octet-stream"
    head, rest = split_body(response)
    sizes = [o["parameters"]["binary_data_size"] for o in head["outputs"]]
    assert sizes == [16, 4 + 3 + 4 + len("chien é".encode()), 2]
    assert all("data" not in o for o in head["outputs"])
    assert head["id"] == "r" and head["model_name"] == "net"
    assert rest == SCORES.data + wire(b"cat", "chien é".encode()) + FLAGS.data


def test_each_outputs_binary_choice_overrides_the_default() -> None:
    response = http_api.infer_response(request(), [SCORES, LABELS, FLAGS], True, {"labels": False})
    head, rest = split_body(response)
    assert head["outputs"][1] == {
        "name": "labels",
        "datatype": "BYTES",
        "shape": [2],
        "data": ["cat", "chien é"],
    }
    assert rest == SCORES.data + FLAGS.data

    response = http_api.infer_response(request(), [SCORES, LABELS, FLAGS], False, {"flags": True})
    head, rest = split_body(response)
    assert "data" in head["outputs"][0] and "data" in head["outputs"][1]
    assert head["outputs"][2]["parameters"] == {"binary_data_size": 2}
    assert rest == FLAGS.data


def test_bytes_that_are_not_utf8_go_as_binary_even_when_json_was_asked() -> None:
    blob = OutputTensor("blob", "BYTES", (2,), [b"\xff\xd8", b"ok"])
    response = http_api.infer_response(request(), [FLAGS, blob], False, {"blob": False})
    head, rest = split_body(response)
    assert head["outputs"][0]["data"] == [True, False]
    assert head["outputs"][1] == {
        "name": "blob",
        "datatype": "BYTES",
        "shape": [2],
        "parameters": {"binary_data_size": 12},
    }
    assert rest == wire(b"\xff\xd8", b"ok")


def test_a_full_request_through_rows_and_back() -> None:
    """An echo model over parse_infer, row_inputs, join_outputs and infer_response."""
    raw = le_bytes("FP16", [0.5, 1.0, 1.5, 2.0, 2.5, 3.0])
    doc = {
        "id": "e2e",
        "inputs": [
            {"name": "x", "datatype": "FP16", "shape": [3, 2], "parameters": {"binary_data_size": len(raw)}},
            {"name": "t", "datatype": "BYTES", "shape": [3], "data": ["a", "b", "c"]},
        ],
        "outputs": [{"name": "t"}, {"name": "x", "parameters": {"binary_data": True}}],
    }
    infer, binary_default, binary_outputs = parse(doc, raw)
    rows = oip.row_inputs(infer.inputs)
    outputs = oip.select_outputs(oip.join_outputs(rows, None), infer.outputs)
    response = http_api.infer_response(infer, outputs, binary_default, binary_outputs)
    head, rest = split_body(response)
    assert head == {
        "id": "e2e",
        "model_name": "m",
        "model_version": "1",
        "outputs": [
            {"name": "t", "datatype": "BYTES", "shape": [3], "data": ["a", "b", "c"]},
            {"name": "x", "datatype": "FP16", "shape": [3, 2], "parameters": {"binary_data_size": 12}},
        ],
    }
    assert rest == raw


# --- HTTP: errors -----------------------------------------------------------------------------


def test_an_overloaded_error_asks_the_client_to_retry() -> None:
    response = http_api.error_response("overloaded", "the queue of model 'm' is full")
    assert response.status == 503 and response.headers["Retry-After"] == "1"
    assert response.content_type == "application/json"
    assert json.loads(bytes(response.body)) == {"error": "the queue of model 'm' is full"}  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("code", "status"), [("bad_request", 400), ("unknown_model", 404), ("shutting_down", 503), ("x", 500)]
)
def test_other_errors_have_their_status_and_no_retry_after(code: str, status: int) -> None:
    response = http_api.error_response(code, "why")
    assert response.status == status and "Retry-After" not in response.headers
    assert json.loads(bytes(response.body)) == {"error": "why"}  # type: ignore[arg-type]


def test_oip_error_carries_its_code_and_message() -> None:
    err = oip.bad_request("input 'x': nope")
    assert isinstance(err, OipError) and err.code == "bad_request" and str(err) == "input 'x': nope"


# --- limits and odd values found by attacking the gateway ---------------------------------------


def test_bytes_elements_past_the_shape_are_refused_before_the_rest_is_read() -> None:
    """A BYTES input's elements are counted against its shape as they are read: a body
    of millions of elements for a shape of one is refused at the second."""
    raw = b"\x01\x00\x00\x00a" * 100_000
    with refused(r"input 'x': more than the 1 BYTES elements its shape holds"):
        oip.raw_input("x", "BYTES", [1, 1], raw)
    with refused(r"input 'x': more than the 2 BYTES elements"):
        oip.split_bytes_elements("x", raw, 2)


@pytest.mark.parametrize("datatype", [["FP32"], {"a": 1}, 3, None])
def test_a_datatype_that_is_no_string_is_a_bad_request(datatype: Any) -> None:
    with refused(r"input 'x': unknown datatype"):
        oip.json_input("x", datatype, [1], [1])


def test_a_model_giving_an_empty_map_is_a_model_error() -> None:
    with refused(r"the model gave no outputs", ErrorCode.MODEL_ERROR):
        oip.join_outputs([{}, {}], None)


@pytest.mark.parametrize("header", ["\u00b2", "\u0661\u0660\u0663", "\uff11\uff10"])
def test_a_header_length_in_other_digits_is_refused(header: str) -> None:
    with refused(r"Inference-Header-Content-Length must be an integer"):
        http_api.parse_infer("m", "", b"{}", header)


def test_json_over_its_limit_is_too_large_with_a_hint() -> None:
    body = b" " * (http_api.MAX_JSON_BYTES + 1)
    with refused(r"over 16777216: send large tensors as binary data", ErrorCode.TOO_LARGE):
        http_api.parse_infer("m", "", body, None)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_outputs_go_binary_even_when_json_was_asked(value: float) -> None:
    """JSON has no NaN or infinity: such an output goes as binary data, exactly."""
    raw = np.array([1.5, value], dtype="<f4").tobytes()
    out = OutputTensor("y", "FP32", (1, 2), raw)
    response = http_api.infer_response(InferRequest("m", []), [out], False, {})
    head_len = int(response.headers[http_api.HEADER_LENGTH])
    assert response.body is not None
    head = json.loads(bytes(response.body[:head_len]))
    assert head["outputs"][0]["parameters"] == {"binary_data_size": 8}
    assert bytes(response.body[head_len:]) == raw


def test_output_size_counts_bytes_and_length_prefixes() -> None:
    assert oip.output_size(OutputTensor("y", "FP32", (1, 2), b"\x00" * 8)) == 8
    assert oip.output_size(OutputTensor("y", "BYTES", (2,), [b"ab", b""])) == 4 + 2 + 4


def test_many_rows_are_joined_in_linear_time_and_a_failed_row_cancels_the_rest() -> None:
    """4096 rows' replies arriving in any order are returned in row order; the first
    error reply raises at once and cancels the rows still waiting."""
    import asyncio
    import random

    from batcher.gateway.core import _all_or_first_error

    async def run(rows: int, fail_at: int | None) -> tuple[Any, list[asyncio.Future[dict[str, Any]]]]:
        loop = asyncio.get_running_loop()
        futs: list[asyncio.Future[dict[str, Any]]] = [loop.create_future() for _ in range(rows)]
        order = list(range(rows))
        random.Random(3).shuffle(order)

        async def answer() -> None:
            for n, i in enumerate(order):
                if n == fail_at:
                    futs[i].set_result(
                        {"id": i, "ok": False, "error": {"code": "model_error", "message": "x"}}
                    )
                    return
                futs[i].set_result({"id": i, "ok": True, "output": i})
                if n % 64 == 0:
                    await asyncio.sleep(0)

        task = asyncio.ensure_future(answer())
        try:
            result: Any = await _all_or_first_error(futs)
        except OipError as exc:
            result = exc
        await task
        return result, futs

    replies, _ = asyncio.run(run(oip.MAX_ROWS, None))
    assert [r["output"] for r in replies] == list(range(oip.MAX_ROWS))
    error, futs = asyncio.run(run(1000, 500))
    assert isinstance(error, OipError) and error.code == "model_error"
    assert sum(f.cancelled() for f in futs) == 499
