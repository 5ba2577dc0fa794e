"""`batcher bench`: the load generator's settings, result merging and a real run."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from batcher.bench import LoadSettings, ShardResult, format_report, merge, new_histogram


def test_settings_reject_ambiguous_load() -> None:
    with pytest.raises(ValueError, match="exactly one of concurrency"):
        LoadSettings(connect="tcp://127.0.0.1:1", concurrency=4, rate=10.0)
    with pytest.raises(ValueError, match="exactly one of concurrency"):
        LoadSettings(connect="tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="exactly one of duration_s or requests"):
        LoadSettings(connect="tcp://127.0.0.1:1", concurrency=4, duration_s=1.0, requests=10)
    with pytest.raises(ValueError, match="concurrency must be >= 1, got 0"):
        LoadSettings(connect="tcp://127.0.0.1:1", concurrency=0)


def test_shards_split_the_load_exactly() -> None:
    s = LoadSettings(connect="tcp://x", concurrency=10, duration_s=None, requests=101, processes=3)
    shards = [s.shard(i) for i in range(3)]
    assert sum(sh.concurrency or 0 for sh in shards) == 10
    assert sum(sh.requests or 0 for sh in shards) == 101
    open_loop = LoadSettings(connect="tcp://x", rate=90.0, processes=3)
    assert [sh.rate for sh in (open_loop.shard(i) for i in range(3))] == [30.0, 30.0, 30.0]


def _shard(latencies_us: list[int], sizes: Counter[int], sent: int) -> ShardResult:
    hist = new_histogram()
    for v in latencies_us:
        hist.record_value(v)
    return ShardResult(
        sent=sent,
        ok=len(latencies_us),
        batch_sizes=sizes,
        histogram=hist.encode(),
        measured_s=2.0,
        wall_s=2.0,
    )


def test_merge_adds_histograms_and_counts_batches() -> None:
    settings = LoadSettings(connect="tcp://x", concurrency=8, duration_s=2.0)
    a = _shard([1000] * 90, Counter({4: 8}), 90)  # 90 requests answered in 1 ms
    b = _shard([50_000] * 10, Counter({4: 4, 2: 2}), 11)  # 10 in 50 ms, one lost
    b.lost = 1
    result = merge(settings, [a, b])
    assert result.sent == 101 and result.ok == 100 and result.lost == 1
    assert result.throughput_rps == pytest.approx(50.0)
    assert result.latency_ms["p50"] == pytest.approx(1.0, rel=0.01)
    assert result.latency_ms["p99"] == pytest.approx(50.0, rel=0.01)
    # 12 requests in batches of 4 are 3 batches, 2 requests in batches of 2 are 1 batch
    assert result.batch_sizes == {2: 1, 4: 3}
    assert result.mean_batch_size == pytest.approx(14 / 4)
    assert "p99.9" in format_report(result)


@pytest.mark.integration
def test_bench_spawn_measures_a_real_broker(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "batcher",
            "bench",
            "--spawn",
            "--model",
            "sim",
            "--workers",
            "2",
            "--sim-base-ms",
            "2",
            "--sim-per-item-ms",
            "0.5",
            "--max-batch-size",
            "8",
            "--concurrency",
            "16",
            "--requests",
            "400",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "throughput:" in proc.stdout and "latency ms:" in proc.stdout
    data = json.loads(out.read_text())
    assert data["sent"] == 400 and data["ok"] == 400 and data["lost"] == 0 and data["errors"] == {}
    assert data["throughput_rps"] > 0
    assert set(data["latency_ms"]) >= {"p50", "p90", "p99", "p99.9", "max"}
    assert data["latency_ms"]["p50"] <= data["latency_ms"]["p99"] <= data["latency_ms"]["max"]
    sizes = {int(k): v for k, v in data["batch_sizes"].items()}
    assert max(sizes) <= 8 and max(sizes) > 1  # 16 in flight against 2 workers: real batches
    assert sum(k * v for k, v in sizes.items()) == 400


@pytest.mark.integration
def test_bench_open_loop_reports_rate(tmp_path: Path) -> None:
    out = tmp_path / "open.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "batcher",
            "bench",
            "--spawn",
            "--model",
            "echo",
            "--workers",
            "1",
            "--rate",
            "200",
            "--duration",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["settings"]["rate"] == 200.0
    assert data["ok"] == data["sent"] > 100  # about 200 at 200/s for 1 s, Poisson
    assert "kept_up" in data["client"]
