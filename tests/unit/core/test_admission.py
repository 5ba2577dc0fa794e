"""The broker's admission rule on a float clock (batcher/core/admission.py, sans-I/O): the
refusal order, the deadline arithmetic and the length bucket, as data."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batcher.core.admission import SHUTTING_DOWN_MESSAGE, Admitted, Refusal, admit
from batcher.core.pool import WorkerInfo, WorkerPool
from batcher.core.scheduler import BatchSettings, Scheduler
from batcher.wire.protocol import ErrorCode, Heartbeat, RequestHeader
from batcher.wire.signature import Signature, TensorSpec

SIG = Signature((TensorSpec("x", "FP32", (-1, 4)),), (TensorSpec("y", "FP32", (-1, 4)),))
BUCKETED = BatchSettings(max_batch_size=4, max_wait_ms=0.0, bucket_by="length", length_buckets=(8, 16))


def pool(no_worker_timeout_s: float = 0.0, signature: Signature | None = None) -> WorkerPool:
    s = Scheduler(per_model={"m": BUCKETED}, worker_prefetch=1, no_worker_timeout_s=no_worker_timeout_s)
    p = WorkerPool(s, Heartbeat(interval_ms=100.0, liveness=3), 1, now=0.0)
    p.joined(b"w", WorkerInfo("m", 0, 42, signature), None, 0.0)
    return p


def header(rid: Any = 7, timeout_ms: float | None = None) -> RequestHeader:
    return RequestHeader(rid, "m", timeout_ms, 0.0, "infer")


def tensor(rows: int, cols: int = 4) -> dict[str, Any]:
    return {"datatype": "FP32", "shape": [rows, cols], "data": b"\0" * (4 * rows * cols)}


def body(value: Any) -> bytes:
    return msgpack.packb({"id": 7, "input": value}, use_bin_type=True)


def verdict(p: WorkerPool, value: Any, *, draining: bool = False, h: RequestHeader | None = None,
            settings: BatchSettings | None = BUCKETED, now: float = 1.0) -> Admitted | Refusal:  # fmt: skip
    return admit(h or header(), "m", body(value), now, draining=draining, pool=p, settings=settings,
                 default_timeout_s=None)  # fmt: skip


def test_a_fitting_request_is_admitted_with_its_bucket() -> None:
    assert verdict(pool(), tensor(3)) == Admitted(None, 0)
    assert verdict(pool(), tensor(9)) == Admitted(None, 1)
    assert verdict(pool(), tensor(99)) == Admitted(None, 2)  # past the last bound: its own bucket
    assert verdict(pool(), tensor(3), settings=None) == Admitted(None, None)  # no bucketing


def test_a_draining_broker_refuses_first_whatever_else_is_wrong() -> None:
    got = verdict(pool(signature=SIG), "not a tensor", draining=True)
    assert got == Refusal(ErrorCode.SHUTTING_DOWN, SHUTTING_DOWN_MESSAGE, 7)


def test_a_model_without_a_worker_is_refused_before_the_body_is_looked_at() -> None:
    p = pool(no_worker_timeout_s=0.5, signature=SIG)
    p.lose(b"w", failed=True)
    p.scheduler.unavailable(1.0)  # the loop's turn that stamps "no worker since"
    got = verdict(p, "not a tensor", now=10.0)
    assert isinstance(got, Refusal) and got.code == ErrorCode.UNAVAILABLE and got.req_id == 7
    assert "has had no worker for" in got.message


def test_a_body_that_misfits_the_signature_is_a_bad_request_before_its_length_is_read() -> None:
    got = verdict(pool(signature=SIG), tensor(3, cols=5))
    assert isinstance(got, Refusal) and got.code == ErrorCode.BAD_REQUEST and got.req_id == 7
    assert "shape" in got.message


def test_an_unmeasurable_body_is_a_bad_request_under_bucketing_only() -> None:
    got = verdict(pool(), [1, 2, 3])
    assert isinstance(got, Refusal) and got.code == ErrorCode.BAD_REQUEST and got.req_id == 7
    assert "groups requests by length" in got.message
    assert verdict(pool(), [1, 2, 3], settings=None) == Admitted(None, None)


@given(
    now=st.floats(0, 1e6),
    timeout_ms=st.none() | st.floats(0, 1e7),
    default_s=st.none() | st.floats(0, 1e4),
)
def test_the_deadline_is_the_requests_timeout_else_the_default_and_zero_means_none(
    now: float, timeout_ms: float | None, default_s: float | None
) -> None:
    verdict = admit(
        header(timeout_ms=timeout_ms), "m", body(tensor(3)), now,
        draining=False, pool=pool(), settings=None, default_timeout_s=default_s,
    )  # fmt: skip
    assert isinstance(verdict, Admitted)
    got = verdict.deadline
    timeout_s = timeout_ms / 1000.0 if timeout_ms else default_s
    if not timeout_s:
        assert got is None
    else:
        assert got == pytest.approx(now + timeout_s) and got >= now


def test_an_admitted_request_expires_after_its_own_timeout_else_the_brokers_default() -> None:
    def admitted(timeout_ms: float | None, default_s: float | None) -> Admitted | Refusal:
        return admit(header(timeout_ms=timeout_ms), "m", body(tensor(3)), 10.0, draining=False, pool=pool(),
                     settings=BUCKETED, default_timeout_s=default_s)  # fmt: skip

    assert admitted(500.0, None) == Admitted(10.5, 0)
    assert admitted(None, 2.0) == Admitted(12.0, 0)
    assert admitted(250.0, 2.0) == Admitted(10.25, 0)  # its own wins
    assert admitted(None, None) == Admitted(None, 0)
