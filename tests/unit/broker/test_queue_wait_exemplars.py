"""The queue-wait histogram's exemplars (batcher.broker.metrics): a batch's traced
requests are observed with their queue spans' ids, and each bucket ends with the same
exemplar as if every traced request had been given one (the last traced request that
fell in it), its counts and sum unchanged."""

from __future__ import annotations

import random
from typing import Any, NamedTuple

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import Histogram

from batcher.broker.metrics import SECONDS_BUCKETS, PrometheusMetrics, exemplar_of


class Ctx(NamedTuple):
    trace_id: int
    span_id: int


def buckets(histogram: Any) -> list[tuple[str, float, Any]]:
    """(le, count, exemplar labels or None) of every bucket of model `m`."""
    out = []
    for metric in histogram.collect():
        for s in metric.samples:
            if s.name.endswith("_bucket") and s.labels.get("model") == "m":
                out.append((s.labels["le"], s.value, None if s.exemplar is None else s.exemplar.labels))
            elif s.name.endswith("_sum") and s.labels.get("model") == "m":
                out.append(("sum", s.value, None))
    return out


@pytest.mark.parametrize("seed", range(30))
def test_each_bucket_keeps_the_exemplar_every_observation_would_have_left(seed: int) -> None:
    rng = random.Random(seed)
    metrics = PrometheusMetrics(lambda: {})
    reference = Histogram("reference_wait_seconds", "", ["model"], buckets=SECONDS_BUCKETS, registry=None)
    for _ in range(rng.randint(1, 5)):  # a few batches, each of waits in several buckets
        n = rng.randint(1, 40)
        waits_ms = [
            rng.choice([0.2, 0.5, 0.7, 1.0, 3.0, 40.0, 20_000.0, rng.uniform(0, 50)]) for _ in range(n)
        ]
        spans = [None if rng.random() < 0.3 else Ctx(rng.getrandbits(128) or 1, rng.getrandbits(64) or 1)
                 for _ in range(n)]  # fmt: skip
        metrics.queue_waits_ms("m", waits_ms, spans)
        for w, ctx in zip(waits_ms, spans, strict=True):
            reference.labels("m").observe(w / 1000.0, exemplar_of(ctx))
    assert buckets(metrics.queue_wait) == buckets(reference)


def test_untraced_waits_are_counted_without_exemplars() -> None:
    metrics = PrometheusMetrics(lambda: {})
    metrics.queue_waits_ms("m", [0.1, 7.0])
    metrics.queue_waits_ms("m", [0.3], [None])
    got = buckets(metrics.queue_wait)
    assert all(ex is None for _, _, ex in got)
    assert [v for le, v, _ in got if le == "+Inf"] == [3.0]
