"""Aligned tensors (batcher/wire/aligned.py, docs/protocol.md 3.1 "Alignment"): every tensor
batcher writes (worker replies, client requests) has its data at a multiple of 8 bytes
from the body's first byte, whatever precedes it, and decodes to exactly the map of
three keys it was; a real worker's replies, as a client receives them, are aligned
(issue 28 item 22)."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from batcher.wire import aligned, protocol, tensor
from workers import fastpath

DTYPES = ["|b1", "|u1", "<u2", "<i4", "<i8", "<f2", "<f4", "<f8"]


def _array(dtype: str, shape: tuple[int, ...], seed: int) -> Any:
    """Random contents (BOOL: 0 and 1), so that the data's bytes are found where they sit."""
    rng = np.random.default_rng(seed)
    if dtype == "|b1":
        return rng.integers(0, 2, shape).astype(bool)
    return (
        rng.integers(0, 255, int(np.prod(shape)), dtype=np.uint8)
        .view(np.uint8)
        .astype(np.dtype(dtype))
        .reshape(shape)
    )


arrays = st.builds(
    _array,
    st.sampled_from(DTYPES),
    st.lists(st.integers(16, 40), min_size=1, max_size=2).map(tuple),
    st.integers(0, 2**32),
)
ids = st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=300))
payloads = st.recursive(
    arrays
    | st.integers(-(2**63), 2**64 - 1)
    | st.text(max_size=40)
    | st.binary(max_size=20)
    | st.floats(allow_nan=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=8,
)


def _arrays_in(value: Any) -> list[Any]:
    if tensor.is_array(value):
        return [value]
    if isinstance(value, dict):
        return [a for v in value.values() for a in _arrays_in(v)]
    if isinstance(value, list):
        return [a for v in value for a in _arrays_in(v)]
    return []


def _as_plain(value: Any) -> Any:
    """A decoded value with each tensor as (datatype, shape, its bytes)."""
    if tensor.is_tensor(value):
        return (value["datatype"], list(value["shape"]), bytes(value["data"]))
    if isinstance(value, dict):
        return {k: _as_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_plain(v) for v in value]
    return value


def assert_aligned(body: bytes, arrays_in_it: list[Any]) -> None:
    """Each array's bytes, searched from where the one before it ended (they are written
    in this order), start at a multiple of ALIGN_BYTES."""
    end = 0
    for a in arrays_in_it:
        at = body.find(a.tobytes(), end)
        assert at >= 0 and at % tensor.ALIGN_BYTES == 0, (at, a.dtype, a.shape)
        end = at + a.nbytes


@given(ids, payloads)
def test_every_tensor_written_starts_at_a_multiple_of_8_and_decodes_to_what_it_held(
    req_id: Any, payload: Any
) -> None:
    body = protocol.pack_carrying({"id": req_id, "ok": True, "output": payload, "batch_size": 3}, payload)
    assert_aligned(body, _arrays_in(payload))
    plain = protocol.pack({"id": req_id, "ok": True, "output": payload, "batch_size": 3})  # unaligned
    decode = lambda b: msgpack.unpackb(b, raw=False, strict_map_key=False)  # noqa: E731
    assert _as_plain(decode(body)) == _as_plain(decode(plain))
    assert decode(body) == decode(plain)  # the very same maps, keys and all


@given(ids, arrays, st.floats(0, 1e6), st.integers(1, 4096))
def test_the_batch_reply_encoder_writes_what_ok_reply_writes(
    req_id: Any, array: Any, queue_ms: float, n: int
) -> None:
    encoder = fastpath.ReplyEncoder(n, "host/gpu0/42", 0.5, 3.25)
    fast = encoder.encode(req_id, array, queue_ms)
    assert fast == protocol.ok_reply(
        req_id, array, fastpath.reply_meta(n, "host/gpu0/42", queue_ms, 0.5, 3.25)
    )
    assert fast is not None
    assert_aligned(fast, [array])


def test_only_the_keys_headers_widen_and_the_map_decodes_to_exactly_the_three_keys() -> None:
    x = np.arange(4, dtype=np.float64)
    shifts = set()
    for req_id in ["i" * k for k in range(24)]:
        body = protocol.pack_carrying({"id": req_id, "input": x}, x)
        plain = msgpack.packb(
            {"id": req_id, "input": {"datatype": "FP64", "shape": [4], "data": x.tobytes()}}
        )
        # what any decoder reads is the same map as the shortest encoding's, keys in that order
        assert msgpack.unpackb(body) == msgpack.unpackb(plain)
        assert list(msgpack.unpackb(body)["input"]) == ["datatype", "shape", "data"]
        assert body.find(x.tobytes()) % 8 == 0
        shifts.add(len(body) - len(plain))
    assert shifts == set(range(tensor.ALIGN_BYTES))  # every shift, 0 to 7 bytes, was needed
    for offset in range(64):
        for size in (0, 32, 300, 70_000):
            head = aligned.tensor_head(offset, "UINT8", (size,), size)
            assert (offset + len(head)) % tensor.ALIGN_BYTES == 0


def test_a_widened_tensor_is_read_by_every_reader_batcher_has() -> None:
    """msgspec (the broker's signature check, the worker's fast path and large-body views)
    and msgpack read the widened keys as the keys they are."""
    from batcher.wire.signature import Signature, TensorSpec

    sig = Signature((TensorSpec("x", "FP32", (-1, 3)),), (TensorSpec("y", "FP32", (-1, 3)),))
    for req_id in range(8):
        x = np.arange(3, dtype=np.float32)
        body = protocol.pack_carrying({"id": "i" * req_id, "input": x}, x)
        assert sig.misfit(body) is None
        decoded = fastpath.decode_uniform([body])
        assert decoded is not None and decoded[0][0]["input"].tolist() == [0, 1, 2]
        big = np.arange(20_000, dtype=np.float32)
        large = protocol.pack_carrying({"id": req_id, "input": big}, big)
        viewed = tensor.unpack_viewing(large, "input", tensor.arrays_hook)
        assert np.array_equal(viewed["input"], big)


def test_an_invalid_tensor_map_from_a_model_is_written_as_it_is() -> None:
    odd = {"datatype": "BF16", "shape": [3], "data": b"\0" * 6}
    assert msgpack.unpackb(protocol.ok_reply(1, odd))["output"] == odd


# --- a real worker -------------------------------------------------------------------------------


flat_payloads = st.one_of(
    arrays,
    st.lists(arrays | st.binary(max_size=30), max_size=4),
    st.dictionaries(st.text(max_size=8), arrays | st.binary(max_size=30), max_size=4),
)


@given(ids, flat_payloads)
@example(1, [np.arange(3, dtype=np.int32), aligned._MARK + b"\x00"])
def test_the_c_speed_path_for_plain_payloads_writes_what_the_general_writer_writes(
    req_id: Any, payload: Any
) -> None:
    fields = {"id": req_id, "ok": True, "output": payload, "worker": "h/gpu-/1", "infer_ms": 0.25}
    fast = aligned.pack_plain(fields, payload)
    expected = aligned.pack(fields)
    if fast is None:
        # the one case it hands back to the general writer: the mark's bytes stand in the
        # data itself (Hypothesis draws them from the source's constants now and then)
        assert aligned._MARK in expected
    else:
        assert fast == expected


@given(name=st.text(max_size=31).filter(lambda s: len(s.encode()) < 32))
@example(name="datatype")
@example(name="")
def test_each_encoding_of_a_key_decodes_to_it_and_adds_the_bytes_it_names(name: str) -> None:
    """The widened keys: fixstr, str 8, str 16 and str 32 of the same name. (The module
    builds its keys at import, which a mutation run cannot reach: this checks the builder.)"""
    for extra in (0, 1, 2, 4):
        key = aligned._key(name, extra)
        assert msgpack.unpackb(key, raw=False) == name
        assert len(key) == len(name.encode()) + 1 + extra


@pytest.mark.parametrize("n", [15, 16, 65535, 65536])
def test_maps_and_lists_of_every_header_size_around_a_tensor_decode_to_what_they_held(n: int) -> None:
    """A map or list that holds a tensor is written entry by entry, with a header of its
    own (fixmap/fixarray, 16-bit, 32-bit count): every size decodes to the same value."""
    x = np.arange(3, dtype=np.float64)
    mapping: dict[str, Any] = {"t": x, **{f"k{i}": i for i in range(n - 1)}}
    listing: list[Any] = [x, *range(n - 1)]
    for value in (mapping, listing):
        body = aligned.pack(value)
        assert _as_plain(msgpack.unpackb(body, raw=False)) == _as_plain(
            msgpack.unpackb(msgpack.packb(value, default=tensor.msgpack_default), raw=False)
        )
        assert_aligned(body, [x])


@pytest.mark.parametrize("size", [0, 255, 256, 65535, 65536])
def test_tensor_data_of_every_bin_header_size_decodes_whole_and_aligned(size: int) -> None:
    """...with the data's bin header the shortest, and only the bytes that align it (0 to 7)
    added to the shortest encoding, wherever the tensor starts."""
    x = (np.arange(size) % 251).astype(np.uint8)
    body = aligned.pack({"id": 1, "output": x})
    got = msgpack.unpackb(body, raw=False)["output"]
    assert (got["datatype"], got["shape"], bytes(got["data"])) == ("UINT8", [size], x.tobytes())
    assert_aligned(body, [x])
    for req_id in ["i" * k for k in range(8)]:
        body = aligned.pack({"id": req_id, "output": x})
        shortest = msgpack.packb(
            {"id": req_id, "output": {"datatype": "UINT8", "shape": [size], "data": x.tobytes()}}
        )
        data_at = len(shortest) - size  # the data ends the body
        assert len(body) - len(shortest) == -data_at % tensor.ALIGN_BYTES


def test_a_tuple_of_arrays_from_a_model_is_written_aligned_as_a_list() -> None:
    """Models often return a tuple: it is a list on the wire, its tensors aligned too."""
    a, b = np.arange(5, dtype=np.float32), np.arange(7, dtype=np.int64)
    for output in ((a, b), (b"x", a, (b, 3))):
        body = protocol.ok_reply(1, output, {"batch_size": 1})
        assert_aligned(body, [a, b])
        expected = msgpack.packb(output, default=tensor.msgpack_default)
        assert _as_plain(msgpack.unpackb(body)["output"]) == _as_plain(msgpack.unpackb(expected))


def test_a_valid_tensor_map_is_aligned_like_an_array_and_a_numpy_scalar_beside_it_is_a_number() -> None:
    """A client (or a model) may give a tensor as its map, datatype, shape and data: it is
    aligned as an array is. A numpy scalar in the same body goes as the number it holds."""
    data = np.arange(6, dtype=np.float64)
    for extra in ("", "i" * 5):
        request = {
            "id": extra,
            "score": np.float32(0.5),
            "input": {"datatype": "FP64", "shape": [2, 3], "data": data.tobytes()},
        }
        body = aligned.pack(request)
        assert_aligned(body, [data])
        got = msgpack.unpackb(body)
        assert got["score"] == 0.5
        assert (got["input"]["datatype"], got["input"]["shape"]) == ("FP64", [2, 3])
        assert got["input"]["data"] == data.tobytes()


@pytest.mark.parametrize("n", [1, 15, 16, 300])
def test_the_c_speed_path_writes_flat_lists_and_maps_of_any_length_as_the_general_writer(n: int) -> None:
    """However many arrays a flat payload holds (more than 255 too), every one is aligned,
    and the bytes are the general writer's (whose list and map headers widen at 16)."""
    arrays = [np.full(3, i, dtype=np.int16) for i in range(n)]
    for payload in (arrays, {f"y{i}": a for i, a in enumerate(arrays)}):
        fields = {"id": 7, "ok": True, "output": payload}
        fast = aligned.pack_plain(fields, payload)
        assert fast is not None
        assert fast == aligned.pack(fields)
        assert_aligned(fast, arrays)
        assert len(tensor.unpack_arrays(fast)["output"]) == n


def test_the_c_speed_path_refuses_a_payload_that_is_no_field_of_the_body() -> None:
    x = np.arange(3, dtype=np.float32)
    assert aligned.pack_plain({"id": 1, "output": np.arange(3, dtype=np.float32)}, x) is None
    assert aligned.pack_plain({"id": 1}, x) is None
