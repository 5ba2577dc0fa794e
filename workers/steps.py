"""Step-level (continuous) batching in a worker: a generative model run one step at a
time over the sequences it holds, new ones admitted between steps, finished ones gone
at once (docs/generative.md).

A step-level model is an object with `step_level = True` and three methods:

    start(items)  # [(key, input), ...]: new sequences (one prefill); may return, per
                  # item, None or an exception (BadInput: bad_request; other: model_error)
    step()        # one step over every sequence: [(key, chunk, done), ...]; a chunk
                  # that is an exception ends its sequence with model_error
    stop(key)     # forget a sequence the worker ended (cancelled, past its deadline)

A sequence whose `done` is true is forgotten by the model itself. A step need not
yield a chunk for every sequence. The worker holds at most `max_active` sequences
(its credit at the broker) and streams every step's chunks as one CHUNK message.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from batcher.errors import BatcherError
from batcher.wire import protocol
from batcher.wire.protocol import CHUNK_DROPPED, CHUNK_ERROR, CHUNK_FINAL, CHUNK_MORE, ErrorCode

log = logging.getLogger("batcher.worker")


class BadInput(BatcherError, ValueError):
    """What a step-level model's `start` returns (or raises) for an input it cannot take:
    its request is answered `bad_request`."""


class StepModel(Protocol):
    """The interface of a step-level model (module docstring)."""

    step_level: bool

    def start(self, items: list[tuple[int, Any]]) -> list[BaseException | None] | None: ...

    def step(self) -> Iterable[tuple[int, Any, bool]]: ...

    def stop(self, key: int) -> None: ...


def is_step_model(model: object) -> bool:
    """Whether `model` declares itself step-level; TypeError if it says so without the methods."""
    if getattr(model, "step_level", False) is not True:
        return False
    missing = [m for m in ("start", "step", "stop") if not callable(getattr(model, m, None))]
    if missing:
        raise TypeError(
            f"a step-level model needs start, step and stop methods; missing {', '.join(missing)}"
        )
    return True


class BatchingLevel(StrEnum):
    """When a step-level worker admits new sequences."""

    STEP = "step"  # between any two steps: continuous batching
    REQUEST = "request"  # only once every sequence it holds has ended: the request-level baseline


BATCHING_LEVELS = tuple(level.value for level in BatchingLevel)


@dataclass(slots=True, eq=False)
class _Sequence:
    seq_id: int
    req_id: int | str | None
    stream: bool
    input: Any
    deadline: float | None
    collected: list[Any] = field(default_factory=list)  # a request without "stream": its chunks so far
    chunks: int = 0
    received_at: float = 0.0  # (monotonic) the times a traced sequence's span is made of
    admitted_at: float | None = None
    first_at: float | None = None
    steps_at: float = 0.0  # the worker's steps counted when it was admitted
    trace: Any = None  # its parent's SpanContext when traced (workers.step_spans)


#: At least this often a stepping worker sends a CHUNK, with entries or not (seconds).
PROGRESS_EVERY_S = 0.1

Decode = Callable[[list[Any]], tuple[list[dict[str, Any]], dict[int, str]]]


class StepRunner:
    """A worker's step-level model and the sequences it holds: it takes START and CANCEL
    messages, runs one step at a time, and collects the CHUNK entries to send."""

    def __init__(
        self,
        model: StepModel,
        max_active: int,
        level: BatchingLevel,
        worker_name: str,
        decode: Decode,
        version: str | None = None,
    ) -> None:
        self.model = model
        self.max_active = max_active
        self.level = BatchingLevel(level)
        self.worker_name = worker_name
        #: The last reply's `version` (a repository's, else none): docs/protocol.md 4.3.
        self.final_meta: dict[str, Any] = {"worker": worker_name}
        if version is not None:
            self.final_meta["version"] = version
        self.decode = decode
        self.waiting: deque[_Sequence] = deque()
        self.active: dict[int, _Sequence] = {}
        self.counters: dict[str, float] = {
            "active": 0, "waiting": 0, "steps": 0, "chunks": 0, "cancelled": 0, "expired": 0, "step_ms": 0.0
        }  # fmt: skip
        self._ids: list[int] = []
        self._flags: list[int] = []
        self._bodies: list[bytes] = []
        self._stepped = False  # a step ran since the last CHUNK: one is due, entries or not
        self._sent_at = 0.0  # when the last CHUNK was taken
        self._warned: set[str] = set()  # the kinds of odd step results logged already
        self.spans: Any = None  # workers.step_spans.StepSpans when tracing is on

    # --- what the broker says ---------------------------------------------------------------

    def receive_start(self, header_frame: bytes, body_frames: list[Any], now: float) -> None:
        """New sequences, from a START message; ValueError for one that cannot be read
        (nothing in it can be answered: the broker takes the worker for broken if it
        never hears of those sequences)."""
        header = protocol.unpack(header_frame)
        if not (isinstance(header, list) and len(header) in (3, 4)):
            raise ValueError(f"START header must be [seq_ids, remaining_ms, lengths], got {header!r}"[:200])
        seq_ids, remaining_ms, lengths = header[:3]
        parents = header[3] if len(header) == 4 and isinstance(header[3], list) else None
        if not (
            isinstance(seq_ids, list)
            and isinstance(remaining_ms, list)
            and len(remaining_ms) == len(seq_ids)
            and all(type(s) is int for s in seq_ids)
            and all(
                r is None or (isinstance(r, int | float) and not isinstance(r, bool) and r >= 0)
                for r in remaining_ms
            )
            and isinstance(lengths, list)
            and len(lengths) == len(seq_ids)
            and all(type(n) is int and n >= 0 for n in lengths)
        ):
            raise ValueError(f"START header is malformed: {header!r}"[:200])
        try:
            bodies = protocol.split_bodies(lengths, body_frames)
        except ValueError as exc:  # each sequence is still answered, if without its id
            for seq_id in seq_ids:
                why = f"the broker's START message was malformed: {exc}"
                self._final(seq_id, protocol.error_reply(None, ErrorCode.INTERNAL, why), CHUNK_ERROR)
            return
        requests, bad = self.decode(bodies)
        for i, (seq_id, left_ms, request) in enumerate(zip(seq_ids, remaining_ms, requests, strict=True)):
            req_id = protocol.answer_id(request)
            stream = request.get("stream") is True
            if i in bad:
                self._final(
                    seq_id, protocol.error_reply(req_id, ErrorCode.BAD_REQUEST, bad[i], stream), CHUNK_ERROR
                )
                continue
            deadline = None if left_ms is None else now + left_ms / 1000.0
            seq = _Sequence(seq_id, req_id, stream, request.get("input"), deadline, received_at=now)
            if self.spans is not None and parents is not None and i < len(parents):
                self.spans.received(seq, parents[i])
            self.waiting.append(seq)

    def receive_cancel(self, frame: bytes) -> None:
        """Stop the sequences a CANCEL names; each is acknowledged (CHUNK_DROPPED), which
        frees its slot at the broker. An id not held (it ended meanwhile) is ignored."""
        seq_ids = protocol.unpack(frame)
        if not isinstance(seq_ids, list):
            raise ValueError(f"CANCEL must be a list of sequence ids, got {seq_ids!r}"[:200])
        wanted = {s for s in seq_ids if type(s) is int}
        if not wanted:
            return
        kept: deque[_Sequence] = deque()
        for seq in self.waiting:
            if seq.seq_id in wanted:
                self._dropped(seq.seq_id)
            else:
                kept.append(seq)
        self.waiting = kept
        for seq_id in wanted & self.active.keys():
            del self.active[seq_id]
            self._stop(seq_id)
            self._dropped(seq_id)

    def reset(self) -> None:
        """The connection is gone (a broker that lost us answers for these): drop everything."""
        for seq_id in list(self.active):
            self._stop(seq_id)
        self.active.clear()
        self.waiting.clear()
        self.take_entries()
        if self.spans is not None:
            self.spans.reset(self.counters["steps"])

    # --- running ----------------------------------------------------------------------------

    def busy(self) -> bool:
        """Whether a step is to run (a sequence is held)."""
        return bool(self.active or self.waiting)

    def run_step(self, now: float) -> None:
        """End what passed its deadline, admit what the level allows (its prefill), run
        one step; `step_ms` counts both."""
        self._expire(now)
        t0 = time.perf_counter()
        self._admit()
        if not self.active:
            return
        self._stepped = True
        try:
            results = list(self.model.step())
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            log.warning("step-level model raised in a step over %d sequences: %s", len(self.active), message)
            for seq_id, seq in list(self.active.items()):
                self._stop(seq_id)
                self._fail(seq, ErrorCode.MODEL_ERROR, message)
            self.active.clear()
            return
        finally:
            self.counters["steps"] += 1
            self.counters["step_ms"] = round((time.perf_counter() - t0) * 1000.0, 3)
        for result in results:
            self._take_chunk(result)

    def _take_chunk(self, result: Any) -> None:
        try:
            key, chunk, done = result
            key = operator.index(key)  # an int, or a numpy integer
            done = bool(done)
        except Exception as exc:  # not a triple, a key that is no integer, a done with no truth
            self._odd_result(result, exc)
            return
        seq = self.active.get(key)
        if seq is None:
            return  # a sequence it was told to stop (or never had): nothing to send
        if isinstance(chunk, BaseException):
            del self.active[key]
            self._stop(key)
            self._fail(seq, ErrorCode.MODEL_ERROR, f"{type(chunk).__name__}: {chunk}")
            return
        seq.chunks += 1
        if seq.chunks == 1:
            seq.first_at = time.monotonic()
        self.counters["chunks"] += 1
        if done:
            del self.active[key]
        try:
            if not seq.stream:
                seq.collected.append(chunk)
                if done:
                    meta = {"chunks": seq.chunks, **self.final_meta}
                    self._final(key, protocol.ok_reply(seq.req_id, seq.collected, meta), CHUNK_FINAL)
                return
            reply: dict[str, Any] = {"id": seq.req_id, "ok": True, "output": chunk, "more": not done}
            if done:
                reply.update(chunks=seq.chunks, **self.final_meta)
            self._entry(key, CHUNK_FINAL if done else CHUNK_MORE, protocol.pack_carrying(reply, chunk))
        except (TypeError, ValueError, OverflowError, BufferError, RecursionError) as exc:
            if not done:
                del self.active[key]
                self._stop(key)
            self._fail(seq, ErrorCode.MODEL_ERROR, f"output cannot be encoded: {exc}")

    def _odd_result(self, result: Any, exc: Exception) -> None:
        """A step result that is not (int key, chunk, bool-able done): if it names a held
        sequence, that sequence fails (model_error); either way it is logged, once per kind."""
        try:
            key: int | None = operator.index(result[0])
        except Exception:  # no key to name a sequence by
            key = None
        seq = None if key is None else self.active.pop(key, None)
        if seq is not None:
            self._stop(seq.seq_id)
            self._fail(
                seq, ErrorCode.MODEL_ERROR, f"the step gave {protocol.clip(result)}: {protocol.describe(exc)}"
            )
        kind = f"{type(exc).__name__}"
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(
                "a step-level model's step gave %s, not (int key, chunk, done): %s",
                protocol.clip(result),
                protocol.describe(exc),
            )

    def _admit(self) -> None:
        if not self.waiting:
            return
        if self.level is BatchingLevel.REQUEST and self.active:
            return  # the request-level baseline: the batch at hand runs to its longest sequence
        room = self.max_active - len(self.active)
        new = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
        if not new:
            return
        items = [(seq.seq_id, seq.input) for seq in new]
        try:
            verdicts = self.model.start(items)
        except Exception as exc:
            verdicts = [exc] * len(new)
        if verdicts is None:
            verdicts = [None] * len(new)
        elif not isinstance(verdicts, list | tuple) or len(verdicts) != len(new):
            log.warning(
                "a step-level model's start gave %r for %d items: taken as a failure", verdicts, len(new)
            )
            verdicts = [
                ValueError(f"start returned {type(verdicts).__name__}, not one verdict per item")
            ] * len(new)
        admitted_at, steps = time.monotonic(), self.counters["steps"]
        for seq, verdict in zip(new, verdicts, strict=True):
            seq.admitted_at, seq.steps_at = admitted_at, steps
            if verdict is None:
                self.active[seq.seq_id] = seq
                continue
            self._stop(seq.seq_id)  # whatever the model may have kept of it (once per item)
            code = ErrorCode.BAD_REQUEST if isinstance(verdict, BadInput) else ErrorCode.MODEL_ERROR
            self._fail(
                seq,
                code,
                str(verdict) if code is ErrorCode.BAD_REQUEST else f"{type(verdict).__name__}: {verdict}",
            )

    def _expire(self, now: float) -> None:
        late = [seq for seq in self.waiting if seq.deadline is not None and seq.deadline <= now]
        if late:
            self.waiting = deque(seq for seq in self.waiting if seq not in late)
        for seq_id, seq in list(self.active.items()):
            if seq.deadline is not None and seq.deadline <= now:
                del self.active[seq_id]
                self._stop(seq_id)
                late.append(seq)
        for seq in late:
            self.counters["expired"] += 1
            self._fail(seq, ErrorCode.DEADLINE_EXCEEDED, "deadline passed while generating")

    # --- entries ----------------------------------------------------------------------------

    def _stop(self, key: int) -> None:
        with contextlib.suppress(Exception):  # the model's own error: the sequence is gone anyway
            self.model.stop(key)

    def _fail(self, seq: _Sequence, code: ErrorCode, message: str) -> None:
        self._final(seq.seq_id, protocol.error_reply(seq.req_id, code, message, seq.stream), CHUNK_ERROR)

    def _final(self, seq_id: int, body: bytes, flag: int) -> None:
        self._entry(seq_id, flag, body)

    def _dropped(self, seq_id: int) -> None:
        self.counters["cancelled"] += 1
        self._entry(seq_id, CHUNK_DROPPED, b"")

    def _entry(self, seq_id: int, flag: int, body: bytes) -> None:
        if self.spans is not None and flag != CHUNK_MORE:
            self.spans.ended(seq_id, flag, body, self.counters["steps"])
        self._ids.append(seq_id)
        self._flags.append(flag)
        self._bodies.append(body)

    def take_entries(self, now: float | None = None) -> list[Any] | None:
        """The CHUNK message of everything collected since the last call; None if nothing
        was, unless (given `now`) steps ran since the last one, PROGRESS_EVERY_S ago or
        more: then a CHUNK of counters alone says the worker makes progress (a request
        without "stream", or a step that yields nothing, sends no entry for many steps)."""
        progress = now is not None and self._stepped and now - self._sent_at >= PROGRESS_EVERY_S
        if not self._ids and not progress:
            return None
        self._stepped = False
        if now is not None:
            self._sent_at = now
        self.counters["active"] = len(self.active)
        self.counters["waiting"] = len(self.waiting)
        frames = protocol.chunk_frames(self._ids, self._flags, self._bodies, dict(self.counters))
        self._ids, self._flags, self._bodies = [], [], []
        return frames
