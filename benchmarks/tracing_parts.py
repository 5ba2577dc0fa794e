"""Tracing's parts at sampling 1 on small messages (issue 32), each measured alone in CPU
time (thread CPU, or a child process's), so that a change to one part can be seen on a
machine other work shares, where the throughput of `tracing.py` swings by 2x from round
to round. With --baseline DIR (a source tree, e.g. `git archive main | tar -x -C
/tmp/base`), every part is measured from that tree too, the two alternating round by
round, each in a fresh process.

Parts (median us over the rounds):
- relay: the broker's loop, per traced request (admission, queue span records, the batch
  span, the hand-over of records to the exporter process), batches of 26;
- worker: a worker's main thread, extra per batch of 26 traced against the same untraced;
- record: one `Tracer.record` span (a worker's span, as its batches make three);
- encode: the exporter process's encoding, per span record (queue spans and their batch
  spans, 26 a batch);
- post-1 / post-512: one OTLP/HTTP export of 1 and of 512 records to the tests'
  collector (tests/otlp_collector.py, in a process of its own): the exporter's CPU for
  it (encoding included), and the collector's.

    python benchmarks/tracing_parts.py [--runs 5] [--baseline /tmp/base]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import handle_sigterm, md_table, write_results

HERE = Path(__file__).resolve().parent
PARTS = ("relay", "worker", "record", "encode", "post-1", "post-512")


def rb(n: int) -> bytes:
    return random.getrandbits(n * 8).to_bytes(n, "big")


def span_records(batches: int) -> list[list[Any]]:
    """The broker's records of `batches` batches of 26 (batcher.observe.otlp_records)."""
    from batcher.observe.relay import BATCH, QUEUE

    out: list[list[Any]] = []
    t0 = time.time_ns()
    for b in range(batches):
        bt, bs = rb(16), random.getrandbits(63)
        links = []
        for i in range(26):
            t, s = rb(16), random.getrandbits(63)
            out.append([QUEUE, t, s, 0, t0 + i, t0 + i + 5000, "echo", 0.0, "batched", 1, f"r{b}-{i}", None,
                        None, bt if i else None, bs if i else 0, None])  # fmt: skip
            links.append([t, s, f"r{b}-{i}"])
        attributes = {"batcher.model": "echo", "batcher.batch_id": str(b), "batcher.batch_size": 26,
                      "batcher.batch_cost": 26.0, "batcher.worker": "w-1", "batcher.attempt": 1,
                      "batcher.traced_requests": 26, "batcher.infer_ms": 0.1}  # fmt: skip
        out.append([BATCH, bt, bs, 77, t0, t0 + 9, attributes, links, [], None, None])
    return out


def part_relay() -> float:
    from types import SimpleNamespace as NS

    import zmq

    from batcher.observe import relay

    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.setsockopt(zmq.SNDHWM, 100_000)
    b.setsockopt(zmq.RCVHWM, 100_000)
    a.bind("inproc://relay")
    b.connect("inproc://relay")
    rs = relay.RelaySpans.__new__(relay.RelaySpans)  # without its exporter process
    rs.ratio, rs.parent_based, rs.samples_roots = 1.0, True, True
    rs._offset_ns, rs._bits, rs._random = (
        time.time_ns() - time.monotonic_ns(),
        random.getrandbits,
        random.random,
    )
    rs._records, rs._max_kept, rs._open, rs._sock = [], 2048, {}, a
    n = 400
    spent = 0.0
    for bid in range(n):
        now = time.monotonic()
        reqs = [
            NS(id=f"{bid}-{i}", priority=0.0, attempts=0, handbacks=0, deadline_at=None, arrived_at=now,
               trace=None, cost=1.0)
            for i in range(26)
        ]  # fmt: skip
        batch = NS(requests=reqs, model="echo", batch_id=bid, multiplexed=False)
        t0 = time.thread_time()
        for r in reqs:
            r.trace = rs.admit(None, None)
        rs.batch_started(batch, "w-1", 26.0, now)
        rs.batch_answered(bid, now, 0.1, 0.01, None, 0)
        spent += time.thread_time() - t0
        if bid % 20 == 0:
            while b.poll(0):
                b.recv()
    return spent / (n * 26) * 1e6


def _tracer() -> Any:
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from batcher.observe.settings import TraceSettings
    from batcher.observe.spans import Tracer

    class Null(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    settings = TraceSettings(
        endpoint="http://127.0.0.1:9",
        max_queue_size=10**7,
        max_export_batch_size=10**7,
        schedule_delay_ms=1e6,
    )
    return Tracer(settings, "batcher-worker", {"batcher.model": "echo"}, exporter=Null())


TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def part_worker() -> float:
    from batcher.wire import protocol
    from workers import batch_runner

    tracer = _tracer()
    bodies = [protocol.pack({"id": i, "input": "x" * 16}) for i in range(26)]
    plain = protocol.batch_frames(1, [0.1] * 26, bodies)
    traced = protocol.batch_frames(1, [0.1] * 26, bodies, TRACEPARENT)
    n, extra = 500, []
    for _ in range(4):
        spent = []
        for frames, tr in ((plain, None), (traced, tracer)):
            batch_runner.set_tracer(tr)
            t0 = time.thread_time()
            for _ in range(n):
                batch_runner.run_batch(list, frames[2], frames[3:], "w", time.monotonic())
            spent.append((time.thread_time() - t0) / n * 1e6)
        tracer.processor._queue.clear()
        extra.append(spent[1] - spent[0])
    return statistics.median(extra)


def part_record() -> float:
    from batcher.observe.spans import span_context
    from batcher.wire.tracecontext import parse_traceparent

    tracer = _tracer()
    parent = span_context(parse_traceparent(TRACEPARENT))  # type: ignore[arg-type]
    attributes = {"batcher.batch_id": "123", "batcher.batch_size": 26}
    n = 5000
    t0 = time.thread_time()
    for _ in range(n):
        now = time.monotonic()
        tracer.record("batcher.worker.decode", parent, now, now, attributes)
    return (time.thread_time() - t0) / n * 1e6


def part_encode() -> float:
    from opentelemetry.sdk.resources import Resource

    from batcher.observe.otlp_records import Encoder

    encoder = Encoder(Resource.create({"service.name": "batcher-broker", "batcher.models": "echo"}))
    records = span_records(20)
    rounds = 10
    t0 = time.thread_time()
    for _ in range(rounds):
        encoder.encode(records)
    return (time.thread_time() - t0) / rounds / len(records) * 1e6


def part_post(size: int) -> dict[str, float]:
    import psutil
    from opentelemetry.sdk.resources import Resource

    from batcher.observe.export import make_exporter
    from batcher.observe.otlp_records import RecordExporter
    from batcher.observe.settings import TraceSettings

    code = "from tests.otlp_collector import Collector\nimport sys\nc = Collector(mode='sink')\n"
    code += "print(c.endpoint, flush=True)\nsys.stdin.read()\n"
    collector = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert collector.stdout is not None
        endpoint = collector.stdout.readline().strip()
        exporter = RecordExporter(make_exporter(TraceSettings(endpoint=endpoint)), Resource.create({}))
        records = span_records(20)[:size]
        exporter.export(records)
        posts = 2000 if size == 1 else 40
        c0 = sum(psutil.Process(collector.pid).cpu_times()[:2])
        t0 = time.thread_time()
        for _ in range(posts):
            exporter.export(records)
        spent = time.thread_time() - t0
        c1 = sum(psutil.Process(collector.pid).cpu_times()[:2])
        return {"exporter": spent / posts * 1e6, "collector": (c1 - c0) / posts * 1e6}
    finally:
        if collector.stdin is not None:
            collector.stdin.close()
        collector.wait(10)


def run_part(part: str) -> Any:
    if part == "relay":
        return part_relay()
    if part == "worker":
        return part_worker()
    if part == "record":
        return part_record()
    if part == "encode":
        return part_encode()
    return part_post(int(part.split("-")[1]))


def measure(part: str, tree: Path) -> Any:
    """One measurement of `part` in a fresh process importing batcher from `tree`."""
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{HERE}"}
    out = subprocess.run(
        [sys.executable, str(HERE / "tracing_parts.py"), "--part", part],
        capture_output=True, text=True, cwd=tree, env=env, timeout=600, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    handle_sigterm()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="1 round")
    p.add_argument("--baseline", type=Path, default=None, help="a source tree to measure too, alternating")
    p.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # (one measurement, in a child)
    args = p.parse_args(argv)
    if args.part:
        print(json.dumps(run_part(args.part)))
        return
    runs = 1 if args.quick else args.runs
    trees = {"this tree": HERE.parent}
    if args.baseline is not None:
        trees["baseline"] = args.baseline.resolve()
    got: dict[str, dict[str, list[Any]]] = {name: {part: [] for part in PARTS} for name in trees}
    for i in range(runs):
        for part in PARTS:
            for name, tree in trees.items():
                got[name][part].append(measure(part, tree))
        print(f"round {i + 1}/{runs}: " + json.dumps(got), flush=True)

    def median(values: list[Any], key: str | None = None) -> float:
        return statistics.median(v[key] if key else v for v in values)

    rows = []
    for name in trees:
        g = got[name]
        rows.append(
            [name, median(g["relay"]), median(g["worker"]), median(g["record"]), median(g["encode"]),
             median(g["post-1"], "exporter"), median(g["post-1"], "collector"),
             median(g["post-512"], "exporter"), median(g["post-512"], "collector")]
        )  # fmt: skip
    headers = [
        "tree", "relay us/req", "worker extra us/batch of 26", "record us/span", "encode us/record",
        "post of 1: exporter us", "collector us", "post of 512: exporter us", "collector us",
    ]  # fmt: skip
    table = md_table(headers, rows)
    print(table)
    body = (
        "Tracing's parts at sampling 1, each in CPU time, in fresh processes, the trees alternating each "
        f"round; medians of {runs} rounds (see the script's doc for what each part holds).\n\n" + table
    )
    write_results("tracing_parts", "Tracing's parts, in CPU time", body, {"rounds": got}, args.quick)


if __name__ == "__main__":
    main()
