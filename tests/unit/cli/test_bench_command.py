"""`batcher bench`'s own options (batcher.cli.bench_command.BenchOptions), parsed by click as
a user types them: the defaults --help names, the spawned serve's command line, the input
of each request, and the load settings a run gets. Nothing is started."""

from __future__ import annotations

import dataclasses
from typing import Any

import click
import pytest

import batcher.cli.commands
from batcher.cli.bench_command import BenchOptions
from workers.models import SimSettings

CONNECT = "tcp://127.0.0.1:5555"


def options(*args: str) -> BenchOptions:
    """The BenchOptions `batcher bench ARGS` runs with."""
    params = batcher.cli.commands.bench.make_context("bench", list(args)).params
    return BenchOptions(**{f.name: params[f.name] for f in dataclasses.fields(BenchOptions)})


def settings(opts: BenchOptions, *, spawn: bool = False, key: str | None = None) -> Any:
    return opts.load_settings(
        CONNECT, spawn=spawn, curve_server_key=key, curve_secret_key=key, request_input=opts.request_input()
    )


def test_without_a_loop_or_a_length_it_is_64_in_flight_for_10_s() -> None:
    s = settings(options("--connect", CONNECT))
    assert (s.concurrency, s.rate, s.duration_s, s.requests) == (64, None, 10.0, None)
    assert (s.payload_bytes, s.model, s.input, s.stream, s.processes) == (16, None, None, False, 1)


def test_a_rate_or_a_request_count_replaces_the_default_loop_or_length() -> None:
    s = settings(options("--connect", CONNECT, "--rate", "50", "--requests", "7"))
    assert (s.concurrency, s.rate, s.duration_s, s.requests) == (None, 50.0, None, 7)
    s = settings(options("--connect", CONNECT, "--concurrency", "3", "--duration", "2.5"))
    assert (s.concurrency, s.rate, s.duration_s, s.requests) == (3, None, 2.5, None)


def test_spawn_asks_the_model_it_serves() -> None:
    assert settings(options("--spawn"), spawn=True).model == "sim"
    assert settings(options("--spawn", "--model", "echo"), spawn=True).model == "echo"
    streamed = settings(options("--spawn", "--stream"), spawn=True)
    assert (streamed.model, streamed.input, streamed.stream) == ("simlm", {"tokens": 32}, True)
    # Against a running broker, no model named is the broker's default.
    assert settings(options("--connect", CONNECT, "--stream")).model is None


def test_input_is_json_and_a_bad_one_names_the_option() -> None:
    assert options("--spawn", "--input", '{"tokens": 64}').request_input() == {"tokens": 64}
    assert options("--spawn", "--stream", "--input", "5").request_input() == 5
    with pytest.raises(click.BadParameter) as caught:
        options("--spawn", "--input", "{nope").request_input()
    assert caught.value.param_hint == "--input" and "not JSON" in caught.value.message


def test_a_load_the_settings_refuse_is_a_usage_error() -> None:
    with pytest.raises(click.UsageError, match=r"concurrency \(2\) must be >= processes \(4\)"):
        settings(options("--connect", CONNECT, "--concurrency", "2", "--processes", "4"))


def test_the_spawned_serve_gets_the_workers_model_costs_and_key_pair() -> None:
    opts = options("--spawn", "--workers", "100", "--stream", "--max-active", "9")
    sim = SimSettings(1.5, 0.25, 3.0, 0.5)
    steps = batcher.cli.commands.StepOptions(max_active=9, batching_level="request")
    args = opts.serve_args(sim, steps, ["--max-batch-size", "3"], "broker.key_secret")
    pairs = dict(zip(args[::2], args[1::2], strict=True))
    assert pairs == {
        "--workers": "100",
        "--workers-per-gpu": "64",  # as many as --workers, within its bound: spread over any GPUs
        "--model": "simlm",
        "--sim-base-ms": "1.5",
        "--sim-per-item-ms": "0.25",
        "--simlm-step-base-ms": "3.0",
        "--simlm-step-per-seq-ms": "0.5",
        "--max-active": "9",
        "--batching-level": "request",
        "--max-batch-size": "3",
        "--curve-secret-key": "broker.key_secret",
    }
    assert "--curve-secret-key" not in opts.serve_args(sim, steps, [], None)
    assert options("--spawn", "--workers", "3").serve_args(sim, steps, [], None)[:4] == [
        "--workers",
        "3",
        "--workers-per-gpu",
        "3",
    ]
