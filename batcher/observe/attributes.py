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
