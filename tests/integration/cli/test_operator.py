"""The operator's command line: what decides a value (flag, environment, model table,
file, default), environment variables that mean one thing on every command, `send
--timeout-s`, `keygen` that keeps an existing pair, `stats --watch` rates and a table
that stays aligned, `ready`, `reload`, --no-worker-timeout-ms and GPU placement options.

Real processes where the behaviour is a process's (the `serve`, `spawn` and `cli`
fixtures); in-process checks of the settings the CLI builds where nothing need run.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import stat
import threading
from pathlib import Path
from typing import Any

import click
import pytest

import batcher.cli.commands
import batcher.cli.serve_commands
from batcher.cli.stats_table import Rates, compute_rates, format_stats
from batcher.serve.launcher import free_tcp_address
from batcher.transport.security import generate_keys
from tests.helpers import FLAT_SIM, broker_stats, silent, start_broker, wait_until
from tests.integration.operations.test_operations import settings_from_cli

#: Every test here runs the CLI or a worker as a process of its own.
pytestmark = pytest.mark.integration

OPERATIONS = Path(__file__).resolve().parents[3] / "docs" / "operations.md"
REAL_POOL_SETTINGS = batcher.cli.serve_commands.pool_settings  # before any test replaces it


def addresses() -> list[str]:
    return ["--frontend", free_tcp_address(), "--backend", free_tcp_address()]


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "batcher.toml"
    path.write_text(text)
    return str(path)


def assert_usage_error(result: Any, *expected: str) -> None:
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr, result.stderr
    for text in expected:
        assert text in result.stderr, result.stderr


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """(public, secret) key files of a broker and of a client called alice."""
    return {who: generate_keys(str(tmp_path / "keys" / who), who) for who in ("broker", "alice")}


# --- 1. precedence: command line, environment, model table, file's top level, default -------


def test_flag_and_environment_beat_a_model_table(tmp_path):
    """The defect: `--max-batch-size 16` left a model whose table said 32 at 32."""
    config = write(
        tmp_path,
        "max_batch_size = 4\nmax_queue = 70\n"
        "[models.sim]\nmax_batch_size = 32\nmax_queue = 90\nmax_wait_ms = 7\n"
        "[models.echo]\nmax_wait_ms = 9\n",
    )
    models = ("--model", "sim", "--model", "echo")
    s = settings_from_cli(
        "broker", "--config", config, *models, "--max-batch-size", "16", env={"BATCHER_MAX_QUEUE": "55"}
    )
    sim, echo = s.per_model["sim"], s.per_model["echo"]
    assert sim.max_batch_size == 16  # the flag, over the table
    assert sim.max_queue == 55  # the environment, over the table
    assert sim.max_wait_ms == 7.0  # the table, over the default
    assert (echo.max_batch_size, echo.max_queue, echo.max_wait_ms) == (16, 55, 9.0)

    s = settings_from_cli("broker", "--config", config, *models, env={"BATCHER_MAX_QUEUE": None})
    sim, echo = s.per_model["sim"], s.per_model["echo"]
    assert (sim.max_batch_size, sim.max_queue) == (32, 90)  # the table, over the top level
    assert (echo.max_batch_size, echo.max_queue) == (4, 70)  # the top level, where the table is silent
    assert s.batch.max_wait_ms == 5.0 and echo.policy == "adaptive"  # the defaults


def test_flag_beats_the_model_table_in_a_running_broker(spawn, tmp_path, zctx):
    config = write(tmp_path, "[models.sim]\nmax_batch_size = 32\nmax_queue = 90\nmax_wait_ms = 7\n")
    frontend = free_tcp_address()
    spawn(
        "broker", "--config", config, "--frontend", frontend, "--backend", free_tcp_address(),
        "--max-batch-size", "16", env={"BATCHER_MAX_QUEUE": "55"},
    )  # fmt: skip
    models = wait_until(lambda: broker_stats(frontend, zctx).get("models"), 15, "the broker answering")
    sim = models["sim"]
    assert (sim["max_batch_size"], sim["max_queue"], sim["max_wait_ms"]) == (16, 55, 7.0), sim


def pool_from_cli(
    monkeypatch: pytest.MonkeyPatch, *args: str, env: dict[str, str | None] | None = None
) -> Any:
    """The PoolSettings `batcher serve ARGS` would start its workers with; nothing is started."""
    from click.testing import CliRunner

    captured: list[Any] = []
    real = REAL_POOL_SETTINGS

    def capture(*a: Any, **kw: Any) -> Any:
        captured.append(real(*a, **kw))
        raise SystemExit(0)

    monkeypatch.setattr(batcher.cli.serve_commands, "pool_settings", capture)  # where serve looks it up
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        result = CliRunner().invoke(batcher.cli.commands.main, ["serve", *args], env=env)
    finally:
        root.handlers[:], root.level = handlers, level
    assert result.exit_code == 0 and captured, (result.output, result.exception)
    return captured[0]


def test_workers_flag_or_variable_beats_the_model_tables(monkeypatch, tmp_path):
    tables = "[models.echo]\nworkers = 2\ngpus = [1]\n[models.sim]\nworkers = 1\n"
    config = write(tmp_path, "workers = 3\n" + tables)
    args = ("--config", config, "--model", "echo", "--model", "sim", "--gpus", "0,1",
            "--workers-per-gpu", "2")  # fmt: skip
    pool = pool_from_cli(monkeypatch, *args, env={"BATCHER_WORKERS": None})
    assert pool.model_workers == {"echo": 2, "sim": 1} and pool.model_gpus == {"echo": (1,)}
    assert (pool.gpus, pool.workers_per_gpu, pool.workers_per_model) == ((0, 1), 2, 3)
    assert sorted(pool.placement()) == [("echo", 1), ("echo", 1), ("sim", 0)]

    for flag, env in ((["--workers", "1"], {}), ([], {"BATCHER_WORKERS": "1"})):
        pool = pool_from_cli(monkeypatch, *args, *flag, env=env)
        assert pool.model_workers == {} and pool.workers_per_model == 1, (flag, env)
        assert pool.model_gpus == {"echo": (1,)}  # a pin is not a count: it still holds
        assert sorted(pool.placement()) == [("echo", 1), ("sim", 0)]


# --- 2. environment variables: one meaning each ---------------------------------------------


def env_options() -> list[tuple[str, batcher.cli.commands.EnvOption]]:
    return [
        (name, p)
        for name, command in batcher.cli.commands.main.commands.items()
        for p in command.params
        if isinstance(p, batcher.cli.commands.EnvOption)
    ]


def test_each_variable_means_one_thing_on_every_command():
    """A variable read by several commands is the same option on all of them."""
    by_var: dict[str, set[tuple[str | None, bool]]] = {}
    for _, p in env_options():
        assert isinstance(p.envvar, str), p.envvar
        by_var.setdefault(p.envvar, set()).add((p.name, p.multiple))
    mixed = {var: kinds for var, kinds in by_var.items() if len(kinds) > 1}
    assert not mixed, mixed
    meanings = {
        ("worker", "connect"): "BATCHER_WORKER_CONNECT",
        ("worker", "model"): "BATCHER_WORKER_MODEL",
        ("worker", "curve_secret_key"): "BATCHER_WORKER_CURVE_SECRET_KEY",
        ("serve", "curve_secret_key"): "BATCHER_BROKER_CURVE_SECRET_KEY",
        ("broker", "curve_secret_key"): "BATCHER_BROKER_CURVE_SECRET_KEY",
        ("send", "connect"): "BATCHER_CONNECT",
        ("gateway", "connect"): "BATCHER_GATEWAY_CONNECT",
        ("send", "model"): "BATCHER_REQUEST_MODEL",
        ("send", "curve_secret_key"): "BATCHER_CURVE_SECRET_KEY",
        ("bench", "curve_secret_key"): "BATCHER_CURVE_SECRET_KEY",
        ("serve", "models"): "BATCHER_MODEL",
        ("ready", "models"): "BATCHER_READY_MODEL",
        ("stats", "timeout_s"): "BATCHER_STATS_TIMEOUT_S",
        ("send", "timeout_s"): "BATCHER_SEND_TIMEOUT_S",
    }
    got = {(c, p.name): p.envvar for c, p in env_options()}
    assert {k: got.get(k) for k in meanings} == meanings
    deprecated = {(c, p.name, p.old_envvar) for c, p in env_options() if p.old_envvar}
    assert deprecated == {
        ("worker", "connect", "BATCHER_CONNECT"),
        ("gateway", "connect", "BATCHER_CONNECT"),
        ("worker", "model", "BATCHER_MODEL"),
        ("worker", "curve_secret_key", "BATCHER_CURVE_SECRET_KEY"),
        ("serve", "curve_secret_key", "BATCHER_CURVE_SECRET_KEY"),
        ("broker", "curve_secret_key", "BATCHER_CURVE_SECRET_KEY"),
        ("send", "model", "BATCHER_MODEL"),
        ("bench", "model", "BATCHER_MODEL"),
        ("stats", "timeout_s", "BATCHER_TIMEOUT_S"),
    }


def test_operations_md_lists_every_variable():
    text = OPERATIONS.read_text()
    section = text[text.index("### Environment variables") :]
    section = section[: section.index("\n## ")]
    listed = set(re.findall(r"`(BATCHER_[A-Z_]+)`", section))
    used = {p.envvar for _, p in env_options() if not p.hidden} | {
        p.old_envvar for _, p in env_options() if p.old_envvar
    }
    assert used - listed == set(), "variables missing from operations.md"
    assert listed - used == set(), "variables documented that no option reads"


def test_old_names_still_read_where_they_meant_that(monkeypatch, keys):
    for var in ("BATCHER_STATS_TIMEOUT_S", "BATCHER_BROKER_CURVE_SECRET_KEY", "BATCHER_WORKER_CONNECT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("BATCHER_TIMEOUT_S", "0.3")
    monkeypatch.setenv("BATCHER_CURVE_SECRET_KEY", keys["alice"][1])
    monkeypatch.setenv("BATCHER_CONNECT", "tcp://127.0.0.1:7")
    stats_ctx = batcher.cli.commands.stats.make_context("stats", [])
    assert stats_ctx.params["timeout_s"] == 0.3
    worker_ctx = batcher.cli.commands.worker.make_context("worker", [])
    assert worker_ctx.params["connect"] == "tcp://127.0.0.1:7"
    assert worker_ctx.params["curve_secret_key"] == keys["alice"][1]
    s = settings_from_cli("broker", *addresses())
    assert s.curve is not None and s.curve.secret_key_file == keys["alice"][1]
    # A client's own key pair is still BATCHER_CURVE_SECRET_KEY, with no warning to give.
    send_ctx = batcher.cli.commands.send.make_context("send", ["1"])
    assert send_ctx.params["curve_secret_key"] == keys["alice"][1]
    assert not send_ctx.meta.get("batcher.deprecated_envvars")

    # The new name wins over the old one.
    monkeypatch.setenv("BATCHER_STATS_TIMEOUT_S", "2.5")
    monkeypatch.setenv("BATCHER_BROKER_CURVE_SECRET_KEY", keys["broker"][1])
    assert batcher.cli.commands.stats.make_context("stats", []).params["timeout_s"] == 2.5
    s = settings_from_cli("broker", *addresses())
    assert s.curve is not None and s.curve.secret_key_file == keys["broker"][1]


def test_worker_reads_its_own_variables_over_the_old_ones(spawn, zctx):
    frontend, backend = start_broker(spawn, zctx, "--model", "echo")
    # The old names hold what they mean for clients and serve: a worker must not use them.
    worker = spawn(
        "worker",
        env={
            "BATCHER_WORKER_CONNECT": backend,
            "BATCHER_WORKER_MODEL": "echo",
            "BATCHER_CONNECT": frontend,
            "BATCHER_MODEL": "sim echo",
        },
    )
    wait_until(
        lambda: broker_stats(frontend, zctx).get("models", {}).get("echo", {}).get("workers") == 1,
        15,
        "the worker joined as echo",
    )
    assert "deprecated" not in worker.stderr_path.read_text()


def test_worker_old_names_work_with_one_warning_each(spawn, zctx):
    frontend, backend = start_broker(spawn, zctx, "--model", "echo")
    worker = spawn(
        "worker",
        env={"BATCHER_CONNECT": backend, "BATCHER_MODEL": "echo",
             "BATCHER_WORKER_CONNECT": None, "BATCHER_WORKER_MODEL": None},
    )  # fmt: skip
    wait_until(
        lambda: broker_stats(frontend, zctx).get("models", {}).get("echo", {}).get("workers") == 1,
        15,
        "the worker joined with the old names",
    )
    lines = [line for line in worker.stderr_path.read_text().splitlines() if "deprecated" in line]
    assert len(lines) == 2, lines
    assert any("BATCHER_CONNECT" in line and "set BATCHER_WORKER_CONNECT" in line for line in lines), lines
    assert any("BATCHER_MODEL" in line and "set BATCHER_WORKER_MODEL" in line for line in lines), lines


# --- 3. send --timeout-s --------------------------------------------------------------------


def test_send_timeout_s_bounds_the_wait_and_says_why(cli, fake_broker):
    fb = fake_broker(silent)
    # Without --timeout-s the client would wait 30 s, past this run's 15.
    result = cli("send", "--connect", fb.address, "--timeout-s", "0.5", "1", "2", timeout_s=15)
    assert result.returncode == 1, result
    replies = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["error"]["code"] for r in replies] == ["timeout", "timeout"], replies
    notes = [line for line in result.stderr.splitlines() if line.startswith("timeout: ")]
    assert notes and all(n[len("timeout: ") :] for n in notes), result.stderr
    assert "Traceback" not in result.stderr


def test_send_timeout_from_its_variable(cli, fake_broker, monkeypatch):
    monkeypatch.setenv("BATCHER_SEND_TIMEOUT_S", "0.5")
    fb = fake_broker(silent)
    result = cli("send", "--connect", fb.address, "1", timeout_s=15)
    assert result.returncode == 1 and json.loads(result.stdout)["error"]["code"] == "timeout", result


# --- 4. keygen ------------------------------------------------------------------------------


def test_keygen_keeps_an_existing_pair_unless_forced(cli, tmp_path):
    directory = tmp_path / "keys" / "alice"
    first = cli("keygen", str(directory), "--name", "alice")
    assert first.returncode == 0, first
    public, secret = directory / "alice.key", directory / "alice.key_secret"
    before = (public.read_bytes(), secret.read_bytes())
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600

    again = cli("keygen", str(directory), "--name", "alice")
    assert again.returncode == 1, again
    assert "already exist" in again.stderr and "--force" in again.stderr and str(public) in again.stderr
    assert (public.read_bytes(), secret.read_bytes()) == before

    secret.unlink()  # half a pair is still a pair that someone may rely on
    assert cli("keygen", str(directory), "--name", "alice").returncode == 1
    assert public.read_bytes() == before[0]

    forced = cli("keygen", str(directory), "--name", "alice", "--force")
    assert forced.returncode == 0, forced
    assert public.read_bytes() != before[0] and stat.S_IMODE(secret.stat().st_mode) == 0o600


def test_keygen_name_must_be_a_file_name(cli, tmp_path):
    result = cli("keygen", str(tmp_path / "k"), "--name", "../elsewhere")
    assert_usage_error(result, "plain file name")
    assert not (tmp_path / "elsewhere.key").exists()


# --- 5. stats: rates and an aligned table ---------------------------------------------------


def model(requests: int, ok: int, batches: int, **outcomes: int) -> dict[str, Any]:
    return {"requests": requests, "batches": batches, "outcomes": {"ok": ok, **outcomes}}


def test_rates_between_two_snapshots():
    before = {"models": {"sim": model(100, 90, 10, overloaded=10), "gone": model(5, 5, 1)}}
    after = {
        "models": {
            "sim": model(140, 120, 14, overloaded=16, deadline_exceeded=4),
            "new": model(6, 6, 3),
            "restarted": model(1, 1, 1),
        }
    }
    before["models"]["restarted"] = model(50, 50, 20)
    r = compute_rates(before, after, elapsed_s=2.0)
    assert r["sim"] == Rates(requests_s=20.0, ok_s=15.0, errors_s=5.0, batches_s=2.0)
    assert r["new"] == Rates(3.0, 3.0, 0.0, 1.5)  # new since: counted from 0
    assert r["restarted"] == Rates(None, None, None, None)  # counters went down
    assert set(r) == {"sim", "new", "restarted"}
    with pytest.raises(ValueError, match="elapsed_s"):
        compute_rates(before, after, elapsed_s=0.0)


def test_rates_of_odd_fields_are_unknown():
    before = {"models": {"m": {"batches": "x", "outcomes": {"ok": 1}}}}
    after = {"models": {"m": {"batches": 3, "outcomes": {"ok": float("nan")}}}}
    assert compute_rates(before, after, 1.0)["m"] == Rates(None, None, None, None)


def column_ends(header: str) -> dict[str, int]:
    """Where each right-aligned column of the header ends."""
    names = ["queued", "workers", "busy", "batches", "requests", "mean bs", "req/s", "batch/s"]
    return {n: header.index(n) + len(n) for n in names if n in header}


@pytest.mark.parametrize("with_rates", [False, True])
def test_stats_table_stays_aligned_for_long_names_and_big_numbers(with_rates):
    long_name = "a-model-name-longer-than-fifteen-characters"
    snapshot = {
        "models": {
            "sim": {"queued": 3, "workers": 2, "busy_workers": 1, "batches": 7, "requests": 9,
                    "mean_batch_size": 1.5, "queue_ms_p50": 0.1, "queue_ms_p99": 12345.678,
                    "outcomes": {"ok": 9}},
            long_name: {"queued": 123456789, "workers": 1, "busy_workers": 0, "batches": 10**12,
                        "requests": 10**13, "outcomes": {"ok": 10**13}},
        }
    }  # fmt: skip
    rates = {"sim": Rates(12345.6, 12345.6, 0.0, 99.0)} if with_rates else None
    lines = format_stats(snapshot, rates).splitlines()
    header, rows = lines[0], lines[2:4]
    assert lines[1] == "-" * len(header)
    ends = column_ends(header)
    assert len(ends) == (8 if with_rates else 6)
    for row in rows:
        name = row.split()[0]
        assert row.startswith(name + " ") and name in ("sim", long_name)
        for column, end in ends.items():
            # Right-aligned: the cell ends where its header does, and a gap follows.
            assert row[end - 1] != " " and row[end : end + 2] == "  ", (column, row)
    assert header.index("queued") > len(long_name)
    assert rows[0].split()[0] == long_name and f"{10**13}" in rows[0]


def test_stats_count_goes_with_watch(cli):
    result = cli("stats", "--connect", free_tcp_address(), "--count", "2", timeout_s=10)
    assert_usage_error(result, "--count goes with --watch")


def test_stats_watch_shows_rates_under_load(serve, client, cli):
    sp = serve("--workers", "1", "--model", "echo", workers=1)
    c = client(sp.frontend)
    stop = threading.Event()
    sent: list[int] = []

    def load() -> None:
        while not stop.is_set():
            sent.append(len(c.request_many(range(20))))

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    try:
        wait_until(lambda: sent, 10, "the load running")
        result = cli("stats", "--connect", sp.frontend, "--watch", "--count", "3", "--interval-s", "0.3")
    finally:
        stop.set()
        thread.join(10)
    assert result.returncode == 0, result.stderr
    frames = [f for f in result.stdout.split(sp.frontend + "  ") if f.strip()]
    assert len(frames) == 3, result.stdout
    rows, counts = [], []
    for frame in frames:
        lines = frame.splitlines()
        header = lines[1]
        assert header.split()[-5:] == ["req/s", "ok/s", "err/s", "batch/s", "outcomes"], header
        row = next(line for line in lines if line.startswith("echo "))
        start = header.index("infer p50/p99 ms") + len("infer p50/p99 ms")
        rows.append(row[start:].split()[:4])
        ok = re.search(r"\bok: (\d+)", row)
        assert ok, row
        counts.append((int(ok.group(1)), int(row.split()[4])))  # (answered ok, batches) so far
    assert rows[0] == ["-", "-", "-", "-"], rows  # one snapshot: no rate yet
    for (req_s, ok_s, err_s, batch_s), (ok_now, batches_now), (ok_before, batches_before) in zip(
        rows[1:], counts[1:], counts[:-1], strict=True
    ):
        assert float(ok_s) == float(req_s) and float(err_s) == 0, rows
        # Each rate is its counter's growth over the time between the two snapshots, which
        # is the 0.3 s interval at least (tenfold slack above): both give that same time.
        ok_grew, batches_grew = ok_now - ok_before, batches_now - batches_before
        assert ok_grew > 0 and batches_grew > 0, counts
        between_s = ok_grew / float(ok_s)
        assert 0.3 * 0.95 <= between_s <= 3.0, (rows, counts)
        assert batches_grew / float(batch_s) == pytest.approx(between_s, rel=0.05), (rows, counts)


# --- 7. ready -------------------------------------------------------------------------------


def test_readiness_of_a_snapshot():
    snapshot = {
        "models": {
            "sim": {"configured": True, "workers": 2},
            "echo": {"configured": True, "workers": 0},
            "extra": {"configured": False, "workers": 0},
        }
    }
    ready, problems = batcher.cli.commands.readiness(snapshot, ())
    assert ready == ["ready: sim (2 workers)"] and problems == ["echo has no worker"]
    ready, problems = batcher.cli.commands.readiness(snapshot, ("x", "sim"))
    assert ready == ["ready: sim (2 workers)"]
    assert problems == ["unknown model 'x' (served: sim, echo, extra)"]
    snapshot["models"]["echo"]["workers"] = 1
    assert batcher.cli.commands.readiness(snapshot, ()) == (
        ["ready: sim (2 workers)", "ready: echo (1 worker)"],
        [],
    )


def test_ready_waits_for_a_worker_and_says_what_is_missing(spawn, cli, zctx):
    frontend, backend = start_broker(spawn, zctx, "--model", "echo", "--model", "sim")

    missing = cli("ready", "--connect", frontend, "--timeout-s", "0.5")
    assert missing.returncode == 1, missing
    assert "not ready after 0.5s: echo has no worker; sim has no worker" in missing.stderr, missing.stderr
    unknown = cli("ready", "--connect", frontend, "--model", "x", "--timeout-s", "0.3")
    assert unknown.returncode == 1 and "unknown model 'x' (served: echo, sim)" in unknown.stderr, unknown

    # `ready` started before the workers: it waits for them, and says so once they are in.
    waiting: list[Any] = []
    thread = threading.Thread(
        target=lambda: waiting.append(cli("ready", "--connect", frontend, "--timeout-s", "30", timeout_s=40))
    )
    thread.start()
    spawn("worker", "--connect", backend, "--model", "echo")
    spawn("worker", "--connect", backend, "--model", "sim", *FLAT_SIM)
    thread.join(45)
    (result,) = waiting
    assert result.returncode == 0, result
    assert result.stdout.splitlines() == ["ready: echo (1 worker)", "ready: sim (1 worker)"]
    only = cli("ready", "--connect", frontend, "--model", "sim")
    assert only.returncode == 0 and only.stdout.splitlines() == ["ready: sim (1 worker)"], only


def test_ready_without_a_broker_says_so(cli):
    address = free_tcp_address()
    result = cli("ready", "--connect", address, "--timeout-s", "0.3", timeout_s=10)
    assert result.returncode == 1, result
    assert f"no broker answered at {address} within 0.3s" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


# --- 7. reload ------------------------------------------------------------------------------


def test_reload_sends_the_request_and_prints_the_answer(cli, fake_broker):
    def answer(body: dict[str, Any]) -> dict[str, Any] | None:
        if body.get("op") != "reload":
            return None
        if body.get("model") == "sim":
            return {"id": body["id"], "ok": True, "output": {"model": "sim", "replaced": 2}}
        return {"id": body["id"], "ok": False, "error": {"code": "unknown_model", "message": "no model 'x'"}}

    fb = fake_broker(answer)
    ok = cli("reload", "sim", "--connect", fb.address, timeout_s=15)
    assert ok.returncode == 0, ok
    assert json.loads(ok.stdout) == {"model": "sim", "replaced": 2}
    assert [(b.get("op"), b.get("model")) for b in fb.received] == [("reload", "sim")]

    failed = cli("reload", "x", "--connect", fb.address, timeout_s=15)
    assert failed.returncode == 1, failed
    assert "reload of 'x' failed: unknown_model: no model 'x'" in failed.stderr, failed.stderr


def test_reload_without_an_answer_times_out(cli, fake_broker):
    fb = fake_broker(silent)
    result = cli("reload", "sim", "--connect", fb.address, "--timeout-s", "0.5", timeout_s=15)
    assert result.returncode == 1 and "reload of 'sim' failed: timeout" in result.stderr, result


# --- 7. --no-worker-timeout-ms, GPU placement, bench's CURVE keys ----------------------------


def test_no_worker_timeout_reaches_the_broker_settings(tmp_path):
    assert settings_from_cli("broker", *addresses()).no_worker_timeout_ms == 10_000.0
    s = settings_from_cli("broker", *addresses(), "--no-worker-timeout-ms", "250")
    assert s.no_worker_timeout_ms == 250.0
    config = write(tmp_path, "no_worker_timeout_ms = 0\n")
    assert settings_from_cli("serve", *addresses(), "--config", config).no_worker_timeout_ms == 0.0


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["broker", "--no-worker-timeout-ms", "-1"], "Invalid value for '--no-worker-timeout-ms'"),
        (["broker", "--no-worker-timeout-ms", "1e12"], "Invalid value for '--no-worker-timeout-ms'"),
        (["serve", "--gpus", "0,0"], "device ids must differ, got 0 more than once"),
        (["serve", "--gpus", "70000"], "device ids must be within 0..65535"),
        (["serve", "--gpus", "a"], "expected device ids like 0,1"),
        (["serve", "--workers-per-gpu", "0"], "Invalid value for '--workers-per-gpu'"),
        (["serve", "--gpus", "0", "--workers", "2", "--model", "echo"], "needs 2 workers"),
        (["send", "--timeout-s", "0", "1"], "Invalid value for '--timeout-s'"),
    ],
    ids=" ".join,
)
def test_bad_new_options_are_usage_errors(cli, args, expected):
    if args[0] != "send":
        args += addresses()
    else:
        args[1:1] = ["--connect", free_tcp_address()]
    result = cli(*args, timeout_s=10)
    assert_usage_error(result, expected)
    assert "started worker" not in result.stderr


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("[models.echo]\ngpus = [0, 70000]\n", "[models.echo] gpus: device ids must be within 0..65535"),
        ("[models.echo]\ngpus = [1.5]\n", "[models.echo] gpus: expected a list of integers"),
        ("[models.echo]\ngpus = []\n", "[models.echo] gpus: expected at least one device id"),
        ("[models.echo]\nworkers = 1000\n", "[models.echo] workers: 1000 is not in the range 0<=x<=256"),
        ("[models.echo]\nworkers = true\n", "[models.echo] workers: expected an integer"),
        ("gpus = [0, 0]\n", "gpus (top level): device ids must differ"),
        ("[models.echo]\ngpus = [3]\n", "model 'echo'"),
    ],
    ids=lambda v: v if "\n" in v else None,
)
def test_bad_placement_in_the_config_is_a_usage_error(cli, tmp_path, toml, expected):
    config = write(tmp_path, toml)
    result = cli("serve", "--config", config, "--model", "echo", "--gpus", "0,1", *addresses(), timeout_s=10)
    assert_usage_error(result, expected)


def test_serve_places_workers_on_the_gpus_given(serve, zctx, tmp_path):
    config = write(tmp_path, "[models.sim]\ngpus = [1]\n")
    sp = serve("--config", config, "--model", "echo", "--model", "sim", "--gpus", "0,1",
               "--workers-per-gpu", "2", *FLAT_SIM, workers=6)  # fmt: skip
    models = broker_stats(sp.frontend, zctx)["models"]
    assert sorted(w["gpu"] for w in models["echo"]["worker_list"]) == [0, 0, 1, 1]
    assert sorted(w["gpu"] for w in models["sim"]["worker_list"]) == [1, 1]


def test_bench_spawn_takes_no_server_key(cli, keys):
    result = cli("bench", "--spawn", "--curve-server-key", keys["broker"][0], "--requests", "1", timeout_s=10)
    assert_usage_error(result, "--curve-server-key is for --connect")


def test_bench_passes_the_broker_options_to_its_serve(monkeypatch, keys):
    """bench --spawn hands its scheduling options, --no-worker-timeout-ms and the key pair
    to the `serve` it starts, and gives the load generator that key pair too."""
    from click.testing import CliRunner

    import batcher.cli.bench
    import batcher.serve.launcher

    started: list[list[str]] = []
    loads: list[Any] = []

    class Spawned(batcher.serve.launcher.ServeProcess):
        def start(self) -> Any:
            started.append(self.args)
            raise click.ClickException("stopped here by the test")

    monkeypatch.setattr(batcher.serve.launcher, "ServeProcess", Spawned)
    real = batcher.cli.bench.LoadSettings
    monkeypatch.setattr(batcher.cli.bench, "LoadSettings", lambda **kw: loads.append(kw) or real(**kw))
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        result = CliRunner().invoke(
            batcher.cli.commands.main,
            ["bench", "--spawn", "--requests", "5", "--no-worker-timeout-ms", "1234",
             "--max-batch-size", "3", "--curve-secret-key", keys["broker"][1]],
        )  # fmt: skip
    finally:
        root.handlers[:], root.level = handlers, level
    assert "stopped here by the test" in result.output, (result.output, result.exception)
    (args,) = started
    pairs = dict(zip(args[::2], args[1::2], strict=False))
    assert pairs["--no-worker-timeout-ms"] == "1234.0" and pairs["--max-batch-size"] == "3"
    assert pairs["--curve-secret-key"] == keys["broker"][1]
    (load,) = loads
    assert load["curve_server_key"] == load["curve_secret_key"] == keys["broker"][1]


def test_bench_and_ready_with_curve_keys(cli, spawn, keys, tmp_path):
    broker_public, broker_secret = keys["broker"]
    spawned = cli("bench", "--spawn", "--curve-secret-key", broker_secret, "--model", "echo",
                  "--workers", "1", "--requests", "40", "--concurrency", "4", timeout_s=60)  # fmt: skip
    assert spawned.returncode == 0, spawned.stderr
    assert "40 ok, 0 errors" in spawned.stdout, spawned.stdout

    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "alice.key").write_bytes(Path(keys["alice"][0]).read_bytes())
    frontend = free_tcp_address()
    spawn("serve", "--frontend", frontend, "--backend", free_tcp_address(), "--workers", "1", "--model",
          "echo", "--curve-secret-key", broker_secret, "--curve-clients", str(allowed))  # fmt: skip
    alice = ("--curve-server-key", broker_public, "--curve-secret-key", keys["alice"][1])
    ready = cli("ready", "--connect", frontend, *alice, "--timeout-s", "30", timeout_s=40)
    assert ready.returncode == 0 and ready.stdout == "ready: echo (1 worker)\n", ready
    connected = cli("bench", "--connect", frontend, *alice, "--model", "echo", "--requests", "40",
                    "--concurrency", "4", timeout_s=60)  # fmt: skip
    assert connected.returncode == 0, connected.stderr
    assert "40 ok, 0 errors" in connected.stdout, connected.stdout


def test_sighup_rereads_the_config_and_reloads_every_model(serve, zctx, tmp_path):
    """SIGHUP to serve: the file's new batching settings apply (a flag still wins), and
    every model's workers are replaced by new processes."""
    path = tmp_path / "batcher.toml"
    path.write_text("max_wait_ms = 3\nmax_queue = 70\n[models.echo]\nmax_batch_size = 4\n")
    sp = serve("--config", str(path), "--model", "echo", "--workers", "1", "--max-queue", "33", workers=1)
    assert sp.process is not None

    def echo() -> dict[str, Any]:
        return broker_stats(sp.frontend, zctx).get("models", {}).get("echo", {})

    before = echo()
    assert (before["max_batch_size"], before["max_wait_ms"], before["max_queue"]) == (4, 3.0, 33)
    old_worker = before["worker_list"][0]["worker"]
    path.write_text("max_wait_ms = 7\nmax_queue = 70\n[models.echo]\nmax_batch_size = 6\n")
    os.kill(sp.process.pid, signal.SIGHUP)

    def reloaded() -> dict[str, Any] | None:
        e = echo()
        replaced = e.get("workers") == 1 and e["worker_list"][0]["worker"] != old_worker
        return e if replaced and e["max_batch_size"] == 6 else None

    after = wait_until(reloaded, 30, "new settings and a new worker")
    assert after["max_wait_ms"] == 7.0 and after["max_queue"] == 33, after  # the flag still wins
    assert sp.process.poll() is None
