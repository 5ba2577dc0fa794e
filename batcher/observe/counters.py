"""The spans this process dropped, counted without importing opentelemetry: the export
thread adds to it, the metrics endpoint (`batcher_trace_spans_dropped_total`) and
`stats` read it, whether tracing is on or not (0 then)."""

from __future__ import annotations

import threading

_lock = threading.Lock()
_dropped = [0]


def spans_dropped() -> int:
    """Spans this process dropped so far: its export queue was full, or their export failed."""
    return _dropped[0]


def count_dropped(n: int) -> None:
    """Add `n` dropped spans (from any thread)."""
    with _lock:
        _dropped[0] += n
