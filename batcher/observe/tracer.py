"""Switching tracing on: `start_tracing` reads the settings and, only when they ask for
spans, imports the OpenTelemetry SDK (batcher.observe.spans) and returns the process's
tracer; None otherwise, and nothing of opentelemetry is loaded. The hot paths hold that
value and test it once (`if tracer is None`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from batcher.extras import MissingExtra, install_command
from batcher.observe.settings import TraceSettings, trace_settings

if TYPE_CHECKING:
    from batcher.observe.spans import Tracer

log = logging.getLogger("batcher.tracing")


def settings_from(
    endpoint: str | None, sample_ratio: float | None, env: Mapping[str, str] | None = None
) -> TraceSettings:
    """The process's trace settings: the options over the OTEL_* variables."""
    return trace_settings(endpoint, sample_ratio, os.environ if env is None else env)


def start_tracing(
    settings: TraceSettings, service: str, attributes: Mapping[str, Any] | None = None
) -> Tracer | None:
    """The tracer of this process (`service`: batcher-broker, batcher-worker,
    batcher-gateway; `attributes`: resource attributes such as the model and GPU), or None
    when tracing is off. MissingExtra when it is on and the SDK is not installed."""
    if not settings.enabled:
        return None
    try:
        from batcher.observe.spans import Tracer
    except ImportError as exc:
        raise MissingExtra(
            f"tracing needs the OpenTelemetry SDK ({exc.name or exc}): {install_command('tracing')}"
        ) from None
    tracer = Tracer(settings, service, attributes)
    log.info(
        "tracing to %s (%s, sampling %g) as %s",
        settings.traces_url, settings.protocol, settings.sample_ratio, settings.service_name or service,
    )  # fmt: skip
    return tracer


def start_broker_tracing(broker: Any) -> Any:
    """The spans of a broker of these BrokerSettings (its `trace` and `models`:
    batcher.observe.broker_spans.BrokerSpans) when tracing is on, else None: the broker's
    loop tests that value once where it would record."""
    settings: TraceSettings = broker.trace
    attributes = {"batcher.models": ",".join(broker.models)}
    if not settings.enabled:
        return None
    if os.environ.get("BATCHER_TRACE_IN_PROCESS") == "1":  # the SDK in the broker's process
        tracer = start_tracing(settings, "batcher-broker", attributes)
        from batcher.observe.broker_spans import BrokerSpans

        return BrokerSpans(tracer) if tracer is not None else None

    from batcher.extras import missing_module

    if missing_module("tracing") is not None:
        raise MissingExtra(f"tracing needs the OpenTelemetry SDK: {install_command('tracing')}")
    from batcher.observe.relay import RelaySpans

    log.info(
        "tracing to %s (%s, sampling %g) as %s, from an exporter process",
        settings.traces_url, settings.protocol, settings.sample_ratio, settings.service_name or "the broker",
    )  # fmt: skip
    return RelaySpans(settings, "batcher-broker", attributes)
