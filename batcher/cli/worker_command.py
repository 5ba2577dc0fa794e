"""`batcher worker`: one model-worker process connected to a broker's backend."""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import click

from batcher.cli.option_groups import (
    ClientKeys,
    StepOptions,
    curve_worker_options,
    heartbeat_options,
    max_padded_elements_option,
    no_warmup_option,
    sim_options,
    step_options,
    threads_option,
    trace_options,
)
from batcher.cli.options import (
    CONNECT_ADDRESS,
    LogOptions,
    check_models,
    int_list_callback,
    int_range,
    local_option,
    logging_options,
    option,
    parse_batch_sizes,
    setting_option,
    setup,
    text_callback,
)
from batcher.observe.settings import TraceSettings
from batcher.wire.protocol import Heartbeat
from workers.exit_codes import EXIT_MODEL_LOAD_FAILED
from workers.models import SimSettings
from workers.placement import parse_cpus
from workers.worker import ModelLoadError, WorkerSettings, run_worker


@click.command()
@option(
    "--connect",
    type=CONNECT_ADDRESS,
    envvar="BATCHER_WORKER_CONNECT",
    old_envvar="BATCHER_CONNECT",
    default=WorkerSettings().connect,
    help="The broker's backend address.",
)
@option(
    "--model",
    envvar="BATCHER_WORKER_MODEL",
    old_envvar="BATCHER_MODEL",
    default=WorkerSettings().model,
    help="The model to load: sim, echo, pkg.module:attr, onnx:PATH or NAME=SPEC.",
)
@setting_option("--gpu", cls=WorkerSettings, field="gpu")
@threads_option("every core (one worker); `serve` divides the cores among its workers")
@option(
    "--cpus",
    callback=text_callback(parse_cpus),
    default=None,
    help="Run this worker and its model's threads on these CPUs only, e.g. 1 or 2-3 "
    "(Linux). `serve --pin-cpus` gives each worker its own.",
)
@option(
    "--warmup-sizes",
    callback=int_list_callback(parse_batch_sizes),
    default=None,
    help="Batch sizes the warm-up runs the model at, e.g. 1,2,4,8 (the default; serve passes "
    "each model's allowed sizes).",
)
@no_warmup_option
@option(
    "--warmup-sample",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="A JSON file holding one request's input, tensors as `batcher send` reads them, for "
    "the warm-up to run the model on instead of its warmup_sample or zeros of its signature "
    "(serve: a model table's warmup_sample).",
)
@max_padded_elements_option
@option(
    "--multiplex",
    "multiplex",
    default=None,
    metavar="JSON",
    help="Serve many models, loading each on first use and unloading the least recently used "
    'to stay within a budget (docs/models.md): {"budget_mb": MB, "models": {"NAME": '
    '{"target": SPEC, "memory_mb": MB}}}. --model is then not loaded.',
)
@setting_option("--parent-pid", cls=WorkerSettings, field="parent_pid", hidden=True)
@local_option(
    "--load-error-fd",
    type=int_range(0, 2**31 - 1),
    default=None,
    hidden=True,
    help="Started by serve for a reload: write why the model did not load to this pipe.",
)
@heartbeat_options
@curve_worker_options
@sim_options
@step_options
@trace_options
@logging_options
def worker(
    connect: str,
    model: str,
    gpu: int | None,
    threads_per_worker: int | None,
    cpus: tuple[int, ...] | None,
    warmup_sizes: tuple[int, ...] | None,
    no_warmup: bool,
    warmup_sample: str | None,
    max_padded_elements: int,
    multiplex: str | None,
    parent_pid: int | None,
    load_error_fd: int | None,
    heartbeat: Heartbeat,
    curve: ClientKeys,
    sim: SimSettings,
    steps: StepOptions,
    trace: TraceSettings,
    logs: LogOptions,
) -> None:
    """Run one model-worker process connected to a broker's backend."""
    setup(logs)
    check_models((model,))
    try:
        run_worker(
            WorkerSettings(
                connect,
                model,
                gpu,
                sim,
                parent_pid,
                heartbeat,
                curve.curve_server_key,
                curve.curve_secret_key,
                threads_per_worker,
                () if no_warmup else (warmup_sizes or WorkerSettings().warmup_sizes),
                steps.max_active,
                steps.batching_level,
                cpus,
                max_padded_elements,
                warmup_sample,
                trace,
                multiplex,
            )
        )
    except ModelLoadError as exc:
        logging.getLogger("batcher.worker").error("%s", exc)
        if load_error_fd is not None:
            _tell_load_error(load_error_fd, str(exc))
        sys.exit(EXIT_MODEL_LOAD_FAILED)


def _tell_load_error(fd: int, message: str) -> None:
    """Write why the model did not load to serve's pipe, at most one pipe buffer (written
    at once), ignoring a pipe that is gone: serve then has only the log."""
    with contextlib.suppress(OSError):
        os.write(fd, message.encode("utf-8", "replace")[:4000])
