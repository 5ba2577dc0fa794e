"""The gateway's spans (docs/tracing.md): the HTTP or gRPC server span of a request (its
caller's `traceparent`/`tracestate` header or metadata as parent), its parse, and its
rows' round trip to the broker, whose context each row carries in the batcher request's
`traceparent`/`tracestate` fields. An unsampled caller's context is passed on as it came,
so the broker respects it too; a malformed one is ignored (a new trace, where sampling
says so)."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from batcher.wire.tracecontext import parse_traceparent, parse_tracestate


class GatewayTrace:
    """One request's spans at the gateway (`span` None: not sampled here; `forward` the
    context fields each row sends to the broker)."""

    def __init__(self, tracer: Any, span: Any, forward: dict[str, str]) -> None:
        self.tracer = tracer
        self.span = span
        self.forward = forward
        self._trip: Any = None
        self._token: Any = None
        if span is not None:  # the current span of this request's task: its log lines carry its ids
            from opentelemetry import context, trace

            self._token = context.attach(trace.set_span_in_context(span))

    def parsed(self, begun: float, ended: float) -> None:
        """The request's parse, from `begun` to `ended` (monotonic)."""
        if self.span is not None:
            self.tracer.record("batcher.gateway.parse", self.span.get_span_context(), begun, ended)

    def round_trip(self, model: str, rows: int) -> dict[str, str]:
        """The rows' round trip to the broker begins: the fields each row carries."""
        if self.span is None:
            return self.forward
        from opentelemetry.trace import SpanKind

        from batcher.observe.spans import traceparent_of, tracestate_of

        attrs = {"batcher.model": model, "batcher.rows": rows, "rpc.system": "batcher"}
        self._trip = self.tracer.start(
            "batcher.gateway.broker",
            self.span.get_span_context(),
            time.monotonic(),
            attrs,
            kind=SpanKind.CLIENT,
        )
        ctx = self._trip.get_span_context()
        fields = {"traceparent": traceparent_of(ctx)}
        if (state := tracestate_of(ctx)) is not None:
            fields["tracestate"] = state
        return fields

    def round_trip_ended(self, error: str | None = None) -> None:
        """The rows' replies came (or `error` ended the wait)."""
        if self._trip is not None:
            self.tracer.end(self._trip, time.monotonic(), error)
            self._trip = None

    def end(self, attributes: dict[str, Any], error: str | None = None) -> None:
        """The request was answered: its server span ends with `attributes` (the status)."""
        if self.span is None:
            return
        self.round_trip_ended(error)
        for key, value in attributes.items():
            self.span.set_attribute(key, value)
        self.tracer.end(self.span, time.monotonic(), error)
        if self._token is not None:
            from opentelemetry import context

            with contextlib.suppress(Exception):  # a context left in another task: nothing to undo
                context.detach(self._token)
            self._token = None


def begin(
    tracer: Any, traceparent: str | None, tracestate: str | None, name: str, attributes: dict[str, Any]
) -> GatewayTrace | None:
    """A request's trace at the gateway, its server span begun now; None when tracing is
    off or the request is neither sampled nor carries a context to pass on."""
    if tracer is None:
        return None
    parent = parse_traceparent(traceparent)
    state = parse_tracestate(tracestate) if parent is not None else None
    if not tracer.sample(parent):
        if parent is None:
            return None
        forward = {"traceparent": parent.header()}
        if state is not None:
            forward["tracestate"] = state
        return GatewayTrace(tracer, None, forward)
    from opentelemetry.trace import SpanKind

    from batcher.observe.spans import span_context

    ctx = None if parent is None else span_context(parent, state)
    span = tracer.start(name, ctx, time.monotonic(), attributes, kind=SpanKind.SERVER)
    return GatewayTrace(tracer, span, {})
