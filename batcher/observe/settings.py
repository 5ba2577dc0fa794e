"""What to trace and where to send it: the --trace-endpoint and --trace-sample-ratio
options over the standard OpenTelemetry variables (OTEL_EXPORTER_OTLP_ENDPOINT,
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL,
OTEL_TRACES_SAMPLER, OTEL_TRACES_SAMPLER_ARG, OTEL_SERVICE_NAME, OTEL_SDK_DISABLED,
OTEL_TRACES_EXPORTER, OTEL_BSP_*). Pure: the environment is passed in as a mapping."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from batcher.errors import SettingsError

#: OTLP's two transports here: HTTP with protobuf bodies (the default), and gRPC
#: (`pip install 'batcher[tracing-grpc]'`).
PROTOCOLS = ("http/protobuf", "grpc")
#: OTEL_TRACES_SAMPLER values understood, and whether each follows a parent's decision.
SAMPLERS = {
    "always_on": False,
    "always_off": False,
    "traceidratio": False,
    "parentbased_always_on": True,
    "parentbased_always_off": True,
    "parentbased_traceidratio": True,
}


@dataclass(frozen=True)
class TraceSettings:
    """Tracing on (an endpoint) or off (None), how much of it, and how spans leave:
    `sample_ratio` of the requests that come without a sampled-or-not parent are traced
    (a parent's decision is followed when `parent_based`); spans wait in a queue of
    `max_queue_size` (more are dropped and counted) and leave `max_export_batch_size` at
    a time every `schedule_delay_ms`, each export given `export_timeout_ms`."""

    endpoint: str | None = None
    sample_ratio: float = 1.0
    parent_based: bool = True
    protocol: str = "http/protobuf"
    service_name: str | None = None  # None: the process's own (batcher-broker, ...)
    max_queue_size: int = 2048
    max_export_batch_size: int = 512
    schedule_delay_ms: float = 500.0
    export_timeout_ms: float = 10_000.0

    def __post_init__(self) -> None:
        if not (isinstance(self.sample_ratio, int | float) and 0.0 <= self.sample_ratio <= 1.0):
            raise SettingsError(f"trace_sample_ratio must be in [0, 1], got {self.sample_ratio}")
        if self.protocol not in PROTOCOLS:
            raise SettingsError(
                f"the OTLP protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}"
            )
        if self.endpoint is not None:
            parts = urlsplit(self.endpoint)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise SettingsError(
                    f"trace_endpoint must be an http:// or https:// URL, got {self.endpoint!r}"
                )
        if not isinstance(self.max_queue_size, int) or self.max_queue_size < 1:
            raise SettingsError(f"max_queue_size must be >= 1, got {self.max_queue_size}")
        if not isinstance(self.max_export_batch_size, int) or self.max_export_batch_size < 1:
            raise SettingsError(f"max_export_batch_size must be >= 1, got {self.max_export_batch_size}")
        for name in ("schedule_delay_ms", "export_timeout_ms"):
            value = getattr(self, name)
            if not 0 < value < math.inf:
                raise SettingsError(f"{name} must be a finite number > 0, got {value}")

    @property
    def enabled(self) -> bool:
        """Whether spans are recorded at all."""
        return self.endpoint is not None

    @property
    def traces_url(self) -> str:
        """Where OTLP/HTTP posts spans: the endpoint as given when it has a path, else its
        /v1/traces (as OTEL_EXPORTER_OTLP_ENDPOINT is read); gRPC takes the endpoint."""
        assert self.endpoint is not None
        if self.protocol == "grpc" or urlsplit(self.endpoint).path not in ("", "/"):
            return self.endpoint
        return self.endpoint.rstrip("/") + "/v1/traces"


def _float_env(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return float(raw)
    except ValueError:
        raise SettingsError(f"{name} must be a number, got {raw!r}") from None


def trace_settings(endpoint: str | None, sample_ratio: float | None, env: Mapping[str, str]) -> TraceSettings:
    """The settings of one process: the options given (None: not given) over the
    environment's OTEL_* variables. OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none
    switch tracing off whatever else is set."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return TraceSettings()
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return TraceSettings()
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if endpoint is None:
        endpoint = (
            env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None
        )
    sampler = env.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
    if sampler not in SAMPLERS:
        raise SettingsError(f"OTEL_TRACES_SAMPLER must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
    parent_based = SAMPLERS[sampler]
    if sample_ratio is not None:
        ratio, parent_based = float(sample_ratio), True
    elif sampler.endswith("always_on"):
        ratio = 1.0
    elif sampler.endswith("always_off"):
        ratio = 0.0
    else:
        ratio = _float_env(env, "OTEL_TRACES_SAMPLER_ARG", 1.0)
    return TraceSettings(
        endpoint=endpoint,
        sample_ratio=ratio,
        parent_based=parent_based,
        protocol=protocol,
        service_name=env.get("OTEL_SERVICE_NAME") or None,
        max_queue_size=int(_float_env(env, "OTEL_BSP_MAX_QUEUE_SIZE", 2048)),
        max_export_batch_size=int(_float_env(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)),
        schedule_delay_ms=_float_env(env, "OTEL_BSP_SCHEDULE_DELAY", 500.0),
        export_timeout_ms=_float_env(env, "OTEL_BSP_EXPORT_TIMEOUT", 10_000.0),
    )
