"""The `batcher` command line: serve, broker, worker, send, demo, bench.

Every option can also be set by an environment variable BATCHER_<OPTION>
(`--max-wait-ms` is BATCHER_MAX_WAIT_MS); a flag on the command line wins.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from batcher.broker import BindError, Broker, BrokerSettings, run_broker
from batcher.config import Config, ConfigError, Kind, load_config, type_problem
from batcher.logs import FORMATS, setup_logging
from batcher.protocol import Heartbeat
from batcher.scheduler import POLICIES, BatchSettings
from batcher.security import CurveServerKeys, KeyFileError

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_FRONTEND = "tcp://127.0.0.1:5555"
DEFAULT_BACKEND = "tcp://127.0.0.1:5556"
#: Chosen by measurement: see docs/benchmarks.md.
DEFAULT_WORKER_PREFETCH = 2
#: How often `serve` looks for dead workers to respawn.
SUPERVISE_INTERVAL_S = 0.2

# Upper bounds of the numeric options, shown by --help. Each is finite, far above any
# useful setting, and small enough for where the value ends up: poll timeouts in whole
# milliseconds, libzmq's int64 options, msgpack's 32-bit lengths, one process per worker.
MAX_MS = 60_000.0  # heartbeat interval, batch window, simulated batch costs: one minute
MAX_TIMEOUT_MS = 86_400_000.0  # request deadlines: one day
MAX_BATCH_SIZE = 4096
MAX_QUEUE = 10_000_000  # requests per model
MAX_WORKERS = 256  # worker processes per model
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


def option(*decls: str, **kwargs: Any) -> Callable[[F], F]:
    """click.option with the BATCHER_<OPTION> environment variable filled in."""
    long_name = next(d for d in decls if d.startswith("--"))
    kwargs.setdefault("envvar", "BATCHER_" + long_name[2:].replace("-", "_").upper())
    kwargs.setdefault("show_envvar", True)
    kwargs.setdefault("show_default", True)
    return click.option(*decls, **kwargs)


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
    environment variable, then the file, then the built-in default decide). Every value
    is checked here, type and range, so an error names the file, the table and the key."""
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
    if p.name == "batch_sizes":
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
            try:
                if name == "batch_sizes":
                    _parse_batch_sizes(value if isinstance(value, str) else ",".join(map(str, value)))
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


curve_client_options = [
    option(
        "--curve-server-key",
        type=click.Path(exists=True, dir_okay=False),
        default=None,
        help="The broker's public key file: turns CurveZMQ encryption on.",
    ),
    option(
        "--curve-secret-key",
        type=click.Path(exists=True, dir_okay=False),
        default=None,
        help="This side's key pair (NAME.key_secret), for a broker with an allow-list.",
    ),
]


def with_curve_client(f: F) -> F:
    """The client side of CurveZMQ, shared by worker, send and bench."""
    for d in reversed(curve_client_options):
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


def scheduling_options(f: F) -> F:
    """The broker's queueing and batching options, shared by serve, broker and bench."""
    decorators = [
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
        *heartbeat_options,
        option(
            "--curve-secret-key",
            type=click.Path(exists=True, dir_okay=False),
            default=None,
            help="The broker's key pair (NAME.key_secret from `batcher keygen`): encrypts both sockets.",
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
    for d in reversed(decorators):
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
    """BrokerSettings from CLI values: the flags are every model's defaults, and the
    config file's [models.NAME] tables override them per model."""
    # `serve` takes model specs (NAME=pkg.mod:attr); the broker only needs their names.
    names = tuple(m.partition("=")[0].strip() for m in models) if models else ("sim",)
    try:
        default = BatchSettings(
            max_batch_size=sched["max_batch_size"],
            max_wait_ms=sched["max_wait_ms"],
            batch_sizes=sched["batch_sizes"],
            max_queue=sched["max_queue"],
            policy=sched["policy"],
        )
        per_model = load_config(sched["config"]).model_settings(default) if sched["config"] else {}
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
        )
    except (ValueError, ConfigError) as exc:
        raise click.UsageError(str(exc)) from None


def _curve_keys(secret_key: str | None, clients: str | None, workers: str | None) -> CurveServerKeys | None:
    if secret_key is None:
        for flag, value in (("--curve-clients", clients), ("--curve-workers", workers)):
            if value is not None:
                raise click.UsageError(f"{flag} needs --curve-secret-key (the broker's key pair)")
        return None
    return CurveServerKeys(secret_key, clients, workers)


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
    "curve_secret_key",
    "curve_clients",
    "curve_workers",
    "metrics_port",
    "config",
)


def _pop_scheduling(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: kwargs.pop(k) for k in SCHEDULING_KEYS}


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
@option("--workers", type=int_range(0, MAX_WORKERS), default=2, help="Worker processes per model.")
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
    workers: int,
    models: tuple[str, ...],
    sim_base_ms: float,
    sim_per_item_ms: float,
    log_level: str,
    log_format: str,
    **kwargs: Any,
) -> None:
    """Run a broker and --workers worker processes per model (worker i on GPU i)."""
    from workers.models import SimSettings
    from workers.supervisor import PoolSettings, Supervisor

    setup_logging(log_level, log_format)
    _check_models(models)
    settings = broker_settings(frontend, backend, models, _pop_scheduling(kwargs))
    try:
        broker = Broker(settings)  # bind before the workers start, so a busy port fails fast
    except (BindError, KeyFileError) as exc:
        raise click.ClickException(str(exc)) from None
    supervisor = Supervisor(
        PoolSettings(
            backend,
            models,
            workers,
            SimSettings(sim_base_ms, sim_per_item_ms),
            heartbeat=settings.heartbeat,
            log_level=log_level,
            log_format=log_format,
            curve_secret_key=settings.curve.secret_key_file if settings.curve else None,
        ),
    )

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
    broker.signals.install()
    broker.call_every(SUPERVISE_INTERVAL_S, supervisor.check)
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
    setup_logging(log_level, log_format)
    settings = broker_settings(frontend, backend, models, _pop_scheduling(kwargs))
    try:
        run_broker(settings)
    except (BindError, KeyFileError) as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@option("--connect", default=DEFAULT_BACKEND, help="The broker's backend address.")
@option("--model", default="sim", help="sim, echo, pkg.module:attr or NAME=SPEC.")
@option("--gpu", type=int_range(0, MAX_GPU), default=None, help="GPU id (sets CUDA_VISIBLE_DEVICES).")
@option("--parent-pid", type=int_range(1, 2**31 - 1), default=None, hidden=True)
@heartbeat_options[0]
@heartbeat_options[1]
@with_curve_client
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

    setup_logging(log_level, log_format)
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
@option("--model", default=None, help="Model to ask (the broker's default when absent).")
@option("--timeout-ms", type=float_range(0, MAX_TIMEOUT_MS), default=None, help="Deadline per request.")
@with_curve_client
@logging_options
@click.argument("inputs", nargs=-1)
def send(
    connect: str,
    model: str | None,
    timeout_ms: float | None,
    curve_server_key: str | None,
    curve_secret_key: str | None,
    log_level: str,
    log_format: str,
    inputs: tuple[str, ...],
) -> None:
    """Send JSON INPUTS (or one JSON value per stdin line) and print each reply as JSON.

    All inputs are sent at once, so they can share a batch. A string is JSON in quotes:
    '"hello"'. NaN and Infinity are refused (they are not JSON); in a reply they print
    as null, so every line is strict JSON. Exits 1 if any reply is an error.
    """
    from batcher.client import Client

    setup_logging(log_level, log_format)
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
    with Client(connect, curve_server_key=curve_server_key, curve_secret_key=curve_secret_key) as client:
        pendings = [client.submit(v, model=model, timeout_ms=timeout_ms) for v in values]
        for p in pendings:
            reply = p.wait()
            failed |= not reply.get("ok")
            click.echo(strict_json(reply))
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

    setup_logging(log_level, log_format)
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
@option("--model", default=None, help="Model to ask; with --spawn, the model served (default sim).")
@option("--processes", type=int_range(1, MAX_PROCESSES), default=1, help="Load generator processes.")
@option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="Write the full result as JSON to this file.",
)
@option("--workers", type=int_range(1, MAX_WORKERS), default=2, help="--spawn: worker processes.")
@scheduling_options
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
    sim_base_ms: float,
    sim_per_item_ms: float,
    log_level: str,
    log_format: str,
    **kwargs: Any,
) -> None:
    """Measure throughput and latency of a broker under closed- or open-loop load."""
    from batcher.bench import LoadSettings, format_report
    from batcher.launcher import ServeProcess

    setup_logging(log_level, log_format)
    if spawn == (connect is not None):
        raise click.UsageError("give exactly one of --connect ADDR or --spawn")
    if concurrency is None and rate is None:
        concurrency = 64
    if duration_s is None and requests is None:
        duration_s = 10.0
    serve_args = ["--workers", str(workers), "--model", model or "sim"]
    serve_args += ["--sim-base-ms", str(sim_base_ms), "--sim-per-item-ms", str(sim_per_item_ms)]
    scheduling = _pop_scheduling(kwargs)
    curve_key = scheduling["curve_secret_key"] if spawn else None
    for key, value in scheduling.items():
        if value is not None:
            text = ",".join(map(str, value)) if key == "batch_sizes" else str(value)
            serve_args += ["--" + key.replace("_", "-"), text]
    serve = ServeProcess(serve_args) if spawn else None
    try:
        if serve is not None:
            serve.start().wait_ready(workers)
            connect = serve.frontend
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
                curve_key=curve_key,
            )
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        result = _run_with_progress(settings)
    finally:
        if serve is not None:
            serve.stop()
    click.echo(format_report(result))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result.to_json(), f, indent=2)


def _run_with_progress(settings: Any) -> Any:
    """run_load with a progress bar on stderr (elapsed time, or requests answered)."""
    import time

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
@click.option("--watch", is_flag=True, help="Refresh in place until Ctrl-C.")
@click.option("--interval-s", type=float_range(0.1, MAX_STATS_S), default=1.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the raw stats as JSON.")
@option(
    "--timeout-s", type=float_range(0.1, MAX_STATS_S), default=5.0, help="How long to wait for the broker."
)
@with_curve_client
@logging_options
def stats(
    connect: str,
    watch: bool,
    interval_s: float,
    as_json: bool,
    timeout_s: float,
    curve_server_key: str | None,
    curve_secret_key: str | None,
    log_level: str,
    log_format: str,
) -> None:
    """Ask a running broker for its queues, workers, batches and recent latencies."""
    import time

    from batcher.client import BatcherError, Client
    from batcher.stats_table import format_stats

    setup_logging(log_level, log_format)
    with Client(
        connect, timeout_s, curve_server_key=curve_server_key, curve_secret_key=curve_secret_key
    ) as c:
        while True:
            try:
                snapshot = c.control("stats")
            except BatcherError as exc:
                raise click.ClickException(f"no stats from {connect}: {exc}") from None
            text = strict_json(snapshot, indent=2) if as_json else format_stats(snapshot)
            if not watch:
                click.echo(text)
                return
            click.clear()
            click.echo(f"{connect}  {time.strftime('%H:%M:%S')}\n{text}")
            try:
                time.sleep(interval_s)  # the refresh interval of --watch
            except KeyboardInterrupt:
                return


@main.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--name", default="batcher", show_default=True, help="Base name of the two files.")
@logging_options
def keygen(directory: str, name: str, log_level: str, log_format: str) -> None:
    """Write a CurveZMQ key pair to DIRECTORY: NAME.key (public, to share) and
    NAME.key_secret (secret, keep private)."""
    from batcher.security import generate_keys

    setup_logging(log_level, log_format)
    public, secret = generate_keys(directory, name)
    click.echo(f"public key: {public}\nsecret key: {secret}")


if __name__ == "__main__":
    main()
