"""The broker's exporter process (batcher.observe.relay): span records read from the
broker's ipc:// PAIR socket, built into the SDK's spans and exported over OTLP from the
SDK exporter's thread, all outside the broker's process. It ends when its stdin closes
(the broker's shutdown, or the broker's death), after exporting what it holds; every
few hundred milliseconds it tells the broker how many spans it dropped since it last said.

    python -m batcher.observe.relay_exporter ADDRESS CONFIG_JSON
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

import msgpack
import zmq
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from batcher.observe.counters import spans_dropped
from batcher.observe.export import make_provider
from batcher.observe.settings import TraceSettings

_SCOPE = InstrumentationScope("batcher")
_KINDS = {0: SpanKind.INTERNAL, 1: SpanKind.SERVER, 2: SpanKind.CLIENT}
_SAMPLED = TraceFlags(1)


def build(record: list[Any], resource: Any) -> ReadableSpan:
    """One record (see relay.RelaySpans) as the SDK's finished span."""
    name, kind, trace_id, span_id, parent_id, start_ns, end_ns, attributes, links, events, error, state = (
        record
    )
    trace_id = int.from_bytes(trace_id, "big")
    trace_state = TraceState.from_header([state]) if state else None
    ctx = SpanContext(trace_id, span_id, False, _SAMPLED, trace_state)
    parent = SpanContext(trace_id, parent_id, False, _SAMPLED, trace_state) if parent_id else None
    return ReadableSpan(
        name,
        context=ctx,
        parent=parent,
        resource=resource,
        attributes=attributes,
        events=[Event(n, a, timestamp=t) for n, t, a in events],
        links=[Link(SpanContext(int.from_bytes(t, "big"), s, False, _SAMPLED), a) for t, s, a in links],
        kind=_KINDS.get(kind, SpanKind.INTERNAL),
        status=Status(StatusCode.ERROR, error) if error else Status(StatusCode.UNSET),
        start_time=start_ns,
        end_time=end_ns,
        instrumentation_scope=_SCOPE,
    )


def main(argv: list[str]) -> None:
    address, config_text = argv
    config = json.loads(config_text)
    nice = int(config.get("nice", 0))
    if nice:
        os.nice(nice)  # serving first: on a busy machine spans wait (or drop, counted)
    settings = TraceSettings(**config["settings"])
    provider, processor = make_provider(settings, config["service"], config["attributes"])
    resource = provider.resource
    done = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.buffer.read()  # returns at EOF: the broker closed it, or died
        done.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    told = 0
    while not done.is_set() or sock.poll(0):
        if sock.poll(200):
            for record in msgpack.unpackb(sock.recv(), raw=False, strict_map_key=False):
                try:
                    processor.on_end(build(record, resource))
                except Exception:  # one bad record is not worth the others
                    continue
        dropped = spans_dropped()
        if dropped != told:
            try:
                sock.send(msgpack.packb(dropped - told), zmq.NOBLOCK)
                told = dropped
            except zmq.ZMQError:
                pass
    provider.shutdown()
    sock.close()
    ctx.term()


if __name__ == "__main__":
    main(sys.argv[1:])
