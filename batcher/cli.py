"""The `batcher` command line: serve, broker, worker, send, stats, ready, reload, bench,
keygen, demo.

Every option can also be set by an environment variable, BATCHER_<OPTION> unless the
name would mean different things on different commands (the worker's backend address
is BATCHER_WORKER_CONNECT, since BATCHER_CONNECT is a client's frontend address). What
decides a value, first match wins: the command line, the environment, the config
file's [models.NAME] table (for that model), the file's top level, the default.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import click
from click.core import ParameterSource

from batcher.broker import BindError, Broker, BrokerSettings, run_broker
from batcher.config import COMMA_LIST_OPTIONS, Config, ConfigError, Kind, load_config, type_problem
from batcher.logs import FORMATS, setup_logging
from batcher.protocol import Heartbeat
from batcher.scheduler import POLICIES, BatchSettings
from batcher.security import CurveServerKeys, KeyFileError

if TYPE_CHECKING:
    from workers.models import SimSettings
    from workers.supervisor import PoolSettings

F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger("batcher.cli")

DEFAULT_FRONTEND = "tcp://127.0.0.1:5555"
DEFAULT_BACKEND = "tcp://127.0.0.1:5556"
#: Chosen by measurement: see docs/benchmarks.md.
DEFAULT_WORKER_PREFETCH = 2
#: How often `serve` looks for dead workers to respawn.
SUPERVISE_INTERVAL_S = 0.2
#: How long a request for a model without any worker waits before `unavailable`.
DEFAULT_NO_WORKER_TIMEOUT_MS = 10_000.0
#: How often `batcher ready` asks the broker again while a model has no worker.
READY_POLL_S = 0.2

# Upper bounds of the numeric options, shown by --help. Each is finite, far above any
# useful setting, and small enough for where the value ends up: poll timeouts in whole
# milliseconds, libzmq's int64 options, msgpack's 32-bit lengths, one process per worker.
MAX_MS = 60_000.0  # heartbeat interval, batch window, simulated batch costs: one minute
MAX_TIMEOUT_MS = 86_400_000.0  # request deadlines: one day
MAX_TIMEOUT_S = MAX_TIMEOUT_MS / 1000  # a client's wait for a reply: one day
MAX_BATCH_SIZE = 4096
MAX_QUEUE = 10_000_000  # requests per model
MAX_WORKERS = 256  # worker processes per model
MAX_WORKERS_PER_GPU = 64
MAX_GPU = 65_535  # serve numbers its workers' GPUs across models: up to MAX_WORKERS each
MAX_PREFETCH = 64
MAX_RETRIES = 100
MAX_LIVENESS = 100
MAX_MESSAGE_BYTES = 1 << 30  # 1 GiB: bigger inputs belong in shared storage, not a message
MAX_BENCH_S = 86_400.0
MAX_RATE = 1_000_000.0
MAX_CONCURRENCY = 100_000
MAX_REQUESTS = 1_000_000_000
MAX_PROCESSES = 256
MAX_STATS_S = 3600.0
MAX_REFRESHES = 1_000_000_000
#: The range of a [models.NAME] table's `workers` (the workers of that model).
MODEL_WORKERS = click.IntRange(min=0, max=MAX_WORKERS)

#: Names that used to mean one thing on some commands and another elsewhere. Each is
#: still read, after its new name, where it had that meaning, with a warning saying why.
DEPRECATED_ENVVARS = {
    "BATCHER_CONNECT": "it is also the frontend address a client connects to",
    "BATCHER_MODEL": "it is also the list of models serve and broker serve",
    "BATCHER_CURVE_SECRET_KEY": "it is also a client's own key pair",
    "BATCHER_TIMEOUT_S": "send, ready and reload wait for other things, with variables of their own",
}
#: ctx.meta key of the deprecated variables a command read, for the warning.
_DEPRECATED_READ = "batcher.deprecated_envvars"
#: Deprecated variables already warned about by this process (each is warned about once).
_warned: set[str] = set()


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that refuses NaN too: NaN compares false with both bounds, so a
    range alone lets it through (and `inf` only fails because every range has a max)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        if isinstance(rv, float) and math.isnan(rv):
            self.fail(f"{value!r} is not a number", param, ctx)
        return rv


def int_range(lo: int, hi: int) -> click.IntRange:
    """The type of an int option: both bounds given, so --help shows them."""
    return click.IntRange(min=lo, max=hi)


def float_range(lo: float, hi: float, *, min_open: bool = False) -> FiniteFloatRange:
    """The type of a float option: finite, within both bounds (shown by --help)."""
    return FiniteFloatRange(min=lo, max=hi, min_open=min_open)


class EnvOption(click.Option):
    """A click.Option that, when its own variable is unset, also reads its deprecated
    name (`old_envvar`), and records that, so the command can warn once logging is up.
    --help shows the new name only."""

    def __init__(self, *args: Any, old_envvar: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.old_envvar = old_envvar

    def resolve_envvar_value(self, ctx: click.Context) -> str | None:
        rv = super().resolve_envvar_value(ctx)
        if rv is None and self.old_envvar and os.environ.get(self.old_envvar):
            ctx.meta.setdefault(_DEPRECATED_READ, {})[self.old_envvar] = (self.envvar, self.opts[0])
            return os.environ[self.old_envvar]
        return rv


def envvar_name(long_name: str) -> str:
    """The default variable of an option: `--max-wait-ms` reads BATCHER_MAX_WAIT_MS."""
    return "BATCHER_" + long_name[2:].replace("-", "_").upper()


def option(*decls: str, old_envvar: str | None = None, **kwargs: Any) -> Callable[[F], F]:
    """click.option reading an environment variable: BATCHER_<OPTION> unless `envvar`
    names another, and `old_envvar` (deprecated) after it."""
    long_name = next(d for d in decls if d.startswith("--"))
    kwargs.setdefault("envvar", envvar_name(long_name))
    kwargs.setdefault("show_envvar", True)
    kwargs.setdefault("show_default", True)
    return click.option(*decls, cls=EnvOption, old_envvar=old_envvar, **kwargs)


def setup(log_level: str, log_format: str) -> None:
    """Every command's start: logging, then a warning for each deprecated variable read."""
    setup_logging(log_level, log_format)
    ctx = click.get_current_context(silent=True)
    read: dict[str, tuple[str, str]] = ctx.meta.get(_DEPRECATED_READ, {}) if ctx else {}
    for old, (new, flag) in read.items():
        if old in _warned:
            continue
        _warned.add(old)
        log.warning(
            "%s is deprecated for `batcher %s %s` (%s): set %s instead",
            old,
            ctx.info_name if ctx else "?",
            flag,
            DEPRECATED_ENVVARS.get(old, "its meaning differs by command"),
            new,
        )


def given_outside_file(ctx: click.Context | None, names: Iterable[str]) -> set[str]:
    """The options among `names` set on the command line or in the environment: they beat
    the config file everywhere, its [models.NAME] tables included."""
    if ctx is None:
        return set()
    sources = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    return {n for n in names if ctx.get_parameter_source(n) in sources}


def logging_options(f: F) -> F:
    """--log-level and --log-format, on every command."""
    f = option(
        "--log-format",
        type=click.Choice(FORMATS),
        default="text",
        help="Log lines as text or as JSON objects.",
    )(f)
    f = option(
        "--log-level",
        type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
        default="INFO",
        help="Logging threshold (logs go to stderr).",
    )(f)
    return f


def _load_config(ctx: click.Context, param: click.Parameter, path: str | None) -> str | None:
    """--config: the file's top-level keys become option defaults (so a flag, then its
    environment variable, then the file, then the built-in default decide; the
    [models.NAME] tables are applied by broker_settings and serve). Every value is
    checked here, type and range, so an error names the file, the table and the key."""
    if path is None:
        return None
    try:
        config = load_config(path)
        _check_config(ctx, config)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None
    ctx.default_map = {**(ctx.default_map or {}), **config.options}
    return path


def _param_kind(p: click.Parameter) -> Kind:
    """The TOML type a config file must give for the option `p`."""
    if p.name in COMMA_LIST_OPTIONS:
        return Kind.INT_LIST
    if p.multiple:
        return Kind.STR_OR_LIST
    if isinstance(p.type, click.types.BoolParamType):
        return Kind.BOOL
    if isinstance(p.type, click.types.IntParamType):
        return Kind.INT
    if isinstance(p.type, click.types.FloatParamType):
        return Kind.NUMBER
    return Kind.STR


def _check_config(ctx: click.Context, config: Config) -> None:
    """Check a config.Config against the options: every top-level key must be some
    command's option and have its type; this command's options, and the [models.NAME]
    tables' keys, must also pass the flag's own range check."""
    params: dict[str, list[click.Parameter]] = {}
    for command in main.commands.values():
        for p in command.params:
            if p.name is not None:
                params.setdefault(p.name, []).append(p)
    unknown = sorted(set(config.options) - set(params))
    if unknown:
        raise ConfigError(f"{config.path}: unknown settings {unknown}")
    for key, value in config.raw.items():
        kinds = dict.fromkeys(_param_kind(p) for p in params["models" if key == "model" else key])
        problem = type_problem(value, kinds)
        if problem:
            raise config.error(key, None, problem)
    own = {p.name: p for p in ctx.command.params if p.name is not None}
    tables: list[tuple[str | None, dict[str, Any]]] = [(None, config.options), *config.models.items()]
    for model, table in tables:
        for name, value in table.items():
            key = "model" if name == "models" and model is None else name
            text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
            try:
                if name == "batch_sizes":
                    _parse_batch_sizes(text)
                elif name == "gpus":
                    _parse_gpus(text)
                elif name == "workers" and model is not None:  # whether this command has --workers or not
                    MODEL_WORKERS.convert(value, None, ctx)
                elif name in own and name != "config":
                    own[name].type_cast_value(ctx, value)
            except click.BadParameter as exc:
                raise config.error(key, model, exc.message) from None
            except ValueError as exc:
                raise config.error(key, model, str(exc)) from None


def _parse_batch_sizes(value: str) -> tuple[int, ...]:
    """`1,2,4,8` as a tuple of sizes, each within 1..MAX_BATCH_SIZE (ValueError if not)."""
    try:
        sizes = tuple(int(v) for v in value.replace(" ", "").split(","))
    except ValueError:
        raise ValueError(f"expected sizes like 1,2,4,8, got {value!r}") from None
    for size in sizes:
        if not 1 <= size <= MAX_BATCH_SIZE:
            raise ValueError(f"batch sizes must be within 1..{MAX_BATCH_SIZE}, got {size}")
    return sizes


def _parse_gpus(value: str) -> tuple[int, ...]:
    """`0,1` as a tuple of device ids, each within 0..MAX_GPU, none twice (ValueError if not)."""
    if not value.strip():
        raise ValueError("expected at least one device id, like 0,1")
    try:
        gpus = tuple(int(v) for v in value.replace(" ", "").split(","))
    except ValueError:
        raise ValueError(f"expected device ids like 0,1, got {value!r}") from None
    for gpu in gpus:
        if not 0 <= gpu <= MAX_GPU:
            raise ValueError(f"device ids must be within 0..{MAX_GPU}, got {gpu}")
    twice = sorted({g for g in gpus if gpus.count(g) > 1})
    if twice:
        raise ValueError(f"device ids must differ, got {', '.join(map(str, twice))} more than once")
    return gpus


def _gpus(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        return _parse_gpus(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _batch_sizes(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    if not value:
        return None
    try:
        return _parse_batch_sizes(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


config_option = option(
    "--config",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    is_eager=True,
    expose_value=True,
    callback=_load_config,
    help="TOML file: option defaults and per-model [models.NAME] settings.",
)


def curve_client_options(secret_envvar: str, old_envvar: str | None = None) -> list[Callable[[F], F]]:
    """--curve-server-key and --curve-secret-key of a connecting side; the secret key's
    variable names whose key pair it is (a client's or a worker's)."""
    return [
        option(
            "--curve-server-key",
            type=click.Path(exists=True, dir_okay=False),
            default=None,
            help="The broker's public key file: turns CurveZMQ encryption on.",
        ),
        option(
            "--curve-secret-key",
            envvar=secret_envvar,
            old_envvar=old_envvar,
            type=click.Path(exists=True, dir_okay=False),
            default=None,
            help="This side's key pair (NAME.key_secret), for a broker with an allow-list.",
        ),
    ]


def with_curve_client(f: F) -> F:
    """The client side of CurveZMQ, shared by send, stats, ready, reload and bench."""
    for d in reversed(curve_client_options("BATCHER_CURVE_SECRET_KEY")):
        f = d(f)
    return f


def with_curve_worker(f: F) -> F:
    """A worker's side of CurveZMQ: its key pair is not a client's, so its own variable."""
    for d in reversed(curve_client_options("BATCHER_WORKER_CURVE_SECRET_KEY", "BATCHER_CURVE_SECRET_KEY")):
        f = d(f)
    return f


heartbeat_options = [
    option(
        "--heartbeat-ms",
        type=float_range(1, MAX_MS),
        default=500.0,
        help="Interval of heartbeats between broker and workers.",
    ),
    option(
        "--heartbeat-liveness",
        type=int_range(1, MAX_LIVENESS),
        default=3,
        help="Heartbeat intervals of silence after which a peer is taken for dead.",
    ),
]


def _scheduling_decorators(broker_key: bool) -> list[Callable[[F], F]]:
    """The broker's queueing and batching options; with `broker_key`, its key pair too
    (bench has a client's --curve-secret-key instead, which --spawn gives its broker)."""
    return [
        option(
            "--max-batch-size",
            type=int_range(1, MAX_BATCH_SIZE),
            default=8,
            help="Largest batch sent to a worker.",
        ),
        option(
            "--max-wait-ms",
            type=float_range(0, MAX_MS),
            default=5.0,
            help="Longest a request waits for its batch to fill.",
        ),
        option(
            "--policy",
            type=click.Choice(POLICIES),
            default="adaptive",
            help="window: wait up to --max-wait-ms for a full batch; adaptive: dispatch at once "
            "unless waiting is expected to lower latency.",
        ),
        option(
            "--batch-sizes",
            callback=_batch_sizes,
            default=None,
            help=f"Allowed batch sizes, e.g. 1,2,4,8 (must start at 1; each 1..{MAX_BATCH_SIZE}); "
            "a batch is cut to the largest the queue fills.",
        ),
        option(
            "--max-queue", type=int_range(1, MAX_QUEUE), default=10_000, help="Queued requests per model."
        ),
        option(
            "--default-timeout-ms",
            type=float_range(0, MAX_TIMEOUT_MS),
            default=0.0,
            help="Deadline for requests that carry no timeout_ms (0: none).",
        ),
        option(
            "--worker-prefetch",
            type=int_range(1, MAX_PREFETCH),
            default=DEFAULT_WORKER_PREFETCH,
            help="Batches a worker may hold at once (the next one waits on the worker).",
        ),
        option(
            "--max-retries",
            type=int_range(0, MAX_RETRIES),
            default=1,
            help="Re-dispatches of a batch whose worker died, before its requests get worker_failed.",
        ),
        option(
            "--max-message-bytes",
            type=int_range(1024, MAX_MESSAGE_BYTES),
            default=16 * 1024 * 1024,
            help="Largest request accepted: a bigger frame disconnects its sender (libzmq), a "
            "bigger message of several frames is answered bad_request.",
        ),
        option(
            "--no-worker-timeout-ms",
            type=float_range(0, MAX_TIMEOUT_MS),
            default=DEFAULT_NO_WORKER_TIMEOUT_MS,
            help="A request for a configured model that has had no worker this long is answered "
            "unavailable (0: wait forever for a worker).",
        ),
        *heartbeat_options,
        *(
            [
                option(
                    "--curve-secret-key",
                    envvar="BATCHER_BROKER_CURVE_SECRET_KEY",
                    old_envvar="BATCHER_CURVE_SECRET_KEY",
                    type=click.Path(exists=True, dir_okay=False),
                    default=None,
                    help="The broker's key pair (NAME.key_secret from `batcher keygen`): "
                    "encrypts both sockets.",
                )
            ]
            if broker_key
            else []
        ),
        option(
            "--curve-clients",
            type=click.Path(exists=True, file_okay=False),
            default=None,
            help="Directory of the public keys (.key) of the clients allowed on the frontend "
            "(without it: any key, encrypted only).",
        ),
        option(
            "--curve-workers",
            type=click.Path(exists=True, file_okay=False),
            default=None,
            help="Directory of the public keys (.key) of the workers allowed on the backend "
            "(besides the broker's own key, which serve's workers use). Without it the backend "
            "admits any key, or only the broker's own if --curve-clients is given.",
        ),
        option(
            "--metrics-port",
            type=int_range(1, 65535),
            default=None,
            help="Serve Prometheus metrics at http://127.0.0.1:PORT/metrics.",
        ),
        config_option,
    ]


def scheduling_options(f: F) -> F:
    """The broker's options, shared by serve and broker."""
    for d in reversed(_scheduling_decorators(broker_key=True)):
        f = d(f)
    return f


def bench_scheduling_options(f: F) -> F:
    """The broker's options as `bench --spawn` passes them on, without its key pair."""
    for d in reversed(_scheduling_decorators(broker_key=False)):
        f = d(f)
    return f


def sim_options(f: F) -> F:
    """The simulated GPU's cost, shared by serve, worker and bench."""
    f = option(
        "--sim-base-ms",
        type=float_range(0, MAX_MS),
        default=20.0,
        help="sim model: fixed cost of one batch.",
    )(f)
    f = option(
        "--sim-per-item-ms",
        type=float_range(0, MAX_MS),
        default=2.5,
        help="sim model: added cost per request in a batch.",
    )(f)
    return f


def broker_settings(
    frontend: str, backend: str, models: tuple[str, ...], sched: dict[str, Any]
) -> BrokerSettings:
    """BrokerSettings from CLI values: the options are every model's defaults, and the
    config file's [models.NAME] tables override those the file set (a value from the
    command line or the environment wins over the tables too)."""
    # `serve` takes model specs (NAME=pkg.mod:attr); the broker only needs their names.
    names = tuple(m.partition("=")[0].strip() for m in models) if models else ("sim",)
    fixed = given_outside_file(click.get_current_context(silent=True), BATCH_KEYS)
    try:
        default = BatchSettings(
            max_batch_size=sched["max_batch_size"],
            max_wait_ms=sched["max_wait_ms"],
            batch_sizes=sched["batch_sizes"],
            max_queue=sched["max_queue"],
            policy=sched["policy"],
        )
        per_model = load_config(sched["config"]).model_settings(default, fixed) if sched["config"] else {}
        return BrokerSettings(
            frontend=frontend,
            backend=backend,
            models=names,
            batch=default,
            per_model=per_model,
            default_timeout_ms=sched["default_timeout_ms"],
            worker_prefetch=sched["worker_prefetch"],
            heartbeat=Heartbeat(sched["heartbeat_ms"], sched["heartbeat_liveness"]),
            max_retries=sched["max_retries"],
            max_message_bytes=sched["max_message_bytes"],
            curve=_curve_keys(sched["curve_secret_key"], sched["curve_clients"], sched["curve_workers"]),
            metrics_port=sched["metrics_port"],
            no_worker_timeout_ms=sched["no_worker_timeout_ms"],
        )
    except (ValueError, ConfigError) as exc:
        raise click.UsageError(str(exc)) from None


def pool_settings(
    backend: str,
    models: tuple[str, ...],
    sim: SimSettings,
    broker: BrokerSettings,
    *,
    workers: int | None,
    gpus: tuple[int, ...] | None,
    workers_per_gpu: int,
    config: str | None,
    log_level: str,
    log_format: str,
) -> PoolSettings:
    """serve's PoolSettings from CLI values. The config file's [models.NAME] tables pin
    models to GPUs (`gpus`) and set their worker counts (`workers`, unless --workers came
    from the command line or the environment). A placement that the devices cannot
    hold (PoolSettings refuses it) is a usage error."""
    from workers.supervisor import PoolSettings

    model_gpus: dict[str, tuple[int, ...]] = {}
    model_workers: dict[str, int] = {}
    try:
        if config:
            parsed = load_config(config)
            model_gpus = parsed.model_gpus()
            if not given_outside_file(click.get_current_context(silent=True), ["workers"]):
                model_workers = parsed.model_workers()
        return PoolSettings(
            backend,
            models,
            workers,
            sim,
            heartbeat=broker.heartbeat,
            log_level=log_level,
            log_format=log_format,
            curve_secret_key=broker.curve.secret_key_file if broker.curve else None,
            gpus=gpus,
            workers_per_gpu=workers_per_gpu,
            model_gpus=model_gpus,
            model_workers=model_workers,
        )
    except (ValueError, ConfigError) as exc:
        raise click.UsageError(str(exc)) from None


def _reread_batching(ctx: click.Context, path: str, models: Iterable[str]) -> dict[str, BatchSettings]:
    """Each model's batching settings as the config file now says (SIGHUP to serve): the
    file is checked as at start, and what the command line or the environment set still
    wins. ConfigError or ValueError if the file is no longer good."""
    config = load_config(path)
    _check_config(ctx, config)
    own = {p.name: p for p in ctx.command.params if p.name is not None}
    fixed = given_outside_file(ctx, BATCH_KEYS)
    values: dict[str, Any] = {}
    for key in BATCH_KEYS:
        param = own[key]
        raw = ctx.params[key] if key in fixed else config.options.get(key, param.default)
        values[key] = raw if key in fixed else param.process_value(ctx, raw)
    default = BatchSettings(**values)
    per_model = config.model_settings(default, fixed)
    return {name: per_model.get(name, default) for name in dict.fromkeys([*models, *per_model])}


def _curve_keys(secret_key: str | None, clients: str | None, workers: str | None) -> CurveServerKeys | None:
    if secret_key is None:
        for flag, value in (("--curve-clients", clients), ("--curve-workers", workers)):
            if value is not None:
                raise click.UsageError(f"{flag} needs --curve-secret-key (the broker's key pair)")
        return None
    return CurveServerKeys(secret_key, clients, workers)


#: The options a [models.NAME] table may set for its model: BatchSettings' fields.
BATCH_KEYS = tuple(f.name for f in dataclasses.fields(BatchSettings))

SCHEDULING_KEYS = (
    "max_batch_size",
    "max_wait_ms",
    "policy",
    "batch_sizes",
    "max_queue",
    "default_timeout_ms",
    "worker_prefetch",
    "max_retries",
    "max_message_bytes",
    "heartbeat_ms",
    "heartbeat_liveness",
    "no_worker_timeout_ms",
    "curve_secret_key",
    "curve_clients",
    "curve_workers",
    "metrics_port",
    "config",
)


def _pop_scheduling(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The scheduling options out of a command's keyword arguments (bench has no broker
    key pair among them)."""
    return {k: kwargs.pop(k) for k in SCHEDULING_KEYS if k in kwargs}


def _check_models(models: tuple[str, ...]) -> None:
    from workers.models import ModelSpec

    for m in models:
        try:
            ModelSpec.parse(m)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--model") from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="batcher")
def main() -> None:
    """batcher: a dynamic-batching inference broker over ZeroMQ and msgpack."""


@main.command()
@option("--frontend", default=DEFAULT_FRONTEND, help="Address clients connect to (ROUTER).")
@option("--backend", default=DEFAULT_BACKEND, help="Address workers connect to (ROUTER).")
@option(
    "--workers",
    type=int_range(0, MAX_WORKERS),
    default=None,
    show_default=False,
    help="Worker processes per model. Default: --workers-per-gpu on each GPU serve may use "
    "(--gpus), or 2 when it sees no GPU.",
)
@option(
    "--gpus",
    callback=_gpus,
    default=None,
    show_default=False,
    help=f"GPU ids the workers may use, e.g. 0,1 (each 0..{MAX_GPU}). Default: the visible devices.",
)
@option(
    "--workers-per-gpu",
    type=int_range(1, MAX_WORKERS_PER_GPU),
    default=1,
    help="Most workers of one model on one GPU; without --workers, each model gets this many per GPU.",
)
@option(
    "--model",
    "models",
    multiple=True,
    default=("sim",),
    help="Model to serve: sim, echo, pkg.module:attr or NAME=SPEC; repeat for several. "
    "The first is the default for requests that name none.",
)
@scheduling_options
@sim_options
@logging_options
def serve(
    frontend: str,
    backend: str,
    workers: int | None,
    gpus: tuple[int, ...] | None,
    workers_per_gpu: int,
    models: tuple[str, ...],
    sim_base_ms: float,
    sim_per_item_ms: float,
    log_level: str,
    log_format: str,
    **kwargs: Any,
) -> None:
    """Run a broker and its worker processes: per model, --workers of them, or
    --workers-per-gpu on each GPU it may use.

    `batcher reload MODEL`, or SIGHUP (which re-reads --config's batching settings and
    reloads every model), replaces a model's workers: new ones first, then the old ones
    drained and stopped."""
    from workers.models import ModelSpec, SimSettings
    from workers.rollout import Rollouts, serve_tick
    from workers.supervisor import Supervisor

    setup(log_level, log_format)
    _check_models(models)
    sched = _pop_scheduling(kwargs)
    settings = broker_settings(frontend, backend, models, sched)
    pool = pool_settings(
        backend,
        models,
        SimSettings(sim_base_ms, sim_per_item_ms),
        settings,
        workers=workers,
        gpus=gpus,
        workers_per_gpu=workers_per_gpu,
        config=sched["config"],
        log_level=log_level,
        log_format=log_format,
    )
    try:
        broker = Broker(settings)  # bind before the workers start, so a busy port fails fast
    except (BindError, KeyFileError) as exc:
        raise click.ClickException(str(exc)) from None
    supervisor = Supervisor(pool)

    fatal: list[str] = []

    def on_worker_event(model: str, event: str) -> None:
        broker.metrics.worker_event(model, event)
        if event == "load_failed":  # a configuration error: stop now, say why, exit non-zero
            fatal.append(f"model {model!r} could not be loaded (the worker's error is above)")
            broker.request_stop()
            broker.request_stop()
        elif event == "given_up" and supervisor.all_given_up(model):
            broker.model_failed(model, f"every worker of model {model!r} failed to start (see serve's log)")

    supervisor.on_event = on_worker_event
    rollouts = Rollouts(broker, supervisor)
    broker.on_reload = lambda model, reply: rollouts.start(model, reply, time.monotonic())
    ctx = click.get_current_context()
    names = tuple(dict.fromkeys(ModelSpec.parse(m).name for m in models))

    def on_hangup(now: float) -> None:
        """SIGHUP: re-read --config's batching settings, then reload every model."""
        if sched["config"]:
            try:
                broker.apply_model_settings(_reread_batching(ctx, sched["config"], settings.models))
            except (ConfigError, ValueError, click.ClickException) as exc:
                log.error("SIGHUP: %s; batching settings unchanged", exc)
        for name in names:
            rollouts.start(name, None, now)

    broker.signals.install()
    broker.signals.install_hangup()
    broker.call_every(SUPERVISE_INTERVAL_S, serve_tick(broker, supervisor, rollouts, on_hangup))
    try:
        supervisor.start()
        broker.run()
    finally:
        # After a second signal nothing waits: workers still in a batch are killed.
        supervisor.stop(timeout_s=0.0 if broker.signals.count > 1 else 5.0)
        broker.close()
    if fatal:
        raise click.ClickException(fatal[0])


@main.command()
@option("--frontend", default=DEFAULT_FRONTEND, help="Address clients connect to (ROUTER).")
@option("--backend", default=DEFAULT_BACKEND, help="Address workers connect to (ROUTER).")
@option(
    "--model",
    "models",
    multiple=True,
    default=("sim",),
    help="Model name requests may use before any worker has joined (repeat for several); "
    "the first is the default.",
)
@scheduling_options
@logging_options
def broker(
    frontend: str, backend: str, models: tuple[str, ...], log_level: str, log_format: str, **kwargs: Any
) -> None:
    """Run a broker alone; start workers with `batcher worker`."""
    setup(log_level, log_format)
    settings = broker_settings(frontend, backend, models, _pop_scheduling(kwargs))
    try:
        run_broker(settings)
    except (BindError, KeyFileError) as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@option(
    "--connect",
    envvar="BATCHER_WORKER_CONNECT",
    old_envvar="BATCHER_CONNECT",
    default=DEFAULT_BACKEND,
    help="The broker's backend address.",
)
@option(
    "--model",
    envvar="BATCHER_WORKER_MODEL",
    old_envvar="BATCHER_MODEL",
    default="sim",
    help="The model to load: sim, echo, pkg.module:attr or NAME=SPEC.",
)
@option("--gpu", type=int_range(0, MAX_GPU), default=None, help="GPU id (sets CUDA_VISIBLE_DEVICES).")
@option("--parent-pid", type=int_range(1, 2**31 - 1), default=None, hidden=True)
@heartbeat_options[0]
@heartbeat_options[1]
@with_curve_worker
@sim_options
@logging_options
def worker(
    connect: str,
    model: str,
    gpu: int | None,
    parent_pid: int | None,
    heartbeat_ms: float,
    heartbeat_liveness: int,
    curve_server_key: str | None,
    curve_secret_key: str | None,
    sim_base_ms: float,
    sim_per_item_ms: float,
    log_level: str,
    log_format: str,
) -> None:
    """Run one model-worker process connected to a broker's backend."""
    from workers.models import SimSettings
    from workers.supervisor import EXIT_MODEL_LOAD_FAILED
    from workers.worker import ModelLoadError, WorkerSettings, run_worker

    setup(log_level, log_format)
    _check_models((model,))
    try:
        run_worker(
            WorkerSettings(
                connect,
                model,
                gpu,
                SimSettings(sim_base_ms, sim_per_item_ms),
                parent_pid,
                Heartbeat(heartbeat_ms, heartbeat_liveness),
                curve_server_key,
                curve_secret_key,
            )
        )
    except ModelLoadError as exc:
        logging.getLogger("batcher.worker").error("%s", exc)
        sys.exit(EXIT_MODEL_LOAD_FAILED)


def _json_key(key: object) -> str:
    if isinstance(key, str):
        return key
    if isinstance(key, bytes):
        return key.hex()
    if key is None or isinstance(key, bool | int) or (isinstance(key, float) and math.isfinite(key)):
        return json.dumps(key)
    return repr(key)


def jsonable(value: Any) -> Any:
    """`value` (a decoded msgpack reply) made printable as strict JSON: NaN and infinities
    become null (JSON has neither), bytes hex, other keys and types strings."""
    if value is None or isinstance(value, str | bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {_json_key(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return repr(value)


def strict_json(value: Any, indent: int | None = None) -> str:
    """JSON that any parser takes: no NaN or Infinity tokens, whatever `value` holds."""
    return json.dumps(jsonable(value), indent=indent, allow_nan=False)


class _NotStrictJSON(ValueError):
    """NaN, Infinity or a number too big for a float: accepted by Python's json, not JSON."""


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotStrictJSON(f"{text} is too large for a 64-bit float")
    return value


def _no_constant(name: str) -> Any:
    raise _NotStrictJSON(f"{name} is not JSON (JSON has no NaN or Infinity)")


def parse_input(text: str) -> Any:
    """One `batcher send` input: strict JSON (no NaN or Infinity, so what is sent is what
    any other JSON tool would read) that msgpack can encode; click.BadParameter if not."""
    import msgpack

    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except _NotStrictJSON as exc:
        raise click.BadParameter(f"{text!r}: {exc}", param_hint="INPUTS") from None
    except json.JSONDecodeError as exc:
        hint = ""
        if text.strip()[:1] not in ('"', "{", "["):
            hint = f"; to send it as a string, quote it: '{json.dumps(text)}'"
        raise click.BadParameter(f"not JSON: {text!r} ({exc.msg}){hint}", param_hint="INPUTS") from None
    try:
        msgpack.packb(value, use_bin_type=True)
    except OverflowError:
        raise click.BadParameter(
            f"{text!r}: an integer outside msgpack's range -2**63 .. 2**64-1", param_hint="INPUTS"
        ) from None
    except UnicodeEncodeError:
        raise click.BadParameter(
            f"{text!r}: a string that is not valid Unicode (a lone surrogate)", param_hint="INPUTS"
        ) from None
    except (ValueError, TypeError) as exc:
        raise click.BadParameter(f"{text!r} cannot be sent as msgpack: {exc}", param_hint="INPUTS") from None
    return value


@main.command()
@option("--connect", default=DEFAULT_FRONTEND, help="The broker's frontend address.")
@option(
    "--model",
    envvar="BATCHER_REQUEST_MODEL",
    old_envvar="BATCHER_MODEL",
    default=None,
    help="Model to ask (the broker's default when absent).",
)
@option(
    "--timeout-ms",
    type=float_range(0, MAX_TIMEOUT_MS),
    default=None,
    help="Deadline per request, kept by the broker (answered deadline_exceeded past it).",
)
@option(
    "--timeout-s",
    envvar="BATCHER_SEND_TIMEOUT_S",
    type=float_range(0, MAX_TIMEOUT_S, min_open=True),
    default=30.0,
    help="How long to wait for each reply, here: a request unanswered by then is reported "
    "as a timeout (the broker may be down or unreachable).",
)
@with_curve_client
@logging_options
@click.argument("inputs", nargs=-1)
def send(
    connect: str,
    model: str | None,
    timeout_ms: float | None,
    timeout_s: float,
    curve_server_key: str | None,
    curve_secret_key: str | None,
    log_level: str,
    log_format: str,
    inputs: tuple[str, ...],
) -> None:
    """Send JSON INPUTS (or one JSON value per stdin line) and print each reply as JSON.

    All inputs are sent at once, so they can share a batch. A string is JSON in quotes:
    '"hello"'. NaN and Infinity are refused (they are not JSON); in a reply they print
    as null, so every line is strict JSON. Exits 1 if any reply is an error; a request
    with no reply within --timeout-s prints as a `timeout` error, its reason on stderr.
    """
    from batcher.client import Client

    setup(log_level, log_format)
    if inputs:
        texts = list(inputs)
    else:
        try:
            stdin = sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise click.BadParameter(f"stdin is not UTF-8 text: {exc}", param_hint="INPUTS") from None
        texts = [line for line in stdin.splitlines() if line.strip()]
    values = [parse_input(t) for t in texts]
    failed = False
    timeouts: dict[str, None] = {}  # the client's messages, each said once, in order
    with Client(
        connect, timeout_s, curve_server_key=curve_server_key, curve_secret_key=curve_secret_key
    ) as client:
        pendings = [client.submit(v, model=model, timeout_ms=timeout_ms) for v in values]
        for p in pendings:
            reply = p.wait()
            failed |= not reply.get("ok")
            click.echo(strict_json(reply))
            error = reply.get("error")
            if isinstance(error, dict) and error.get("code") == "timeout":
                timeouts[str(error.get("message", ""))] = None
    for message in timeouts:
        click.echo(f"timeout: {message}", err=True)
    sys.exit(1 if failed else 0)


@main.command()
@option("--workers", type=int_range(1, MAX_WORKERS), default=2, help="sim workers to start.")
@option(
    "--policy",
    type=click.Choice(POLICIES),
    default="window",
    help="Dispatch policy; the reference design's is window.",
)
@logging_options
def demo(workers: int, policy: str, log_level: str, log_format: str) -> None:
    """The reference scenario: 8 clients, 5 ms apart, max batch 4, 50 ms window.

    Starts a real broker and workers on free loopback ports, prints each result and
    checks the reference pass criteria; exits 1 if one fails.
    """
    from batcher.demo import run_demo

    setup(log_level, log_format)
    sys.exit(0 if run_demo(workers, policy) else 1)


@main.command()
@option("--connect", default=None, help="Frontend of a running broker to load.")
@option("--spawn", is_flag=True, default=False, help="Start a broker and workers (serve options below).")
@option(
    "--concurrency",
    type=int_range(1, MAX_CONCURRENCY),
    default=None,
    help="Closed loop: requests in flight.",
)
@option(
    "--rate",
    type=float_range(0, MAX_RATE, min_open=True),
    default=None,
    help="Open loop: Poisson arrivals per second.",
)
@option(
    "--duration",
    "duration_s",
    type=float_range(0, MAX_BENCH_S, min_open=True),
    default=None,
    help="Seconds of load after warm-up (default 10 unless --requests).",
)
@option("--requests", type=int_range(1, MAX_REQUESTS), default=None, help="Requests to send in all.")
@option("--warmup-s", type=float_range(0, MAX_BENCH_S), default=0.0, help="Seconds of load not measured.")
@option(
    "--payload-bytes",
    type=int_range(0, MAX_MESSAGE_BYTES),
    default=16,
    help="Size of each request's input.",
)
@option(
    "--model",
    envvar="BATCHER_REQUEST_MODEL",
    old_envvar="BATCHER_MODEL",
    default=None,
    help="Model to ask; with --spawn, the model served (default sim).",
)
@option("--processes", type=int_range(1, MAX_PROCESSES), default=1, help="Load generator processes.")
@option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="Write the full result as JSON to this file.",
)
@option("--workers", type=int_range(1, MAX_WORKERS), default=2, help="--spawn: worker processes.")
@bench_scheduling_options
@with_curve_client
@sim_options
@logging_options
def bench(
    connect: str | None,
    spawn: bool,
    concurrency: int | None,
    rate: float | None,
    duration_s: float | None,
    requests: int | None,
    warmup_s: float,
    payload_bytes: int,
    model: str | None,
    processes: int,
    json_path: str | None,
    workers: int,
    curve_server_key: str | None,
    curve_secret_key: str | None,
    sim_base_ms: float,
    sim_per_item_ms: float,
    log_level: str,
    log_format: str,
    **kwargs: Any,
) -> None:
    """Measure throughput and latency of a broker under closed- or open-loop load.

    With --spawn, --curve-secret-key is the spawned broker's key pair, and the load
    generator uses it too (the broker admits its own key on both sockets)."""
    from batcher.bench import LoadSettings, format_report
    from batcher.launcher import ServeProcess

    setup(log_level, log_format)
    if spawn == (connect is not None):
        raise click.UsageError("give exactly one of --connect ADDR or --spawn")
    if spawn and curve_server_key is not None:
        raise click.UsageError(
            "--curve-server-key is for --connect; with --spawn, --curve-secret-key is the "
            "broker's key pair and the load generator's"
        )
    if concurrency is None and rate is None:
        concurrency = 64
    if duration_s is None and requests is None:
        duration_s = 10.0
    # --workers-per-gpu as high as --workers: the spawned serve spreads its workers over
    # whatever GPUs it sees rather than refusing more workers than GPUs.
    per_gpu = min(workers, MAX_WORKERS_PER_GPU)
    serve_args = ["--workers", str(workers), "--workers-per-gpu", str(per_gpu), "--model", model or "sim"]
    serve_args += ["--sim-base-ms", str(sim_base_ms), "--sim-per-item-ms", str(sim_per_item_ms)]
    scheduling = _pop_scheduling(kwargs)
    for key, value in [*scheduling.items(), ("curve_secret_key", curve_secret_key)]:
        if value is not None:
            text = ",".join(map(str, value)) if key == "batch_sizes" else str(value)
            serve_args += ["--" + key.replace("_", "-"), text]
    serve = ServeProcess(serve_args) if spawn else None
    if serve is not None:
        connect, curve_server_key = serve.frontend, curve_secret_key  # a .key_secret holds the public key too
    assert connect is not None
    try:
        settings = LoadSettings(
            connect=connect,
            concurrency=concurrency,
            rate=rate,
            duration_s=duration_s,
            requests=requests,
            payload_bytes=payload_bytes,
            model=model,
            processes=processes,
            warmup_s=warmup_s,
            curve_server_key=curve_server_key,
            curve_secret_key=curve_secret_key,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        if serve is not None:
            serve.start()
            _wait_spawned(serve, workers, curve_secret_key)
        result = _run_with_progress(settings)
    except KeyFileError as exc:  # a key file that exists but holds no usable key
        raise click.ClickException(str(exc)) from None
    finally:
        if serve is not None:
            serve.stop()
    click.echo(format_report(result))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result.to_json(), f, indent=2)
    if result.failure is not None:  # the report says FAILED; a script must see it too
        click.echo(f"bench: {result.failure}", err=True)
        sys.exit(1)


def _wait_spawned(serve: Any, workers: int, curve_key: str | None, timeout_s: float = 30.0) -> None:
    """Wait until bench's spawned `serve` has `workers` workers, asking its stats as the
    load generator will connect (with its CURVE key pair, if any)."""
    from batcher.client import BatcherError, Client

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


def _run_with_progress(settings: Any) -> Any:
    """run_load with a progress bar on stderr (elapsed time, or requests answered)."""
    from batcher.bench import run_load

    if settings.requests is not None:
        length, unit = settings.requests, "requests"
    else:
        length, unit = int((settings.duration_s + settings.warmup_s) * 10), "time"
    start = time.monotonic()
    with click.progressbar(length=length, label="bench", file=sys.stderr, show_eta=False) as bar:

        def on_progress(completed: int) -> None:
            done = completed if unit == "requests" else int((time.monotonic() - start) * 10)
            bar.update(min(length, done) - bar.pos)

        return run_load(settings, on_progress)


@main.command()
@option("--connect", default=DEFAULT_FRONTEND, help="The broker's frontend address.")
@click.option("--watch", is_flag=True, help="Refresh in place until Ctrl-C, with rates per second.")
@click.option("--interval-s", type=float_range(0.1, MAX_STATS_S), default=1.0, show_default=True)
@click.option(
    "--count",
    type=int_range(1, MAX_REFRESHES),
    default=None,
    help="With --watch: stop after this many refreshes (default: until Ctrl-C).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the raw stats as JSON.")
@option(
    "--timeout-s",
    envvar="BATCHER_STATS_TIMEOUT_S",
    old_envvar="BATCHER_TIMEOUT_S",
    type=float_range(0.1, MAX_STATS_S),
    default=5.0,
    help="How long to wait for the broker.",
)
@with_curve_client
@logging_options
def stats(
    connect: str,
    watch: bool,
    interval_s: float,
    count: int | None,
    as_json: bool,
    timeout_s: float,
    curve_server_key: str | None,
    curve_secret_key: str | None,
    log_level: str,
    log_format: str,
) -> None:
    """Ask a running broker for its queues, workers, batches and recent latencies.

    --watch adds, per model, requests answered, ok and errors per second and batches per
    second, each over the last refresh interval (`-` until the second refresh)."""
    from batcher.client import BatcherError, Client
    from batcher.stats_table import compute_rates, format_stats

    setup(log_level, log_format)
    if count is not None and not watch:
        raise click.UsageError("--count goes with --watch")
    previous: tuple[float, dict[str, Any]] | None = None
    shown = 0
    with Client(
        connect, timeout_s, curve_server_key=curve_server_key, curve_secret_key=curve_secret_key
    ) as c:
        try:
            while True:
                try:
                    snapshot = c.control("stats")
                except BatcherError as exc:
                    raise click.ClickException(f"no stats from {connect}: {exc}") from None
                now = time.monotonic()
                if as_json:
                    text = strict_json(snapshot, indent=2)
                elif watch:
                    rates = compute_rates(previous[1], snapshot, now - previous[0]) if previous else {}
                    text = format_stats(snapshot, rates)
                else:
                    text = format_stats(snapshot)
                if not watch:
                    click.echo(text)
                    return
                click.clear()
                click.echo(f"{connect}  {time.strftime('%H:%M:%S')}\n{text}")
                shown += 1
                if count is not None and shown >= count:
                    return
                previous = (now, snapshot)
                time.sleep(interval_s)  # the refresh interval of --watch
        except KeyboardInterrupt:
            return


def readiness(snapshot: Mapping[str, Any], wanted: Iterable[str]) -> tuple[list[str], list[str]]:
    """What `batcher ready` says of a `stats` snapshot: (one line per ready model, one
    per problem). `wanted` empty means every model the broker was configured with."""
    models = snapshot.get("models")
    models = models if isinstance(models, dict) else {}
    names = list(wanted) or [
        name for name, m in models.items() if not isinstance(m, dict) or m.get("configured", True)
    ]
    if not names:
        return [], ["the broker serves no model"]
    ready_lines, problems = [], []
    for name in dict.fromkeys(names):
        m = models.get(name)
        if m is None:
            served = ", ".join(map(str, models)) or "none"
            problems.append(f"unknown model {name!r} (served: {served})")
            continue
        workers = m.get("workers") if isinstance(m, dict) else None
        n = workers if isinstance(workers, int) and not isinstance(workers, bool) else 0
        if n >= 1:
            ready_lines.append(f"ready: {name} ({n} worker{'' if n == 1 else 's'})")
        else:
            problems.append(f"{name} has no worker")
    return ready_lines, problems


@main.command()
@option("--connect", default=DEFAULT_FRONTEND, help="The broker's frontend address.")
@option(
    "--model",
    "models",
    envvar="BATCHER_READY_MODEL",
    multiple=True,
    help="A model that must have a worker (repeat for several). Default: every model the "
    "broker was configured with.",
)
@option(
    "--timeout-s",
    envvar="BATCHER_READY_TIMEOUT_S",
    type=float_range(0.1, MAX_STATS_S),
    default=5.0,
    help="How long to wait for every model to have a worker.",
)
@with_curve_client
@logging_options
def ready(
    connect: str,
    models: tuple[str, ...],
    timeout_s: float,
    curve_server_key: str | None,
    curve_secret_key: str | None,
    log_level: str,
    log_format: str,
) -> None:
    """Wait until the broker answers and each model has at least one worker: a readiness
    check for a supervisor, a container or a deployment script.

    Exits 0 printing `ready: MODEL (N workers)` per model; exits 1 after --timeout-s
    saying what is missing, or that no broker answered."""
    from batcher.client import BatcherError, Client

    setup(log_level, log_format)
    deadline = time.monotonic() + timeout_s
    problems: list[str] | None = None  # None: the broker has not answered yet
    with Client(
        connect, timeout_s, curve_server_key=curve_server_key, curve_secret_key=curve_secret_key
    ) as client:
        while True:
            client.timeout_s = max(0.01, deadline - time.monotonic())
            try:
                ready_lines, problems = readiness(client.control("stats"), models)
            except BatcherError as exc:
                if exc.code != "timeout" and problems is None:
                    problems = [f"the broker answered {exc}"]
            else:
                if not problems:
                    click.echo("\n".join(ready_lines))
                    return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            time.sleep(min(READY_POLL_S, remaining))  # between asks: a worker takes time to join
    if problems is None:
        raise click.ClickException(
            f"no broker answered at {connect} within {timeout_s}s (is it running, and are the "
            "CURVE keys right?)"
        )
    raise click.ClickException(f"not ready after {timeout_s}s: {'; '.join(problems)}")


@main.command("reload")
@click.argument("model")
@option("--connect", default=DEFAULT_FRONTEND, help="The broker's frontend address.")
@option(
    "--timeout-s",
    envvar="BATCHER_RELOAD_TIMEOUT_S",
    type=float_range(0.1, MAX_STATS_S),
    default=120.0,
    help="How long to wait for the reload: new workers loading the model, then the old draining.",
)
@with_curve_client
@logging_options
def reload_model(
    model: str,
    connect: str,
    timeout_s: float,
    curve_server_key: str | None,
    curve_secret_key: str | None,
    log_level: str,
    log_format: str,
) -> None:
    """Reload MODEL with no request refused or lost: serve starts new workers of it,
    waits until they are ready, then drains and stops the old ones.

    Prints the broker's answer as JSON; exits 1 with its error code and message if the
    reload failed or no answer came within --timeout-s."""
    from batcher.client import BatcherError, Client

    setup(log_level, log_format)
    with Client(
        connect, timeout_s, curve_server_key=curve_server_key, curve_secret_key=curve_secret_key
    ) as client:
        try:
            output = client.control("reload", model=model)
        except BatcherError as exc:
            raise click.ClickException(f"reload of {model!r} failed: {exc.code}: {exc.message}") from None
    click.echo(strict_json(output, indent=2))


@main.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--name", default="batcher", show_default=True, help="Base name of the two files.")
@click.option("--force", is_flag=True, help="Replace a key pair of that name already in DIRECTORY.")
@logging_options
def keygen(directory: str, name: str, force: bool, log_level: str, log_format: str) -> None:
    """Write a CurveZMQ key pair to DIRECTORY: NAME.key (public, to share) and
    NAME.key_secret (secret, keep private). An existing pair is kept unless --force:
    every peer holding its public key would have to be given the new one."""
    from batcher.security import KeyExistsError, generate_keys

    setup(log_level, log_format)
    try:
        public, secret = generate_keys(directory, name, force=force)
    except KeyExistsError as exc:
        raise click.ClickException(str(exc)) from None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--name") from None
    click.echo(f"public key: {public}\nsecret key: {secret}")


if __name__ == "__main__":
    main()
