"""A model that releases the GIL runs on the worker's model thread (workers/overlap.py):
the thread itself, then a worker serving such a model through a scripted backend, where
the batch at hand, the next one (queued with the thread) and the rest (pending) must each
be answered, or handed back to the broker, exactly as on the main thread.

The integration half: these tests start processes or measure time; the unit tests
are in tests/unit/workers/test_overlap.py."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from batcher.wire import protocol
from tests.helpers import FakeBackend, pack, wait_until
from tests.unit.workers.test_overlap import NOGIL, batch, reply_of, runs


@pytest.fixture
def nogil_worker(spawn: Any, zctx: zmq.Context[Any], tmp_path: Path) -> tuple[Any, FakeBackend, bytes, Path]:
    """A worker of the NoGil model on a scripted backend: (worker, backend, its identity,
    the file where the model notes what it runs)."""
    fb = FakeBackend(zctx)
    log = tmp_path / "runs"
    worker = spawn(
        "worker", "--connect", fb.address, "--model", NOGIL, "--heartbeat-ms", "10000",
        env={"BATCHER_TEST_RUNS": str(log)},
    )  # fmt: skip
    return worker, fb, fb.next(protocol.CMD_READY, 20)[0], log


@pytest.mark.integration
def test_batches_run_one_at_a_time_on_the_model_thread_and_are_answered_in_order(nogil_worker: Any) -> None:
    worker, fb, ident, log = nogil_worker
    for k in range(1, 5):
        fb.send_batch(ident, *batch(k, 10 * k, 10 * k + 1, sleep=0.05))
    for k in range(1, 5):
        batch_id, replies = reply_of(fb.next(protocol.CMD_REPLY, 10))
        assert batch_id == k
        assert [(r["id"], r["ok"], r["output"]["i"]) for r in replies] == [
            (10 * k, True, 10 * k),
            (10 * k + 1, True, 10 * k + 1),
        ]
    expected = []
    for k in range(1, 5):
        expected += [f"start {10 * k} {10 * k + 1} model", f"end {10 * k} {10 * k + 1} model"]
    assert runs(log) == expected  # never two at once, each on the model thread
    assert "Traceback" not in worker.stderr_path.read_text()


@pytest.mark.integration
def test_a_stop_answers_the_batch_at_hand_and_hands_the_rest_back(nogil_worker: Any) -> None:
    worker, fb, ident, log = nogil_worker
    fb.send_batch(ident, *batch(1, 1, sleep=1.0))  # at hand
    wait_until(lambda: runs(log) == ["start 1 model"], 10, "the first batch running")
    fb.send_batch(ident, *batch(2, 2))  # queued with the model thread
    fb.send_batch(ident, *batch(3, 3))  # pending
    worker.process.send_signal(signal.SIGTERM)
    batch_id, replies = reply_of(fb.next(protocol.CMD_REPLY, 10))
    assert (batch_id, [r["ok"] for r in replies]) == (1, [True])
    fb.next(protocol.CMD_DISCONNECT, 10)  # the broker re-dispatches 2 and 3
    assert worker.process.wait(10) == 0
    assert runs(log) == ["start 1 model", "end 1 model"]


@pytest.mark.integration
def test_a_broker_that_forgot_the_worker_gets_no_reply_of_the_old_connection(nogil_worker: Any) -> None:
    worker, fb, ident, log = nogil_worker
    fb.send_batch(ident, *batch(1, 1, sleep=0.5))
    wait_until(lambda: runs(log) == ["start 1 model"], 10, "the first batch running")
    fb.send_batch(ident, *batch(2, 2))  # queued with the model thread
    fb.sock.send_multipart([ident, protocol.WORKER_PROTOCOL, protocol.CMD_DISCONNECT])
    again = fb.next(protocol.CMD_READY, 10)[0]
    assert again != ident, "a new connection, so a new identity"
    wait_until(lambda: "end 1 model" in runs(log), 10, "the first batch ended")
    fb.send_batch(again, *batch(4, 4))
    batch_id, replies = reply_of(fb.next(protocol.CMD_REPLY, 10))
    assert batch_id == 4, "a reply of the old connection came on the new one"
    assert [r["output"]["i"] for r in replies] == [4]
    assert runs(log) == ["start 1 model", "end 1 model", "start 4 model", "end 4 model"]
    assert worker.process.poll() is None


@pytest.mark.integration
def test_heartbeats_go_on_while_a_large_batch_is_decoded_and_encoded(
    spawn: Any, zctx: zmq.Context[Any]
) -> None:
    """Decoding and encoding happen on the main thread, outside the model: a batch that
    takes longer than the broker's heartbeat expiry to read must not silence the worker."""
    heavy = [{"a": k} for k in range(100_000)]  # a map each: slow to decode, and to encode back
    # 16 bodies: over 0.4 s at this VM's fast moments too (8 took 0.39 s once, too short to tell)
    bodies = [pack({"id": i, "input": {"i": i, "v": heavy}}) for i in range(16)]
    header = pack([1, [0.0] * len(bodies), [len(b) for b in bodies]])
    fb = FakeBackend(zctx)  # silent until the batch is sent: the worker's expiry is 150 ms
    worker = spawn("worker", "--connect", fb.address, "--model", NOGIL, "--heartbeat-ms", "50", "--no-warmup")
    ident = fb.next(protocol.CMD_READY, 20)[0]
    started = last = time.monotonic()
    fb.send_batch(ident, header, bodies)
    silence, replied = 0.0, False
    while not replied:
        assert time.monotonic() - started < 60, "no reply"
        if fb.sock.poll(20):
            frames = fb.sock.recv_multipart()
            now = time.monotonic()
            silence, last = max(silence, now - last), now
            replied = frames[2] == protocol.CMD_REPLY
        fb.sock.send_multipart([ident, protocol.WORKER_PROTOCOL, protocol.CMD_HEARTBEAT])  # the broker's
    took_s = time.monotonic() - started
    assert took_s > 0.4, f"the batch took {took_s:.2f} s: too little to tell"
    assert silence < 0.3, f"the worker was silent {silence:.2f} s of {took_s:.2f} s (heartbeat 50 ms)"
    assert worker.process.poll() is None
