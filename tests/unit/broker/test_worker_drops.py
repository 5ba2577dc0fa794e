"""A worker's dropped trace spans, said in its heartbeats (docs/protocol.md 6.6), counted
once per model by the broker's stats however often the same count is said again."""

from __future__ import annotations

from types import SimpleNamespace

from batcher.broker.stats import BrokerStats
from batcher.wire import protocol


def said(n: object) -> list[bytes]:
    return [protocol.pack({"trace_spans_dropped": n})]


def test_each_workers_growth_is_added_to_its_model_once_and_bad_frames_are_ignored() -> None:
    stats = BrokerStats()
    a, b = SimpleNamespace(model="m"), SimpleNamespace(model="m")
    stats.worker_said(a, b"a", said(3))
    stats.worker_said(a, b"a", said(3))  # said again: nothing new
    stats.worker_said(b, b"b", said(2))
    stats.worker_said(a, b"a", said(5))
    for bad in ([b"\xc1"], said(-1), said("7"), said(True), [protocol.pack([1])], []):
        stats.worker_said(a, b"a", bad)
    stats.worker_said(None, b"gone", said(9))  # a worker no longer known
    assert dict(stats.worker_spans_dropped) == {"m": 7}
