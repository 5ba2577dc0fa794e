"""The autoscaling signal of a real `batcher serve` and `batcher broker`: stats' `scaling`
entry and the batcher_desired_workers / batcher_desired_cells gauges under an open-loop
load (batcher bench --rate), and --target-utilization from the flag and the config file."""

from __future__ import annotations

import math
from urllib.parse import urlparse

import pytest

from batcher.serve.launcher import free_tcp_address
from tests.helpers import broker_stats, sample, scrape, start_broker, wait_until

pytestmark = pytest.mark.integration

#: Offered requests a second; the sim model at 5 + 0.5 n ms and batches of at most 8 gives
#: a worker 8 / 9 ms = 889 req/s at full batches, so at a 0.1 target each worker takes 89.
RATE = 300.0


def _port() -> int:
    port = urlparse(free_tcp_address()).port
    assert port is not None
    return port


def test_serve_exports_desired_workers_and_cells_for_the_offered_load(serve, spawn, zctx):
    port = _port()
    sp = serve(
        "--workers", "2", "--model", "sim", "--sim-base-ms", "5", "--sim-per-item-ms", "0.5",
        "--max-batch-size", "8", "--target-utilization", "0.1", "--metrics-port", str(port),
        workers=2,
    )  # fmt: skip
    spawn("bench", "--connect", sp.frontend, "--rate", str(RATE), "--duration", "30", "--warmup-s", "0")

    def loaded() -> dict | None:
        entry = broker_stats(sp.frontend, zctx)["models"]["sim"]["scaling"]
        # the 10 s window holds at least 3 s of the load and the cost is learned
        ok = entry["desired_workers"] is not None and entry["offered_per_s"] > 0.8 * RATE * 3 / 10
        return entry if ok and entry["offered_per_s"] > 0.8 * RATE else None

    entry = wait_until(loaded, 25, "the signal sees the load", interval_s=0.25)
    stats = broker_stats(sp.frontend, zctx)["models"]["sim"]
    a_ms, b_ms = stats["batch_cost_ms"]
    assert entry["target_utilization"] == 0.1
    assert entry["cell_workers"] == 2
    assert entry["scaling_batch_size"] == 8
    assert 0.8 * RATE <= entry["offered_per_s"] <= 1.25 * RATE
    # what the formula gives for the rate and the cost the broker reports (both move a
    # little between the two reads: one worker either way)
    expected = entry["offered_per_s"] * (a_ms + 8 * b_ms) / 1000 / (8 * 0.1)
    assert abs(entry["desired_workers"] - math.ceil(expected)) <= 1, (entry, a_ms, b_ms)
    assert entry["desired_workers"] >= 3  # 300 / 89 = 3.4 on the model's nominal cost
    assert entry["desired_cells"] == math.ceil(entry["desired_workers"] / 2)

    m = scrape(port)
    workers = sample(m, "batcher_desired_workers", model="sim")
    cells = sample(m, "batcher_desired_cells", model="sim")
    assert abs(workers - entry["desired_workers"]) <= 1
    assert workers - 1 < sample(m, "batcher_workers_needed", model="sim") <= workers
    assert cells == math.ceil(workers / 2)


def test_a_plain_broker_has_no_desired_cells_and_reads_the_target_from_its_config(spawn, zctx, tmp_path):
    """A broker's workers join from anywhere: it cannot know a cell's size, so it exports
    desired workers only (0 while no load is offered) and its target comes from the file."""
    config = tmp_path / "batcher.toml"
    config.write_text("target_utilization = 0.5\n")
    port = _port()
    metrics = ("--metrics-port", str(port))
    frontend, _ = start_broker(spawn, zctx, "--model", "sim", "--config", str(config), *metrics)
    entry = wait_until(
        lambda: broker_stats(frontend, zctx)["models"]["sim"]["scaling"]["scaling_batch_size"],
        10,
        "the first scaling tick",
    )
    entry = broker_stats(frontend, zctx)["models"]["sim"]["scaling"]
    assert entry["target_utilization"] == 0.5
    assert entry["desired_workers"] == 0 and entry["desired_cells"] is None
    assert entry["cell_workers"] is None
    m = scrape(port)
    assert sample(m, "batcher_desired_workers", model="sim") == 0
    assert not any(name == "batcher_desired_cells" for name, _ in m)


@pytest.mark.parametrize("value", ["0", "1.5", "nan"])
def test_a_bad_target_utilization_flag_is_a_usage_error(cli, value):
    result = cli("broker", "--target-utilization", value)
    assert result.returncode == 2
    assert "--target-utilization" in result.stderr
