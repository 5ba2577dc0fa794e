"""The spans this process dropped, counted without importing opentelemetry: the export
thread adds to it, the metrics endpoint (`batcher_trace_spans_dropped_total`) and
`stats` read it, whether tracing is on or not (0 then)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

_lock = threading.Lock()
_dropped = [0]


def spans_dropped() -> int:
    """Spans this process dropped so far: its export queue was full, or their export failed."""
    return _dropped[0]


def count_dropped(n: int) -> None:
    """Add `n` dropped spans (from any thread)."""
    with _lock:
        _dropped[0] += n


class DroppedSpans:
    """A Prometheus collector of `batcher_trace_spans_dropped_total`, the count above, for
    the registry of each process that exports spans (broker, gateway); prometheus_client
    is imported only when it is collected."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        yield CounterMetricFamily(
            "batcher_trace_spans_dropped",
            "Trace spans dropped: the export queue was full, or the collector failed or was down",
            value=spans_dropped(),
        )
