"""The spans of a step-level worker's sequences (docs/tracing.md, "Streams"): one span a
request stream, `batcher.worker.sequence`, from the START that brought it to its ending
entry, a child of the request's stream span at the broker (`batcher.stream`: its
traceparent rides in the START header's 4th element). A span per step would be too many: the steps are counted
(`batcher.steps`, `batcher.chunks`) and the two moments that matter are events, its
admission (the prefill) and its first chunk (`batcher.first_chunk_ms`). Loaded only
when tracing is on."""

from __future__ import annotations

import time
from typing import Any

from batcher.observe.spans import Tracer, span_context
from batcher.wire import protocol
from batcher.wire.codes import CHUNK_DROPPED, CHUNK_ERROR
from batcher.wire.tracecontext import parse_traceparent

#: Traced sequences held at most (a broker that never ends them cannot grow the table).
MAX_HELD = 100_000


class StepSpans:
    """The traced sequences of one StepRunner, each ended into its span."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.held: dict[int, Any] = {}  # seq id -> its _Sequence (workers.steps)

    def received(self, seq: Any, traceparent: object) -> None:
        """A sequence from a START: traced when its traceparent is valid and sampled."""
        parent = parse_traceparent(traceparent)
        if parent is None or not parent.sampled or len(self.held) >= MAX_HELD:
            return
        seq.trace = span_context(parent)
        self.held[seq.seq_id] = seq

    def ended(self, seq_id: int, flag: int, body: bytes, steps: float) -> None:
        """A sequence's ending entry (flag CHUNK_FINAL, CHUNK_ERROR or CHUNK_DROPPED): its span."""
        seq = self.held.pop(seq_id, None)
        if seq is None:
            return
        self._record(seq, flag, body, steps)

    def reset(self, steps: float) -> None:
        """The connection is gone: every traced sequence ends, unanswered by this worker."""
        for seq in list(self.held.values()):
            self._record(seq, CHUNK_DROPPED, b"", steps, "connection_lost")
        self.held.clear()

    def _record(self, seq: Any, flag: int, body: bytes, steps: float, outcome: str | None = None) -> None:
        now = time.monotonic()
        error = None
        if outcome is None:
            outcome = "ok" if flag not in (CHUNK_ERROR, CHUNK_DROPPED) else "cancelled"
        if flag == CHUNK_ERROR:
            outcome, error = _error_of(body)
        attributes: dict[str, Any] = {
            "batcher.seq_id": str(seq.seq_id),
            "batcher.stream": seq.stream,
            "batcher.chunks": seq.chunks,
            "batcher.steps": int(steps - seq.steps_at) if seq.admitted_at is not None else 0,
            "batcher.outcome": outcome,
        }
        if seq.req_id is not None:
            attributes["batcher.request_id"] = str(seq.req_id)
        events: list[tuple[str, float, dict[str, Any]]] = []
        if seq.admitted_at is not None:
            attributes["batcher.admit_wait_ms"] = round((seq.admitted_at - seq.received_at) * 1000.0, 3)
            events.append(("batcher.admitted", seq.admitted_at, {}))
        if seq.first_at is not None:
            attributes["batcher.first_chunk_ms"] = round((seq.first_at - seq.received_at) * 1000.0, 3)
            events.append(("batcher.first_chunk", seq.first_at, {}))
        self.tracer.record(
            "batcher.worker.sequence", seq.trace, seq.received_at, now, attributes, error=error, events=events
        )


def _error_of(body: bytes) -> tuple[str, str]:
    """(code, message) of an error reply's body (small and rare: reading it costs little)."""
    try:
        error = protocol.unpack(bytes(body))["error"]
        return str(error["code"]), str(error.get("message", ""))[:200]
    except Exception:  # msgpack raises several unrelated types; a body without the code
        return "model_error", "an error reply"
