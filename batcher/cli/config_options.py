"""--config: a TOML file's top-level keys become option defaults, every value checked
against the options (type and range) so an error names the file, the table and the key;
and serve's re-reading of the file on SIGHUP. The file itself is read by
`batcher.cli.config_file`."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import click
from click.core import ParameterSource

from batcher.cli.config_file import COMMA_LIST_OPTIONS, Config, ConfigError, Kind, load_config, type_problem
from batcher.cli.options import MODEL_WORKERS, option, parse_batch_sizes, parse_gpus, parse_length_buckets
from batcher.core.scheduler import BatchSettings

#: The options a [models.NAME] table may set for its model: BatchSettings' fields.
BATCH_KEYS = tuple(f.name for f in dataclasses.fields(BatchSettings))


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
        check_config(ctx, config)
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


def check_config(ctx: click.Context, config: Config) -> None:
    """Check a config.Config against the options: every top-level key must be some
    command's option and have its type; this command's options, and the [models.NAME]
    tables' keys, must also pass the flag's own range check."""
    from batcher.cli.commands import main  # every command's options: the group is assembled there

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
                    parse_batch_sizes(text)
                elif name == "length_buckets":
                    parse_length_buckets(text)
                elif name == "gpus":
                    parse_gpus(text)
                elif name == "workers" and model is not None:  # whether this command has --workers or not
                    MODEL_WORKERS.convert(value, None, ctx)
                elif name in own and name != "config":
                    own[name].type_cast_value(ctx, value)
            except click.BadParameter as exc:
                raise config.error(key, model, exc.message) from None
            except ValueError as exc:
                raise config.error(key, model, str(exc)) from None


config_option = option(
    "--config",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    is_eager=True,
    expose_value=True,
    callback=_load_config,
    help="TOML file: option defaults and per-model [models.NAME] settings.",
)


def reread_batching(ctx: click.Context, path: str, models: Iterable[str]) -> dict[str, BatchSettings]:
    """Each model's batching settings as the config file now says (SIGHUP to serve): the
    file is checked as at start, and what the command line or the environment set still
    wins. ValueError (ConfigError among them) if the file is no longer good."""
    try:
        config = load_config(path)
        check_config(ctx, config)
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
