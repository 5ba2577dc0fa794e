"""`batcher stats`: the broker's `stats` control reply as a table per model.

The table is built from whatever the broker sends: a missing field, a NaN or an
infinity (a worker may report one) prints as `-` rather than failing the command or
printing `nan` as if it were a measurement. Columns are as wide as their widest cell,
so long model names and large counts keep the table aligned.

`stats --watch` also shows rates, computed here from two snapshots: the broker keeps
totals only, and a rate over the refresh interval is what a person watching wants.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
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


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _total(values: Any) -> str:
    if not isinstance(values, dict):
        return "-"
    numbers = [_number(v) for v in values.values()]
    return str(sum(n for n in numbers if n is not None))


def _signature(value: Any) -> str:
    """A model's signature as `inputs x FP32 [-1, 4]; outputs y FP32 [-1, 3]` ("" if none)."""
    if not isinstance(value, dict):
        return ""

    def specs(key: str) -> str:
        items = value.get(key)
        if not isinstance(items, list):
            return "-"
        return (
            ", ".join(
                f"{t.get('name')} {t.get('datatype')} {t.get('shape')}" for t in items if isinstance(t, dict)
            )
            or "-"
        )

    return f"inputs {specs('inputs')}; outputs {specs('outputs')}"


def _models(snapshot: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The snapshot's models, each a dict (an odd entry becomes an empty one)."""
    models = snapshot.get("models")
    if not isinstance(models, dict):
        return {}
    return {str(name): (m if isinstance(m, dict) else {}) for name, m in models.items()}


@dataclass(frozen=True)
class Rates:
    """One model's rates per second between two snapshots. None where they cannot be
    told: a field missing or odd, or a counter that went down (the broker restarted)."""

    requests_s: float | None  # requests answered, whatever the outcome: ok_s + errors_s
    ok_s: float | None
    errors_s: float | None
    batches_s: float | None


def _answered(model: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """(requests answered, of which ok) from a model's `outcomes`."""
    outcomes = model.get("outcomes", {})
    if not isinstance(outcomes, dict):
        return None, None
    numbers = [_number(v) for v in outcomes.values()]
    if any(n is None for n in numbers):
        return None, None
    ok = _number(outcomes.get("ok", 0))
    return float(sum(n for n in numbers if n is not None)), None if ok is None else float(ok)


def _errors(total: float | None, ok: float | None) -> float | None:
    return None if total is None or ok is None else total - ok


def _per_second(now: float | None, before: float | None, elapsed_s: float) -> float | None:
    if now is None or before is None or now < before:
        return None
    return (now - before) / elapsed_s


def compute_rates(
    previous: Mapping[str, Any], current: Mapping[str, Any], elapsed_s: float
) -> dict[str, Rates]:
    """Each model's rates between two `stats` snapshots taken `elapsed_s` apart. A model
    absent from `previous` is new since: its counters started from 0."""
    if not elapsed_s > 0 or not math.isfinite(elapsed_s):
        raise ValueError(f"elapsed_s must be a finite number > 0, got {elapsed_s}")
    before_models = _models(previous)
    out = {}
    for name, now in _models(current).items():
        before = before_models.get(name, {"batches": 0, "outcomes": {}})
        total_now, ok_now = _answered(now)
        total_before, ok_before = _answered(before)
        requests_s = _per_second(total_now, total_before, elapsed_s)
        ok_s = _per_second(ok_now, ok_before, elapsed_s)
        errors_s = None  # only where both others are known: a restart can leave errors at 0
        if requests_s is not None and ok_s is not None:
            errors_s = _per_second(_errors(total_now, ok_now), _errors(total_before, ok_before), elapsed_s)
        batches_s = _per_second(_number(now.get("batches")), _number(before.get("batches")), elapsed_s)
        out[name] = Rates(requests_s, ok_s, errors_s, batches_s)
    return out


#: The table's columns: header and alignment (`<` left, `>` right). Outcomes come last.
_COLUMNS = (
    ("model", "<"),
    ("queued", ">"),
    ("workers", ">"),
    ("busy", ">"),
    ("batches", ">"),
    ("requests", ">"),
    ("mean bs", ">"),
    ("queue p50/p99 ms", ">"),
    ("infer p50/p99 ms", ">"),
)
_RATE_COLUMNS = (("req/s", ">"), ("ok/s", ">"), ("err/s", ">"), ("batch/s", ">"))
_GAP = "  "


def format_stats(snapshot: Mapping[str, Any], rates: Mapping[str, Rates] | None = None) -> str:
    """A table with one row per model, then the broker-wide counters. With `rates` (even
    empty: `--watch` before its second snapshot), rate columns too."""
    columns = _COLUMNS + (_RATE_COLUMNS if rates is not None else ())
    rows: list[tuple[list[str], str]] = []
    for name, m in sorted(_models(snapshot).items()):
        outcomes = m.get("outcomes")
        outcomes = outcomes if isinstance(outcomes, dict) else {}
        outcome_text = ", ".join(f"{k}: {_count(v)}" for k, v in sorted(outcomes.items())) or "-"
        cells = [
            name,
            _count(m.get("queued")),
            _count(m.get("workers")),
            _count(m.get("busy_workers")),
            _count(m.get("batches")),
            _count(m.get("requests")),
            _ms(m.get("mean_batch_size")),
            _ms(m.get("queue_ms_p50")) + " / " + _ms(m.get("queue_ms_p99")),
            _ms(m.get("infer_ms_p50")) + " / " + _ms(m.get("infer_ms_p99")),
        ]
        if rates is not None:
            r = rates.get(name)
            values = (r.requests_s, r.ok_s, r.errors_s, r.batches_s) if r else (None,) * 4
            cells += [_rate(v) for v in values]
        rows.append((cells, outcome_text))
    widths = [max([len(h)] + [len(cells[i]) for cells, _ in rows]) for i, (h, _) in enumerate(columns)]

    def line(cells: list[str], last: str) -> str:
        padded = [f"{c:{align}{w}}" for c, (_, align), w in zip(cells, columns, widths, strict=True)]
        return _GAP.join([*padded, last])

    header = line([h for h, _ in columns], "outcomes")
    lines = [header, "-" * len(header), *(line(cells, last) for cells, last in rows)]
    extras = {
        "workers lost": _count(snapshot.get("workers_lost", 0)),
        "batches retried": _count(snapshot.get("batches_retried", 0)),
        "undeliverable replies": _count(snapshot.get("undeliverable", 0)),
        "refused (no model)": _total(snapshot.get("refused_without_model", {})),
    }
    lines.append("  ".join(f"{k}: {v}" for k, v in extras.items()))
    for name, m in sorted(_models(snapshot).items()):
        signature = _signature(m.get("signature"))
        if signature:
            lines.append(f"{name}: {signature}")
        streams = _streams(m)
        if streams:
            lines.append(f"{name}: {streams}")
        if m.get("multiplexed") is True:
            lines.append(f"{name}: {_multiplexed(m)}")
        scaling = _scaling(m)
        if scaling:
            lines.append(f"{name}: {scaling}")
    lines += _versions(snapshot.get("versions"))
    if snapshot.get("stopping"):
        lines.append("the broker is draining (shutting down)")
    return "\n".join(lines)


def _percent(value: Any) -> str:
    n = _number(value)
    return "-" if n is None else f"{100 * n:.1f}%"


def _versions(value: Any) -> list[str]:
    """One line per repository model: its served versions, its split and each version's
    share of the requests that named none (docs/models.md)."""
    if not isinstance(value, dict):
        return []
    lines = []
    for name, v in sorted(value.items()):
        if not isinstance(v, dict):
            continue
        served = ", ".join(map(str, v.get("served") or [])) or "none"
        traffic = v.get("traffic")
        split = (
            " ".join(f"{k}={w}" for k, w in traffic.items())
            if isinstance(traffic, dict)
            else "all to the newest"
        )
        routed, share = v.get("routed"), v.get("share")
        shares = (
            ", ".join(f"{k}: {_count(n)} ({_percent(share.get(k))})" for k, n in routed.items())
            if isinstance(routed, dict) and isinstance(share, dict)
            else ""
        )
        lines.append(f"{name}: versions {served}; split {split}; routed {shares or '-'}")
    return lines


def _multiplexed(model: Mapping[str, Any]) -> str:
    """A multiplexed model's placement and loads in one line."""
    return (
        f"multiplexed: held by {_count(model.get('held_by'))} of {_count(model.get('workers'))} workers; "
        f"cold loads {_count(model.get('cold_loads'))} ({_ms(model.get('cold_load_ms_total'))} ms in all, "
        f"max {_ms(model.get('cold_load_ms_max'))}); unloads {_count(model.get('unloads'))}"
    )


def _streams(model: Mapping[str, Any]) -> str:
    """A step-level model's sequences in one line ("" for a model that has had none)."""
    if not _number(model.get("sequences")) and not _number(model.get("active_sequences")):
        return ""
    cancelled = model.get("sequences_cancelled")
    cancelled_text = (
        ", ".join(f"{k} {_count(v)}" for k, v in sorted(cancelled.items()))
        if isinstance(cancelled, dict)
        else ""
    )
    first = f"{_ms(model.get('first_chunk_ms_p50'))} / {_ms(model.get('first_chunk_ms_p99'))}"
    return (
        f"sequences {_count(model.get('active_sequences'))} active, {_count(model.get('sequences'))} in all; "
        f"chunks {_count(model.get('chunks'))} ({_rate(_number(model.get('chunks_per_s')))}/s); "
        f"first chunk p50/p99 {first} ms; cancelled: {cancelled_text or 'none'}"
    )


def _scaling(model: Mapping[str, Any]) -> str:
    """The autoscaling signal (docs/kubernetes.md, Scaling), once the broker has one."""
    entry = model.get("scaling")
    if not isinstance(entry, dict) or _number(entry.get("desired_workers")) is None:
        return ""
    text = (
        f"scaling: {_rate(_number(entry.get('offered_per_s')))} req/s offered needs "
        f"{_count(entry.get('desired_workers'))} workers ({_ms(entry.get('workers_needed'))} before "
        f"rounding up) at target {_count(entry.get('target_utilization'))}"
    )
    if _number(entry.get("desired_cells")) is not None:
        text += f": {_count(entry.get('desired_cells'))} cells of {_count(entry.get('cell_workers'))}"
    return text
