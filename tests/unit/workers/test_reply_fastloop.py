"""The one-pass reply loop of a plain batch (fastpath.ReplyEncoder.encode_plain, the
common case: bytes outputs, float queue_ms, no stream) writes exactly the REPLY the
per-request path writes, for any batch: whatever its ids, outputs, stream flags and
queue_ms, a batch the loop does not take is answered by the per-request path, so the
frames are the same either way and every request gets exactly one reply."""

from __future__ import annotations

import math
import random
import struct
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batcher.wire import protocol, tensor
from workers import batch_runner
from workers.fastpath import ReplyEncoder, round_ms

WORKER = "host/gpu0/1234"

#: The ids a client may send (the broker forwards only int and str; the rest are answered nil).
_IDS = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.text(max_size=6),
    st.booleans(),
    st.floats(allow_nan=False),
    st.none(),
    st.just([1]),
    st.just("missing"),
)
_OUTPUTS = st.one_of(
    st.binary(max_size=40),
    st.binary(min_size=300, max_size=400),  # bin 16
    st.text(max_size=5),
    st.lists(st.integers(0, 9), max_size=3),
    st.just(ValueError("this one failed")),
    st.just(tensor.TensorError("does not fit")),
    st.just(object()),  # cannot be encoded: model_error for it alone
)
_QUEUE_MS = st.one_of(
    st.floats(0, 1e6),
    st.floats(),  # NaN, infinities, negative zero
    st.integers(0, 10**6),
    st.booleans(),
    st.none(),
    st.just("7"),
)


def _request(req_id: Any, stream: Any) -> bytes:
    fields: dict[str, Any] = {"input": b"x", "model": "echo"}
    if req_id != "missing":
        fields["id"] = req_id
    if stream is not None:
        fields["stream"] = stream
    return protocol.pack(fields)


def _both_ways(
    monkeypatch: pytest.MonkeyPatch, bodies: list[bytes], queue_ms: list[Any], outputs: list[Any], wait: bool
) -> tuple[list[Any], list[Any]]:
    """run_batch's REPLY frames with the one-pass loop, then with the per-request path
    alone (time frozen, so infer_ms and worker_wait_ms are equal)."""
    monkeypatch.setattr(batch_runner.time, "perf_counter", lambda: 100.0)
    monkeypatch.setattr(batch_runner.time, "monotonic", lambda: 50.0)
    frames = protocol.batch_frames(3, queue_ms, bodies)
    arrived_at = 49.98765 if wait else None

    def run() -> list[Any]:
        return batch_runner.run_batch(lambda inputs: list(outputs), frames[2], frames[3:], WORKER, arrived_at)

    fast = run()
    with monkeypatch.context() as m:
        m.setattr(ReplyEncoder, "encode_plain", lambda self, requests, outs, q: None)
        slow = run()
    return fast, slow


#: An item of the common case (the one-pass loop's), but for its odd ids and queue_ms.
_COMMON = st.tuples(
    st.one_of(st.integers(-(2**63), 2**64 - 1), st.text(max_size=6), st.none(), st.just("missing")),
    st.none(),
    st.binary(max_size=40),
    st.floats(),
)
_ANY = st.tuples(_IDS, st.sampled_from([None, True, False, 1]), _OUTPUTS, _QUEUE_MS)
#: A common item but for one field, which may be anything (a stream flag, an error...).
_ONE_ODD = st.tuples(_COMMON, st.integers(0, 3), _ANY).map(
    lambda t: tuple(t[2][j] if j == t[1] else t[0][j] for j in range(4))
)
_BATCHES = st.one_of(
    st.lists(_COMMON, min_size=1, max_size=8),
    st.tuples(st.lists(_COMMON, max_size=6), _ONE_ODD).flatmap(lambda t: st.permutations([*t[0], t[1]])),
    st.lists(_COMMON | _ANY, min_size=1, max_size=8),
)


@given(_BATCHES, st.booleans())
def test_a_mixed_batch_replies_the_same_bytes_either_way(
    items: list[tuple[Any, Any, Any, Any]], wait: bool
) -> None:
    bodies = [_request(req_id, stream) for req_id, stream, _, _ in items]
    with pytest.MonkeyPatch.context() as monkeypatch:  # undone after each example
        queue_ms, outputs = [q for *_, q in items], [o for _, _, o, _ in items]
        fast, slow = _both_ways(monkeypatch, bodies, queue_ms, outputs, wait)
    assert fast == slow
    assert len(protocol.unpack(fast[2])[2]) == len(items)  # every request answered, once


@pytest.mark.parametrize("wait", [True, False])
def test_the_common_batch_takes_the_one_pass_loop_and_replies_as_the_per_request_path(
    monkeypatch: pytest.MonkeyPatch, wait: bool
) -> None:
    bodies = [_request(i, None) for i in range(30)] + [_request("s", None), _request("missing", None)]
    queue_ms = [0.1234567 * i for i in range(32)]  # (as the broker sends them: not rounded)
    outputs = [b"x" * i for i in range(32)]
    taken: list[int] = []
    encode_plain = ReplyEncoder.encode_plain

    def counted(self: ReplyEncoder, *args: Any) -> Any:
        replies = encode_plain(self, *args)
        taken.append(replies is not None)
        return replies

    monkeypatch.setattr(ReplyEncoder, "encode_plain", counted)
    fast, slow = _both_ways(monkeypatch, bodies, queue_ms, outputs, wait)
    assert taken[0] is True  # the fast run took the loop (the slow run's is patched out)
    assert fast == slow
    replies = protocol.split_bodies(protocol.unpack(fast[2])[2], fast[3:])
    decoded = [msgpack.unpackb(r) for r in replies]
    assert [r["id"] for r in decoded] == [*range(30), "s", None]
    assert [r["output"] for r in decoded] == outputs
    # The broker sends queue_ms unrounded: each reply's is rounded here, wait known or not.
    waited_ms = round((50.0 - 49.98765) * 1000.0, 3) if wait else 0.0  # (the worker's wait, as it rounds it)
    assert [r["queue_ms"] for r in decoded] == [round(q + waited_ms, 3) for q in queue_ms]


def _same_float(a: float, b: float) -> bool:
    return struct.pack(">d", a) == struct.pack(">d", b) or (math.isnan(a) and math.isnan(b))


@given(st.floats())
def test_round_ms_is_round_to_three_places(x: float) -> None:
    assert _same_float(round_ms(x), round(x, 3))


def test_round_ms_is_round_at_the_halves_where_the_product_errs() -> None:
    rng = random.Random(7)
    for _ in range(20000):
        half = rng.randrange(0, 10**12) / 1000 + 0.0005  # the nearest float to a half
        for x in (half, math.nextafter(half, math.inf), math.nextafter(half, -math.inf)):
            assert _same_float(round_ms(x), round(x, 3)), x
    for x in (0.0, -0.0, -0.0001, 0.0625, 2.675, 1e9, 1e9 - 0.0005, 5e-324, math.inf, -math.inf, math.nan):
        assert _same_float(round_ms(x), round(x, 3)), x


def _near_halves(count: int) -> list[float]:
    rng = random.Random(11)
    values = []
    for _ in range(count):
        half = rng.randrange(0, 10**12) / 1000 + 0.0005  # the nearest float to a half
        values += [half, math.nextafter(half, math.inf), math.nextafter(half, -math.inf)]
    return values


def test_the_one_pass_loop_rounds_queue_ms_as_the_per_request_path_at_the_halves() -> None:
    # wait_ms 0.0: q + wait_ms is q itself, so q may be put exactly where rounding is hard
    odd = [0.0, 0.0001, 0.0625, 2.675, 1e9, 1e9 - 0.0005, 1e12 + 0.0625, 5e-324, math.inf, math.nan]
    queue_ms = [*_near_halves(3000), *odd]
    encoder = ReplyEncoder(len(queue_ms), WORKER, 0.0, 1.5)
    requests = [{"id": i} for i in range(len(queue_ms))]
    outputs = [b"x"] * len(queue_ms)
    one_pass = encoder.encode_plain(requests, outputs, queue_ms)
    assert one_pass == [encoder.encode(i, b"x", round(q + 0.0, 3)) for i, q in enumerate(queue_ms)]
