"""The worker's fast paths for uniform tensor batches and plain batches (workers/fastpath.py): they decode
exactly what the general path decodes, leaves every other batch to it, and writes
replies byte for byte as `protocol.ok_reply` does; run_batch gives the same REPLY frames
with it as without it, whatever the batch holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

np = pytest.importorskip("numpy")

from batcher.wire import protocol, tensor  # noqa: E402
from batcher.wire.frames import split_bodies  # noqa: E402
from workers import fastpath, worker  # noqa: E402
from workers.fastpath import ReplyEncoder, Rows, decode_plain, decode_uniform, reply_meta  # noqa: E402
from workers.worker import _decode_requests, run_batch  # noqa: E402

WORKER = "host/gpu0/1234"


def body(req_id: Any, x: Any, **extra: Any) -> bytes:
    fields = {"id": req_id, "model": "m", "input": tensor.from_array(x) if tensor.is_array(x) else x, **extra}
    return protocol.pack(fields)


def rows(n: int, shape: tuple[int, ...] = (4,), dtype: Any = np.float32) -> list[Any]:
    rng = np.random.default_rng(n)
    return [np.asarray(rng.standard_normal(shape) * 10).astype(dtype) for _ in range(n)]


# --- decoding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int8, np.uint64, np.bool_])
@pytest.mark.parametrize("shape", [(4,), (2, 3), (), (0, 5)])
def test_a_uniform_batch_decodes_to_what_the_general_path_gives(dtype: Any, shape: tuple[int, ...]) -> None:
    xs = rows(5, shape, dtype)
    bodies = [body(i, x) for i, x in enumerate(xs)]
    bodies[3] = body("three", xs[3], timeout_ms=50, priority=2, cost=0.5, op="infer")
    fast = decode_uniform(bodies)
    assert fast is not None
    requests, inputs = fast
    general, bad = _decode_requests(bodies)
    assert bad == {}
    assert isinstance(inputs, Rows) and inputs.stacked.shape == (5, *shape)
    assert [r["id"] for r in requests] == [g["id"] for g in general] == [0, 1, 2, "three", 4]
    for r, g, x in zip(requests, general, xs, strict=True):
        assert r["input"] is not None and r["input"].dtype == g["input"].dtype == x.dtype
        assert r["input"].shape == g["input"].shape == x.shape
        assert np.array_equal(r["input"], g["input"]) and np.array_equal(r["input"], x)
        assert not r["input"].flags.writeable and not g["input"].flags.writeable  # both read-only
    assert all(a is b for a, b in zip(inputs, [r["input"] for r in requests], strict=True))


def odd_batches() -> dict[str, list[bytes]]:
    x = np.ones(4, np.float32)
    good = [body(i, x) for i in range(3)]
    bad_data = protocol.pack({"id": 9, "input": {"datatype": "FP32", "shape": [4], "data": b"\0" * 15}})
    unknown_type = protocol.pack({"id": 9, "input": {"datatype": "FP8", "shape": [4], "data": b"\0" * 16}})
    negative = protocol.pack({"id": 9, "input": {"datatype": "FP32", "shape": [-4], "data": b""}})
    return {
        "another shape": [*good, body(9, np.ones(5, np.float32))],
        "another dtype": [*good, body(9, np.ones(4, np.float64))],
        "a key it does not know": [*good, body(9, x, trace="abc")],
        "a bool id": [*good, body(True, x)],
        "a float id": [*good, body(1.5, x)],
        "an input that is no tensor": [*good, body(9, 42)],
        "named tensors": [*good, body(9, {"x": tensor.from_array(x)})],
        "data of the wrong size": [*good, bad_data],
        "an unknown datatype": [*good, unknown_type],
        "a negative axis": [*good, negative],
        "invalid msgpack": [*good, b"\xc1"],
        "invalid UTF-8": [*good, body(9, x).replace(b"\xa1m", b"\xa1\xff")],
        "trailing bytes": [*good, body(9, x) + b"\x00"],
        "not a map": [*good, protocol.pack([1, 2])],
        "a large body": [*good, body(9, np.ones(20_000, np.float32))],
    }


@pytest.mark.parametrize("name", list(odd_batches()))
def test_any_other_batch_is_left_to_the_general_path(name: str) -> None:
    assert decode_uniform(odd_batches()[name]) is None
    assert decode_uniform([]) is None


def test_the_invalid_utf8_case_really_is_invalid() -> None:
    with pytest.raises(UnicodeDecodeError):
        protocol.unpack(odd_batches()["invalid UTF-8"][-1])


def test_a_repeated_key_counts_once_the_last_time_as_msgpack_decodes_it() -> None:
    x, y = np.zeros(2, np.float32), np.ones(2, np.float32)
    one = protocol.pack({"id": 1, "input": tensor.from_array(x)})
    repeated = b"\x83" + protocol.pack("id") + protocol.pack(1) + protocol.pack("id") + protocol.pack(2)
    repeated += protocol.pack("input") + protocol.pack(tensor.from_array(y))
    fast = decode_uniform([one, repeated])
    assert fast is not None
    assert [r["id"] for r in fast[0]] == [1, msgpack.unpackb(repeated)["id"]] == [1, 2]
    assert np.array_equal(fast[1][1], y)


# --- replies -----------------------------------------------------------------------------------


@pytest.mark.parametrize("req_id", [0, 7, -3, 2**40, 2**64 - 1, "", "abc", "é" * 40, None])
@pytest.mark.parametrize("queue_ms", [None, 0, 0.5, 1234.567])
@pytest.mark.parametrize("wait_ms", [None, 0.0, 3.25])
def test_an_encoded_reply_is_byte_for_byte_ok_reply(req_id: Any, queue_ms: Any, wait_ms: Any) -> None:
    out = np.arange(10, dtype=np.float32)
    encoder = ReplyEncoder(32, WORKER, wait_ms, 5.125)
    expected = protocol.ok_reply(req_id, out, reply_meta(32, WORKER, queue_ms, wait_ms, 5.125))
    assert encoder.encode(req_id, out, queue_ms) == expected


@pytest.mark.parametrize(
    "out",
    [
        np.arange(10, dtype=np.float32),
        np.array(2.5),  # 0-d
        np.zeros((0, 3), np.int64),
        np.array([True, False]),
        np.arange(63, dtype=np.uint8),  # bin 8: 63 bytes
        np.arange(64, dtype=np.float32),  # bin 8 at its top: 256 bytes is bin 16
        np.arange(16383, dtype=np.float32),  # bin 16 at its top
        np.arange(16384, dtype=np.float32),  # bin 32
        np.ones((3, 4, 5), np.float16),
        np.arange(12, dtype=np.int32).reshape(3, 4)[1],  # a row: a view, C-ordered
    ],
)
def test_every_datatype_and_size_is_written_as_ok_reply_writes_it(out: Any) -> None:
    encoder = ReplyEncoder(3, WORKER, None, 1.0)
    expected = protocol.ok_reply(5, out, reply_meta(3, WORKER, 0.25, None, 1.0))
    assert encoder.encode(5, out, 0.25) == expected
    assert encoder.encode(5, out, 0.25) == expected  # the tensor header, cached


@pytest.mark.parametrize("req_id", [0, 2**64 - 1, "abc", None])
@pytest.mark.parametrize("queue_ms", [None, 0.5])
@pytest.mark.parametrize("wait_ms", [None, 3.25])
@pytest.mark.parametrize("size", [0, 16, 31, 255, 256, 65535, 65536])  # bin 8, 16 and 32
def test_a_bytes_reply_is_byte_for_byte_ok_reply(req_id: Any, queue_ms: Any, wait_ms: Any, size: int) -> None:
    out = bytes(range(256)) * (size // 256) + bytes(size % 256)
    encoder = ReplyEncoder(27, WORKER, wait_ms, 0.004)
    expected = protocol.ok_reply(req_id, out, reply_meta(27, WORKER, queue_ms, wait_ms, 0.004))
    assert encoder.encode(req_id, out, queue_ms) == expected
    assert encoder.encode(req_id, out, queue_ms) == expected  # the batch's parts, kept


@pytest.mark.parametrize("out", [np.arange(6, dtype=np.float32), b"abc"])
def test_a_repository_version_is_in_the_encoded_reply_as_ok_reply_writes_it(out: Any) -> None:
    encoder = ReplyEncoder(4, WORKER, 1.5, 2.0, version="2")
    expected = protocol.ok_reply(9, out, reply_meta(4, WORKER, 0.5, 1.5, 2.0, version="2"))
    assert encoder.encode(9, out, 0.5) == expected
    assert protocol.unpack(expected)["version"] == "2"
    assert "version" not in protocol.unpack(ReplyEncoder(4, WORKER, 1.5, 2.0).encode(9, out, 0.5) or b"")


def test_run_batch_names_the_version_on_the_fast_and_the_general_path() -> None:
    bodies = [protocol.pack({"id": 1, "input": np.ones(2, np.float32)})]
    bodies.append(protocol.pack({"id": 2, "input": [1]}))  # not a tensor: the general path
    header, body_frames = frames_of(bodies)

    def replies(version: str | None) -> list[Any]:
        frames = run_batch(lambda xs: xs, header, body_frames, WORKER, version=version)
        return [protocol.unpack(bytes(b)) for b in split_bodies(protocol.unpack(frames[2])[2], frames[3:])]

    assert [(r["ok"], r["version"]) for r in replies("3")] == [(True, "3"), (True, "3")]
    assert ["version" in r for r in replies(None)] == [False, False]


def test_a_bytes_reply_with_an_id_msgpack_cannot_hold_is_left_to_ok_reply() -> None:
    assert ReplyEncoder(1, WORKER, None, 1.0).encode(2**64, b"x", 0.0) is None


@pytest.mark.parametrize(
    "out",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4)[:, 1],  # not C-ordered
        np.arange(4, dtype=">f4"),  # big-endian: ok_reply converts it
        np.arange(4, dtype=np.complex64),  # no datatype: ok_reply says so
        np.float32(1.5),  # a numpy scalar goes as a plain number
        [1, 2],
        "text",
        {"y": np.ones(2, np.float32)},
    ],
)
def test_anything_but_a_plain_array_is_left_to_ok_reply(out: Any) -> None:
    assert ReplyEncoder(1, WORKER, None, 1.0).encode(1, out, 0.0) is None


# --- run_batch with and without it ---------------------------------------------------------------


def frames_of(bodies: list[bytes]) -> tuple[bytes, list[Any]]:
    frames = protocol.batch_frames(3, [0.5 * i for i in range(len(bodies))], bodies)
    return frames[2], frames[3:]


def both_ways(
    monkeypatch: pytest.MonkeyPatch, model: Any, bodies: list[bytes]
) -> tuple[list[Any], list[Any]]:
    """run_batch's REPLY frames with the fast path, then without it (time frozen, so
    infer_ms and worker_wait_ms are equal)."""
    monkeypatch.setattr(worker.time, "perf_counter", lambda: 100.0)
    monkeypatch.setattr(worker.time, "monotonic", lambda: 50.0)
    header, body_frames = frames_of(bodies)
    fast = run_batch(model, header, body_frames, WORKER, arrived_at=49.99)
    with monkeypatch.context() as m:
        m.setattr(fastpath, "decode_uniform", lambda bodies: None)
        m.setattr(fastpath, "decode_plain", lambda lengths, frames: None)
        m.setattr(ReplyEncoder, "encode", lambda self, req_id, output, queue_ms: None)
        m.setattr(ReplyEncoder, "encode_plain", lambda self, requests, outputs, queue_ms: None)
        slow = run_batch(model, header, body_frames, WORKER, arrived_at=49.99)
    return fast, slow


def negate(inputs: list[Any]) -> list[Any]:
    return [-x if tensor.is_array(x) else ValueError("no tensor") for x in inputs]


@pytest.mark.parametrize("name", ["uniform", *odd_batches()])
def test_run_batch_replies_the_same_bytes_either_way(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    bodies = [body(i, x) for i, x in enumerate(rows(6))] if name == "uniform" else odd_batches()[name]
    fast, slow = both_ways(monkeypatch, negate, bodies)
    assert fast == slow
    assert len(protocol.unpack(fast[2])[2]) == len(bodies)  # every request answered, once


def test_run_batch_replies_bytes_outputs_the_same_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    bodies = [msgpack.packb({"id": i, "input": b"x" * (i * 100)}) for i in range(5)]
    bodies.append(msgpack.packb({"id": 5, "input": b"y", "stream": True}))  # its reply says "more"
    bodies.append(msgpack.packb({"id": 6, "input": "text"}))
    fast, slow = both_ways(monkeypatch, list, bodies)
    assert fast == slow
    assert len(protocol.unpack(fast[2])[2]) == len(bodies)


def test_a_model_that_fails_one_row_of_a_uniform_batch_fails_only_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def picky(inputs: list[Any]) -> list[Any]:
        return [ValueError("odd") if i == 2 else x * 2 for i, x in enumerate(inputs)]

    bodies = [body(i, x) for i, x in enumerate(rows(4))]
    fast, slow = both_ways(monkeypatch, picky, bodies)
    assert fast == slow
    _, _, lengths, errors, *_ = protocol.unpack(fast[2])
    replies = [protocol.unpack(r) for r in protocol.split_bodies(lengths, fast[3:])]
    assert [r["ok"] for r in replies] == [True, True, False, True] and errors == 1


@pytest.mark.parametrize("shape", [(), (1,), (2, 3)])
def test_tensors_of_any_rank_come_back_as_tensors_of_that_rank(
    monkeypatch: pytest.MonkeyPatch, shape: Any
) -> None:
    """An echo of 0-d tensors gives 0-d tensors back, not plain numbers (a row of a
    stacked 1-d array is a numpy scalar when iterated; the model must get a 0-d array)."""
    xs = rows(3, shape)
    fast, slow = both_ways(monkeypatch, lambda inputs: list(inputs), [body(i, x) for i, x in enumerate(xs)])
    assert fast == slow
    _, _, lengths, *_ = protocol.unpack(fast[2])
    outputs = [protocol.unpack(r)["output"] for r in protocol.split_bodies(lengths, fast[3:])]
    assert all(tensor.is_tensor(o) and o["shape"] == list(shape) for o in outputs)


def test_a_plain_model_gets_a_list_of_the_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []

    def keep(inputs: list[Any]) -> list[Any]:
        seen.append(inputs)
        return [float(x.sum()) for x in inputs]

    xs = rows(3)
    fast, slow = both_ways(monkeypatch, keep, [body(i, x) for i, x in enumerate(xs)])
    assert fast == slow
    assert isinstance(seen[0], list) and all(np.array_equal(a, x) for a, x in zip(seen[0], xs, strict=True))


# --- the ONNX model on stacked rows ----------------------------------------------------------------

onnx = pytest.importorskip("onnx", reason="the onnx package builds the test models")
pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install 'batcher[onnx]')")
from tests import onnx_models  # noqa: E402
from workers.models import ModelSpec, load_model  # noqa: E402


def test_an_onnx_model_runs_the_stacked_rows_as_they_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_model(ModelSpec.parse(f"onnx:{onnx_models.linear(tmp_path / 'l.onnx')}"), None, threads=1)
    xs = rows(5)
    stacked = np.stack(xs)
    fed: list[Any] = []
    run = model.session.run
    monkeypatch.setattr(model.session, "run", lambda names, feed: fed.append(feed["x"]) or run(names, feed))
    given = Rows(stacked)
    out = model(given)
    assert fed[0] is stacked  # not stacked again
    assert all(np.array_equal(o, p) for o, p in zip(out, model(list(xs)), strict=True))
    fast, slow = both_ways(monkeypatch, model, [body(i, x) for i, x in enumerate(xs)])
    assert fast == slow


def test_a_stacked_batch_the_model_refuses_fails_request_by_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_model(ModelSpec.parse(f"onnx:{onnx_models.linear(tmp_path / 'l.onnx')}"), None, threads=1)
    bodies = [body(i, x) for i, x in enumerate(rows(3, (5,)))]  # the model takes 4 columns
    fast, slow = both_ways(monkeypatch, model, bodies)
    assert fast == slow
    _, _, lengths, errors, *_ = protocol.unpack(fast[2])
    replies = [protocol.unpack(r) for r in protocol.split_bodies(lengths, fast[3:])]
    assert errors == 3 and all(r["error"]["code"] == "model_error" for r in replies)


def test_rows_changed_after_the_decode_are_not_taken_for_the_stacked_array() -> None:
    given = Rows(np.zeros((3, 2), np.float32))
    assert fastpath.stacked_of(given) is given.stacked
    given.append(np.ones(2, np.float32))
    assert fastpath.stacked_of(given) is None
    assert fastpath.stacked_of([np.ones(2)]) is None


def test_the_load_process_sends_what_pack_carrying_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    # benchmarks/onnx_served.py encodes its tensor once; each body must still be the usual one.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3] / "benchmarks"))
    import onnx_served

    x = np.arange(1024, dtype=np.float32)
    rest = onnx_served.RestOfBody(x)
    for req_id in [1, 127, 128, 255, 256, 65535, 65536, 2**32, 2**63]:
        expected = protocol.pack_carrying({"id": req_id, "model": "mlp", "input": x}, x)
        assert onnx_served.request_body(req_id, rest) == expected


def test_a_batch_without_tensors_does_not_import_numpy() -> None:
    # Importing numpy takes a tenth of a second and more: a sim worker's first batch must not pay it.
    import subprocess
    import sys

    code = (
        "import sys; from batcher.wire import protocol; from workers import fastpath, worker; "
        "bodies = [protocol.pack({'id': i, 'input': {'text': 'x'}}) for i in range(3)]; "
        "frames = protocol.batch_frames(1, [0.0] * 3, bodies); "
        "worker.run_batch(lambda xs: xs, frames[2], frames[3:], 'w'); print('numpy' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr


@pytest.mark.parametrize(
    "change",
    [
        lambda rows: rows.__setitem__(0, rows[0] * 2),
        lambda rows: rows.reverse(),
        lambda rows: rows.sort(key=lambda r: float(r.sum())),
        lambda rows: rows.append(rows[0]),
        lambda rows: rows.pop(),
    ],
)
def test_a_changed_list_of_rows_is_no_longer_taken_for_its_stacked_array(change: Any) -> None:
    """A model that preprocesses its inputs in place is run on what it made of them."""
    rows = Rows(np.arange(12, dtype=np.float32).reshape(3, 4))
    assert fastpath.stacked_of(rows) is rows.stacked
    change(rows)
    assert fastpath.stacked_of(rows) is None


def test_a_batch_without_tensors_is_not_decoded_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    # A body that holds no tensor is left to the general path before any decode is tried:
    # a failed msgspec decode (an exception) cost 0.8 us a batch on a lone request's path.
    def refuse(body: Any) -> Any:
        raise AssertionError("decode_uniform decoded a body that holds no tensor")

    monkeypatch.setattr(fastpath, "_read_request", refuse)
    bodies = [msgpack.packb({"id": i, "input": [1, 2, 3]}) for i in range(4)]
    assert decode_uniform(bodies) is None


def test_other_outputs_never_encode_the_array_reply_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    # The parts an array or bytes reply shares with its batch are encoded at the first such
    # output only: a batch of lists, str or None never pays for them (1.6 us a batch).
    calls: list[Any] = []
    real = fastpath._encode
    monkeypatch.setattr(fastpath, "_encode", lambda value: calls.append(value) or real(value))
    encoder = ReplyEncoder(4, WORKER, 0.25, 1.5)
    others = [[1, 2], "text", None, bytearray(b"ab"), memoryview(b"ab")]
    assert [encoder.encode(i, out, 0.5) for i, out in enumerate(others)] == [None] * len(others)
    assert calls == []
    np = pytest.importorskip("numpy")
    out = np.arange(3, dtype=np.float32)
    meta = reply_meta(4, WORKER, 0.5, 0.25, 1.5)
    assert encoder.encode(7, out, 0.5) == protocol.ok_reply(7, out, meta)


_PLAIN = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)  # fmt: skip


@given(st.lists(st.dictionaries(st.text(max_size=6), _PLAIN, max_size=4), min_size=1, max_size=8))
def test_a_plain_batch_decodes_in_one_pass_to_what_the_general_path_gives(maps: list[dict[str, Any]]) -> None:
    # (no NaN in the maps: NaN != NaN, so two equal decodes would not compare equal)
    bodies = [msgpack.packb(m) for m in maps]
    frames = protocol.batch_frames(1, [0.0] * len(bodies), bodies)
    plain = decode_plain([len(b) for b in bodies], frames[3:])
    if any(b"datatype" in b for b in bodies):
        assert plain is None  # a tensor, perhaps: the tensor paths decide
        return
    requests, bad = _decode_requests(protocol.split_bodies([len(b) for b in bodies], frames[3:]))
    assert bad == {}
    assert plain == requests


@pytest.mark.parametrize(
    ("name", "lengths", "blob"),
    [
        ("a body that is no map", [1, 1], b"\x01\x80"),
        ("lengths that cut a map in two", [1, 3], msgpack.packb({"a": 1}) + b"\x80"),
        ("a truncated body", [3, 1], msgpack.packb({"a": 1})[:3] + b"\x80"),
        ("lengths that miss the frame's end", [4, 1], msgpack.packb({"a": 1}) + b"\x80\x80"),
        ("not msgpack", [1, 1], b"\xc1\xc1"),
        # read on as one stream these are two maps, {1: 2} and {}, but cut where the lengths
        # say, the first is truncated and the second is 2 then {}: no body is one map alone
        ("maps that straddle the lengths", [2, 2], b"\x81\x01\x02\x80"),
        ("a lone body that is no map", [1], b"\x01"),
        ("a lone body with a second value after it", [2], b"\x80\x80"),
        ("a lone body that is not msgpack", [1], b"\xc1"),
    ],
)
def test_a_batch_one_pass_cannot_read_exactly_is_left_to_the_general_path(
    name: str, lengths: list[int], blob: bytes
) -> None:
    assert decode_plain(lengths, [blob]) is None, name


def test_a_batch_of_one_frame_each_is_left_to_the_other_paths_and_a_lone_body_is_decoded() -> None:
    one = msgpack.packb({"id": 1, "input": 1})
    assert decode_plain([len(one), len(one)], [one, one]) is None
    assert decode_plain([len(one)], [one]) == [{"id": 1, "input": 1}]
