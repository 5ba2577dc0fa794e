"""The option machinery every `batcher` command shares: option types, environment
variables, option groups, logging options, the numeric bounds, list parsers and checks.

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
command gets the group's values as one typed argument (a BatchSettings, a Heartbeat...);
the groups several commands use are in `batcher.cli.option_groups`.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

import click

from batcher.extras import MissingExtra, require
from batcher.logs import FORMATS, setup_logging
from batcher.settings import (
    MAX_BATCH_COST as MAX_BATCH_COST,
)
from batcher.settings import (
    MAX_BATCH_SIZE as MAX_BATCH_SIZE,
)
from batcher.settings import (  # re-exported: the bounds of the options
    MAX_BENCH_S as MAX_BENCH_S,
)
from batcher.settings import (
    MAX_CONCURRENCY as MAX_CONCURRENCY,
)
from batcher.settings import (
    MAX_GPU as MAX_GPU,
)
from batcher.settings import (
    MAX_MESSAGE_BYTES as MAX_MESSAGE_BYTES,
)
from batcher.settings import (
    MAX_MS as MAX_MS,
)
from batcher.settings import (
    MAX_PREFETCH as MAX_PREFETCH,
)
from batcher.settings import (
    MAX_PROCESSES as MAX_PROCESSES,
)
from batcher.settings import (
    MAX_QUEUE as MAX_QUEUE,
)
from batcher.settings import (
    MAX_RATE as MAX_RATE,
)
from batcher.settings import (
    MAX_REQUESTS as MAX_REQUESTS,
)
from batcher.settings import (
    MAX_RETRIES as MAX_RETRIES,
)
from batcher.settings import (
    MAX_THREADS as MAX_THREADS,
)
from batcher.settings import (
    MAX_TIMEOUT_MS as MAX_TIMEOUT_MS,
)
from batcher.settings import (
    MAX_WORKERS as MAX_WORKERS,
)
from batcher.settings import (
    MAX_WORKERS_PER_GPU as MAX_WORKERS_PER_GPU,
)
from batcher.settings import (
    bounds,
)
from batcher.settings import default as settings_default
from batcher.transport.addresses import check_address
from workers.models import ONNX_PREFIX, ModelSpec
from workers.supervisor import PoolSettings

F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger("batcher.cli")

#: How often `batcher ready` asks the broker again while a model has no worker.
READY_POLL_S = 0.2

# Upper bounds of the numeric options, shown by --help: those of a settings field are
# declared with it (batcher.settings); the others' are here.
MAX_TIMEOUT_S = MAX_TIMEOUT_MS / 1000  # a client's wait for a reply: one day
#: The largest length bucket bound (--length-buckets).
MAX_LENGTH = 2**31
MAX_LIVENESS = 100
MAX_STATS_S = 3600.0
MAX_REFRESHES = 1_000_000_000

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
    return settings_default(cls, name)


def setting_type(cls: Any, name: str) -> click.IntRange | FiniteFloatRange:
    """The click type of the settings field `name` of `cls` (batcher.settings): its
    bounds, both shown by --help."""
    b = bounds(cls, name)
    if b.min is None or b.max is None:
        raise LookupError(f"{cls.__name__}.{name} needs both bounds to be an option")
    if b.kind is int:
        return click.IntRange(min=int(b.min), max=int(b.max), min_open=b.min_exclusive)
    return FiniteFloatRange(min=b.min, max=b.max, min_open=b.min_exclusive)


def setting_option(*decls: str, cls: Any, field: str, **kwargs: Any) -> Decorator:
    """`option` for the settings field `field` of dataclass `cls`: its type (the field's
    bounds), its default and its help come from the field, so a bound is declared once
    (batcher.settings). `kwargs` (an envvar, a help that names the command's default...)
    go to `option`, and win."""
    kwargs.setdefault("type", setting_type(cls, field))
    kwargs.setdefault("default", settings_default(cls, field))
    if bounds(cls, field).help:
        kwargs.setdefault("help", bounds(cls, field).help)
    if kwargs["default"] is None:
        kwargs.setdefault("show_default", False)
    return option(*decls, **kwargs)


#: The range of a [models.NAME] table's `workers` (the workers of that model): --workers'.
MODEL_WORKERS = setting_type(PoolSettings, "workers_per_model")


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


def parse_batch_sizes(value: str) -> tuple[int, ...]:
    """`1,2,4,8` as a tuple of sizes, each within 1..MAX_BATCH_SIZE (ValueError if not)."""
    try:
        sizes = tuple(int(v) for v in value.replace(" ", "").split(","))
    except ValueError:
        raise ValueError(f"expected sizes like 1,2,4,8, got {value!r}") from None
    for size in sizes:
        if not 1 <= size <= MAX_BATCH_SIZE:
            raise ValueError(f"batch sizes must be within 1..{MAX_BATCH_SIZE}, got {size}")
    return sizes


def parse_length_buckets(value: str) -> tuple[int, ...]:
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


def parse_gpus(value: str) -> tuple[int, ...]:
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


def text_callback(parse: Callable[[str], tuple[int, ...]]) -> Callable[..., tuple[int, ...] | None]:
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


def int_list_callback(parse: Callable[[str], tuple[int, ...]]) -> Callable[..., tuple[int, ...] | None]:
    """As `text_callback`, for an option's `1,2,4`; an empty text is none."""
    parsed = text_callback(parse)

    def callback(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
        return parsed(ctx, param, value) if value else None

    return callback


def check_models(models: tuple[str, ...]) -> None:
    """Each --model spec parses, and an ONNX one finds its extra installed."""
    for m in models:
        try:
            spec = ModelSpec.parse(m)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--model") from None
        if spec.target.startswith(ONNX_PREFIX):
            require_extra("onnx", f"--model {m}")


def require_extra(extra: str, needed_by: str) -> None:
    """batcher.extras.require as a one-line error of the command."""
    try:
        require(extra, needed_by)
    except MissingExtra as exc:
        raise click.ClickException(str(exc)) from None
