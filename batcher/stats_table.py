"""`batcher stats`: the broker's `stats` control reply as a table per model.

The table is built from whatever the broker sends: a missing field, a NaN or an
infinity (a worker may report one) prints as `-` rather than failing the command or
printing `nan` as if it were a measurement.
"""

from __future__ import annotations

import math
from typing import Any


def _number(value: Any) -> float | int | None:
    """`value` if it is a finite number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _count(value: Any) -> str:
    n = _number(value)
    return "-" if n is None else str(n)


def _ms(value: Any) -> str:
    n = _number(value)
    return "-" if n is None else f"{n:.2f}"


def _total(values: Any) -> str:
    if not isinstance(values, dict):
        return "-"
    numbers = [_number(v) for v in values.values()]
    return str(sum(n for n in numbers if n is not None))


def format_stats(snapshot: dict[str, Any]) -> str:
    """A table with one row per model, then the broker-wide counters."""
    header = (
        f"{'model':<14}{'queued':>8}{'workers':>9}{'busy':>6}{'batches':>10}{'requests':>11}"
        f"{'mean bs':>9}{'queue p50/p99 ms':>19}{'infer p50/p99 ms':>19}  outcomes"
    )
    lines = [header, "-" * len(header)]
    models = snapshot.get("models")
    for name, m in sorted((models if isinstance(models, dict) else {}).items()):
        if not isinstance(m, dict):
            m = {}
        outcomes = m.get("outcomes")
        outcomes = outcomes if isinstance(outcomes, dict) else {}
        outcome_text = ", ".join(f"{k}: {_count(v)}" for k, v in sorted(outcomes.items())) or "-"
        lines.append(
            f"{name!s:<14}{_count(m.get('queued')):>8}{_count(m.get('workers')):>9}"
            f"{_count(m.get('busy_workers')):>6}{_count(m.get('batches')):>10}"
            f"{_count(m.get('requests')):>11}{_ms(m.get('mean_batch_size')):>9}"
            f"{_ms(m.get('queue_ms_p50')) + ' / ' + _ms(m.get('queue_ms_p99')):>19}"
            f"{_ms(m.get('infer_ms_p50')) + ' / ' + _ms(m.get('infer_ms_p99')):>19}  {outcome_text}"
        )
    extras = {
        "workers lost": _count(snapshot.get("workers_lost", 0)),
        "batches retried": _count(snapshot.get("batches_retried", 0)),
        "undeliverable replies": _count(snapshot.get("undeliverable", 0)),
        "refused (no model)": _total(snapshot.get("refused_without_model", {})),
    }
    lines.append("  ".join(f"{k}: {v}" for k, v in extras.items()))
    if snapshot.get("stopping"):
        lines.append("the broker is draining (shutting down)")
    return "\n".join(lines)
