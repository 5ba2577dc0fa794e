"""The broker's exporter process (batcher.observe.relay): span records read from the
broker's ipc:// PAIR socket, queued (batcher.observe.export.BoundedExporter: bounded,
drops counted) and exported from its thread, encoded straight into OTLP's protobuf
messages and posted by the SDK's OTLP exporter (batcher.observe.otlp_records), all
outside the broker's process. It ends when its stdin closes (the broker's shutdown, or
the broker's death), after exporting what it holds; every few hundred milliseconds it
tells the broker how many spans it dropped since it last said.

    python -m batcher.observe.relay_exporter ADDRESS CONFIG_JSON
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import msgpack
import msgspec
import zmq
from opentelemetry.sdk.resources import Resource

from batcher.observe.counters import spans_dropped
from batcher.observe.export import BoundedExporter, make_exporter
from batcher.observe.otlp_records import RecordExporter
from batcher.observe.settings import TraceSettings

#: How often, at most, the broker is told of the spans dropped here.
TELL_EVERY_S = 0.2
#: The broker's record messages read (msgspec: a fifth less than msgpack.unpackb here).
_unpack = msgspec.msgpack.Decoder().decode


def exporter_of(config: dict[str, Any]) -> BoundedExporter:
    """The queue and exporter of the records, from the broker's config: its settings, its
    service name and resource attributes (Resource.create also reads OTEL_RESOURCE_ATTRIBUTES
    and OTEL_SERVICE_NAME, as the SDK's provider does)."""
    settings = TraceSettings(**config["settings"])
    resource = Resource.create(
        {"service.name": settings.service_name or config["service"], **(config["attributes"] or {})}
    )
    return BoundedExporter(RecordExporter(make_exporter(settings), resource), settings)


def main(argv: list[str]) -> None:
    address, config_text = argv
    config = json.loads(config_text)
    nice = int(config.get("nice", 0))
    if nice:
        os.nice(nice)  # serving first: on a busy machine spans wait (or drop, counted)
    processor = exporter_of(config)
    done = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.buffer.read()  # returns at EOF: the broker closed it, or died
        done.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    told, told_at = 0, 0.0
    while not done.is_set() or sock.poll(0):
        if sock.poll(200):
            try:
                records = _unpack(sock.recv())
            except ValueError:  # not the broker's (never expected): nothing to export
                records = None
            if isinstance(records, list):
                processor.put_many(records)
        dropped, now = spans_dropped(), time.monotonic()
        if dropped != told and now - told_at >= TELL_EVERY_S:
            try:
                sock.send(msgpack.packb(dropped - told), zmq.NOBLOCK)
                told, told_at = dropped, now
            except zmq.ZMQError:
                pass
    processor.shutdown()
    sock.close()
    ctx.term()


if __name__ == "__main__":
    main(sys.argv[1:])
