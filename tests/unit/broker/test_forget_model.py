"""A model the broker forgot (one only workers announced, none serving it now) leaves
nothing behind in the stats or the Prometheus registry (BrokerStats.forget)."""

from __future__ import annotations

import pytest

from batcher.broker.stats import BrokerStats
from batcher.core.scheduler import Scheduler
from batcher.wire import protocol
from batcher.wire.protocol import ErrorCode


def series_of(stats: BrokerStats, model: str) -> list[str]:
    registry = stats.metrics.registry  # type: ignore[attr-defined]
    return [
        sample.name
        for family in registry.collect()
        for sample in family.samples
        if sample.labels.get("model") == model
    ]


def test_a_forgotten_model_leaves_no_counts_and_no_series_and_the_others_keep_theirs() -> None:
    pytest.importorskip("prometheus_client")
    from batcher.broker.metrics import PrometheusMetrics

    stats = BrokerStats(metrics=PrometheusMetrics(lambda: {}))
    info = type("Info", (), {"model": "gone"})()
    for model in ("gone", "kept"):
        stats.metrics.worker_event(model, "joined")
        stats.metrics.worker_event(model, "died")
        stats.batch_answered(model, [0.0, 0.1], 0.2, 1.0, 2.0, 1.0, 1, 0, (3, 5), 0.5)
        stats.count(model, ErrorCode.WORKER_FAILED)
        stats.sequence_cancelled(model, "client_gone")
        stats.chunk(model, True, 0.1, 0.5)
        stats.metrics.model_loaded(model, 0.1)
        stats.metrics.model_unloaded(model)
    stats.worker_said(info, b"w", [protocol.pack({"trace_spans_dropped": 3})])
    scheduler = Scheduler(models=["gone", "kept"])
    stats.autoscale.tick(0.0, scheduler.views())
    assert set(stats.autoscale._windows) == {"gone", "kept"}
    assert series_of(stats, "gone") and "gone" in stats.models and stats.worker_spans_dropped["gone"] == 3
    kept = series_of(stats, "kept")
    stats.forget("gone")
    assert series_of(stats, "gone") == []
    assert "gone" not in stats.models and "gone" not in stats.worker_spans_dropped
    assert series_of(stats, "kept") == kept
    assert set(stats.autoscale._windows) == {"kept"}
    BrokerStats().forget("never")  # without metrics, and a model never counted: nothing to do
