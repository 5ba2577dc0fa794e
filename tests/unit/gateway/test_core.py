"""The gateway's row bodies (batcher.gateway.core.pack_request): the fast path for rows
of tensors writes the very bytes protocol.pack_carrying writes (every tensor aligned),
and whatever it does not take goes to pack_carrying itself."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from batcher.gateway.core import pack_request
from batcher.wire import protocol, tensor

DATATYPES = sorted(tensor.ITEM_BYTES)


@st.composite
def tensors(draw: Any, valid: bool = True) -> dict[str, Any]:
    datatype = draw(st.sampled_from(DATATYPES))
    shape = draw(st.lists(st.integers(0, 5), max_size=3))
    size = math.prod(shape) * tensor.ITEM_BYTES[datatype]
    if not valid:
        size += draw(st.sampled_from([-1, 1])) if size else 1
    data = b"\x01" * max(size, 0)  # valid for every datatype, BOOL included
    as_view = draw(st.booleans())
    return {"datatype": datatype, "shape": shape, "data": memoryview(data) if as_view else data}


@st.composite
def messages(draw: Any) -> dict[str, Any]:
    message: dict[str, Any] = {
        "id": draw(st.integers(1, 2**40)),
        "model": draw(st.text(max_size=40)),
        "timeout_ms": draw(st.floats(0.001, 1e9)),
    }
    if draw(st.booleans()):
        message["priority"] = draw(st.floats(0.0, 1.0))
    one = tensors(valid=draw(st.integers(0, 9)) > 0)
    if draw(st.booleans()):
        message["input"] = draw(one)
    else:
        message["input"] = draw(st.dictionaries(st.text(max_size=20), one, min_size=1, max_size=17))
    return message


@given(messages())
def test_rows_are_written_as_pack_carrying_writes_them(message: dict[str, Any]) -> None:
    assert pack_request(message) == protocol.pack_carrying(message, message["input"])


def test_other_rows_go_to_pack_carrying() -> None:
    """BYTES rows (lists), a control op, and a map whose input is not its last key."""
    for message in (
        {"id": 1, "model": "m", "timeout_ms": 5.0, "input": [b"a", b"bc"]},
        {"id": 2, "op": "stats"},
        {"id": 3, "input": {"datatype": "FP32", "shape": [1], "data": b"\0" * 4}, "model": "m"},
    ):
        assert pack_request(message) == protocol.pack_carrying(message, message.get("input"))


def test_rows_of_tensors_take_the_fast_path(monkeypatch: Any) -> None:
    """A row of one tensor, and of named tensors, never reaches pack_carrying."""
    rows = (
        {"datatype": "FP32", "shape": [4], "data": b"\0" * 16},
        {
            "a": {"datatype": "INT8", "shape": [3], "data": b"abc"},
            "b": {"datatype": "FP64", "shape": [], "data": b"\0" * 8},
        },
    )
    expected = [protocol.pack_carrying({"id": 7, "model": "m", "input": row}, row) for row in rows]

    def refuse(*_: Any) -> bytes:
        raise AssertionError("pack_carrying was called")

    monkeypatch.setattr(protocol, "pack_carrying", refuse)
    assert [pack_request({"id": 7, "model": "m", "input": row}) for row in rows] == expected


def test_the_grpc_address_brackets_an_ipv6_host() -> None:
    from batcher.gateway.server import grpc_address

    assert grpc_address("127.0.0.1", 8001) == "127.0.0.1:8001"
    assert grpc_address("localhost", 8001) == "localhost:8001"
    assert grpc_address("::1", 8001) == "[::1]:8001"
    assert grpc_address("::", 0) == "[::]:0"
    assert grpc_address("[::1]", 8001) == "[::1]:8001"  # already bracketed
