"""The attributes of the broker's batch span, the same whether the broker's own SDK
(broker_spans) or its exporter process (relay) makes the span."""

from __future__ import annotations

from typing import Any


def batch_attributes(batch: Any, cost: float, worker: str, traced: int) -> tuple[int, dict[str, Any]]:
    """(the batch's attempt: 1, or more after a lost worker or a hung batch; its span's
    attributes), for `batch` of cost `cost` sent to `worker`, `traced` of its requests traced."""
    attempt = 1 + max(r.attempts + r.handbacks for r in batch.requests)
    attributes = {
        "batcher.model": batch.model,
        "batcher.batch_id": str(batch.batch_id),
        "batcher.batch_size": len(batch.requests),
        "batcher.batch_cost": float(cost),
        "batcher.worker": worker,
        "batcher.attempt": attempt,
        "batcher.traced_requests": traced,
    }
    return attempt, attributes


#: A stream span's outcomes that are no error: its last chunk was a result, or its client
#: cancelled it or went away.
STREAM_FINE = frozenset({"ok", "cancelled", "client_gone"})


def stream_attributes(req: Any, model: str, worker: str) -> dict[str, Any]:
    """The attributes a stream span begins with, for `req` given to `worker` (its outcome,
    chunks and first chunk's time are added when they are known)."""
    attributes = {"batcher.model": model, "batcher.worker": worker, "batcher.attempt": int(req.attempts) + 1}
    if req.id is not None:
        attributes["batcher.request_id"] = str(req.id)
    return attributes
