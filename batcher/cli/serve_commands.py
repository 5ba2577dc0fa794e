"""`batcher serve` (a broker, its workers and, with a port, a gateway) and `batcher broker`
(a broker alone), and how their options become BrokerSettings and PoolSettings."""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import click

from batcher.broker.loop import BindError, BrokerSettings, run_broker
from batcher.cli.config_file import ConfigError, load_config
from batcher.cli.config_options import BATCH_KEYS, config_option, given_outside_file, reread_batching
from batcher.cli.gateway_command import (
    GATEWAY_HOST_OPTION,
    GRPC_PORT_OPTION,
    HTTP_PORT_OPTION,
    GatewayAccess,
    gateway_access_options,
    gateway_processes_option,
)
from batcher.cli.option_groups import (
    BrokerOptions,
    StepOptions,
    backend_option,
    batching_options,
    broker_options,
    curve_server_options,
    frontend_option,
    heartbeat_options,
    max_padded_elements_option,
    no_warmup_option,
    pass_trace_to_children,
    sim_options,
    step_options,
    threads_option,
    trace_options,
)
from batcher.cli.options import (
    MAX_GPU,
    LogOptions,
    check_models,
    float_range,
    logging_options,
    option,
    parse_gpus,
    require_extra,
    setting_option,
    setup,
    text_callback,
)
from batcher.core.multiplex import MAX_MB
from batcher.core.scheduler import BatchSettings
from batcher.errors import SettingsError
from batcher.gateway.process import GatewayProcess, gateway_command, local_address
from batcher.gateway.processes import check_supported as check_processes_supported
from batcher.gateway.settings import GatewaySettings
from batcher.observe.settings import TraceSettings
from batcher.serve.multiplexed_pool import multiplex_catalog
from batcher.serve.repository_control import RepositoryControl
from batcher.serve.serving import ModelLoadFailed, run_serve
from batcher.settings import MAX_WORKERS
from batcher.transport.security import CurveServerKeys, KeyFileError
from batcher.wire.protocol import Heartbeat
from workers import warmup
from workers.models import MAX_PADDED_ELEMENTS, ModelSpec, SimSettings
from workers.supervisor import PoolSettings


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
        file = load_config(config) if config else None
        per_model = file.model_settings(batching, fixed) if file else {}
        cached = (*map(served_name, broker_opts.cache_model), *(file.cached_models() if file else ()))
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
            target_utilization=broker_opts.target_utilization,
            cache_bytes=broker_opts.cache_bytes,
            cache_models=tuple(dict.fromkeys(cached)),
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
    repository_workers: dict[str, int] | None = None,
    multiplex: str | None = None,
    multiplex_workers: int | None = None,
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
        model_workers.update(repository_workers or {})  # a repository model's config.toml
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
            multiplex=multiplex,
            multiplex_workers=multiplex_workers,
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


def _repository(
    root: str | None, poll_s: float | None, models: tuple[str, ...], batching: BatchSettings
) -> tuple[RepositoryControl | None, tuple[str, ...], dict[str, BatchSettings], dict[str, int]]:
    """serve's model repository (None without --model-repository), the models to serve
    (--model's, unless left at its default, and each served version's but the
    multiplexed ones: RepositoryControl.pooled), and the versions' batching settings and
    worker counts."""
    if root is None:
        if poll_s is not None:
            raise click.UsageError("--repository-poll-s goes with --model-repository")
        return None, models, {}, {}
    repository = RepositoryControl(root, batching, poll_s)
    specs, batch, workers = repository.initial()
    pooled = [e["target"] for e in repository.pooled.values()]
    if any(spec.partition("=")[2].startswith("onnx:") for spec in specs) or any(
        t.startswith("onnx:") for t in pooled
    ):
        require_extra("onnx", f"--model-repository {root}")
    ctx = click.get_current_context(silent=True)
    source = ctx.get_parameter_source("models") if ctx is not None else None
    given = source is not None and source is not click.core.ParameterSource.DEFAULT
    served = (*(models if given else ()), *specs)
    if not served and not repository.pooled:
        raise click.UsageError(
            f"the model repository {root} holds no model that can be served, and no --model was given"
        )
    return repository, served, batch, workers


def _multiplex(
    repository: RepositoryControl | None, workers: int | None, memory_mb: int | None
) -> dict[str, Any]:
    """PoolSettings' `multiplex` (the catalog of serve's multiplexed workers, None: no
    model is multiplexed yet: the pool starts when one is loaded) and `multiplex_workers`;
    a usage error for the options without a model repository, or a multiplexed model
    without a budget it fits."""
    if repository is None:
        if workers is not None or memory_mb is not None:
            raise click.UsageError(
                "--multiplex-workers and --multiplex-memory-mb go with --model-repository (for its "
                "models whose config.toml says multiplexed = true)"
            )
        return {"multiplex": None, "multiplex_workers": workers}
    try:
        catalog = multiplex_catalog(repository, memory_mb)
    except SettingsError as exc:
        raise click.UsageError(str(exc)) from None
    return {"multiplex": catalog, "multiplex_workers": workers}


def _warmup_sizes(batch: BatchSettings) -> tuple[int, ...]:
    """The batch sizes a model's warm-up runs: its allowed ones, else 1, 2, 4, ... max."""
    return warmup.warmup_sizes(batch.max_batch_size, batch.batch_sizes)


def served_name(text: str) -> str:
    """The name a --model value is configured under at the broker: a worker's spec
    (`onnx:PATH`, `NAME=SPEC`, `sim`, `pkg.mod:attr`) is named as that worker announces
    itself (`onnx:dir/digits.onnx` is `digits`); any other text is a name as it is
    (`batcher broker --model mymodel`)."""
    try:
        return ModelSpec.parse(text).name
    except ValueError:
        return text.strip()


@click.command()
@frontend_option
@backend_option
@setting_option("--workers", cls=PoolSettings, field="workers_per_model")
@option(
    "--gpus",
    callback=text_callback(parse_gpus),
    default=None,
    show_default=False,
    help=f"GPU ids the workers may use, e.g. 0,1 (each 0..{MAX_GPU}). Default: the visible devices.",
)
@setting_option("--workers-per-gpu", cls=PoolSettings, field="workers_per_gpu")
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
@option(
    "--model-repository",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    show_default=False,
    help="Serve every model of this directory, laid out as Triton's: DIR/NAME/<version>/model.onnx "
    "(or model.py), an optional DIR/NAME/config.toml (docs/models.md). Combines with --model.",
)
@option(
    "--repository-poll-s",
    type=float_range(0.1, 86400.0),
    default=None,
    show_default=False,
    help="With --model-repository: look at the directory every this many seconds and apply what "
    "changed (a new version joins, then the policy retires the old; a removed model drains and "
    "stops). Default: only `batcher load`/`unload` change what is served.",
)
@option(
    "--multiplex-workers",
    type=click.IntRange(1, MAX_WORKERS),
    default=None,
    show_default=False,
    help="With --model-repository: the workers that serve, between them, every model whose "
    "config.toml says `multiplexed = true`, each loading a model on first use. Default: as many "
    "as --workers gives a model.",
)
@option(
    "--multiplex-memory-mb",
    type=click.IntRange(1, MAX_MB),
    default=None,
    show_default=False,
    help="The memory each multiplexed worker may hold its models in (their config's memory_mb, "
    "else their file's size): past it, the least recently used is unloaded. Needed when a model "
    "is multiplexed.",
)
@no_warmup_option
@max_padded_elements_option
@HTTP_PORT_OPTION
@GRPC_PORT_OPTION
@GATEWAY_HOST_OPTION
@gateway_processes_option("--gateway-processes")
@gateway_access_options("gateway-")
@batching_options
@broker_options
@heartbeat_options
@curve_server_options
@config_option
@sim_options
@step_options
@trace_options
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
    model_repository: str | None,
    repository_poll_s: float | None,
    multiplex_workers: int | None,
    multiplex_memory_mb: int | None,
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
    trace: TraceSettings,
    logs: LogOptions,
) -> None:
    """Run a broker and its worker processes: per model, --workers of them, or
    --workers-per-gpu on each GPU it may use. With --http-port or --grpc-port, a
    gateway process serves the Open Inference Protocol (KServe v2) in front of it.

    `batcher reload MODEL`, or SIGHUP (which re-reads --config's batching settings and
    reloads every model), replaces a model's workers: new ones first, then the old ones
    drained and stopped.

    --model-repository serves a Triton-style model repository, each version side by side
    (docs/models.md); `batcher split`, `batcher load` and `batcher unload` change it at run time."""
    setup(logs)
    _check_serve(models, http_port, grpc_port)
    repository, models, repo_batch, repo_workers = _repository(
        model_repository, repository_poll_s, models, batching
    )
    settings = broker_settings(
        frontend,
        backend,
        (*models, *(repository.pooled if repository else ())),  # multiplexed: configured, waited for too
        batching=batching,
        broker_opts=broker_opts,
        heartbeat=heartbeat,
        curve=curve,
        config=config,
    )
    settings = dataclasses.replace(settings, trace=trace, per_model={**settings.per_model, **repo_batch})
    pass_trace_to_children(trace)  # its workers and gateway trace as it does
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
        repository_workers=repo_workers,
        **_multiplex(repository, multiplex_workers, multiplex_memory_mb),
    )
    settings = _with_cell_workers(settings, pool)
    ctx = click.get_current_context()
    reread = None if config is None else functools.partial(reread_batching, ctx, config, settings.models)
    gateway = _serve_gateway(settings, http_port, grpc_port, host, processes, gateway_access, logs)
    _run(settings, pool, reread, gateway, repository)


def _run(
    settings: BrokerSettings,
    pool: PoolSettings,
    reread: Callable[[], dict[str, BatchSettings]] | None,
    gateway: GatewayProcess | None,
    repository: RepositoryControl | None,
) -> None:
    """run_serve, its failures to start said as a usage tool says them."""
    try:
        run_serve(settings, pool, reread, gateway, repository)
    except (BindError, KeyFileError, ModelLoadFailed) as exc:
        raise click.ClickException(str(exc)) from None


def _check_serve(models: tuple[str, ...], http_port: int, grpc_port: int) -> None:
    """What serve refuses before it starts anything: a bad model spec, a gateway without
    its extra."""
    check_models(models)
    if http_port or grpc_port:
        require_extra("gateway", "serve --http-port/--grpc-port (the gateway)")


def _with_cell_workers(settings: BrokerSettings, pool: PoolSettings) -> BrokerSettings:
    """The broker's settings with the cell's worker count of each model: what
    batcher_desired_cells divides by."""
    counts = Counter(ModelSpec.parse(spec).name for spec, _ in pool.placement())
    return dataclasses.replace(settings, cell_workers=dict(counts))


@click.command()
@frontend_option
@backend_option
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
@trace_options
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
    trace: TraceSettings,
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
    settings = dataclasses.replace(settings, trace=trace)
    try:
        run_broker(settings)
    except (BindError, KeyFileError) as exc:
        raise click.ClickException(str(exc)) from None
