"""The `batcher` command group: serve, broker, worker, gateway, send, stats, ready, reload,
bench, keygen, demo.

Each command lives in a module of its own (or with the commands it goes with), over one
module of shared option machinery:

- `options`: option types, `option` / `local_option` / `option_group`, environment
  variables (deprecated names too), logging options, the numeric bounds, list parsers;
- `option_groups`: the option groups commands share (CURVE, heartbeats, batching, the
  broker's settings, the simulated model, step-level models, warm-up and threads);
- `config_options`: --config, the TOML file's checks and serve's re-reading of it;
- the commands: `serve_commands` (serve, broker), `worker_command`, `gateway_command`,
  `send_command`, `control_commands` (stats, ready, reload), `bench_command`,
  `keygen_command`, `demo_command`.

This module assembles the group (`main`, the console entry point through `batcher.cli:main`)
and re-exports the names it used to define, so `batcher.cli.commands.X` keeps working.
"""

from __future__ import annotations

import click

from batcher.cli.bench_command import bench, spawned_broker_options
from batcher.cli.config_options import BATCH_KEYS, config_option, given_outside_file
from batcher.cli.control_commands import (
    load_model,
    readiness,
    ready,
    reload_model,
    split_model,
    stats,
    unload_model,
)
from batcher.cli.demo_command import demo
from batcher.cli.gateway_command import GatewayAccess, gateway
from batcher.cli.keygen_command import keygen
from batcher.cli.option_groups import (
    BrokerOptions,
    ClientKeys,
    StepOptions,
    batching_options,
    broker_options,
    curve_client_options,
    curve_server_options,
    curve_worker_options,
    heartbeat_options,
    max_padded_elements_option,
    no_warmup_option,
    sim_options,
    step_options,
    threads_option,
)
from batcher.cli.options import (
    BIND_ADDRESS,
    CONNECT_ADDRESS,
    DEPRECATED_ENVVARS,
    MAX_BATCH_COST,
    MAX_BATCH_SIZE,
    MAX_BENCH_S,
    MAX_CONCURRENCY,
    MAX_GPU,
    MAX_LENGTH,
    MAX_LIVENESS,
    MAX_MESSAGE_BYTES,
    MAX_MS,
    MAX_PREFETCH,
    MAX_PROCESSES,
    MAX_QUEUE,
    MAX_RATE,
    MAX_REFRESHES,
    MAX_REQUESTS,
    MAX_RETRIES,
    MAX_STATS_S,
    MAX_THREADS,
    MAX_TIMEOUT_MS,
    MAX_TIMEOUT_S,
    MAX_WORKERS,
    MAX_WORKERS_PER_GPU,
    MODEL_WORKERS,
    READY_POLL_S,
    Decorator,
    EnvOption,
    FiniteFloatRange,
    LogOptions,
    ZmqAddress,
    envvar_name,
    field_default,
    float_range,
    int_range,
    local_option,
    logging_options,
    option,
    option_group,
    setup,
)
from batcher.cli.send_command import jsonable, parse_input, send, strict_json
from batcher.cli.serve_commands import broker, broker_settings, pool_settings, serve, served_name
from batcher.cli.worker_command import worker

__all__ = [
    "BATCH_KEYS",
    "BIND_ADDRESS",
    "CONNECT_ADDRESS",
    "DEPRECATED_ENVVARS",
    "MAX_BATCH_COST",
    "MAX_BATCH_SIZE",
    "MAX_BENCH_S",
    "MAX_CONCURRENCY",
    "MAX_GPU",
    "MAX_LENGTH",
    "MAX_LIVENESS",
    "MAX_MESSAGE_BYTES",
    "MAX_MS",
    "MAX_PREFETCH",
    "MAX_PROCESSES",
    "MAX_QUEUE",
    "MAX_RATE",
    "MAX_REFRESHES",
    "MAX_REQUESTS",
    "MAX_RETRIES",
    "MAX_STATS_S",
    "MAX_THREADS",
    "MAX_TIMEOUT_MS",
    "MAX_TIMEOUT_S",
    "MAX_WORKERS",
    "MAX_WORKERS_PER_GPU",
    "MODEL_WORKERS",
    "READY_POLL_S",
    "BrokerOptions",
    "ClientKeys",
    "Decorator",
    "EnvOption",
    "FiniteFloatRange",
    "GatewayAccess",
    "LogOptions",
    "StepOptions",
    "ZmqAddress",
    "batching_options",
    "bench",
    "broker",
    "broker_options",
    "broker_settings",
    "config_option",
    "curve_client_options",
    "curve_server_options",
    "curve_worker_options",
    "demo",
    "envvar_name",
    "field_default",
    "float_range",
    "gateway",
    "given_outside_file",
    "heartbeat_options",
    "int_range",
    "jsonable",
    "keygen",
    "load_model",
    "local_option",
    "logging_options",
    "main",
    "max_padded_elements_option",
    "no_warmup_option",
    "option",
    "option_group",
    "parse_input",
    "pool_settings",
    "readiness",
    "ready",
    "reload_model",
    "send",
    "serve",
    "served_name",
    "setup",
    "sim_options",
    "spawned_broker_options",
    "split_model",
    "stats",
    "step_options",
    "strict_json",
    "threads_option",
    "unload_model",
    "worker",
]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="batcher")
def main() -> None:
    """batcher: a dynamic-batching inference broker over ZeroMQ and msgpack."""


# In the order they were defined when they shared one module (main.commands keeps it).
for _command in (
    gateway,
    serve,
    broker,
    worker,
    send,
    demo,
    bench,
    stats,
    ready,
    reload_model,
    split_model,
    load_model,
    unload_model,
    keygen,
):
    main.add_command(_command)
del _command


if __name__ == "__main__":
    main()
