"""The option groups several commands share (made with `batcher.cli.options.option_group`):
CURVE keys (client, worker and broker sides), heartbeats, batching, the broker's other
settings, the simulated model's costs, step-level models, and the warm-up and thread
options of serve and worker. Each group hands its command one typed value."""

from __future__ import annotations

import os
from dataclasses import dataclass

import click

from batcher.broker.loop import BrokerSettings
from batcher.cli.options import (
    BIND_ADDRESS,
    CONNECT_ADDRESS,
    MAX_BATCH_SIZE,
    MAX_LIVENESS,
    MAX_MS,
    Decorator,
    field_default,
    float_range,
    int_list_callback,
    int_range,
    option,
    option_group,
    parse_batch_sizes,
    parse_length_buckets,
    setting_option,
)
from batcher.client.sync import Client
from batcher.core.scheduler import BUCKET_BY, POLICIES, BatchSettings
from batcher.extras import install_command, missing_module
from batcher.observe.settings import TraceSettings
from batcher.observe.tracer import settings_from
from batcher.transport.security import CurveServerKeys
from batcher.wire.protocol import Heartbeat
from workers.models import SimSettings
from workers.steps import BATCHING_LEVELS
from workers.worker import WorkerSettings

#: --connect of a client of the broker (send, stats, ready, reload, gateway): its frontend.
connect_option = option(
    "--connect",
    type=CONNECT_ADDRESS,
    default=BrokerSettings().frontend,
    help="The broker's frontend address.",
)
#: The two addresses a broker binds: serve and broker.
frontend_option = option(
    "--frontend",
    type=BIND_ADDRESS,
    default=BrokerSettings().frontend,
    help="Address clients connect to (ROUTER).",
)
backend_option = option(
    "--backend",
    type=BIND_ADDRESS,
    default=BrokerSettings().backend,
    help="Address workers connect to (ROUTER).",
)


def threads_option(default_text: str) -> Decorator:
    """--threads-per-worker, its default described as `default_text`: serve, worker."""
    return setting_option(
        "--threads-per-worker",
        cls=WorkerSettings,
        field="threads",
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
max_padded_elements_option = setting_option(
    "--max-padded-elements", cls=WorkerSettings, field="max_padded_elements"
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
CURVE_ALLOW_LIST_FLAGS = (
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
    *CURVE_ALLOW_LIST_FLAGS,
)

HEARTBEAT_FLAGS = (
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
heartbeat_options = option_group("heartbeat", _heartbeat, *HEARTBEAT_FLAGS)

#: How each model's requests are queued and batched: BatchSettings' fields, by name.
BATCHING_FLAGS = (
    setting_option("--max-batch-size", cls=BatchSettings, field="max_batch_size"),
    setting_option("--max-wait-ms", cls=BatchSettings, field="max_wait_ms"),
    option(
        "--policy",
        type=click.Choice(POLICIES),
        default=BatchSettings().policy.value,
        help="window: wait up to --max-wait-ms for a full batch; adaptive: dispatch at once "
        "unless waiting is expected to lower latency.",
    ),
    option(
        "--batch-sizes",
        callback=int_list_callback(parse_batch_sizes),
        default=None,
        help=f"Allowed batch sizes, e.g. 1,2,4,8 (must start at 1; each 1..{MAX_BATCH_SIZE}); "
        "a batch is cut to the largest the queue fills.",
    ),
    setting_option("--max-queue", cls=BatchSettings, field="max_queue"),
    setting_option("--priority-aging-ms", cls=BatchSettings, field="priority_aging_ms"),
    setting_option("--max-batch-cost", cls=BatchSettings, field="max_batch_cost"),
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
        callback=int_list_callback(parse_length_buckets),
        default=None,
        help="Upper bounds of the length buckets, e.g. 16,32,64,128 (with --bucket-by length): "
        "a request of length 20 joins the 32 bucket; one longer than the last has a bucket of its own.",
    ),
)

#: Every model's batching settings (a model's [models.NAME] table may differ): serve, broker.
batching_options = option_group("batching", BatchSettings, *BATCHING_FLAGS)


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
    target_utilization: float
    cache_bytes: int = 0
    cache_model: tuple[str, ...] = ()


BROKER_FLAGS = (
    setting_option("--default-timeout-ms", cls=BrokerSettings, field="default_timeout_ms"),
    setting_option("--worker-prefetch", cls=BrokerSettings, field="worker_prefetch"),
    setting_option("--max-retries", cls=BrokerSettings, field="max_retries"),
    setting_option("--max-message-bytes", cls=BrokerSettings, field="max_message_bytes"),
    setting_option("--no-worker-timeout-ms", cls=BrokerSettings, field="no_worker_timeout_ms"),
    setting_option("--metrics-port", cls=BrokerSettings, field="metrics_port"),
    setting_option("--batch-timeout-ms", cls=BrokerSettings, field="batch_timeout_ms"),
    setting_option("--cache-bytes", cls=BrokerSettings, field="cache_bytes"),
    option(
        "--cache-model",
        multiple=True,
        default=(),
        help="A model whose ok replies are cached (repeatable; needs --cache-bytes; the config "
        "file's [models.NAME] cache = true too). docs/operations.md, Response cache.",
    ),
    option(
        "--metrics-host",
        default=BrokerSettings().metrics_host,
        help="The address the metrics endpoint listens on: 0.0.0.0 (or ::) for every "
        "interface. It has no authentication, so expose it only where that is fine.",
    ),
    option(
        "--target-utilization",
        type=float_range(0, 1, min_open=True),
        default=BrokerSettings().target_utilization,
        help="The share of its workers' full-batch capacity the offered load should take: "
        "batcher_desired_workers (and stats' desired_workers) is the workers the measured "
        "arrival rate needs at it (docs/kubernetes.md, Scaling).",
    ),
)

#: The broker's other settings: serve and broker.
broker_options = option_group("broker_opts", BrokerOptions, *BROKER_FLAGS)


def _sim(
    sim_base_ms: float, sim_per_item_ms: float, simlm_step_base_ms: float, simlm_step_per_seq_ms: float
) -> SimSettings:
    return SimSettings(sim_base_ms, sim_per_item_ms, simlm_step_base_ms, simlm_step_per_seq_ms)


#: The simulated GPU's cost: serve, worker and bench.
sim_options = option_group(
    "sim",
    _sim,
    setting_option("--sim-base-ms", cls=SimSettings, field="base_ms"),
    setting_option("--sim-per-item-ms", cls=SimSettings, field="per_item_ms"),
    setting_option("--simlm-step-base-ms", cls=SimSettings, field="step_base_ms"),
    setting_option("--simlm-step-per-seq-ms", cls=SimSettings, field="step_per_seq_ms"),
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
    setting_option("--max-active", cls=WorkerSettings, field="max_active"),
    option(
        "--batching-level",
        type=click.Choice(BATCHING_LEVELS),
        default=field_default(WorkerSettings, "batching_level"),
        help="Step-level models: `step` admits new sequences between any two steps (continuous "
        "batching); `request` only once all it holds have ended (request-level batching, the baseline).",
    ),
)


def _trace(trace_endpoint: str | None, trace_sample_ratio: float | None) -> TraceSettings:
    """The process's trace settings: these options over the standard OTEL_* variables; a
    usage error naming the pip install when tracing is asked for without its extra."""
    settings = settings_from(trace_endpoint, trace_sample_ratio)
    if settings.enabled:
        extra = "tracing-grpc" if settings.protocol == "grpc" else "tracing"
        if missing_module(extra) is not None:
            raise click.UsageError(f"tracing (--trace-endpoint, OTEL_*) needs {install_command(extra)}")
    return settings


#: --trace-endpoint and --trace-sample-ratio (serve, broker, worker, gateway): OpenTelemetry
#: traces to an OTLP collector (docs/tracing.md).
trace_options = option_group(
    "trace",
    _trace,
    option(
        "--trace-endpoint",
        default=None,
        metavar="URL",
        help="Send OpenTelemetry traces to this OTLP collector (http://host:4318; its /v1/traces "
        "unless the URL has a path). Default: OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT; none: no tracing. "
        "Needs `pip install 'batcher[tracing]'`.",
    ),
    option(
        "--trace-sample-ratio",
        type=float_range(0.0, 1.0),
        default=None,
        help="Share of the requests without a caller's context that are traced (a caller's "
        "sampled flag is followed). Default: OTEL_TRACES_SAMPLER[_ARG], else 1.",
    ),
)


def pass_trace_to_children(trace: TraceSettings) -> None:
    """Let the processes this one starts (serve's workers and gateway, a gateway's
    processes) trace as it does: its settings in the variables their options read."""
    if trace.endpoint is not None:
        os.environ["BATCHER_TRACE_ENDPOINT"] = trace.endpoint
        os.environ["BATCHER_TRACE_SAMPLE_RATIO"] = repr(float(trace.sample_ratio))
