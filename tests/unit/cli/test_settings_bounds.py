"""Settings declared once (batcher/settings.py): every option made from a settings field
accepts, through the command's own parser, exactly what the dataclass accepts. For each,
the edge values pass both; the first value past each edge is refused by both, the flag
with click's range message and the dataclass with its own precise one (the low side's
text pinned here, as the older tests pin it)."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import click
import pytest

from batcher.broker.loop import BrokerSettings
from batcher.cli.commands import main
from batcher.cli.load_settings import LoadSettings
from batcher.core.limits import BatchSettings
from batcher.errors import SettingsError
from batcher.gateway.core import GatewaySettings
from batcher.settings import Bounds, bounds, check, default, setting
from workers.models import SimSettings
from workers.supervisor import PoolSettings
from workers.worker import WorkerSettings

SERVE_BROKER = ("serve", "broker")
POOL = {"backend": "tcp://127.0.0.1:5556", "models": ("sim",)}

#: (flag, commands that have it, dataclass, field, other fields it needs, the message of
#: the first value under the low edge).
ROWS: list[tuple[str, tuple[str, ...], Any, str, dict[str, Any], str]] = [
    (
        "--max-batch-size",
        SERVE_BROKER,
        BatchSettings,
        "max_batch_size",
        {},
        "max_batch_size must be >= 1, got 0",
    ),
    (
        "--max-wait-ms",
        SERVE_BROKER,
        BatchSettings,
        "max_wait_ms",
        {},
        "max_wait_ms must be a finite number >= 0, got -5e-324",
    ),
    ("--max-queue", SERVE_BROKER, BatchSettings, "max_queue", {}, "max_queue must be >= 1, got 0"),
    (
        "--priority-aging-ms",
        SERVE_BROKER,
        BatchSettings,
        "priority_aging_ms",
        {},
        "priority_aging_ms must be a finite number >= 0, got -5e-324",
    ),
    (
        "--max-batch-cost",
        SERVE_BROKER,
        BatchSettings,
        "max_batch_cost",
        {},
        "max_batch_cost must be a finite number > 0, got 0.0",
    ),
    (
        "--default-timeout-ms",
        SERVE_BROKER,
        BrokerSettings,
        "default_timeout_ms",
        {},
        "default_timeout_ms must be >= 0, got -5e-324",
    ),
    (
        "--worker-prefetch",
        SERVE_BROKER,
        BrokerSettings,
        "worker_prefetch",
        {},
        "worker_prefetch must be >= 1, got 0",
    ),
    ("--max-retries", SERVE_BROKER, BrokerSettings, "max_retries", {}, "max_retries must be >= 0, got -1"),
    (
        "--max-message-bytes",
        SERVE_BROKER,
        BrokerSettings,
        "max_message_bytes",
        {},
        "max_message_bytes must be >= 1024, got 1023",
    ),
    (
        "--no-worker-timeout-ms",
        SERVE_BROKER,
        BrokerSettings,
        "no_worker_timeout_ms",
        {},
        "no_worker_timeout_ms must be a finite number >= 0, got -5e-324",
    ),
    ("--metrics-port", SERVE_BROKER, BrokerSettings, "metrics_port", {}, "metrics_port must be >= 1, got 0"),
    (
        "--batch-timeout-ms",
        SERVE_BROKER,
        BrokerSettings,
        "batch_timeout_ms",
        {},
        "batch_timeout_ms must be a finite number > 0, got 0.0",
    ),
    *[
        (
            flag,
            ("serve", "worker", "bench"),
            SimSettings,
            name,
            {},
            f"sim {name} must be a finite number >= 0, got -5e-324",
        )
        for flag, name in (
            ("--sim-base-ms", "base_ms"),
            ("--sim-per-item-ms", "per_item_ms"),
            ("--simlm-step-base-ms", "step_base_ms"),
            ("--simlm-step-per-seq-ms", "step_per_seq_ms"),
        )
    ],
    (
        "--max-active",
        ("serve", "worker", "bench"),
        WorkerSettings,
        "max_active",
        {},
        "max_active must be an int in [1, 4096], got 0",
    ),
    (
        "--threads-per-worker",
        ("serve", "worker"),
        WorkerSettings,
        "threads",
        {},
        "threads_per_worker must be >= 1, got 0",
    ),
    (
        "--threads-per-worker",
        ("serve",),
        PoolSettings,
        "threads_per_worker",
        POOL,
        "threads_per_worker must be >= 1, got 0",
    ),
    (
        "--max-padded-elements",
        ("serve", "worker"),
        WorkerSettings,
        "max_padded_elements",
        {},
        "max_padded_elements must be an int >= 1, got 0",
    ),
    (
        "--max-padded-elements",
        ("serve",),
        PoolSettings,
        "max_padded_elements",
        POOL,
        "max_padded_elements must be an int >= 1, got 0",
    ),
    ("--gpu", ("worker",), WorkerSettings, "gpu", {}, "gpu must be >= 0, got -1"),
    ("--parent-pid", ("worker",), WorkerSettings, "parent_pid", {}, "parent_pid must be >= 1, got 0"),
    ("--workers", ("serve",), PoolSettings, "workers_per_model", POOL, "workers must be >= 0, got -1"),
    (
        "--workers-per-gpu",
        ("serve",),
        PoolSettings,
        "workers_per_gpu",
        POOL,
        "workers_per_gpu must be >= 1, got 0",
    ),
    (
        "--http-port",
        ("gateway", "serve"),
        GatewaySettings,
        "http_port",
        {"grpc_port": 8001},
        "http_port must be in 0..65535, got -1",
    ),
    (
        "--grpc-port",
        ("gateway", "serve"),
        GatewaySettings,
        "grpc_port",
        {"http_port": 8000},
        "grpc_port must be in 0..65535, got -1",
    ),
    (
        "--processes",
        ("gateway",),
        GatewaySettings,
        "processes",
        {"http_port": 8000},
        "processes (the gateway's --processes) must be an integer in 1..256, got 0",
    ),
    (
        "--gateway-processes",
        ("serve",),
        GatewaySettings,
        "processes",
        {"http_port": 8000},
        "processes (the gateway's --processes) must be an integer in 1..256, got 0",
    ),
    *[
        (flag, ("bench",), LoadSettings, name, {"connect": "tcp://127.0.0.1:1", **others}, message)
        for flag, name, others, message in (
            ("--concurrency", "concurrency", {}, "concurrency must be >= 1, got 0"),
            ("--rate", "rate", {"concurrency": None}, "rate must be > 0, got 0.0"),
            ("--duration", "duration_s", {"concurrency": 1}, "duration_s must be > 0, got 0.0"),
            (
                "--requests",
                "requests",
                {"concurrency": 1, "duration_s": None},
                "requests must be >= 1, got 0",
            ),
            ("--warmup-s", "warmup_s", {"concurrency": 1}, "warmup_s must be >= 0, got -5e-324"),
            ("--payload-bytes", "payload_bytes", {"concurrency": 1}, "payload_bytes must be >= 0, got -1"),
            ("--processes", "processes", {"concurrency": 256}, "processes must be >= 1, got 0"),
        )
    ],
    (
        "--request-timeout-ms",
        ("gateway",),
        GatewaySettings,
        "request_timeout_ms",
        {"http_port": 8000},
        "request_timeout_ms must be > 0, got 0.0",
    ),
]


def edges(b: Bounds) -> tuple[list[Any], Any, Any]:
    """The values at the edges of `b` (accepted), the first under and the first over."""
    assert b.min is not None and b.max is not None
    if b.kind is int:
        lo, hi = int(b.min), int(b.max)
        return [lo, hi], lo - 1, hi + 1
    lo_in = math.nextafter(b.min, math.inf) if b.min_exclusive else float(b.min)
    under = float(b.min) if b.min_exclusive else math.nextafter(b.min, -math.inf)
    return [lo_in, float(b.max)], under, math.nextafter(b.max, math.inf)


def param_of(command: str, flag: str) -> click.Parameter:
    (param,) = [p for p in main.commands[command].params if flag in p.opts]
    return param


def parse(command: str, flag: str, value: Any) -> Any:
    """`value` given as `flag` to `command`, through the command's own parser (no run)."""
    cmd = main.commands[command]
    with cmd.make_context(command, [flag, repr(value)]) as ctx:
        return ctx.params[param_of(command, flag).name or ""]


def build(cls: Any, name: str, value: Any, others: dict[str, Any]) -> Any:
    return cls(**{**others, name: value})


CASES = [
    pytest.param(row, command, id=f"{command} {row[0]} {row[2].__name__}.{row[3]}")
    for row in ROWS
    for command in row[1]
]


@pytest.mark.parametrize(("row", "command"), CASES)
def test_the_flag_accepts_what_its_settings_field_accepts(row: Any, command: str, monkeypatch: Any) -> None:
    flag, _, cls, name, others, under_message = row
    for var in [k for k in os.environ if k.startswith("BATCHER_")]:
        monkeypatch.delenv(var)
    b = bounds(cls, name)
    accepted, under, over = edges(b)
    for value in accepted:
        assert parse(command, flag, value) == value
        assert getattr(build(cls, name, value, others), name) == value
    for value, message in ((under, under_message), (over, f"{b.label} must be <= {b.max}, got {over!r}")):
        with pytest.raises(click.BadParameter, match="is not in the range"):
            parse(command, flag, value)
        if b.message is not None and value == over:  # one message for both sides
            message = under_message.replace(f"got {under!r}", f"got {over!r}")
        with pytest.raises(SettingsError) as raised:
            build(cls, name, value, others)
        assert str(raised.value) == message


@pytest.mark.parametrize(("row", "command"), CASES)
def test_the_flag_shows_its_fields_range_default_and_help(row: Any, command: str) -> None:
    flag, _, cls, name, _, _ = row
    param = param_of(command, flag)
    b = bounds(cls, name)
    assert isinstance(param.type, click.IntRange | click.FloatRange)
    assert (param.type.min, param.type.max, param.type.min_open) == (b.min, b.max, b.min_exclusive)
    if flag != "--duration":  # None there: 10 s unless --requests
        assert param.default == default(cls, name)
    if b.help and flag != "--threads-per-worker":  # its help names each command's default
        assert isinstance(param, click.Option) and param.help == b.help


def test_a_nan_and_an_infinity_and_a_bool_are_refused_by_a_number_setting() -> None:
    for bad in (math.nan, math.inf, -math.inf, True, "5"):
        with pytest.raises(SettingsError, match=r"^max_wait_ms must be a finite number >= 0, got "):
            BatchSettings(max_wait_ms=bad)  # type: ignore[arg-type]
    for bad in (True, 2.0, "8"):
        with pytest.raises(SettingsError, match=r"^max_batch_size must be an int, got "):
            BatchSettings(max_batch_size=bad)  # type: ignore[arg-type]


def test_an_optional_setting_takes_none_and_a_required_one_does_not() -> None:
    assert BrokerSettings(metrics_port=None).metrics_port is None
    with pytest.raises(SettingsError, match=r"^max_queue must be an int, got None$"):
        BatchSettings(max_queue=None)  # type: ignore[arg-type]


def test_check_refuses_the_first_field_out_of_bounds_with_its_label() -> None:
    @dataclasses.dataclass(frozen=True)
    class Two:
        a: int = setting(1, kind=int, min=0, max=9, label="the a")
        b: float = setting(0.5, min=0, min_exclusive=True, max=1, noun="a finite number")

        def __post_init__(self) -> None:
            check(self)

    assert Two(9, 1.0) == Two(9, 1)
    with pytest.raises(SettingsError, match=r"^the a must be <= 9, got 10$"):
        Two(10, 0)
    with pytest.raises(SettingsError, match=r"^b must be a finite number > 0, got 0$"):
        Two(0, 0)
    with pytest.raises(LookupError):
        bounds(Two, "c")


@pytest.mark.parametrize("row", [pytest.param(row, id=row[0]) for row in ROWS if "broker" in row[1]])
def test_a_config_file_value_past_an_edge_is_refused_as_the_flag_is(row: Any, tmp_path: Any) -> None:
    """--config (batcher/cli/config_file.py) checks a value with the flag's own type: the
    edges pass, the first value past each is refused naming the file, the table and the
    key; a [models.NAME] table's batching keys too."""
    _, _, cls, name, _, _ = row
    accepted, under, over = edges(bounds(cls, name))
    tables = ["", "[models.echo]\n"] if cls is BatchSettings else [""]
    broker = main.commands["broker"]
    for table in tables:
        where = f"[models.echo] {name}" if table else f"{name} (top level)"
        for value, ok in ((accepted[0], True), (accepted[1], True), (under, False), (over, False)):
            path = tmp_path / "batcher.toml"
            path.write_text(f"{table}{name} = {value!r}\n")
            if ok:
                with broker.make_context("broker", ["--config", str(path)]) as ctx:
                    assert ctx.params["config"] == str(path)
                continue
            with pytest.raises(click.BadParameter) as raised:
                broker.make_context("broker", ["--config", str(path)])
            assert f"{where}: {value!r} is not in the range" in raised.value.message


def test_a_model_tables_workers_have_the_range_of_workers() -> None:
    """A [models.NAME] table's `workers` (PoolSettings.model_workers) is held to the range
    of --workers, in the file (MODEL_WORKERS) and in the dataclass."""
    from batcher.cli.options import MODEL_WORKERS

    b = bounds(PoolSettings, "workers_per_model")
    assert (MODEL_WORKERS.min, MODEL_WORKERS.max) == (b.min, b.max) == (0, 256)
    pool = {**POOL, "models": ("echo",)}
    assert PoolSettings(**pool, model_workers={"echo": 256}).model_workers == {"echo": 256}
    for bad, message in (
        (-1, "workers of model 'echo' must be >= 0, got -1"),
        (257, "workers of model 'echo' must be <= 256, got 257"),
    ):
        with pytest.raises(click.BadParameter, match="is not in the range 0<=x<=256"):
            MODEL_WORKERS.convert(bad, None, None)
        with pytest.raises(SettingsError) as raised:
            PoolSettings(**pool, model_workers={"echo": bad})
        assert str(raised.value) == message
