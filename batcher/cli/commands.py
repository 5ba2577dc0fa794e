"""The `batcher` command line: serve, broker, worker, send, stats, ready, reload, bench,
keygen, demo.

Every option made with `option` can also be set by an environment variable,
BATCHER_<OPTION> unless the name would mean different things on different commands
(the worker's backend address is BATCHER_WORKER_CONNECT, since BATCHER_CONNECT is a
client's frontend address). The choices of one invocation, made with `local_option`
(`stats --watch`, `--interval-s`, `--count`, `--json`; `keygen --name`, `--force`),
read none. What decides a value, first match wins: the command line, the environment,
the config file's [models.NAME] table (for that model), the file's top level, the
default. The defaults are read from the settings dataclasses (BatchSettings,
BrokerSettings, Heartbeat, WorkerSettings, SimSettings), so each is written once.

Options that go together come as one group, a decorator made by `option_group`: the
command gets the group's values as one typed argument (a BatchSettings, a Heartbeat...).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

import click
import zmq
from click.core import ParameterSource

from batcher.broker.loop import BindError, BrokerSettings, run_broker
from batcher.cli.config_file import COMMA_LIST_OPTIONS, Config, ConfigError, Kind, load_config, type_problem
from batcher.cli.demo import DEMO_POLICY, DEMO_WORKERS, run_demo
from batcher.client.sync import TIMEOUT, UNREACHABLE, BatcherError, Client, ClientTimeout, Unreachable
from batcher.core.scheduler import BUCKET_BY, POLICIES, BatchSettings
from batcher.extras import MissingExtra, require
from batcher.gateway import access
from batcher.gateway.core import MAX_PROCESSES as MAX_GATEWAY_PROCESSES
from batcher.gateway.core import GatewaySettings
from batcher.gateway.process import GatewayProcess, gateway_command, local_address
from batcher.gateway.processes import check_supported as check_processes_supported
from batcher.logs import FORMATS, setup_logging
from batcher.serve.serving import ModelLoadFailed, run_serve
from batcher.transport.addresses import check_address
from batcher.transport.security import CurveServerKeys, KeyFileError
from batcher.wire import tensor
from batcher.wire.protocol import MAX_ACTIVE, Heartbeat
from workers import warmup
from workers.models import MAX_PADDED_ELEMENTS, ONNX_PREFIX, ModelSpec, SimSettings
from workers.placement import parse_cpus
from workers.steps import BATCHING_LEVELS
from workers.supervisor import EXIT_MODEL_LOAD_FAILED, PoolSettings
from workers.worker import ModelLoadError, WorkerSettings, run_worker

F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger("batcher.cli")

#: How often `batcher ready` asks the broker again while a model has no worker.
READY_POLL_S = 0.2

# Upper bounds of the numeric options, shown by --help. Each is finite, far above any
# useful setting, and small enough for where the value ends up: poll timeouts in whole
# milliseconds, libzmq's int64 options, msgpack's 32-bit lengths, one process per worker.
MAX_MS = 60_000.0  # heartbeat interval, batch window, simulated batch costs: one minute
MAX_TIMEOUT_MS = 86_400_000.0  # request deadlines: one day
MAX_BATCH_COST = 1e15  # a batch's summed request costs (tokens, pixels, bytes)
MAX_TIMEOUT_S = MAX_TIMEOUT_MS / 1000  # a client's wait for a reply: one day
MAX_BATCH_SIZE = 4096
#: The most intra-op threads one worker's session may get (--threads-per-worker).
MAX_THREADS = 1024
#: The largest length bucket bound (--length-buckets).
MAX_LENGTH = 2**31
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


class ZmqAddress(click.ParamType[str]):
    """A ZeroMQ address option (batcher.transport.addresses): a malformed one is a one-line usage
    error naming the form expected, never libzmq's EINVAL from inside a send or a bind."""

    name = "ADDRESS"

    def __init__(self, *, bind: bool) -> None:
        self.bind = bind

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            return check_address(str(value), bind=self.bind)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


#: The type of an address a socket connects to (--connect) and of one a broker binds.
CONNECT_ADDRESS = ZmqAddress(bind=False)
BIND_ADDRESS = ZmqAddress(bind=True)


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


class Decorator(Protocol):
    """What click.option returns, and an option group is: a command function, with
    options added."""

    def __call__(self, f: F, /) -> F: ...


def option(*decls: str, old_envvar: str | None = None, **kwargs: Any) -> Decorator:
    """click.option reading an environment variable: BATCHER_<OPTION> unless `envvar`
    names another, and `old_envvar` (deprecated) after it."""
    long_name = next(d for d in decls if d.startswith("--"))
    kwargs.setdefault("envvar", envvar_name(long_name))
    kwargs.setdefault("show_envvar", True)
    kwargs.setdefault("show_default", True)
    return click.option(*decls, cls=EnvOption, old_envvar=old_envvar, **kwargs)


def local_option(*decls: str, **kwargs: Any) -> Decorator:
    """click.option for a choice of one invocation (`stats --watch`, `keygen --force`):
    it reads no environment variable, so none left set in a shell can make a script
    watch forever or replace a key pair."""
    kwargs.setdefault("show_default", True)
    return click.option(*decls, **kwargs)


def option_group(into: str, build: Callable[..., Any], *options: Decorator) -> Decorator:
    """One decorator adding `options` to a command, in this order in --help. The command
    gets their values as one typed argument named `into`: `build(**values)`, called
    with the options' parameter names (a dataclass whose fields are named like the
    options, or a function). A ValueError of `build` is a usage error."""

    def decorate(f: F) -> F:
        names: list[str] = []

        @functools.wraps(f)  # keeps f's click parameters (its __dict__) too
        def command(*args: Any, **kwargs: Any) -> Any:
            values = {name: kwargs.pop(name) for name in names}
            try:
                kwargs[into] = build(**values)
            except ValueError as exc:
                raise click.UsageError(str(exc)) from None
            return f(*args, **kwargs)

        before = len(getattr(command, "__click_params__", []))
        for add in reversed(options):
            add(command)
        added: list[click.Parameter] = getattr(command, "__click_params__", [])[before:]
        names.extend(p.name for p in added if p.name is not None)
        return cast(F, command)

    return decorate


def field_default(cls: Any, name: str) -> Any:
    """The default of field `name` of dataclass `cls`, for a class that cannot be built
    without arguments (PoolSettings needs its models)."""
    (f,) = [f for f in dataclasses.fields(cls) if f.name == name]
    return f.default


@dataclass(frozen=True)
class LogOptions:
    """--log-level and --log-format."""

    log_level: str
    log_format: str


logging_options = option_group(
    "logs",
    LogOptions,
    option(
        "--log-level",
        type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
        default="INFO",
        help="Logging threshold (logs go to stderr).",
    ),
    option(
        "--log-format",
        type=click.Choice(FORMATS),
        default="text",
        help="Log lines as text or as JSON objects.",
    ),
)


def setup(logs: LogOptions) -> None:
    """Every command's start: logging, then a warning for each deprecated variable read."""
    setup_logging(logs.log_level, logs.log_format)
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
                elif name == "length_buckets":
                    _parse_length_buckets(text)
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


def _parse_length_buckets(value: str) -> tuple[int, ...]:
    """`16,32,64` as a tuple of increasing bounds >= 1 (ValueError if not)."""
    try:
        bounds = tuple(int(v) for v in value.replace(" ", "").split(","))
    except ValueError:
        raise ValueError(f"expected lengths like 16,32,64,128, got {value!r}") from None
    if list(bounds) != sorted(set(bounds)) or bounds[0] < 1 or bounds[-1] > MAX_LENGTH:
        raise ValueError(
            f"length buckets must be increasing, without repeats, within 1..{MAX_LENGTH}, got {value!r}"
        )
    return bounds


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


def _parsed(parse: Callable[[str], tuple[int, ...]]) -> Callable[..., tuple[int, ...] | None]:
    """A click callback: an option's text through `parse`, its ValueError a usage error.
    An empty text is parsed too (`--cpus ""` is refused, not taken as none); click
    itself takes an empty environment variable as unset."""

    def callback(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
        if value is None:
            return None
        try:
            return parse(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None

    return callback


def _int_list(parse: Callable[[str], tuple[int, ...]]) -> Callable[..., tuple[int, ...] | None]:
    """As `_parsed`, for an option's `1,2,4`; an empty text is none."""
    parsed = _parsed(parse)

    def callback(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
        return parsed(ctx, param, value) if value else None

    return callback


def threads_option(default_text: str) -> Decorator:
    """--threads-per-worker, its default described as `default_text`: serve, worker."""
    return option(
        "--threads-per-worker",
        type=int_range(1, MAX_THREADS),
        default=None,
        show_default=False,
        help=f"Intra-op threads of each worker's ONNX session. Default: {default_text}.",
    )


#: --no-warmup: serve, worker.
no_warmup_option = option(
    "--no-warmup",
    is_flag=True,
    default=False,
    help="Do not run the model before READY (by default a model with a signature, an ONNX "
    "model say, runs at each batch size it may get, on zero inputs, and announces its cost).",
)


#: --max-padded-elements: serve, worker.
max_padded_elements_option = option(
    "--max-padded-elements",
    type=int_range(1, 2**62),
    default=MAX_PADDED_ELEMENTS,
    show_default=True,
    help="The most elements a stacked model's batch may hold once padded (n x the longest "
    "shape, summed over its inputs): requests that would pad past it are run in separate "
    "model calls, and one over it alone is answered bad_request.",
)


config_option = option(
    "--config",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    is_eager=True,
    expose_value=True,
    callback=_load_config,
    help="TOML file: option defaults and per-model [models.NAME] settings.",
)


@dataclass(frozen=True)
class ClientKeys:
    """A connecting side's CURVE key files: the broker's public key (None: no CURVE) and
    this side's key pair."""

    curve_server_key: str | None
    curve_secret_key: str | None

    def client(self, connect: str, timeout_s: float) -> Client:
        """A Client of the broker at `connect`, with these keys."""
        return Client(
            connect, timeout_s, curve_server_key=self.curve_server_key, curve_secret_key=self.curve_secret_key
        )


_CURVE_SERVER_KEY = option(
    "--curve-server-key",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="The broker's public key file: turns CurveZMQ encryption on.",
)


def _own_key_pair(envvar: str, old_envvar: str | None = None) -> Decorator:
    """--curve-secret-key of a connecting side; its variable names whose key pair it is."""
    return option(
        "--curve-secret-key",
        envvar=envvar,
        old_envvar=old_envvar,
        type=click.Path(exists=True, dir_okay=False),
        default=None,
        help="This side's key pair (NAME.key_secret), for a broker with an allow-list.",
    )


#: A client's side of CurveZMQ: send, stats, ready, reload and bench.
curve_client_options = option_group(
    "curve", ClientKeys, _CURVE_SERVER_KEY, _own_key_pair("BATCHER_CURVE_SECRET_KEY")
)
#: A worker's side of CurveZMQ: its key pair is not a client's, so its own variable.
curve_worker_options = option_group(
    "curve",
    ClientKeys,
    _CURVE_SERVER_KEY,
    _own_key_pair("BATCHER_WORKER_CURVE_SECRET_KEY", "BATCHER_CURVE_SECRET_KEY"),
)

#: The allow-lists of a broker's two sockets and its admins (bench --spawn passes them on).
_CURVE_ALLOW_LISTS = (
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
        "--curve-admins",
        type=click.Path(exists=True, file_okay=False),
        default=None,
        help="Directory of the public keys (.key) of the clients that may change the service "
        "(`reload`; also admitted on the frontend). Others are answered `forbidden` and get "
        "`stats` without worker pids. The broker's own key is an admin's. Without it: any "
        "admitted client may reload.",
    ),
)


def _curve_keys(
    curve_secret_key: str | None,
    curve_clients: str | None,
    curve_workers: str | None,
    curve_admins: str | None,
) -> CurveServerKeys | None:
    """The broker's CURVE settings; the allow-lists need its key pair."""
    if curve_secret_key is None:
        for flag, value in (
            ("--curve-clients", curve_clients),
            ("--curve-workers", curve_workers),
            ("--curve-admins", curve_admins),
        ):
            if value is not None:
                raise click.UsageError(f"{flag} needs --curve-secret-key (the broker's key pair)")
        return None
    return CurveServerKeys(curve_secret_key, curve_clients, curve_workers, curve_admins)


#: The broker's side of CurveZMQ: serve and broker.
curve_server_options = option_group(
    "curve",
    _curve_keys,
    option(
        "--curve-secret-key",
        envvar="BATCHER_BROKER_CURVE_SECRET_KEY",
        old_envvar="BATCHER_CURVE_SECRET_KEY",
        type=click.Path(exists=True, dir_okay=False),
        default=None,
        help="The broker's key pair (NAME.key_secret from `batcher keygen`): encrypts both sockets.",
    ),
    *_CURVE_ALLOW_LISTS,
)

_HEARTBEAT = (
    option(
        "--heartbeat-ms",
        type=float_range(1, MAX_MS),
        default=Heartbeat().interval_ms,
        help="Interval of heartbeats between broker and workers.",
    ),
    option(
        "--heartbeat-liveness",
        type=int_range(1, MAX_LIVENESS),
        default=Heartbeat().liveness,
        help="Heartbeat intervals of silence after which a peer is taken for dead.",
    ),
)


def _heartbeat(heartbeat_ms: float, heartbeat_liveness: int) -> Heartbeat:
    return Heartbeat(heartbeat_ms, heartbeat_liveness)


#: Heartbeats between broker and workers: serve, broker and worker.
heartbeat_options = option_group("heartbeat", _heartbeat, *_HEARTBEAT)

#: How each model's requests are queued and batched: BatchSettings' fields, by name.
_BATCHING = (
    option(
        "--max-batch-size",
        type=int_range(1, MAX_BATCH_SIZE),
        default=BatchSettings().max_batch_size,
        help="Largest batch sent to a worker.",
    ),
    option(
        "--max-wait-ms",
        type=float_range(0, MAX_MS),
        default=BatchSettings().max_wait_ms,
        help="Longest a request waits for its batch to fill.",
    ),
    option(
        "--policy",
        type=click.Choice(POLICIES),
        default=BatchSettings().policy.value,
        help="window: wait up to --max-wait-ms for a full batch; adaptive: dispatch at once "
        "unless waiting is expected to lower latency.",
    ),
    option(
        "--batch-sizes",
        callback=_int_list(_parse_batch_sizes),
        default=None,
        help=f"Allowed batch sizes, e.g. 1,2,4,8 (must start at 1; each 1..{MAX_BATCH_SIZE}); "
        "a batch is cut to the largest the queue fills.",
    ),
    option(
        "--max-queue",
        type=int_range(1, MAX_QUEUE),
        default=BatchSettings().max_queue,
        help="Queued requests per model.",
    ),
    option(
        "--priority-aging-ms",
        type=float_range(0, MAX_TIMEOUT_MS),
        default=BatchSettings().priority_aging_ms,
        help="A waiting request gains one priority level each this many ms, so a flood of "
        "higher priorities cannot starve the rest (0: strict priority).",
    ),
    option(
        "--max-batch-cost",
        type=float_range(0, MAX_BATCH_COST, min_open=True),
        default=None,
        help="Largest sum of the requests' `cost` (tokens, pixels, bytes; 1 when a request "
        "gives none) in one batch; a lone request over it runs alone. Default: no cap.",
    ),
    option(
        "--bucket-by",
        type=click.Choice(BUCKET_BY),
        default=None,
        help="Group requests so that padding stays small: `length` reads each request's "
        "length (the first axis of its input tensor) and never batches requests of different "
        "--length-buckets together.",
    ),
    option(
        "--length-buckets",
        callback=_int_list(_parse_length_buckets),
        default=None,
        help="Upper bounds of the length buckets, e.g. 16,32,64,128 (with --bucket-by length): "
        "a request of length 20 joins the 32 bucket; one longer than the last has a bucket of its own.",
    ),
)

#: Every model's batching settings (a model's [models.NAME] table may differ): serve, broker.
batching_options = option_group("batching", BatchSettings, *_BATCHING)


@dataclass(frozen=True)
class BrokerOptions:
    """The broker's settings besides batching, heartbeats and CURVE: BrokerSettings'
    fields of the same names."""

    default_timeout_ms: float
    worker_prefetch: int
    max_retries: int
    max_message_bytes: int
    no_worker_timeout_ms: float
    metrics_port: int | None
    metrics_host: str
    batch_timeout_ms: float | None


_BROKER = (
    option(
        "--default-timeout-ms",
        type=float_range(0, MAX_TIMEOUT_MS),
        default=BrokerSettings().default_timeout_ms,
        help="Deadline for requests that carry no timeout_ms (0: none).",
    ),
    option(
        "--worker-prefetch",
        type=int_range(1, MAX_PREFETCH),
        default=BrokerSettings().worker_prefetch,
        help="Batches a worker may hold at once (the next one waits on the worker).",
    ),
    option(
        "--max-retries",
        type=int_range(0, MAX_RETRIES),
        default=BrokerSettings().max_retries,
        help="Re-dispatches of a batch whose worker died, before its requests get worker_failed.",
    ),
    option(
        "--max-message-bytes",
        type=int_range(1024, MAX_MESSAGE_BYTES),
        default=BrokerSettings().max_message_bytes,
        help="Largest request accepted: a bigger one is answered too_large; a frame over "
        "4 x this (the hard limit) makes libzmq drop its sender's connection.",
    ),
    option(
        "--no-worker-timeout-ms",
        type=float_range(0, MAX_TIMEOUT_MS),
        default=BrokerSettings().no_worker_timeout_ms,
        help="A request for a configured model that has had no worker this long is answered "
        "unavailable (0: wait forever for a worker).",
    ),
    option(
        "--metrics-port",
        type=int_range(1, 65535),
        default=BrokerSettings().metrics_port,
        help="Serve Prometheus metrics at http://HOST:PORT/metrics (HOST: --metrics-host).",
    ),
    option(
        "--batch-timeout-ms",
        type=float_range(0, MAX_TIMEOUT_MS, min_open=True),
        default=None,
        help="A batch running longer is taken for hung: its worker is stopped (serve kills and "
        "respawns its own) and its requests are retried within --max-retries. Default: "
        "10 x n x the model's learned time for one request, at least 1 s (60 s before its "
        "first batch was answered).",
    ),
    option(
        "--metrics-host",
        default=BrokerSettings().metrics_host,
        help="The address the metrics endpoint listens on: 0.0.0.0 (or ::) for every "
        "interface. It has no authentication, so expose it only where that is fine.",
    ),
)

#: The broker's other settings: serve and broker.
broker_options = option_group("broker_opts", BrokerOptions, *_BROKER)


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
    "serve_flags", _serve_flags, *_BATCHING, *_BROKER, *_HEARTBEAT, *_CURVE_ALLOW_LISTS, config_option
)


def _sim(
    sim_base_ms: float, sim_per_item_ms: float, simlm_step_base_ms: float, simlm_step_per_seq_ms: float
) -> SimSettings:
    return SimSettings(sim_base_ms, sim_per_item_ms, simlm_step_base_ms, simlm_step_per_seq_ms)


#: The simulated GPU's cost: serve, worker and bench.
sim_options = option_group(
    "sim",
    _sim,
    option(
        "--sim-base-ms",
        type=float_range(0, MAX_MS),
        default=SimSettings().base_ms,
        help="sim model: fixed cost of one batch.",
    ),
    option(
        "--sim-per-item-ms",
        type=float_range(0, MAX_MS),
        default=SimSettings().per_item_ms,
        help="sim model: added cost per request in a batch.",
    ),
    option(
        "--simlm-step-base-ms",
        type=float_range(0, MAX_MS),
        default=SimSettings().step_base_ms,
        help="simlm model: fixed cost of one step (one token for every active sequence).",
    ),
    option(
        "--simlm-step-per-seq-ms",
        type=float_range(0, MAX_MS),
        default=SimSettings().step_per_seq_ms,
        help="simlm model: added cost per active sequence in a step.",
    ),
)


@dataclass(frozen=True)
class StepOptions:
    """A step-level model's worker settings: serve and worker."""

    max_active: int
    batching_level: str


#: Step-level (generative) models: serve and worker.
step_options = option_group(
    "steps",
    StepOptions,
    option(
        "--max-active",
        type=int_range(1, MAX_ACTIVE),
        default=field_default(WorkerSettings, "max_active"),
        help="Step-level models: most sequences a worker generates at once (its credit at the "
        "broker, which sends it a request per free slot).",
    ),
    option(
        "--batching-level",
        type=click.Choice(BATCHING_LEVELS),
        default=field_default(WorkerSettings, "batching_level"),
        help="Step-level models: `step` admits new sequences between any two steps (continuous "
        "batching); `request` only once all it holds have ended (request-level batching, the baseline).",
    ),
)


def broker_settings(
    frontend: str,
    backend: str,
    models: tuple[str, ...],
    *,
    batching: BatchSettings,
    broker_opts: BrokerOptions,
    heartbeat: Heartbeat,
    curve: CurveServerKeys | None,
    config: str | None,
) -> BrokerSettings:
    """BrokerSettings from CLI values: `models` are the models' names or specs (each
    configured under `served_name`), `batching` is every model's default, and the
    config file's [models.NAME] tables override what the file set (a value from the
    command line or the environment wins over the tables too)."""
    names = tuple(dict.fromkeys(map(served_name, models))) if models else BrokerSettings().models
    fixed = given_outside_file(click.get_current_context(silent=True), BATCH_KEYS)
    try:
        per_model = load_config(config).model_settings(batching, fixed) if config else {}
        return BrokerSettings(
            frontend=frontend,
            backend=backend,
            models=names,
            batch=batching,
            per_model=per_model,
            default_timeout_ms=broker_opts.default_timeout_ms,
            worker_prefetch=broker_opts.worker_prefetch,
            heartbeat=heartbeat,
            max_retries=broker_opts.max_retries,
            max_message_bytes=broker_opts.max_message_bytes,
            curve=curve,
            metrics_port=broker_opts.metrics_port,
            metrics_host=broker_opts.metrics_host,
            batch_timeout_ms=broker_opts.batch_timeout_ms,
            no_worker_timeout_ms=broker_opts.no_worker_timeout_ms,
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
    logs: LogOptions,
    threads_per_worker: int | None = None,
    warmup: bool = True,
    steps: StepOptions | None = None,
    pin_cpus: bool = False,
    max_padded_elements: int = MAX_PADDED_ELEMENTS,
) -> PoolSettings:
    """serve's PoolSettings from CLI values. The config file's [models.NAME] tables pin
    models to GPUs (`gpus`) and set their worker counts (`workers`, unless --workers came
    from the command line or the environment). A placement that the devices cannot
    hold (PoolSettings refuses it) is a usage error."""
    model_gpus: dict[str, tuple[int, ...]] = {}
    model_workers: dict[str, int] = {}
    warmup_samples: dict[str, str] = {}
    try:
        if config:
            parsed = load_config(config)
            model_gpus = parsed.model_gpus()
            warmup_samples = parsed.model_warmup_samples()
            if not given_outside_file(click.get_current_context(silent=True), ["workers"]):
                model_workers = parsed.model_workers()
        return PoolSettings(
            backend,
            models,
            workers,
            sim,
            heartbeat=broker.heartbeat,
            log_level=logs.log_level,
            log_format=logs.log_format,
            curve_secret_key=broker.curve.secret_key_file if broker.curve else None,
            gpus=gpus,
            workers_per_gpu=workers_per_gpu,
            model_gpus=model_gpus,
            model_workers=model_workers,
            threads_per_worker=threads_per_worker,
            warmup_sizes={
                ModelSpec.parse(m).name: _warmup_sizes(
                    broker.per_model.get(ModelSpec.parse(m).name, broker.batch)
                )
                for m in models
            }
            if warmup
            else None,
            **(dataclasses.asdict(steps) if steps is not None else {}),
            pin_cpus=pin_cpus,
            max_padded_elements=max_padded_elements,
            warmup_samples=warmup_samples,
        )
    except (ValueError, ConfigError) as exc:
        raise click.UsageError(str(exc)) from None


def _serve_gateway(
    broker: BrokerSettings,
    http_port: int,
    grpc_port: int,
    host: str,
    processes: int,
    gateway_access: GatewayAccess,
    logs: LogOptions,
) -> GatewayProcess | None:
    """serve's gateway process, when a port asks for one: it connects to the broker's
    frontend as a client (with the broker's own key pair under CurveZMQ), so with
    --curve-clients it must not be a way past the allow-list: checked here, before
    anything binds. With --gateway-processes N > 1 it is the parent of N (one process
    to start, watch and stop, as for one)."""
    if not http_port and not grpc_port:
        if processes > 1:
            raise click.UsageError(
                f"--gateway-processes {processes} needs --http-port or --grpc-port: there is no gateway"
            )
        return None
    curve = broker.curve
    gateway_access.check(
        host,
        allow_lists="--curve-clients" if curve is not None and curve.clients_dir is not None else None,
        keys_option="--gateway-api-keys-file",
    )
    key = curve.secret_key_file if curve else None
    settings = GatewaySettings(
        connect=local_address(broker.frontend),
        host=host,
        http_port=http_port,
        grpc_port=grpc_port,
        curve_server_key=key,
        curve_secret_key=key,
        api_keys_file=gateway_access.api_keys_file,
        tls_cert_file=gateway_access.tls_cert_file,
        tls_key_file=gateway_access.tls_key_file,
        processes=processes,
    )
    try:
        check_processes_supported(processes)
    except ValueError as exc:
        raise click.UsageError(str(exc).replace("--processes", "--gateway-processes")) from None
    return GatewayProcess(gateway_command(settings, logs.log_level, logs.log_format))


def _warmup_sizes(batch: BatchSettings) -> tuple[int, ...]:
    """The batch sizes a model's warm-up runs: its allowed ones, else 1, 2, 4, ... max."""
    return warmup.warmup_sizes(batch.max_batch_size, batch.batch_sizes)


def _reread_batching(ctx: click.Context, path: str, models: Iterable[str]) -> dict[str, BatchSettings]:
    """Each model's batching settings as the config file now says (SIGHUP to serve): the
    file is checked as at start, and what the command line or the environment set still
    wins. ValueError (ConfigError among them) if the file is no longer good."""
    try:
        config = load_config(path)
        _check_config(ctx, config)
        own = {p.name: p for p in ctx.command.params if p.name is not None}
        fixed = given_outside_file(ctx, BATCH_KEYS)
        values: dict[str, Any] = {}
        for key in BATCH_KEYS:
            param = own[key]
            raw = ctx.params[key] if key in fixed else config.options.get(key, param.default)
            values[key] = raw if key in fixed else param.process_value(ctx, raw)
    except click.ClickException as exc:  # a value the option itself refuses
        raise ValueError(str(exc)) from None
    default = BatchSettings(**values)
    per_model = config.model_settings(default, fixed)
    return {name: per_model.get(name, default) for name in dict.fromkeys([*models, *per_model])}


#: The options a [models.NAME] table may set for its model: BatchSettings' fields.
BATCH_KEYS = tuple(f.name for f in dataclasses.fields(BatchSettings))


def served_name(text: str) -> str:
    """The name a --model value is configured under at the broker: a worker's spec
    (`onnx:PATH`, `NAME=SPEC`, `sim`, `pkg.mod:attr`) is named as that worker announces
    itself (`onnx:dir/digits.onnx` is `digits`); any other text is a name as it is
    (`batcher broker --model mymodel`)."""
    try:
        return ModelSpec.parse(text).name
    except ValueError:
        return text.strip()


def _check_models(models: tuple[str, ...]) -> None:
    """Each --model spec parses, and an ONNX one finds its extra installed."""
    for m in models:
        try:
            spec = ModelSpec.parse(m)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--model") from None
        if spec.target.startswith(ONNX_PREFIX):
            _require("onnx", f"--model {m}")


def _require(extra: str, needed_by: str) -> None:
    """batcher.extras.require as a one-line error of the command."""
    try:
        require(extra, needed_by)
    except MissingExtra as exc:
        raise click.ClickException(str(exc)) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="batcher")
def main() -> None:
    """batcher: a dynamic-batching inference broker over ZeroMQ and msgpack."""


_HTTP_PORT = option(
    "--http-port",
    type=int_range(0, 65535),
    default=0,
    help="Serve the Open Inference Protocol (KServe v2) over HTTP on this port (0: not).",
)
_GRPC_PORT = option(
    "--grpc-port",
    type=int_range(0, 65535),
    default=0,
    help="Serve the Open Inference Protocol (KServe v2) over gRPC on this port (0: not).",
)


@dataclass(frozen=True)
class GatewayAccess:
    """The gateway's access control options (docs/gateway.md, "Access control")."""

    api_keys_file: str | None
    tls_cert_file: str | None
    tls_key_file: str | None
    allow_unauthenticated_gateway: bool

    def check(self, host: str, *, allow_lists: str | None, keys_option: str) -> None:
        """Before anything listens: the key file and TLS pair load, and an
        unauthenticated gateway is not opened past CURVE allow-lists (a usage error)."""
        try:
            if self.api_keys_file is not None:
                access.load_api_keys(self.api_keys_file)
            access.check_tls_pair(self.tls_cert_file, self.tls_key_file)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        error = access.exposure_error(
            host,
            api_keys=self.api_keys_file is not None,
            allow_lists=allow_lists,
            allow_unauthenticated=self.allow_unauthenticated_gateway,
            keys_option=keys_option,
        )
        if error is not None:
            raise click.UsageError(error)


_ALLOW_UNAUTHENTICATED = local_option(
    "--allow-unauthenticated-gateway",
    is_flag=True,
    default=False,
    help="Open the gateway on a non-loopback host without API keys even though CurveZMQ "
    "allow-lists guard the broker (refused otherwise: the gateway would be a way past them).",
)


def _gateway_access_options(prefix: str) -> Decorator:
    """--api-keys-file, --tls-cert-file, --tls-key-file (serve's: --gateway-...) and
    --allow-unauthenticated-gateway."""
    path = click.Path(dir_okay=False)
    return option_group(
        "gateway_access",
        GatewayAccess,
        option(
            f"--{prefix}api-keys-file",
            "api_keys_file",
            envvar="BATCHER_GATEWAY_API_KEYS_FILE",
            type=path,
            default=None,
            help="File of the API keys the gateway accepts, one a line (# comments): every "
            "endpoint but the health probes then needs 'Authorization: Bearer KEY'.",
        ),
        option(
            f"--{prefix}tls-cert-file",
            "tls_cert_file",
            envvar="BATCHER_GATEWAY_TLS_CERT_FILE",
            type=path,
            default=None,
            help=f"PEM certificate (chain) for HTTPS and gRPC over TLS; with --{prefix}tls-key-file.",
        ),
        option(
            f"--{prefix}tls-key-file",
            "tls_key_file",
            envvar="BATCHER_GATEWAY_TLS_KEY_FILE",
            type=path,
            default=None,
            help=f"PEM private key of --{prefix}tls-cert-file (unencrypted).",
        ),
        _ALLOW_UNAUTHENTICATED,
    )


def _gateway_processes_option(name: str) -> Decorator:
    return option(
        name,
        "processes",
        envvar="BATCHER_GATEWAY_PROCESSES",
        type=int_range(1, MAX_GATEWAY_PROCESSES),
        default=field_default(GatewaySettings, "processes"),
        help="Gateway processes sharing the HTTP and gRPC ports (SO_REUSEPORT, Linux), each "
        "with its own link to the broker: up to one a core for HTTP/gRPC parsing (docs/gateway.md).",
    )


_GATEWAY_HOST = option(
    "--gateway-host",
    "host",
    default=field_default(GatewaySettings, "host"),
    help="Address the gateway's HTTP and gRPC ports listen on (0.0.0.0: every interface).",
)


@main.command()
@option(
    "--connect",
    type=CONNECT_ADDRESS,
    default=BrokerSettings().frontend,
    help="The broker's frontend address.",
)
@_HTTP_PORT
@_GRPC_PORT
@_GATEWAY_HOST
@option(
    "--request-timeout-ms",
    type=float_range(0, MAX_TIMEOUT_MS, min_open=True),
    default=field_default(GatewaySettings, "request_timeout_ms"),
    help="Longest wait for the broker's reply to a request that sets no timeout of its own.",
)
@_gateway_processes_option("--processes")
@_gateway_access_options("")
@local_option(
    "--under-serve", is_flag=True, hidden=True, help="Started by serve or a gateway: stop when stdin closes."
)
@local_option(
    "--shared-ports",
    is_flag=True,
    hidden=True,
    help="One of the processes of a gateway of several: bind with SO_REUSEPORT, say so on stdout.",
)
@curve_client_options
@logging_options
def gateway(
    connect: str,
    http_port: int,
    grpc_port: int,
    host: str,
    request_timeout_ms: float,
    processes: int,
    gateway_access: GatewayAccess,
    under_serve: bool,
    shared_ports: bool,
    curve: ClientKeys,
    logs: LogOptions,
) -> None:
    """Serve the Open Inference Protocol (KServe v2) over HTTP and gRPC in front of a
    broker: Triton's and KServe's clients, curl and load balancers reach batcher's
    batching unchanged (docs/gateway.md). Several gateways may front one broker, and
    one gateway may be several processes on the same ports (--processes)."""
    setup(logs)
    try:
        settings = GatewaySettings(
            connect=connect,
            host=host,
            http_port=http_port,
            grpc_port=grpc_port,
            request_timeout_ms=request_timeout_ms,
            curve_server_key=curve.curve_server_key,
            curve_secret_key=curve.curve_secret_key,
            api_keys_file=gateway_access.api_keys_file,
            tls_cert_file=gateway_access.tls_cert_file,
            tls_key_file=gateway_access.tls_key_file,
            processes=processes,
        )
        check_processes_supported(processes)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if shared_ports and processes > 1:
        raise click.UsageError("--shared-ports is for one process of a gateway of several (--processes 1)")
    # A client key pair means a broker with an allow-list (under serve, serve decided).
    gateway_access.check(
        host,
        allow_lists="--curve-secret-key" if curve.curve_secret_key and not under_serve else None,
        keys_option="--api-keys-file",
    )
    _require("gateway", "batcher gateway")
    from batcher.gateway import processes as gateway_processes
    from batcher.gateway.server import run

    control_fd = 0 if under_serve else None
    try:
        if processes > 1:
            gateway_processes.run(
                settings,
                lambda one: gateway_command(one, logs.log_level, logs.log_format, shared=True),
                control_fd=control_fd,
            )
        else:
            if shared_ports:
                gateway_processes.die_with_parent()
            run(
                settings,
                control_fd=control_fd,
                shared=shared_ports,
                on_listening=gateway_processes.report_listening if shared_ports else None,
            )
    except gateway_processes.GatewayExited as exc:
        raise click.ClickException(str(exc)) from None
    except ValueError as exc:  # a key file or TLS pair that changed since the check
        raise click.ClickException(str(exc)) from None
    except zmq.ZMQError as exc:
        raise click.ClickException(f"the gateway cannot connect to {connect}: {exc}") from None
    except OSError as exc:
        raise click.ClickException(f"the gateway cannot listen: {exc}") from None


@main.command()
@option(
    "--frontend",
    type=BIND_ADDRESS,
    default=BrokerSettings().frontend,
    help="Address clients connect to (ROUTER).",
)
@option(
    "--backend",
    type=BIND_ADDRESS,
    default=BrokerSettings().backend,
    help="Address workers connect to (ROUTER).",
)
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
    callback=_parsed(_parse_gpus),
    default=None,
    show_default=False,
    help=f"GPU ids the workers may use, e.g. 0,1 (each 0..{MAX_GPU}). Default: the visible devices.",
)
@option(
    "--workers-per-gpu",
    type=int_range(1, MAX_WORKERS_PER_GPU),
    default=field_default(PoolSettings, "workers_per_gpu"),
    help="Most workers of one model on one GPU; without --workers, each model gets this many per GPU.",
)
@option(
    "--model",
    "models",
    multiple=True,
    default=BrokerSettings().models,
    help="Model to serve: sim, echo, pkg.module:attr, onnx:PATH or NAME=SPEC; repeat for "
    "several. The first is the default for requests that name none.",
)
@threads_option(
    "the cores divided among the workers on this machine (workers x threads <= cores; with "
    "--pin-cpus, the cores but one)"
)
@option(
    "--pin-cpus",
    is_flag=True,
    default=False,
    help="Run each worker on CPUs of its own (--threads-per-worker of them, from the "
    "highest-numbered down) and the broker on the rest, so that no model competes for a CPU "
    "with the broker or another worker (logical CPUs: on SMT hosts, see docs/deployment.md). "
    "Linux only; needs a CPU left for the broker.",
)
@no_warmup_option
@max_padded_elements_option
@_HTTP_PORT
@_GRPC_PORT
@_GATEWAY_HOST
@_gateway_processes_option("--gateway-processes")
@_gateway_access_options("gateway-")
@batching_options
@broker_options
@heartbeat_options
@curve_server_options
@config_option
@sim_options
@step_options
@logging_options
def serve(
    frontend: str,
    backend: str,
    workers: int | None,
    gpus: tuple[int, ...] | None,
    workers_per_gpu: int,
    models: tuple[str, ...],
    threads_per_worker: int | None,
    pin_cpus: bool,
    no_warmup: bool,
    max_padded_elements: int,
    http_port: int,
    grpc_port: int,
    host: str,
    processes: int,
    gateway_access: GatewayAccess,
    batching: BatchSettings,
    broker_opts: BrokerOptions,
    heartbeat: Heartbeat,
    curve: CurveServerKeys | None,
    config: str | None,
    sim: SimSettings,
    steps: StepOptions,
    logs: LogOptions,
) -> None:
    """Run a broker and its worker processes: per model, --workers of them, or
    --workers-per-gpu on each GPU it may use. With --http-port or --grpc-port, a
    gateway process serves the Open Inference Protocol (KServe v2) in front of it.

    `batcher reload MODEL`, or SIGHUP (which re-reads --config's batching settings and
    reloads every model), replaces a model's workers: new ones first, then the old ones
    drained and stopped."""
    setup(logs)
    _check_models(models)
    if http_port or grpc_port:
        _require("gateway", "serve --http-port/--grpc-port (the gateway)")
    settings = broker_settings(
        frontend,
        backend,
        models,
        batching=batching,
        broker_opts=broker_opts,
        heartbeat=heartbeat,
        curve=curve,
        config=config,
    )
    pool = pool_settings(
        backend,
        models,
        sim,
        settings,
        workers=workers,
        gpus=gpus,
        workers_per_gpu=workers_per_gpu,
        config=config,
        logs=logs,
        threads_per_worker=threads_per_worker,
        warmup=not no_warmup,
        steps=steps,
        pin_cpus=pin_cpus,
        max_padded_elements=max_padded_elements,
    )
    ctx = click.get_current_context()
    reread = None if config is None else functools.partial(_reread_batching, ctx, config, settings.models)
    gateway = _serve_gateway(settings, http_port, grpc_port, host, processes, gateway_access, logs)
    try:
        run_serve(settings, pool, reread, gateway)
    except (BindError, KeyFileError, ModelLoadFailed) as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@option(
    "--frontend",
    type=BIND_ADDRESS,
    default=BrokerSettings().frontend,
    help="Address clients connect to (ROUTER).",
)
@option(
    "--backend",
    type=BIND_ADDRESS,
    default=BrokerSettings().backend,
    help="Address workers connect to (ROUTER).",
)
@option(
    "--model",
    "models",
    multiple=True,
    default=BrokerSettings().models,
    help="Model name requests may use before any worker has joined (repeat for several); "
    "the first is the default.",
)
@batching_options
@broker_options
@heartbeat_options
@curve_server_options
@config_option
@logging_options
def broker(
    frontend: str,
    backend: str,
    models: tuple[str, ...],
    batching: BatchSettings,
    broker_opts: BrokerOptions,
    heartbeat: Heartbeat,
    curve: CurveServerKeys | None,
    config: str | None,
    logs: LogOptions,
) -> None:
    """Run a broker alone; start workers with `batcher worker`."""
    setup(logs)
    settings = broker_settings(
        frontend,
        backend,
        models,
        batching=batching,
        broker_opts=broker_opts,
        heartbeat=heartbeat,
        curve=curve,
        config=config,
    )
    try:
        run_broker(settings)
    except (BindError, KeyFileError) as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
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
@option("--gpu", type=int_range(0, MAX_GPU), default=None, help="GPU id (sets CUDA_VISIBLE_DEVICES).")
@threads_option("every core (one worker); `serve` divides the cores among its workers")
@option(
    "--cpus",
    callback=_parsed(parse_cpus),
    default=None,
    help="Run this worker and its model's threads on these CPUs only, e.g. 1 or 2-3 "
    "(Linux). `serve --pin-cpus` gives each worker its own.",
)
@option(
    "--warmup-sizes",
    callback=_int_list(_parse_batch_sizes),
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
@option("--parent-pid", type=int_range(1, 2**31 - 1), default=None, hidden=True)
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
    parent_pid: int | None,
    load_error_fd: int | None,
    heartbeat: Heartbeat,
    curve: ClientKeys,
    sim: SimSettings,
    steps: StepOptions,
    logs: LogOptions,
) -> None:
    """Run one model-worker process connected to a broker's backend."""
    setup(logs)
    _check_models((model,))
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
    become null (JSON has neither), bytes hex, tensors their JSON form (docs/protocol.md),
    other keys and types strings."""
    if value is None or isinstance(value, str | bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, bytes):
        return value.hex()
    if tensor.is_array(value):
        return jsonable(tensor.to_json(value))
    if isinstance(value, dict):
        if tensor.is_tensor(value):
            with contextlib.suppress(tensor.TensorError):
                return jsonable(tensor.to_json(value))
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
    any other JSON tool would read) that msgpack can encode, its JSON tensors sent as
    tensors; click.BadParameter if not."""
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
        value = tensor.json_tensors(value)
    except tensor.TensorError as exc:
        raise click.BadParameter(f"{text!r}: {exc}", param_hint="INPUTS") from None
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
@option(
    "--connect",
    type=CONNECT_ADDRESS,
    default=BrokerSettings().frontend,
    help="The broker's frontend address.",
)
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
@local_option(
    "--stream",
    is_flag=True,
    default=False,
    help='Ask for streamed replies ("stream": true): each chunk prints as it comes, one JSON '
    "line each, every input's chunks together, in order.",
)
@curve_client_options
@logging_options
@click.argument("inputs", nargs=-1)
def send(
    connect: str,
    model: str | None,
    timeout_ms: float | None,
    timeout_s: float,
    stream: bool,
    curve: ClientKeys,
    logs: LogOptions,
    inputs: tuple[str, ...],
) -> None:
    """Send JSON INPUTS (or one JSON value per stdin line) and print each reply as JSON.

    All inputs are sent at once, so they can share a batch. A string is JSON in quotes:
    '"hello"'. NaN and Infinity are refused (they are not JSON); in a reply they print
    as null, so every line is strict JSON. Exits 1 if any reply is an error; a request
    with no reply within --timeout-s prints as a `timeout` error, its reason on stderr.
    """
    setup(logs)
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
    with curve.client(connect, timeout_s) as client:
        if stream:
            streams = [client.stream(v, model=model, timeout_ms=timeout_ms) for v in values]
            replies: Iterable[dict[str, Any]] = (r for st in streams for r in st.replies())
        else:
            pendings = [client.submit(v, model=model, timeout_ms=timeout_ms) for v in values]
            replies = (p.wait() for p in pendings)
        for reply in replies:
            failed |= not reply.get("ok")
            click.echo(strict_json(reply))
            error = reply.get("error")
            if isinstance(error, dict) and error.get("code") in (TIMEOUT, UNREACHABLE):
                timeouts[f"{error['code']}: {error.get('message', '')}"] = None
    for message in timeouts:
        click.echo(message, err=True)
    sys.exit(1 if failed else 0)


@main.command()
@option("--workers", type=int_range(1, MAX_WORKERS), default=DEMO_WORKERS, help="sim workers to start.")
@option(
    "--policy",
    type=click.Choice(POLICIES),
    default=DEMO_POLICY,
    help=f"Dispatch policy; the reference design's is {DEMO_POLICY}.",
)
@logging_options
def demo(workers: int, policy: str, logs: LogOptions) -> None:
    """The reference scenario: 8 clients, 5 ms apart, max batch 4, 50 ms window.

    Starts a real broker and workers on free loopback ports, prints each result and
    checks the reference pass criteria; exits 1 if one fails.
    """
    setup(logs)
    sys.exit(0 if run_demo(workers, policy) else 1)


@main.command()
@option("--connect", type=CONNECT_ADDRESS, default=None, help="Frontend of a running broker to load.")
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
@local_option(
    "--stream",
    is_flag=True,
    default=False,
    help='Streamed requests ("stream": true): also measures time to first chunk, chunks/s and '
    'the time between chunks. Default model with --spawn: simlm; default input: {"tokens": 32}.',
)
@local_option(
    "--input",
    "input_json",
    default=None,
    help="Each request's input as JSON (instead of --payload-bytes of bytes), e.g. '{\"tokens\": 64}'.",
)
@spawned_broker_options
@curve_client_options
@sim_options
@step_options
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
    stream: bool,
    input_json: str | None,
    serve_flags: list[str],
    curve: ClientKeys,
    sim: SimSettings,
    steps: StepOptions,
    logs: LogOptions,
) -> None:
    """Measure throughput and latency of a broker under closed- or open-loop load.

    With --spawn, --curve-secret-key is the spawned broker's key pair, and the load
    generator uses it too (the broker admits its own key on both sockets)."""
    from batcher.cli.bench import LoadSettings, format_report
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
    if concurrency is None and rate is None:
        concurrency = 64
    if duration_s is None and requests is None:
        duration_s = 10.0
    # --workers-per-gpu as high as --workers: the spawned serve spreads its workers over
    # whatever GPUs it sees rather than refusing more workers than GPUs.
    per_gpu = min(workers, MAX_WORKERS_PER_GPU)
    served = model or ("simlm" if stream else BrokerSettings().default_model)
    if spawn and model is None:
        model = served
    try:
        given_input = parse_input(input_json) if input_json is not None else None
    except click.BadParameter as exc:
        raise click.BadParameter(exc.message, param_hint="--input") from None
    if given_input is None and stream:
        given_input = {"tokens": 32}
    serve_args = ["--workers", str(workers), "--workers-per-gpu", str(per_gpu), "--model", served]
    serve_args += ["--sim-base-ms", str(sim.base_ms), "--sim-per-item-ms", str(sim.per_item_ms)]
    serve_args += [
        "--simlm-step-base-ms",
        str(sim.step_base_ms),
        "--simlm-step-per-seq-ms",
        str(sim.step_per_seq_ms),
    ]
    serve_args += ["--max-active", str(steps.max_active), "--batching-level", steps.batching_level]
    serve_args += [*serve_flags, *_serve_flags(curve_secret_key=curve_secret_key)]
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
            input=given_input,
            stream=stream,
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
    from batcher.cli.bench import run_load

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
@option(
    "--connect",
    type=CONNECT_ADDRESS,
    default=BrokerSettings().frontend,
    help="The broker's frontend address.",
)
@local_option("--watch", is_flag=True, help="Refresh in place until Ctrl-C, with rates per second.")
@local_option(
    "--interval-s",
    type=float_range(0.1, MAX_STATS_S),
    default=1.0,
    help="With --watch: seconds between refreshes.",
)
@local_option(
    "--count",
    type=int_range(1, MAX_REFRESHES),
    default=None,
    help="With --watch: stop after this many refreshes (default: until Ctrl-C).",
)
@local_option("--json", "as_json", is_flag=True, help="Print the raw stats as JSON.")
@option(
    "--timeout-s",
    envvar="BATCHER_STATS_TIMEOUT_S",
    old_envvar="BATCHER_TIMEOUT_S",
    type=float_range(0.1, MAX_STATS_S),
    default=5.0,
    help="How long to wait for the broker.",
)
@curve_client_options
@logging_options
def stats(
    connect: str,
    watch: bool,
    interval_s: float,
    count: int | None,
    as_json: bool,
    timeout_s: float,
    curve: ClientKeys,
    logs: LogOptions,
) -> None:
    """Ask a running broker for its queues, workers, batches and recent latencies.

    --watch adds, per model, requests answered, ok and errors per second and batches per
    second, each over the last refresh interval (`-` until the second refresh)."""
    from batcher.cli.stats_table import compute_rates, format_stats

    setup(logs)
    if count is not None and not watch:
        raise click.UsageError("--count goes with --watch")
    previous: tuple[float, dict[str, Any]] | None = None
    shown = 0
    with curve.client(connect, timeout_s) as c:
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
@option(
    "--connect",
    type=CONNECT_ADDRESS,
    default=BrokerSettings().frontend,
    help="The broker's frontend address.",
)
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
@curve_client_options
@logging_options
def ready(
    connect: str,
    models: tuple[str, ...],
    timeout_s: float,
    curve: ClientKeys,
    logs: LogOptions,
) -> None:
    """Wait until the broker answers and each model has at least one worker: a readiness
    check for a supervisor, a container or a deployment script.

    Exits 0 printing `ready: MODEL (N workers)` per model; exits 1 after --timeout-s
    saying what is missing, or that no broker answered."""
    setup(logs)
    deadline = time.monotonic() + timeout_s
    problems: list[str] | None = None  # None: the broker has not answered yet
    unanswered = ""  # why no broker can be reached, when that is known
    with curve.client(connect, timeout_s) as client:
        while True:
            client.timeout_s = max(0.01, deadline - time.monotonic())
            try:
                ready_lines, problems = readiness(client.control("stats"), models)
            except ClientTimeout as exc:  # no broker answered: yet, or none can (Unreachable)
                unanswered = exc.message if isinstance(exc, Unreachable) else unanswered
            except BatcherError as exc:
                if problems is None:
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
            f"no broker answered at {connect} within {timeout_s}s: "
            + (unanswered or "is it running, and are the CURVE keys right?")
        )
    raise click.ClickException(f"not ready after {timeout_s}s: {'; '.join(problems)}")


@main.command("reload")
@click.argument("model")
@option(
    "--connect",
    type=CONNECT_ADDRESS,
    default=BrokerSettings().frontend,
    help="The broker's frontend address.",
)
@option(
    "--timeout-s",
    envvar="BATCHER_RELOAD_TIMEOUT_S",
    type=float_range(0.1, MAX_STATS_S),
    default=120.0,
    help="How long to wait for the reload: new workers loading the model, then the old draining.",
)
@curve_client_options
@logging_options
def reload_model(
    model: str,
    connect: str,
    timeout_s: float,
    curve: ClientKeys,
    logs: LogOptions,
) -> None:
    """Reload MODEL with no request refused or lost: serve starts new workers of it,
    waits until they are ready, then drains and stops the old ones.

    Prints the broker's answer as JSON; exits 1 with its error code and message if the
    reload failed or no answer came within --timeout-s."""
    setup(logs)
    with curve.client(connect, timeout_s) as client:
        try:
            output = client.control("reload", model=model)
        except BatcherError as exc:
            raise click.ClickException(f"reload of {model!r} failed: {exc.code}: {exc.message}") from None
    click.echo(strict_json(output, indent=2))


@main.command()
@click.argument("directory", type=click.Path(file_okay=False))
@local_option("--name", default="batcher", help="Base name of the two files.")
@local_option("--force", is_flag=True, help="Replace a key pair of that name already in DIRECTORY.")
@logging_options
def keygen(directory: str, name: str, force: bool, logs: LogOptions) -> None:
    """Write a CurveZMQ key pair to DIRECTORY: NAME.key (public, to share) and
    NAME.key_secret (secret, keep private). An existing pair is kept unless --force:
    every peer holding its public key would have to be given the new one."""
    from batcher.transport.security import KeyExistsError, generate_keys

    setup(logs)
    try:
        public, secret = generate_keys(directory, name, force=force)
    except KeyExistsError as exc:
        raise click.ClickException(str(exc)) from None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--name") from None
    click.echo(f"public key: {public}\nsecret key: {secret}")


if __name__ == "__main__":
    main()
