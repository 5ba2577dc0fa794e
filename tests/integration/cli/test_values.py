"""CLI hardening (hardening v1): config values type-checked like flags, every numeric
option finite and bounded, clean one-line errors instead of tracebacks, and strict JSON
out of `send` and `stats --json` whatever the broker says.

Run through `python -m batcher` (the `cli` and `spawn` fixtures), as the defects were
found, except the checks of the option table itself and of the stats table.
"""

from __future__ import annotations

import json
import math
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest

import batcher.cli.commands
from batcher.cli.stats_table import format_stats
from batcher.serve.launcher import PICKED_PORTS, free_tcp_address

#: Every test here runs the CLI or a worker as a process of its own.
pytestmark = pytest.mark.integration


def strict_loads(text: str) -> Any:
    """json.loads that fails on NaN and Infinity, which Python's json accepts."""

    def refuse(token: str) -> Any:
        raise AssertionError(f"non-JSON token {token} in {text!r}")

    return json.loads(text, parse_constant=refuse)


def assert_clean_usage_error(result: Any, *expected: str) -> None:
    """Exit 2 (a usage error), each of `expected` in the message, no traceback."""
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr, result.stderr
    for text in expected:
        assert text in result.stderr, result.stderr


def addresses() -> list[str]:
    """Free loopback addresses, so a command that starts after all binds nothing shared."""
    return ["--frontend", free_tcp_address(), "--backend", free_tcp_address()]


# --- config values: types as strict as the flags' -------------------------------------------


def test_config_float_batch_sizes_is_refused_at_start(cli, tmp_path):
    """The defect: [1, 2.0, 4] passed, then every batch of 2 raised in the broker loop."""
    config = tmp_path / "float_sizes.toml"
    config.write_text("[models.echo]\nmax_batch_size = 4\nbatch_sizes = [1, 2.0, 4]\n")
    result = cli("serve", "--config", str(config), "--workers", "1", "--model", "echo", *addresses())
    assert_clean_usage_error(
        result, str(config), "[models.echo] batch_sizes", "expected a list of integers", "2.0 (a float)"
    )
    assert "started worker" not in result.stderr


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("max_batch_size = true\n", "max_batch_size (top level): expected an integer, got true (a boolean)"),
        ("model = 5\n", "model (top level): expected a string or a list of strings, got 5"),
        ('model = ["echo", 5]\n', "model (top level): expected a string or a list of strings, got 5"),
        ("workers = 2.0\n", "workers (top level): expected an integer, got 2.0 (a float)"),
        ('max_wait_ms = "5"\n', 'max_wait_ms (top level): expected a number, got "5" (a string)'),
        ("batch_sizes = [1, 2.5]\n", "batch_sizes (top level): expected a list of integers"),
        ("heartbeat_ms = inf\n", "heartbeat_ms (top level): inf is not in the range"),
        ("heartbeat_ms = nan\n", "heartbeat_ms (top level): nan is not a number"),
        ("max_message_bytes = 9223372036854775807\n", "max_message_bytes (top level)"),
        ("batch_sizes = [1, 2, 100000]\n", "batch_sizes (top level): batch sizes must be within 1..4096"),
        ('[models.echo]\nmax_wait_ms = "5"\n', '[models.echo] max_wait_ms: expected a number, got "5"'),
        ("[models.echo]\nmax_batch_size = true\n", "[models.echo] max_batch_size: expected an integer"),
        ("[models.echo]\nmax_wait_ms = inf\n", "[models.echo] max_wait_ms: inf is not in the range"),
        ("[models.echo]\nmax_wait_ms = nan\n", "[models.echo] max_wait_ms: nan is not a number"),
        ("[models.echo]\nmax_queue = 0\n", "[models.echo] max_queue: 0 is not in the range 1<=x<=10000000"),
        ('[models.echo]\npolicy = "fast"\n', "[models.echo] policy: 'fast' is not one of"),
        ("[models.echo]\nbatch_sizes = 4\n", "[models.echo] batch_sizes: expected a list of integers"),
    ],
    ids=lambda v: v if "\n" in v else None,
)
def test_config_value_of_the_wrong_type_is_a_usage_error(cli, tmp_path, toml, expected):
    config = tmp_path / "batcher.toml"
    config.write_text(toml)
    result = cli("broker", "--config", str(config), "--model", "echo", *addresses(), timeout_s=10)
    assert_clean_usage_error(result, f"{config}: {expected}")


def test_config_integers_where_numbers_go_are_accepted(tmp_path):
    """`max_wait_ms = 5` is a number: the strict check must not refuse ints for floats."""
    from tests.integration.operations.test_operations import settings_from_cli

    config = tmp_path / "batcher.toml"
    config.write_text("max_wait_ms = 5\nheartbeat_ms = 200\n[models.echo]\nmax_wait_ms = 7\n")
    s = settings_from_cli("broker", "--config", str(config), "--model", "echo")
    assert s.batch.max_wait_ms == 5.0 and s.heartbeat.interval_ms == 200.0
    assert s.per_model["echo"].max_wait_ms == 7.0 and isinstance(s.per_model["echo"].max_wait_ms, float)


# --- numeric options: finite and bounded --------------------------------------------------------


def test_every_numeric_option_has_both_bounds_and_refuses_nan():
    """Every int and float option of every command has a finite maximum (shown by --help)
    and every float option refuses NaN, so none can overflow where its value goes."""
    for name, command in batcher.cli.commands.main.commands.items():
        for p in command.params:
            if isinstance(p.type, click.types.IntParamType | click.types.FloatParamType):
                where = f"{name} --{p.name}"
                assert isinstance(p.type, click.IntRange | click.FloatRange), where
                assert p.type.min is not None and p.type.max is not None, where
                assert math.isfinite(p.type.max), where
            if isinstance(p.type, click.types.FloatParamType):
                assert isinstance(p.type, batcher.cli.commands.FiniteFloatRange), f"{name} --{p.name}"
                with pytest.raises(click.BadParameter, match="not a number"):
                    p.type.convert("nan", None, None)


@pytest.mark.parametrize(
    ("command", "variable", "value", "option"),
    [
        ("broker", "BATCHER_HEARTBEAT_MS", "inf", "--heartbeat-ms"),
        ("broker", "BATCHER_HEARTBEAT_MS", "1e300", "--heartbeat-ms"),
        ("broker", "BATCHER_HEARTBEAT_MS", "nan", "--heartbeat-ms"),
        ("serve", "BATCHER_HEARTBEAT_MS", "inf", "--heartbeat-ms"),
        ("broker", "BATCHER_MAX_MESSAGE_BYTES", str(2**70), "--max-message-bytes"),
        ("broker", "BATCHER_MAX_WAIT_MS", "nan", "--max-wait-ms"),
        ("broker", "BATCHER_DEFAULT_TIMEOUT_MS", "inf", "--default-timeout-ms"),
        ("broker", "BATCHER_MAX_QUEUE", str(2**63), "--max-queue"),
        ("broker", "BATCHER_WORKER_PREFETCH", "100000", "--worker-prefetch"),
        ("broker", "BATCHER_MAX_RETRIES", "1000000", "--max-retries"),
        ("broker", "BATCHER_HEARTBEAT_LIVENESS", str(2**40), "--heartbeat-liveness"),
        ("serve", "BATCHER_WORKERS", "257", "--workers"),
        ("serve", "BATCHER_SIM_BASE_MS", "inf", "--sim-base-ms"),
    ],
)
def test_env_heartbeat_inf_and_other_unbounded_values_are_usage_errors(
    spawn, command, variable, value, option
):
    """The defect: BATCHER_HEARTBEAT_MS=inf passed FloatRange(min=1), then `broker` died
    with OverflowError and `serve`'s workers crashed at start, one after the other."""
    args = [command, *addresses(), "--model", "echo"]
    if command == "serve" and variable != "BATCHER_WORKERS":  # the flag would win over it
        args += ["--workers", "1"]
    proc = spawn(*args, env={variable: value})
    returncode = proc.process.wait(timeout=15)
    stderr = proc.stderr_path.read_text(errors="replace")
    assert returncode == 2, stderr
    assert f"Invalid value for '{option}'" in stderr and "Traceback" not in stderr, stderr
    assert "started worker" not in stderr and "listening" not in stderr, stderr


@pytest.mark.parametrize(
    "args",
    [
        ["worker", "--heartbeat-ms", "nan"],
        ["worker", "--gpu", str(2**64)],
        ["bench", "--connect", "{free}", "--rate", "inf"],
        ["bench", "--connect", "{free}", "--duration", "nan"],
        ["bench", "--connect", "{free}", "--concurrency", str(10**9)],
        ["send", "--connect", "{free}", "--timeout-ms", "inf", "1"],
        ["stats", "--connect", "{free}", "--interval-s", "nan"],
        ["stats", "--connect", "{free}", "--timeout-s", "1e309"],
    ],
    ids=" ".join,
)
def test_worker_heartbeat_nan_and_other_float_flags_are_usage_errors(cli, args):
    args = [a.format(free=free_tcp_address()) for a in args]
    if args[0] == "worker":
        args += ["--connect", free_tcp_address()]
    result = cli(*args, timeout_s=10)
    assert_clean_usage_error(result, "Invalid value for")


def test_help_shows_the_bounds(cli):
    result = cli("broker", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    for bound in ("1<=x<=60000.0", "1024<=x<=1073741824", "1<=x<=4096", "0<=x<=100", "1<=x<=64"):
        assert bound in text, bound


# --- batcher send: clean errors, strict JSON ----------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (str(2**64), ["an integer outside msgpack's range"]),
        ('"\\ud800"', ["not valid Unicode (a lone surrogate)"]),
        ("NaN", ["NaN is not JSON"]),
        ("-Infinity", ["-Infinity is not JSON"]),
        ('{"x": [Infinity]}', ["Infinity is not JSON"]),
        ("1e400", ["too large for a 64-bit float"]),
        ("hello", ["not JSON: 'hello'", """quote it: '"hello"'"""]),
        ("{", ["not JSON: '{'"]),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_send_unencodable_or_non_json_input_is_a_usage_error(cli, text, expected):
    """Checked before anything is sent: the address is never contacted."""
    result = cli("send", "--connect", free_tcp_address(), "--", text, timeout_s=10)
    assert_clean_usage_error(result, *expected)
    assert result.stdout == ""


def test_send_rejects_a_bad_stdin_line_too(cli):
    result = cli("send", "--connect", free_tcp_address(), stdin="1\nNaN\n", timeout_s=10)
    assert_clean_usage_error(result, "NaN is not JSON")


def odd_values(body: dict[str, Any]) -> dict[str, Any] | None:
    """A broker (or model) answering with what JSON cannot say as such."""
    odd = {"nan": math.nan, "inf": math.inf, "list": [-math.inf, 1.5], "bytes": b"\x01\xff", 7: "int key"}
    if body.get("op") == "stats":
        model = {"queued": 0, "workers": 1, "busy_workers": 0, "batches": 3, "requests": 3,
                 "mean_batch_size": math.nan, "infer_ms_p50": math.nan, "infer_ms_p99": math.inf,
                 "queue_ms_p50": 0.1, "queue_ms_p99": -math.inf, "outcomes": {"ok": 3},
                 "batch_cost_ms": [math.nan, math.inf]}  # fmt: skip
        return {"id": body["id"], "ok": True, "output": {"models": {"m": model}, "workers_lost": 0}}
    return {"id": body["id"], "ok": True, "output": odd}


def test_send_prints_strict_json_whatever_the_reply_holds(cli, fake_broker):
    fb = fake_broker(odd_values)
    result = cli("send", "--connect", fb.address, "1", timeout_s=15)
    assert result.returncode == 0, result.stderr
    reply = strict_loads(result.stdout)
    assert reply["output"] == {
        "nan": None,
        "inf": None,
        "list": [None, 1.5],
        "bytes": "01ff",
        "7": "int key",
    }, reply


def test_stats_json_nan_prints_strict_json(cli, fake_broker):
    """The defect: a NaN or infinite infer_ms in the snapshot came out as NaN/Infinity."""
    fb = fake_broker(odd_values)
    result = cli("stats", "--connect", fb.address, "--json", timeout_s=15)
    assert result.returncode == 0, result.stderr
    model = strict_loads(result.stdout)["models"]["m"]
    assert model["infer_ms_p50"] is None and model["infer_ms_p99"] is None, model
    assert model["batch_cost_ms"] == [None, None] and model["queue_ms_p50"] == 0.1, model

    table = cli("stats", "--connect", fb.address, timeout_s=15)
    assert table.returncode == 0, table.stderr
    row = next(line for line in table.stdout.splitlines() if line.startswith("m "))
    assert "nan" not in row and "inf" not in row, row
    assert row.split()[1:7] == ["0", "1", "0", "3", "3", "-"], row  # mean bs: "-"
    assert "0.10 / -" in row and "- / -" in row, row


def test_stats_table_survives_missing_and_odd_fields():
    text = format_stats(
        {
            "models": {"a": {"queued": 2, "outcomes": {"ok": math.nan}}, "b": {}},
            "refused_without_model": {"unknown_model": 2, "odd": "x"},
            "workers_lost": math.inf,
        }
    )
    lines = text.splitlines()
    assert lines[2].split()[:3] == ["a", "2", "-"], text
    assert "ok: -" in lines[2] and lines[3].startswith("b "), text
    assert "workers lost: -" in text and "refused (no model): 2" in text, text


# --- busy metrics port ------------------------------------------------------------------------


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_metrics_port_busy_is_a_one_line_error(cli, busy_port):
    result = cli(
        "broker", *addresses(), "--metrics-port", str(busy_port), "--log-level", "WARNING", timeout_s=15
    )
    assert result.returncode not in (0, None), result
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error:") and str(busy_port) in lines[0], lines


def test_curve_allow_list_without_secret_key_is_a_usage_error(cli, tmp_path: Path):
    result = cli("broker", *addresses(), "--curve-workers", str(tmp_path), timeout_s=10)
    assert_clean_usage_error(result, "--curve-workers needs --curve-secret-key")


@pytest.mark.parametrize("command", ["broker", "serve"])
def test_curve_admins_without_secret_key_is_a_usage_error(cli, tmp_path: Path, command: str):
    result = cli(command, *addresses(), "--curve-admins", str(tmp_path), timeout_s=10)
    assert_clean_usage_error(result, "--curve-admins needs --curve-secret-key (the broker's key pair)")


@pytest.mark.parametrize("host", ["no-such-host.invalid", "x" * 64 + ".invalid"])  # unresolved; no name
def test_metrics_host_that_does_not_resolve_is_a_one_line_error(cli, host):
    result = cli(
        "broker", *addresses(), "--metrics-port", "9", "--metrics-host", host,
        "--log-level", "WARNING", timeout_s=15,
    )  # fmt: skip
    assert result.returncode not in (0, None), result
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"cannot serve metrics on {host}:9" in lines[0], lines


# --- ports for the processes we start -----------------------------------------------------------

EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


@pytest.mark.skipif(not EPHEMERAL.exists(), reason="no /proc/sys/net/ipv4/ip_local_port_range here")
def test_picked_ports_lie_below_the_ephemeral_range_where_no_connection_can_take_them() -> None:
    low = int(EPHEMERAL.read_text().split()[0])
    if low - PICKED_PORTS < 1024:
        pytest.skip(f"the ephemeral range starts at {low}: too low to pick below it")
    picked = [int(free_tcp_address().rsplit(":", 1)[1]) for _ in range(200)]
    assert all(low - PICKED_PORTS <= p < low for p in picked), sorted(picked)
    assert len(set(picked)) == len(picked), (
        "a port handed out twice: serve's frontend and backend could share it"
    )
    ports = set(picked)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports.pop()))  # and each was free
