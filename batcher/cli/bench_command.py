"""`batcher bench`: its options, the `serve` it may spawn, and a progress bar; the load
generator itself is `batcher.cli.bench`."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from batcher.broker.loop import BrokerSettings
from batcher.cli.config_options import config_option
from batcher.cli.load_settings import LoadSettings
from batcher.cli.option_groups import (
    BATCHING_FLAGS,
    BROKER_FLAGS,
    CURVE_ALLOW_LIST_FLAGS,
    HEARTBEAT_FLAGS,
    ClientKeys,
    StepOptions,
    curve_client_options,
    sim_options,
    step_options,
)
from batcher.cli.options import (
    CONNECT_ADDRESS,
    MAX_WORKERS,
    MAX_WORKERS_PER_GPU,
    READY_POLL_S,
    LogOptions,
    int_range,
    local_option,
    logging_options,
    option,
    option_group,
    setting_option,
    setup,
)
from batcher.cli.send_command import parse_input
from batcher.client.sync import BatcherError, Client
from batcher.transport.security import KeyFileError
from workers.models import SimSettings

if TYPE_CHECKING:  # the load generator loads when bench runs, not with every command
    from batcher.cli.bench import LoadResult
    from batcher.serve.launcher import ServeProcess


def _serve_flags(**values: object) -> list[str]:
    """Options as `batcher serve` takes them on its command line (None: left out)."""
    flags: list[str] = []
    for name, value in values.items():
        if value is None:
            continue
        text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
        flags += ["--" + name.replace("_", "-"), text]
    return flags


#: The broker's options as `bench --spawn` passes them on to the `serve` it starts (its
#: key pair is bench's --curve-secret-key): the command gets them as `serve` flags.
spawned_broker_options = option_group(
    "serve_flags",
    _serve_flags,
    *BATCHING_FLAGS,
    *BROKER_FLAGS,
    *HEARTBEAT_FLAGS,
    *CURVE_ALLOW_LIST_FLAGS,
    config_option,
)


@dataclass(frozen=True)
class BenchOptions:
    """bench's own options: the load to offer (LoadSettings' fields as given: None where
    --help names a default), where to write the result, and a spawned serve's workers."""

    concurrency: int | None
    rate: float | None
    duration_s: float | None
    requests: int | None
    warmup_s: float
    payload_bytes: int
    model: str | None
    processes: int
    json_path: str | None
    workers: int
    stream: bool
    input_json: str | None

    @property
    def served(self) -> str:
        """The model a spawned serve serves: --model, else simlm for streams, else sim."""
        return self.model or ("simlm" if self.stream else BrokerSettings().default_model)

    def request_input(self) -> Any:
        """Each request's input: --input (a usage error if it is not JSON msgpack can send),
        else {"tokens": 32} for streams, else None (--payload-bytes of bytes)."""
        try:
            given = parse_input(self.input_json) if self.input_json is not None else None
        except click.BadParameter as exc:
            raise click.BadParameter(exc.message, param_hint="--input") from None
        return {"tokens": 32} if given is None and self.stream else given

    def serve_args(
        self, sim: SimSettings, steps: StepOptions, serve_flags: list[str], key: str | None
    ) -> list[str]:
        """The command line of the `serve` that --spawn starts, `key` its key pair."""
        # --workers-per-gpu as high as --workers: the spawned serve spreads its workers over
        # whatever GPUs it sees rather than refusing more workers than GPUs.
        per_gpu = min(self.workers, MAX_WORKERS_PER_GPU)
        args = ["--workers", str(self.workers), "--workers-per-gpu", str(per_gpu), "--model", self.served]
        args += ["--sim-base-ms", str(sim.base_ms), "--sim-per-item-ms", str(sim.per_item_ms)]
        args += [
            "--simlm-step-base-ms",
            str(sim.step_base_ms),
            "--simlm-step-per-seq-ms",
            str(sim.step_per_seq_ms),
        ]
        args += ["--max-active", str(steps.max_active), "--batching-level", steps.batching_level]
        return [*args, *serve_flags, *_serve_flags(curve_secret_key=key)]

    def load_settings(
        self,
        connect: str,
        *,
        spawn: bool,
        curve_server_key: str | None,
        curve_secret_key: str | None,
        request_input: Any,
    ) -> LoadSettings:
        """The run's LoadSettings, with the defaults --help names; one it refuses is a usage error."""
        from batcher.cli import bench as load  # looked up now (a test may replace LoadSettings)

        no_loop = self.concurrency is None and self.rate is None
        no_length = self.duration_s is None and self.requests is None
        try:
            return load.LoadSettings(
                connect=connect,
                concurrency=64 if no_loop else self.concurrency,
                rate=self.rate,
                duration_s=10.0 if no_length else self.duration_s,
                requests=self.requests,
                payload_bytes=self.payload_bytes,
                model=self.served if spawn and self.model is None else self.model,
                processes=self.processes,
                warmup_s=self.warmup_s,
                curve_server_key=curve_server_key,
                curve_secret_key=curve_secret_key,
                input=request_input,
                stream=self.stream,
            )
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None


#: bench's own options, in this order in --help: the command gets them as a BenchOptions.
bench_options = option_group(
    "opts",
    BenchOptions,
    setting_option("--concurrency", cls=LoadSettings, field="concurrency"),
    setting_option("--rate", cls=LoadSettings, field="rate"),
    setting_option("--duration", "duration_s", cls=LoadSettings, field="duration_s", default=None),
    setting_option("--requests", cls=LoadSettings, field="requests"),
    setting_option("--warmup-s", cls=LoadSettings, field="warmup_s"),
    setting_option("--payload-bytes", cls=LoadSettings, field="payload_bytes"),
    option(
        "--model",
        envvar="BATCHER_REQUEST_MODEL",
        old_envvar="BATCHER_MODEL",
        default=None,
        help="Model to ask; with --spawn, the model served (default sim).",
    ),
    setting_option("--processes", cls=LoadSettings, field="processes"),
    option(
        "--json",
        "json_path",
        type=click.Path(dir_okay=False, writable=True),
        default=None,
        help="Write the full result as JSON to this file.",
    ),
    option("--workers", type=int_range(1, MAX_WORKERS), default=2, help="--spawn: worker processes."),
    local_option(
        "--stream",
        is_flag=True,
        default=False,
        help='Streamed requests ("stream": true): also measures time to first chunk, chunks/s and '
        'the time between chunks. Default model with --spawn: simlm; default input: {"tokens": 32}.',
    ),
    local_option(
        "--input",
        "input_json",
        default=None,
        help="Each request's input as JSON (instead of --payload-bytes of bytes), e.g. '{\"tokens\": 64}'.",
    ),
)


@click.command()
@option("--connect", type=CONNECT_ADDRESS, default=None, help="Frontend of a running broker to load.")
@option("--spawn", is_flag=True, default=False, help="Start a broker and workers (serve options below).")
@bench_options
@spawned_broker_options
@curve_client_options
@sim_options
@step_options
@logging_options
def bench(
    connect: str | None,
    spawn: bool,
    opts: BenchOptions,
    serve_flags: list[str],
    curve: ClientKeys,
    sim: SimSettings,
    steps: StepOptions,
    logs: LogOptions,
) -> None:
    """Measure throughput and latency of a broker under closed- or open-loop load.

    With --spawn, --curve-secret-key is the spawned broker's key pair, and the load
    generator uses it too (the broker admits its own key on both sockets)."""
    from batcher.cli.bench import format_report
    from batcher.serve.launcher import ServeProcess

    setup(logs)
    if spawn == (connect is not None):
        raise click.UsageError("give exactly one of --connect ADDR or --spawn")
    curve_server_key, curve_secret_key = curve.curve_server_key, curve.curve_secret_key
    if spawn and curve_server_key is not None:
        raise click.UsageError(
            "--curve-server-key is for --connect; with --spawn, --curve-secret-key is the "
            "broker's key pair and the load generator's"
        )
    request_input = opts.request_input()
    serve = ServeProcess(opts.serve_args(sim, steps, serve_flags, curve_secret_key)) if spawn else None
    if serve is not None:
        connect, curve_server_key = serve.frontend, curve_secret_key  # a .key_secret holds the public key too
    assert connect is not None
    settings = opts.load_settings(
        connect,
        spawn=spawn,
        curve_server_key=curve_server_key,
        curve_secret_key=curve_secret_key,
        request_input=request_input,
    )
    result = _run(serve, settings, opts.workers, curve_secret_key)
    click.echo(format_report(result))
    if opts.json_path:
        with open(opts.json_path, "w") as f:
            json.dump(result.to_json(), f, indent=2)
    if result.failure is not None:  # the report says FAILED; a script must see it too
        click.echo(f"bench: {result.failure}", err=True)
        sys.exit(1)


def _run(
    serve: ServeProcess | None, settings: LoadSettings, workers: int, curve_key: str | None
) -> LoadResult:
    """Run the load, against `serve` (bench --spawn's, started here and stopped after,
    whatever happens) once it has `workers` workers."""
    try:
        if serve is not None:
            serve.start()
            _wait_spawned(serve, workers, curve_key)
        return _run_with_progress(settings)
    except KeyFileError as exc:  # a key file that exists but holds no usable key
        raise click.ClickException(str(exc)) from None
    finally:
        if serve is not None:
            serve.stop()


def _wait_spawned(serve: ServeProcess, workers: int, curve_key: str | None, timeout_s: float = 30.0) -> None:
    """Wait until bench's spawned `serve` has `workers` workers, asking its stats as the
    load generator will connect (with its CURVE key pair, if any)."""
    deadline = time.monotonic() + timeout_s
    with Client(serve.frontend, 1.0, curve_server_key=curve_key, curve_secret_key=curve_key) as client:
        while True:
            if serve.process is not None and serve.process.poll() is not None:
                raise click.ClickException(f"the spawned serve exited with {serve.process.returncode}")
            try:
                models = client.control("stats").get("models", {})
                if sum(m.get("workers", 0) for m in models.values()) >= workers:
                    return
            except BatcherError:
                pass  # not up yet
            if time.monotonic() > deadline:
                raise click.ClickException(f"the spawned serve had no {workers} workers in {timeout_s}s")
            time.sleep(READY_POLL_S)  # between readiness probes


def _run_with_progress(settings: LoadSettings) -> LoadResult:
    """run_load with a progress bar on stderr (elapsed time, or requests answered)."""
    from batcher.cli.bench import run_load

    if settings.requests is not None:
        length, unit = settings.requests, "requests"
    else:
        assert settings.duration_s is not None  # LoadSettings has one of the two
        length, unit = int((settings.duration_s + settings.warmup_s) * 10), "time"
    start = time.monotonic()
    with click.progressbar(length=length, label="bench", file=sys.stderr, show_eta=False) as bar:

        def on_progress(completed: int) -> None:
            done = completed if unit == "requests" else int((time.monotonic() - start) * 10)
            bar.update(min(length, done) - bar.pos)

        return run_load(settings, on_progress)
