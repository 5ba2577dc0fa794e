"""A step-level worker's runner without sockets (workers/steps.py StepRunner, with the
simulated generative model workers/models.py SimLM at zero step time). The wire pieces
of step-level workers are tested with their modules: CHUNK headers in
tests/unit/wire/test_frames.py, `stream` in tests/unit/wire/test_protocol.py."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

from batcher.wire import protocol
from batcher.wire.protocol import (
    CHUNK_DROPPED,
    CHUNK_ERROR,
    CHUNK_FINAL,
    CHUNK_MORE,
    ErrorCode,
)
from workers.models import SimLM, SimSettings, _simlm_input
from workers.steps import BadInput, BatchingLevel, StepRunner, is_step_model
from workers.worker import _decode_requests

Entry = tuple[int, int, Any]  # (seq_id, flag, decoded body or None for a dropped one)


def sim() -> SimLM:
    return SimLM(SimSettings(step_base_ms=0, step_per_seq_ms=0))


def runner(model: Any = None, max_active: int = 4, level: BatchingLevel = BatchingLevel.STEP) -> StepRunner:
    return StepRunner(sim() if model is None else model, max_active, level, "test-worker", _decode_requests)


def req(rid: object, tokens: Any = 3, stream: bool = True, **extra: Any) -> bytes:
    body: dict[str, Any] = {"id": rid, "model": "simlm", "input": tokens, **extra}
    if stream:
        body["stream"] = True
    return protocol.pack(body)


def start(
    r: StepRunner, seqs: dict[int, bytes], now: float = 0.0, remaining_ms: list[float | None] | None = None
) -> None:
    """A START message, as the broker builds it, given to the runner."""
    ids = list(seqs)
    left: list[float | None] = [None] * len(ids) if remaining_ms is None else remaining_ms
    frames = protocol.start_frames(ids, left, list(seqs.values()))
    assert frames[:2] == [protocol.WORKER_PROTOCOL, protocol.CMD_START]
    r.receive_start(frames[2], frames[3:], now)


def cancel(r: StepRunner, seq_ids: list[Any]) -> None:
    frames = protocol.cancel_frames(seq_ids)
    assert frames[:2] == [protocol.WORKER_PROTOCOL, protocol.CMD_CANCEL]
    r.receive_cancel(frames[2])


def take(r: StepRunner) -> tuple[list[Entry], dict[str, float]]:
    """The CHUNK the runner would send now, decoded as the broker does."""
    frames = r.take_entries()
    if frames is None:
        return [], {}
    assert frames[:2] == [protocol.WORKER_PROTOCOL, protocol.CMD_CHUNK]
    header = protocol.parse_chunk_header(frames[2])
    bodies = protocol.split_bodies(header.lengths, frames[3:])
    entries = [
        (s, f, None if f == CHUNK_DROPPED else protocol.unpack(bytes(b)))
        for s, f, b in zip(header.seq_ids, header.flags, bodies, strict=True)
    ]
    return entries, header.counters


def entries(r: StepRunner) -> list[Entry]:
    return take(r)[0]


def step(r: StepRunner, now: float = 0.0) -> list[Entry]:
    r.run_step(now)
    return entries(r)


def run_all(r: StepRunner, limit: int = 100) -> list[list[Entry]]:
    """Every step's entries until nothing is held."""
    out: list[list[Entry]] = []
    while r.busy():
        assert len(out) < limit, "the runner never finishes"
        out.append(step(r))
    return out


def error_of(body: Any) -> tuple[str, str]:
    assert body["ok"] is False
    return body["error"]["code"], body["error"]["message"]


class Scripted:
    """A step-level model whose steps are given: each step() returns the next script
    entry (or raises it, for an exception instance); start and stop are recorded."""

    step_level = True

    def __init__(self, *steps: Any) -> None:
        self.steps = list(steps)
        self.started: list[int] = []
        self.stopped: list[int] = []

    def start(self, items: list[tuple[int, Any]]) -> list[BaseException | None] | None:
        self.started += [k for k, _ in items]
        return None

    def step(self) -> Iterable[tuple[int, Any, bool]]:
        out = self.steps.pop(0)
        if isinstance(out, BaseException):
            raise out
        assert isinstance(out, list)
        return out

    def stop(self, key: int) -> None:
        self.stopped.append(key)


# --- streaming and collecting ----------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_a_repository_versions_runner_names_its_version_in_the_last_reply_alone(stream: bool) -> None:
    r = StepRunner(sim(), 4, BatchingLevel.STEP, "test-worker", _decode_requests, version="2")
    start(r, {1: req("v", {"tokens": 3}, stream=stream)})
    bodies = [body for s in run_all(r) for _, _, body in s]
    assert bodies[-1]["version"] == "2" and bodies[-1]["ok"] is True
    assert all("version" not in b for b in bodies[:-1])
    assert "version" not in runner().final_meta and r.final_meta == {"worker": "test-worker", "version": "2"}


@pytest.mark.parametrize("k", [1, 2, 5])
def test_a_stream_request_of_k_tokens_gets_k_entries_in_order_the_last_final(k: int) -> None:
    r = runner()
    start(r, {7: req("r1", {"tokens": k})})
    steps = run_all(r)
    assert len(steps) == k  # one token a step
    got = [e for s in steps for e in s]
    assert [seq_id for seq_id, _, _ in got] == [7] * k
    assert [flag for _, flag, _ in got] == [CHUNK_MORE] * (k - 1) + [CHUNK_FINAL]
    assert [body["output"] for _, _, body in got] == list(range(k))
    assert [body["more"] for _, _, body in got] == [True] * (k - 1) + [False]
    assert all(body["id"] == "r1" and body["ok"] is True for _, _, body in got)
    last = got[-1][2]
    assert last["chunks"] == k and last["worker"] == "test-worker"
    assert r.counters["chunks"] == k and r.counters["steps"] == k
    assert not r.busy() and r.model.remaining == {}  # type: ignore[attr-defined]


@pytest.mark.parametrize("k", [1, 4])
def test_a_request_without_stream_gets_one_final_reply_of_every_chunk(k: int) -> None:
    r = runner()
    start(r, {3: req(11, k, stream=False)})
    got = [e for s in run_all(r) for e in s]
    ((seq_id, flag, body),) = got
    assert (seq_id, flag) == (3, CHUNK_FINAL)
    assert body["ok"] is True and body["id"] == 11 and body["output"] == list(range(k))
    assert body["chunks"] == k and "more" not in body


def test_max_active_holds_and_later_sequences_are_admitted_between_steps() -> None:
    r = runner(max_active=2)
    start(r, {1: req(1, 1), 2: req(2, 3), 3: req(3, 1)})
    r.run_step(0.0)
    first, counters = take(r)
    assert [(s, f) for s, f, _ in first] == [(1, CHUNK_FINAL), (2, CHUNK_MORE)]
    assert counters["active"] == 1 and counters["waiting"] == 1  # 3 waits: 1 and 2 held the slots
    assert r.model.remaining.keys() == {2}  # type: ignore[attr-defined]
    second = step(r)  # 1 ended: 3 is admitted at once, beside 2
    assert [(s, f) for s, f, _ in second] == [(2, CHUNK_MORE), (3, CHUNK_FINAL)]
    assert [(s, f) for s, f, _ in step(r)] == [(2, CHUNK_FINAL)]
    assert not r.busy()


def test_the_model_never_holds_more_than_max_active() -> None:
    model = sim()
    r = runner(model, max_active=3)
    start(r, {i: req(i, 1 + i % 4) for i in range(10)})
    seen = 0
    while r.busy():
        r.run_step(0.0)
        assert len(r.active) <= 3 and len(model.remaining) <= 3
        seen += sum(1 for _, f, _ in entries(r) if f == CHUNK_FINAL)
    assert seen == 10


def test_request_level_admits_only_once_every_sequence_has_ended() -> None:
    r = runner(max_active=2, level=BatchingLevel.REQUEST)
    start(r, {1: req(1, 1), 2: req(2, 3), 3: req(3, 1)})
    assert [(s, f) for s, f, _ in step(r)] == [(1, CHUNK_FINAL), (2, CHUNK_MORE)]
    assert [(s, f) for s, f, _ in step(r)] == [(2, CHUNK_MORE)]  # a free slot, yet 3 waits
    assert list(r.active) == [2] and [s.seq_id for s in r.waiting] == [3]
    assert [(s, f) for s, f, _ in step(r)] == [(2, CHUNK_FINAL)]
    assert [(s, f) for s, f, _ in step(r)] == [(3, CHUNK_FINAL)]
    assert not r.busy()


def test_nothing_to_run_sends_nothing() -> None:
    r = runner()
    assert not r.busy()
    r.run_step(0.0)
    assert r.take_entries() is None and r.counters["steps"] == 0


# --- cancel, deadlines, reset ----------------------------------------------------------------


def test_cancel_drops_active_and_waiting_sequences_and_stops_the_model() -> None:
    model = sim()
    r = runner(model, max_active=1)
    start(r, {1: req(1, 5), 2: req(2, 5), 3: req(3, 5, stream=False)})
    assert [(s, f) for s, f, _ in step(r)] == [(1, CHUNK_MORE)]
    assert model.remaining.keys() == {1}
    cancel(r, [1, 2, 999])
    got, counters = take(r)
    assert sorted((s, f, b) for s, f, b in got) == [(1, CHUNK_DROPPED, None), (2, CHUNK_DROPPED, None)]
    assert r.counters["cancelled"] == 2 and counters["cancelled"] == 2
    assert 1 not in model.remaining  # stop() was called
    assert list(r.active) == [] and [s.seq_id for s in r.waiting] == [3]
    assert step(r) == []  # 3 is admitted (and collects: it is not a stream)
    assert model.remaining.keys() == {3}
    cancel(r, [3])
    assert entries(r) == [(3, CHUNK_DROPPED, None)] and 3 not in model.remaining
    assert not r.busy()


def test_cancel_of_unknown_or_non_int_ids_gives_nothing() -> None:
    r = runner()
    start(r, {1: req(1, 2)})
    step(r)
    cancel(r, [42, "1", True, None])
    assert r.take_entries() is None and r.counters["cancelled"] == 0
    assert list(r.active) == [1]
    with pytest.raises(ValueError, match="CANCEL must be a list"):
        r.receive_cancel(protocol.pack({"ids": [1]}))


def test_a_sequence_cancelled_after_it_ended_is_not_acknowledged_twice() -> None:
    r = runner()
    start(r, {1: req(1, 1)})
    assert [(s, f) for s, f, _ in step(r)] == [(1, CHUNK_FINAL)]
    cancel(r, [1])  # the cancel crossed its final reply
    assert r.take_entries() is None


def test_a_start_with_no_time_left_expires_with_deadline_exceeded() -> None:
    r = runner()
    start(r, {5: req("late", 3), 6: req("fine", 1)}, now=10.0, remaining_ms=[0, None])
    got = step(r, now=10.0)
    assert [(s, f) for s, f, _ in got] == [(5, CHUNK_ERROR), (6, CHUNK_FINAL)]
    body = got[0][2]
    assert error_of(body)[0] == ErrorCode.DEADLINE_EXCEEDED and body["id"] == "late" and body["more"] is False
    assert r.counters["expired"] == 1


def test_an_active_sequence_past_its_deadline_is_ended_and_stopped() -> None:
    model = sim()
    r = runner(model)
    start(r, {5: req(5, 10, stream=False)}, now=0.0, remaining_ms=[1000.0])
    assert step(r, now=0.0) == []  # collecting: nothing sent yet
    assert step(r, now=0.999) == []
    assert 5 in model.remaining
    ((seq_id, flag, body),) = step(r, now=1.0)
    assert (seq_id, flag) == (5, CHUNK_ERROR) and error_of(body)[0] == ErrorCode.DEADLINE_EXCEEDED
    assert "more" not in body  # not a stream request
    assert 5 not in model.remaining and r.counters["expired"] == 1 and not r.busy()


def test_reset_drops_everything_and_stops_the_model() -> None:
    model = sim()
    r = runner(model, max_active=1)
    start(r, {1: req(1, 5), 2: req(2, 5)})
    r.run_step(0.0)  # 1 active, a chunk not taken yet; 2 waits
    assert model.remaining.keys() == {1}
    r.reset()
    assert not r.busy() and model.remaining == {}
    assert r.take_entries() is None  # what was collected for the old connection is gone
    start(r, {3: req(3, 1)})
    assert [(s, f) for s, f, _ in step(r)] == [(3, CHUNK_FINAL)]


# --- bad inputs and model failures -----------------------------------------------------------


@pytest.mark.parametrize("given", [{"tokens": 0}, {"tokens": "x"}, {"tokens": 3, "bogus": 1}, 0, 1.5, None])
@pytest.mark.parametrize("stream", [True, False])
def test_a_bad_input_is_answered_bad_request_alone(given: Any, stream: bool) -> None:
    r = runner()
    start(r, {1: req("bad", given, stream=stream), 2: req("good", 1, stream=stream)})
    got = {s: (f, b) for s, f, b in step(r)}
    flag, body = got[1]
    assert flag == CHUNK_ERROR and body["id"] == "bad"
    code, message = error_of(body)
    assert code == ErrorCode.BAD_REQUEST and "simlm" in message
    assert body.get("more", "absent") == (False if stream else "absent")
    assert got[2][0] == CHUNK_FINAL and got[2][1]["ok"] is True
    assert not r.busy()


@pytest.mark.parametrize(
    "body", [protocol.pack([1, 2]), protocol.pack("text"), b"\xc1", protocol.pack({"id": "x"})[:-1]]
)
def test_a_body_that_is_not_a_request_map_is_answered_bad_request(body: bytes) -> None:
    r = runner()
    start(r, {1: body, 2: req("ok", 1)})
    got = entries(r)  # known bad before any step
    ((seq_id, flag, reply),) = got
    assert (seq_id, flag) == (1, CHUNK_ERROR)
    assert error_of(reply)[0] == ErrorCode.BAD_REQUEST
    assert [(s, f) for s, f, _ in step(r)] == [(2, CHUNK_FINAL)]


def test_a_malformed_start_header_raises_and_mismatched_bodies_are_answered_internal() -> None:
    r = runner()
    with pytest.raises(ValueError, match="START header"):
        r.receive_start(protocol.pack([[1], [None]]), [req(1)], 0.0)
    with pytest.raises(ValueError, match="malformed"):
        r.receive_start(protocol.pack([[1], [-1.0], [3]]), [b"abc"], 0.0)
    with pytest.raises(ValueError, match="malformed"):
        r.receive_start(protocol.pack([[True], [None], [3]]), [b"abc"], 0.0)
    r.receive_start(protocol.pack([[1, 2], [None, None], [3, 4]]), [b"abc"], 0.0)
    got = entries(r)
    assert [(s, f) for s, f, _ in got] == [(1, CHUNK_ERROR), (2, CHUNK_ERROR)]
    assert all(error_of(b)[0] == ErrorCode.INTERNAL for _, _, b in got)
    assert not r.busy()


def test_a_step_that_raises_ends_every_active_sequence_with_model_error() -> None:
    model = Scripted([(1, "a", False), (2, "b", False)], RuntimeError("boom"))
    r = runner(model, max_active=2)
    start(r, {1: req(1), 2: req(2, stream=False), 3: req(3)})
    assert [(s, f) for s, f, _ in step(r)] == [(1, CHUNK_MORE)]
    got = step(r)
    assert sorted(s for s, _, _ in got) == [1, 2]
    for _, flag, body in got:
        assert flag == CHUNK_ERROR
        assert error_of(body) == (ErrorCode.MODEL_ERROR, "RuntimeError: boom")
    assert sorted(model.stopped) == [1, 2]
    assert r.counters["steps"] == 2
    assert list(r.active) == [] and [s.seq_id for s in r.waiting] == [3]  # it runs next


def test_a_chunk_that_is_an_exception_ends_only_its_sequence() -> None:
    model = Scripted([(1, ValueError("bad token"), False), (2, "x", False)], [(2, "y", True)])
    r = runner(model)
    start(r, {1: req(1), 2: req(2)})
    got = step(r)
    assert [(s, f) for s, f, _ in got] == [(1, CHUNK_ERROR), (2, CHUNK_MORE)]
    assert error_of(got[0][2]) == (ErrorCode.MODEL_ERROR, "ValueError: bad token")
    assert got[0][2]["more"] is False
    assert model.stopped == [1]
    assert [(s, f, b["output"]) for s, f, b in step(r)] == [(2, CHUNK_FINAL, "y")]


@pytest.mark.parametrize("stream", [True, False])
def test_an_unencodable_chunk_ends_its_sequence_with_model_error(stream: bool) -> None:
    # Mid-stream for a stream request; at its final reply for a collected one.
    model = Scripted([(1, object(), not stream), (2, "ok", True)], [(1, "never", True)])
    r = runner(model)
    start(r, {1: req(1, stream=stream), 2: req(2, stream=stream)})
    got = {s: (f, b) for s, f, b in step(r)}
    flag, body = got[1]
    assert flag == CHUNK_ERROR
    code, message = error_of(body)
    assert code == ErrorCode.MODEL_ERROR and "cannot be encoded" in message
    assert got[2][0] == CHUNK_FINAL
    if stream:  # ended mid-stream: the model is told to forget it
        assert model.stopped == [1]
    assert not r.busy()


def test_steps_ignore_results_for_unknown_keys_and_malformed_results() -> None:
    model = Scripted([(99, "stray", True), "junk", (1, "a", True)])
    r = runner(model)
    start(r, {1: req(1)})
    assert [(s, f) for s, f, _ in step(r)] == [(1, CHUNK_FINAL)]


def test_start_that_raises_or_returns_garbage_fails_the_admitted_sequences() -> None:
    class Broken(Scripted):
        def start(self, items: list[tuple[int, Any]]) -> list[BaseException | None] | None:
            super().start(items)
            raise RuntimeError("no memory")

    model = Broken()
    r = runner(model)
    start(r, {1: req(1), 2: req(2)})
    got = step(r)
    assert [(s, f) for s, f, _ in got] == [(1, CHUNK_ERROR), (2, CHUNK_ERROR)]
    assert all(error_of(b) == (ErrorCode.MODEL_ERROR, "RuntimeError: no memory") for _, _, b in got)
    assert model.stopped == [1, 2] and not r.busy()


def test_step_model_detection() -> None:
    assert is_step_model(sim()) and not is_step_model(object())

    class Half:
        step_level = True

        def start(self) -> None: ...

    with pytest.raises(TypeError, match="step, stop"):
        is_step_model(Half())


def test_simlm_input() -> None:
    assert _simlm_input(3) == (3, 0)
    assert _simlm_input({"tokens": 2, "prompt": 5}) == (2, 5)
    for bad in ({"tokens": 0}, {"tokens": "x"}, {"tokens": 3, "bogus": 1}, {"tokens": 1, "prompt": -1}, True):
        with pytest.raises(ValueError):
            _simlm_input(bad)
    verdicts = sim().start([(1, {"tokens": 0}), (2, 2)])
    assert isinstance(verdicts[0], BadInput) and verdicts[1] is None


# --- what an outsider's attack found -----------------------------------------------------------


def test_a_done_without_a_truth_value_fails_its_sequence_not_the_worker() -> None:
    np = pytest.importorskip("numpy")
    model = Scripted([(1, "a", np.array([True, True])), (2, "b", False)], [(2, "c", True)])
    r = runner(model)
    start(r, {1: req(1), 2: req(2)})
    first = step(r)
    assert [(s, f) for s, f, _ in first] == [(1, CHUNK_ERROR), (2, CHUNK_MORE)]
    code, message = error_of(first[0][2])
    assert code == ErrorCode.MODEL_ERROR and "truth value" in message
    assert first[0][2]["more"] is False and model.stopped == [1]
    assert [(s, f) for s, f, _ in step(r)] == [(2, CHUNK_FINAL)]  # the other sequence goes on


def test_numpy_integer_keys_name_their_sequences() -> None:
    np = pytest.importorskip("numpy")
    r = runner(Scripted([(np.int64(5), "x", np.bool_(True))]))
    start(r, {5: req("five")})
    ((seq_id, flag, body),) = step(r)
    assert (seq_id, flag, body["output"], body["more"]) == (5, CHUNK_FINAL, "x", False)


def test_a_key_that_is_no_integer_is_logged_once_and_sends_nothing(caplog: pytest.LogCaptureFixture) -> None:
    r = runner(Scripted([("1", "x", True)], [("1", "y", True)]))
    start(r, {1: req(1)})
    assert step(r) == [] and step(r) == []
    assert len([m for m in caplog.messages if "not (int key, chunk, done)" in m]) == 1
    assert r.busy()  # the sequence is still held: its deadline or a cancel ends it


def test_a_start_verdict_that_is_neither_none_nor_an_exception_fails_and_stops_its_item() -> None:
    class Odd(Scripted):
        def start(self, items: list[tuple[int, Any]]) -> list[BaseException | None] | None:
            super().start(items)
            return ["ok", None]  # type: ignore[list-item]

    model = Odd([(2, "z", True)])
    r = runner(model)
    start(r, {1: req(1), 2: req(2)})
    got = step(r)
    assert [(s, f) for s, f, _ in got] == [(1, CHUNK_ERROR), (2, CHUNK_FINAL)]
    assert error_of(got[0][2])[0] == ErrorCode.MODEL_ERROR and model.stopped == [1]


def test_steps_without_entries_still_send_a_chunk_of_counters_now_and_then() -> None:
    """A request without "stream" sends nothing until its end: the worker's CHUNK of
    counters alone, at most every PROGRESS_EVERY_S, tells the broker its steps go on."""
    from workers.steps import PROGRESS_EVERY_S

    r = runner()
    start(r, {1: req(1, {"tokens": 50}, stream=False)})
    r.run_step(0.0)
    frames = r.take_entries(now=10.0)
    assert frames is not None
    header = protocol.parse_chunk_header(frames[2])
    assert header.seq_ids == [] and header.counters["steps"] == 1 and header.counters["active"] == 1
    r.run_step(0.0)
    assert r.take_entries(now=10.0 + PROGRESS_EVERY_S / 2) is None  # not yet
    assert r.take_entries(now=10.0 + PROGRESS_EVERY_S * 1.01) is not None
    assert r.take_entries(now=20.0) is None  # no step ran since: no progress to tell


class RecordingTracer:
    """A tracer that keeps what it was asked to record (workers.step_spans' only call)."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []

    def record(
        self, name: str, parent: Any, start_s: float, end_s: float, attributes: Any, **kw: Any
    ) -> None:
        self.spans.append(
            {"name": name, "parent": parent, "start": start_s, "end": end_s, **kw, **attributes}
        )


def test_a_traced_sequence_is_one_span_with_its_steps_and_chunks_an_untraced_one_none() -> None:
    from workers.step_spans import StepSpans

    tracer = RecordingTracer()
    r = runner()
    r.spans = StepSpans(tracer)  # type: ignore[arg-type]
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    frames = protocol.start_frames(
        [1, 2, 3], [None, None, 0.0], [req(1, 3), req(2, 2), req(3, 5)], [parent, None, parent]
    )
    r.receive_start(frames[2], frames[3:], 0.0)
    while r.busy():
        r.run_step(1.0)
    take(r)
    by_seq = {s["batcher.seq_id"]: s for s in tracer.spans}
    assert set(by_seq) == {"1", "3"}  # sequence 2 carried no traceparent
    ok, late = by_seq["1"], by_seq["3"]
    assert ok["name"] == "batcher.worker.sequence" and f"{ok['parent'].trace_id:032x}" == parent[3:35]
    assert (ok["batcher.outcome"], ok["batcher.chunks"], ok["batcher.steps"], ok["error"]) == (
        "ok",
        3,
        3,
        None,
    )
    assert [e[0] for e in ok["events"]] == ["batcher.admitted", "batcher.first_chunk"]
    assert late["batcher.outcome"] == "deadline_exceeded" and late["error"]  # its deadline passed at once
    assert not r.spans.held
