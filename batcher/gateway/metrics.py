"""The gateway's own latency and tracing metrics, beside the broker states of its /metrics
(batcher.gateway.brokers): `batcher_gateway_request_duration_seconds`, each infer
request's time in the gateway by protocol, a traced one's trace and span id as its
exemplar (so a slow bucket leads to a trace), and `batcher_trace_spans_dropped_total`,
the spans this process dropped (docs/tracing.md). Exemplars show in the OpenMetrics
exposition, which /metrics serves when the scraper asks for it (`Accept:
application/openmetrics-text`, as Prometheus does with exemplar storage on)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Histogram

from batcher.observe.counters import DroppedSpans

#: The request-duration buckets (seconds), as the broker's latency histograms.
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
CLASSIC = "text/plain; version=0.0.4; charset=utf-8"


class GatewayMetrics:
    """The gateway's histogram and drop counter, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.duration = Histogram(
            "batcher_gateway_request_duration_seconds",
            "Time from an infer request's arrival at the gateway to its answer, by protocol",
            ["protocol"],
            buckets=SECONDS_BUCKETS,
            registry=self.registry,
        )
        self._observe = {p: self.duration.labels(p).observe for p in ("http", "grpc")}
        self.registry.register(DroppedSpans())

    def request_done(self, protocol: str, seconds: float, trace: Any = None) -> None:
        """An infer request answered after `seconds`; `trace` its GatewayTrace, if traced."""
        span = None if trace is None else trace.span
        if span is None:
            self._observe[protocol](seconds)
            return
        ctx = span.get_span_context()
        self._observe[protocol](
            seconds, {"trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}"}
        )

    def exposition(self, brokers_text: str, accept: str | None) -> tuple[bytes, str]:
        """The whole /metrics page (the brokers' families, then these) and its content
        type: OpenMetrics, with exemplars, when `accept` asks for it."""
        if accept is not None and "application/openmetrics-text" in accept:
            from prometheus_client.openmetrics.exposition import generate_latest as openmetrics

            page: bytes = openmetrics(self.registry)  # type: ignore[no-untyped-call]
            return to_openmetrics(brokers_text).encode() + page, OPENMETRICS
        from prometheus_client import generate_latest

        return brokers_text.encode() + generate_latest(self.registry), CLASSIC


def to_openmetrics(text: str) -> str:
    """Hand-written Prometheus text as OpenMetrics: a counter family is named without its
    `_total` suffix in its HELP and TYPE lines (its samples keep it); no `# EOF` (the
    registry's part ends the page)."""
    out = []
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            head, name, rest = line[:7], *line[7:].split(" ", 1)
            if name.endswith("_total"):
                line = f"{head}{name[: -len('_total')]} {rest}"
        out.append(line)
    return "\n".join(out) + "\n"
