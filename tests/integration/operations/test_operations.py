"""Operating a broker: Prometheus metrics, `batcher stats`, JSON logs, the config file.

What docs/operations.md promises, checked against real processes; the example config
(docs/batcher.example.toml) is loaded both in-process and by a real `batcher serve`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import time
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import psutil
import pytest
import zmq
from click.testing import CliRunner

import batcher.cli.commands
import batcher.cli.serve_commands
from batcher.broker.loop import BrokerSettings
from batcher.client.sync import BatcherError, Cancelled, Client
from batcher.serve.launcher import free_tcp_address
from tests.helpers import FLAT_SIM, broker_stats, pack, recv_replies, sample, scrape, start_broker, wait_until

EXAMPLE = Path(__file__).resolve().parents[3] / "docs" / "batcher.example.toml"


def free_port() -> int:
    port = urlparse(free_tcp_address()).port
    assert port is not None
    return port


# --- metrics ------------------------------------------------------------------------------------


@pytest.mark.integration
def test_metrics_port_serves_counters_histograms_and_gauges(serve, client):
    port = free_port()
    # The sim model at 5 ms a batch whatever its size: the model time the metrics report is known.
    sp = serve(
        "--workers", "1", "--model", "sim", *FLAT_SIM, "--max-wait-ms", "2", "--metrics-port", str(port),
        workers=1,
    )  # fmt: skip
    c = client(sp.frontend)
    started = time.monotonic()
    assert [out["echo"] for out in c.request_many(range(50))] == list(range(50))
    elapsed_s = time.monotonic() - started
    with pytest.raises(BatcherError):
        c.request("x", model="nope")
    stats = c.control("stats")["models"]["sim"]

    m = scrape(port)
    assert sample(m, "batcher_requests_total", model="sim", outcome="ok") == 50
    # Refused before it had a model of ours: counted under model="".
    assert sample(m, "batcher_requests_total", model="", outcome="unknown_model") == 1
    batches = stats["batches"]
    assert sample(m, "batcher_batch_size_count", model="sim") == batches
    assert sample(m, "batcher_batch_size_sum", model="sim") == 50
    assert sample(m, "batcher_batch_size_bucket", model="sim", le="+Inf") == batches
    assert sample(m, "batcher_queue_wait_seconds_count", model="sim") == 50
    assert sample(m, "batcher_queue_wait_seconds_bucket", model="sim", le="10.0") == 50
    assert sample(m, "batcher_inference_seconds_count", model="sim") == batches
    # Every batch cost the model at least its 5 ms; the one worker ran them one after the
    # other while the requests were out, so their sum fits in the time they took.
    inference_s = sample(m, "batcher_inference_seconds_sum", model="sim")
    assert batches * 0.005 * 0.999 <= inference_s <= elapsed_s, (batches, inference_s, elapsed_s)
    assert sample(m, "batcher_queue_depth", model="sim") == 0
    assert sample(m, "batcher_workers", model="sim") == 1
    assert sample(m, "batcher_batches_in_flight", model="sim") == 0
    assert sample(m, "batcher_worker_events_total", model="sim", event="joined") == 1


@pytest.mark.integration
def test_queue_depth_and_workers_gauges_follow_the_broker(spawn, zctx):
    port = free_port()
    frontend, _ = start_broker(spawn, zctx, "--model", "sim", "--metrics-port", str(port))
    with Client(frontend, timeout_s=10, context=zctx) as c:
        pendings = [c.submit(i) for i in range(5)]  # no worker: they stay queued
        wait_until(lambda: broker_stats(frontend, zctx)["models"]["sim"]["queued"] == 5, 10, "5 queued")
        m = scrape(port)
        assert sample(m, "batcher_queue_depth", model="sim") == 5
        assert sample(m, "batcher_workers", model="sim") == 0
        for p in pendings:
            p.cancel()
        for p in pendings:
            with pytest.raises(Cancelled):
                p.result()
    m = scrape(port)
    assert sample(m, "batcher_queue_depth", model="sim") == 0
    assert sample(m, "batcher_requests_total", model="sim", outcome="cancelled") == 5


# --- batcher stats ------------------------------------------------------------------------------


@pytest.mark.integration
def test_stats_command_prints_a_table_and_json(serve, client, cli):
    sp = serve("--workers", "1", "--model", "echo", "--model", "sim", "--sim-base-ms", "1", workers=2)
    client(sp.frontend).request_many(range(20), model="echo")

    table = cli("stats", "--connect", sp.frontend)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:3] == ["model", "queued", "workers"], table.stdout
    # The model rows: between the rule and the totals line (the lines after it, such as each
    # model's scaling line once the signal has ticked, are no rows).
    end = next(i for i, line in enumerate(lines) if line.startswith("workers lost"))
    rows = {line.split()[0]: line.split() for line in lines[2:end] if line}
    assert set(rows) == {"echo", "sim"}, table.stdout
    assert rows["echo"][1:3] == ["0", "1"] and rows["echo"][5] == "20", rows[
        "echo"
    ]  # queued, workers, requests
    assert "ok: 20" in table.stdout and "workers lost: 0" in table.stdout

    raw = cli("stats", "--connect", sp.frontend, "--json")
    assert raw.returncode == 0, raw.stderr
    snapshot = json.loads(raw.stdout)
    echo = snapshot["models"]["echo"]
    assert echo["queued"] == 0 and echo["workers"] == 1 and echo["requests"] == 20, echo
    assert echo["outcomes"] == {"ok": 20}
    assert snapshot["workers_lost"] == 0 and snapshot["stopping"] is False


@pytest.mark.integration
def test_stats_command_fails_clearly_without_a_broker(cli):
    result = cli("stats", "--connect", free_tcp_address(), "--timeout-s", "0.3", timeout_s=10)
    assert result.returncode == 1, result
    assert "no stats from" in result.stderr and "Traceback" not in result.stderr, result.stderr


# --- logs ---------------------------------------------------------------------------------------


def json_lines(path: str) -> list[dict[str, Any]]:
    """Every line of a JSON-format log file, parsed (a line that does not parse fails)."""
    lines = Path(path).read_text().splitlines()
    out = []
    for line in lines:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            pytest.fail(f"not a JSON log line: {line!r}")
        assert {"ts", "level", "logger", "pid", "message"} <= set(entry), entry
        out.append(entry)
    return out


@pytest.mark.integration
def test_json_logs_one_line_per_worker_event_and_none_per_request(serve, spawn, client, zctx):
    sp = serve(
        "--workers", "1", "--model", "echo", "--log-format", "json", "--heartbeat-ms", "100", workers=1
    )
    assert sp.process is not None and sp.stderr is not None
    log_path = sp.stderr.name

    def broker_lines(text: str) -> list[dict[str, Any]]:
        return [e for e in json_lines(log_path) if e["pid"] == sp.process.pid and text in e["message"]]

    joined = broker_lines("worker joined")
    assert len(joined) == 1 and joined[0]["level"] == "INFO" and joined[0]["logger"] == "batcher.broker"

    # Traffic: not one line, at INFO, from the broker or its workers.
    before = json_lines(log_path)
    c = client(sp.frontend)
    for _ in range(3):
        assert c.request_many(range(100)) == list(range(100))
    c.control("stats")
    assert json_lines(log_path) == before, "log lines written per request at INFO"

    # Leave: a worker started apart, stopped with SIGTERM.
    extra = spawn("worker", "--connect", sp.backend, "--model", "echo", "--heartbeat-ms", "100",
                  "--log-format", "json")  # fmt: skip
    wait_until(lambda: len(broker_lines("worker joined")) == 2, 10, "the extra worker joined")
    os.kill(extra.pid, signal.SIGTERM)
    assert extra.process.wait(timeout=10) == 0
    wait_until(lambda: broker_lines("left"), 10, "the broker logged the worker leaving")
    assert all(e["level"] == "INFO" for e in broker_lines("left"))
    assert json_lines(str(extra.stderr_path)), "the worker's own log is JSON too"

    # Death and respawn: SIGKILL serve's worker.
    (worker_pid,) = [p.pid for p in psutil.Process(sp.process.pid).children()]
    os.kill(worker_pid, signal.SIGKILL)
    wait_until(lambda: len(broker_lines("worker joined")) == 3, 10, "the respawned worker joined")
    wait_until(lambda: broker_lines("taken for dead"), 10, "the broker logged the death")
    respawning = broker_lines("respawning")
    assert len(respawning) == 1 and respawning[0]["level"] == "WARNING", respawning
    assert f"pid {worker_pid}" in respawning[0]["message"]
    assert len(broker_lines("taken for dead")) == 1 and len(broker_lines("left")) == 1
    assert c.request_many(range(10)) == list(range(10))


# --- the configuration file ---------------------------------------------------------------------


def settings_from_cli(*args: str, env: dict[str, str] | None = None) -> BrokerSettings:
    """The BrokerSettings `batcher ARGS` would run with; nothing is started."""
    captured: list[BrokerSettings] = []
    real = batcher.cli.serve_commands.broker_settings

    def capture(*a: Any, **kw: Any) -> BrokerSettings:
        captured.append(real(*a, **kw))
        raise SystemExit(0)

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level  # the commands set up logging their way
    batcher.cli.serve_commands.broker_settings = capture  # where serve and broker look it up
    try:
        result = CliRunner().invoke(batcher.cli.commands.main, list(args), env=env)
    finally:
        batcher.cli.serve_commands.broker_settings = real
        root.handlers[:], root.level = handlers, level
    assert result.exit_code == 0 and captured, (result.output, result.exception)
    return captured[0]


@pytest.mark.parametrize("command", ["serve", "broker"])
def test_example_config_sets_every_option(command):
    with EXAMPLE.open("rb") as f:
        example = tomllib.load(f)
    s = settings_from_cli(command, "--config", str(EXAMPLE))
    assert s.frontend == example["frontend"] and s.backend == example["backend"]
    b = s.batch
    assert (b.max_batch_size, b.max_wait_ms, b.policy, b.max_queue) == (
        example["max_batch_size"],
        example["max_wait_ms"],
        example["policy"],
        example["max_queue"],
    )
    assert b.batch_sizes == tuple(example["batch_sizes"])
    assert s.default_timeout_ms == example["default_timeout_ms"]
    assert s.worker_prefetch == example["worker_prefetch"]
    assert s.max_retries == example["max_retries"]
    assert s.max_message_bytes == example["max_message_bytes"]
    assert s.heartbeat.interval_ms == example["heartbeat_ms"]
    assert s.heartbeat.liveness == example["heartbeat_liveness"]
    assert s.metrics_port is None  # commented out in the example
    assert s.cache_bytes == example["cache_bytes"]
    assert s.cache_models == tuple(n for n, t in example["models"].items() if t.get("cache"))
    assert set(s.per_model) == set(example["models"]) == {"sim", "echo"}
    for name, table in example["models"].items():
        for key, value in table.items():
            if key == "cache":  # not a batching setting: cache_models, above
                continue
            got = getattr(s.per_model[name], key)
            assert got == (tuple(value) if key == "batch_sizes" else value), (name, key, got)
    # What the tables leave out comes from the top level.
    assert s.per_model["echo"].max_wait_ms == example["max_wait_ms"]


def test_example_config_sets_the_model_list():
    s = settings_from_cli("serve", "--config", str(EXAMPLE))
    assert s.models == ("sim", "echo"), s.models


def test_example_config_leaves_bench_model_alone():
    ctx = batcher.cli.commands.bench.make_context("bench", ["--config", str(EXAMPLE), "--spawn"])
    assert ctx.params["model"] is None, ctx.params["model"]


@pytest.mark.integration
def test_serve_runs_with_the_example_config(serve, client):
    # The flags name the models and keep the test small and off
    # the example's ports; everything else comes from the file.
    sp = serve("--config", str(EXAMPLE), "--workers", "1", "--model", "sim", "--model", "echo",
               "--sim-base-ms", "1", workers=2)  # fmt: skip
    c = client(sp.frontend)
    assert c.request("hi", model="echo") == "hi"
    assert c.request("hi")["echo"] == "hi"  # sim, the first model, is the default
    models = c.control("stats")["models"]
    assert (models["sim"]["max_batch_size"], models["sim"]["max_wait_ms"], models["sim"]["policy"]) == (
        32,
        10.0,
        "window",
    )
    assert (models["echo"]["max_batch_size"], models["echo"]["max_queue"]) == (4, 1000)
    assert models["echo"]["policy"] == "adaptive"  # from the top level


@pytest.mark.integration
def test_flag_beats_environment_beats_file_beats_default(spawn, tmp_path, zctx):
    config = tmp_path / "batcher.toml"
    config.write_text(
        "max_batch_size = 4\nmax_wait_ms = 3\nmax_queue = 77\n\n[models.other]\nmax_batch_size = 2\n"
    )
    frontend = free_tcp_address()
    spawn(
        "broker", "--config", str(config), "--frontend", frontend, "--backend", free_tcp_address(),
        "--max-queue", "33",
        env={"BATCHER_MAX_BATCH_SIZE": "6", "BATCHER_MAX_QUEUE": "55", "BATCHER_POLICY": None},
    )  # fmt: skip
    models = wait_until(lambda: broker_stats(frontend, zctx).get("models"), 15, "the broker answering")
    sim = models["sim"]
    assert sim["max_queue"] == 33  # flag, over environment and file
    assert sim["max_batch_size"] == 6  # environment, over file
    assert sim["max_wait_ms"] == 3.0  # file, over default
    assert sim["policy"] == "adaptive"  # default
    assert models["other"]["max_batch_size"] == 6  # the environment, over its table
    assert models["other"]["max_queue"] == 33  # the rest as for every model


def test_flag_beats_environment_beats_file_in_process(tmp_path):
    config = tmp_path / "batcher.toml"
    config.write_text('max_batch_size = 4\nmax_wait_ms = 3\nmax_queue = 77\npolicy = "window"\n')
    env = {"BATCHER_MAX_BATCH_SIZE": "6", "BATCHER_MAX_QUEUE": "55"}
    s = settings_from_cli("broker", "--config", str(config), "--max-queue", "33", env=env)
    assert (s.batch.max_queue, s.batch.max_batch_size, s.batch.max_wait_ms) == (33, 6, 3.0)
    assert s.batch.policy == "window"
    s = settings_from_cli("broker", "--config", str(config), env={"BATCHER_POLICY": "adaptive"})
    assert s.batch.policy == "adaptive" and s.batch.max_queue == 77
    s = settings_from_cli("broker")
    assert (s.batch.max_batch_size, s.batch.max_queue) == (8, 10_000)  # the defaults


@pytest.mark.integration
def test_max_batch_cost_caps_what_a_batch_sums_to(serve, connect, zctx):
    """Eight requests of cost 2 with --max-batch-cost 4 go in batches of 2 (without the cap,
    --max-batch-size 8 would take them in one); a request of cost 9 runs alone."""
    s = serve(
        "--model", "echo", "--workers", "1", "--max-batch-size", "8", "--max-wait-ms", "200",
        "--policy", "window", "--max-batch-cost", "4", workers=1,
    )  # fmt: skip
    sock = connect(zmq.DEALER, s.frontend)
    for i in range(8):
        sock.send_multipart([b"", pack({"id": i, "input": i, "cost": 2})])
    replies = recv_replies(sock, 8)
    assert sorted(r["id"] for r in replies) == list(range(8)) and all(r["ok"] for r in replies)
    assert [r["batch_size"] for r in replies] == [2] * 8
    sock.send_multipart([b"", pack({"id": "big", "input": 0, "cost": 9})])
    (big,) = recv_replies(sock, 1)
    assert big["ok"] and big["batch_size"] == 1
    assert broker_stats(s.frontend, zctx)["models"]["echo"]["max_batch_cost"] == 4.0


@pytest.mark.integration
def test_metrics_host_names_the_address_the_endpoint_listens_on(spawn):
    """--metrics-host localhost (127.0.0.1 here: tests bind nothing else) reaches the
    endpoint, and the log says where it is."""
    port = free_port()
    proc = spawn(
        "broker", "--frontend", free_tcp_address(), "--backend", free_tcp_address(),
        "--metrics-port", str(port), "--metrics-host", "localhost",
    )  # fmt: skip
    wait_until(lambda: _scraped(port), 20, "metrics served")
    wait_until(
        lambda: f"metrics at http://localhost:{port}/metrics" in proc.stderr_path.read_text(), 10, "logged"
    )


def _scraped(port: int) -> bool:
    try:
        return bool(scrape(port))
    except OSError:
        return False


# --- the Grafana dashboard ---------------------------------------------------------------------------

DASHBOARD = Path(__file__).resolve().parents[3] / "docs" / "grafana-dashboard.json"


def test_grafana_dashboard_is_an_importable_dashboard_with_the_promised_panels():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["__inputs"][0]["pluginId"] == "prometheus"  # Grafana asks for the data source
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    titles = " | ".join(p["title"] for p in panels).lower()
    for wanted in (
        "outcome",
        "latency",
        "queue wait",
        "batch size",
        "queue depth",
        "workers",
        "worker events",
        "chunks per second",
        "time to first chunk",
    ):
        assert wanted in titles, wanted
    for p in panels:
        assert p["targets"] and all(
            t["expr"] and t["datasource"]["uid"] == "${DS_PROMETHEUS}" for t in p["targets"]
        )


@pytest.mark.integration
def test_every_metric_the_dashboard_uses_is_served(serve, client):
    """The names in the dashboard's queries, against a live broker's /metrics."""
    port = free_port()
    sp = serve(
        "--workers", "1", "--model", "sim", "--model", "simlm", *FLAT_SIM, "--simlm-step-base-ms", "1",
        "--metrics-port", str(port), workers=2,
    )  # fmt: skip
    c = client(sp.frontend)
    assert len(c.request_many(range(10))) == 10
    with pytest.raises(BatcherError):
        c.request("x", model="nope")
    assert list(c.stream({"tokens": 3}, model="simlm")) == [0, 1, 2]
    with c.stream({"tokens": 100_000}, model="simlm") as tokens:
        assert next(tokens) == 0  # then cancelled, leaving the block: a cancellation counted
    wait_until(lambda: "batcher_sequences_cancelled_total" in {n for n, _ in scrape(port)}, 10, "a cancel")
    served = {name for name, _ in scrape(port)}
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    used = set(re.findall(r"\b(batcher_[a-z_]+)", " ".join(exprs)))
    assert used and used <= served, sorted(used - served)


@pytest.mark.integration
def test_priority_aging_reaches_the_broker_from_the_file_and_a_model_table(serve, zctx, tmp_path):
    config = tmp_path / "batcher.toml"
    config.write_text("priority_aging_ms = 100\n[models.echo]\npriority_aging_ms = 25\n")
    s = serve(
        "--model", "echo", "--model", "sim", *FLAT_SIM, "--workers", "1", "--config", str(config), workers=2,
    )  # fmt: skip
    models = broker_stats(s.frontend, zctx, timeout_s=5)["models"]
    assert models["echo"]["priority_aging_ms"] == 25.0 and models["sim"]["priority_aging_ms"] == 100.0
