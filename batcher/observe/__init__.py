"""Observability: OpenTelemetry traces of a request's life across gateway, broker and
worker (docs/tracing.md). `settings` reads what to trace and where to send it (the
--trace-* options and the standard OTEL_* variables); `export` builds the SDK's tracer
and exports from a background thread, counting what it drops; `spans` records the spans
of each process from the timestamps its hot path keeps. Nothing here imports
opentelemetry until tracing is switched on: `pip install 'batcher[tracing]'`.
"""
