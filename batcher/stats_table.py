"""`batcher stats`: the broker's `stats` control reply as a table per model."""

from __future__ import annotations

from typing import Any


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_stats(snapshot: dict[str, Any]) -> str:
    """A table with one row per model, then the broker-wide counters."""
    header = (
        f"{'model':<14}{'queued':>8}{'workers':>9}{'busy':>6}{'batches':>10}{'requests':>11}"
        f"{'mean bs':>9}{'queue p50/p99 ms':>19}{'infer p50/p99 ms':>19}  outcomes"
    )
    lines = [header, "-" * len(header)]
    for name, m in sorted(snapshot.get("models", {}).items()):
        outcomes = ", ".join(f"{k}: {v}" for k, v in sorted(m.get("outcomes", {}).items())) or "-"
        lines.append(
            f"{name:<14}{m['queued']:>8}{m['workers']:>9}{m['busy_workers']:>6}{m['batches']:>10}"
            f"{m['requests']:>11}{m['mean_batch_size']:>9.2f}"
            f"{_ms(m.get('queue_ms_p50')) + ' / ' + _ms(m.get('queue_ms_p99')):>19}"
            f"{_ms(m.get('infer_ms_p50')) + ' / ' + _ms(m.get('infer_ms_p99')):>19}  {outcomes}"
        )
    extras = {
        "workers lost": snapshot.get("workers_lost", 0),
        "batches retried": snapshot.get("batches_retried", 0),
        "undeliverable replies": snapshot.get("undeliverable", 0),
        "refused (no model)": sum(snapshot.get("refused_without_model", {}).values()),
    }
    lines.append("  ".join(f"{k}: {v}" for k, v in extras.items()))
    if snapshot.get("stopping"):
        lines.append("the broker is draining (shutting down)")
    return "\n".join(lines)
