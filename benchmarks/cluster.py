"""Cells behind one gateway (issue 31, Speed): does the gateway over many brokers add up
the cells' capacity, and what does each broker more cost a lone request?

Cells are `batcher serve` processes on 127.0.0.1 (a cell per process, as in a pod), each
with sim workers slowed to t(n) = 40 + 5 n ms so that the workers' time, not the gateway's
or the load generator's CPU, bounds the rows a second on this 2-core machine (a worker
serves 32 / 0.2 s = 160 rows/s at full batches). One `batcher gateway --connect ...` in
front; the load is HTTP from a separate process (aiohttp, JSON requests of 8 rows,
--concurrency of them in flight), rows counted when answered 200 with their own values.

- equal: one cell of 2 workers alone, then two such cells: the ratio (target >= 1.8);
- unequal: cells of 1 and of 3 workers, each alone, then both: both / (sum alone)
  (target >= 0.9);
- latency: lone requests (http.client, one at a time, 1 row) to echo cells: p50 through
  a gateway over 1 broker and through one over 4, each less the p50 of the same request
  sent straight to the same brokers over ZeroMQ (to the 4 in turn, as the gateway spreads
  them), the paths measured in turn in short bursts (medians over the rounds): the added
  p50 of 4 brokers within 0.1 ms of 1's.

Needs the gateway over many brokers (issue 31 item 1: `batcher gateway` with --connect
repeatable).

    python benchmarks/cluster.py [--quick] [--baseline-source DIR] [--only-latency]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import zmq
from common import handle_sigterm, md_table, running_serve, serve_args, wait_http_200, write_results

from batcher.cli.commands import main as cli_main
from batcher.serve.launcher import ServeProcess, free_tcp_address

SIM = ["--sim-base-ms", "40", "--sim-per-item-ms", "5"]
ROWS = 8
#: The targets of the issue's Speed section.
EQUAL_TARGET = 1.8
UNEQUAL_TARGET = 0.9
ADDED_P50_SLACK_MS = 0.1


def free_port() -> int:
    return int(free_tcp_address().rsplit(":", 1)[1])


def many_brokers() -> bool:
    """Whether this checkout's gateway takes --connect more than once."""
    (connect,) = [p for p in cli_main.commands["gateway"].params if p.name == "connect"]
    return bool(getattr(connect, "multiple", False))


@contextlib.contextmanager
def cells(worker_counts: list[int], model: str = "sim") -> Iterator[list[ServeProcess]]:
    """One `batcher serve` per entry, with that many workers, all ready."""
    with contextlib.ExitStack() as stack:
        out = []
        for n in worker_counts:
            args = serve_args(workers=n, model=model, max_batch_size=32, max_wait_ms=5.0, extra=SIM)
            out.append(stack.enter_context(running_serve(args, n)))
        yield out


@contextlib.contextmanager
def gateway(brokers: list[ServeProcess], source: Path | None = None) -> Iterator[int]:
    """`batcher gateway --connect A --connect B ...` on a free port, once ready (run from
    another source tree `source` when given: a same-run baseline)."""
    port = free_port()
    connects = [a for b in brokers for a in ("--connect", b.frontend)]
    env = None if source is None else {**os.environ, "PYTHONPATH": str(source)}
    argv = [sys.executable, "-m", "batcher", "gateway", *connects, "--http-port", str(port)]
    proc = subprocess.Popen([*argv, "--log-level", "warning"], start_new_session=True, env=env, cwd=source)
    try:
        wait_http_200(f"http://127.0.0.1:{port}/v2/health/ready", timeout_s=60)
        yield port
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _rows_load(port: int, concurrency: int, warmup_s: float, seconds: float, out: Any) -> None:
    import aiohttp

    async def run() -> float:
        url = f"http://127.0.0.1:{port}/v2/models/sim/infer"
        start = time.perf_counter() + warmup_s
        stop = start + seconds
        counted = [0]

        async def one(session: aiohttp.ClientSession, k: int) -> None:
            n = k
            while time.perf_counter() < stop:
                values = [float(n * ROWS + i) for i in range(ROWS)]
                body = {"inputs": [{"name": "x", "shape": [ROWS, 1], "datatype": "FP32", "data": values}]}
                async with session.post(url, json=body) as r:
                    doc = await r.json()
                assert r.status == 200, doc
                echo = next(o["data"] for o in doc["outputs"] if o["name"] == "echo")
                assert echo == values, (echo, values)
                if start <= time.perf_counter() < stop:
                    counted[0] += ROWS
                n += concurrency

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
            await asyncio.gather(*(one(session, k) for k in range(concurrency)))
        return counted[0] / seconds

    out.put(asyncio.run(run()))


def rows_per_s(port: int, concurrency: int, warmup_s: float, seconds: float) -> float:
    """Rows a second answered by the gateway at `port`, from a load process of its own."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_rows_load, args=(port, concurrency, warmup_s, seconds, out))
    proc.start()
    value = float(out.get(timeout=warmup_s + seconds + 60))
    proc.join(10)
    return value


def _lone_http(port: int, seconds: float, out: Any) -> None:
    import http.client

    body = json.dumps(
        {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1.0, 2.0, 3.0, 4.0]}]}
    )
    conn = http.client.HTTPConnection("127.0.0.1", port)
    times = []
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop:
        t0 = time.perf_counter()
        conn.request("POST", "/v2/models/echo/infer", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        assert r.status == 200
        times.append(time.perf_counter() - t0)
    out.put(statistics.median(times[len(times) // 10 :]) * 1000)


def _lone_direct(addresses: list[str], seconds: float, out: Any) -> None:
    """Lone requests straight to the brokers over ZeroMQ, one DEALER each, taken in turn: the
    same spread over the same processes as a gateway over them gives, without the gateway."""
    import msgpack

    ctx = zmq.Context()
    socks = []
    for address in addresses:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(address)
        socks.append(sock)
    body = msgpack.packb({"id": 1, "model": "echo", "input": [1.0, 2.0, 3.0, 4.0]})
    times = []
    stop = time.perf_counter() + seconds
    turn = 0
    while time.perf_counter() < stop:
        sock = socks[turn % len(socks)]
        turn += 1
        t0 = time.perf_counter()
        sock.send_multipart([b"", body])
        sock.recv_multipart()
        times.append(time.perf_counter() - t0)
    for sock in socks:
        sock.close(0)
    ctx.term()
    out.put(statistics.median(times[len(times) // 10 :]) * 1000)


def in_process(target: Any, *args: Any) -> float:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, out))
    proc.start()
    value = float(out.get(timeout=120))
    proc.join(10)
    return value


def throughput(counts: list[int], concurrency: int, warmup_s: float, seconds: float) -> float:
    with cells(counts) as brokers, gateway(brokers) as port:
        return rows_per_s(port, concurrency, warmup_s, seconds)


def latency(rounds: int, burst_s: float, baseline: Path | None) -> dict[str, float]:
    """Median over `rounds` of each path's p50 (ms) in bursts of `burst_s`, the paths taken
    in turn (a same-run A/B: the machine's drift hits all alike): lone requests through a
    gateway over 1 echo cell (`one`), through one over 4, the first the same (`four`),
    through `baseline`'s gateway over that first cell (`base`, when given), straight to
    that cell (`direct`), and straight to the 4 in turn (`direct_four`: what reaching 4
    broker processes, 3 of them idle between requests, costs without a gateway)."""
    with contextlib.ExitStack() as stack:
        procs = stack.enter_context(cells([1] * 4, model="echo"))
        ports = {"one": stack.enter_context(gateway(procs[:1])), "four": stack.enter_context(gateway(procs))}
        if baseline is not None:
            ports["base"] = stack.enter_context(gateway(procs[:1], baseline))
        for port in ports.values():
            in_process(_lone_http, port, 1.0)  # warm each path up
        runs: dict[str, list[float]] = {name: [] for name in [*ports, "direct", "direct_four"]}
        for _ in range(rounds):
            for name, port in ports.items():
                runs[name].append(in_process(_lone_http, port, burst_s))
            runs["direct"].append(in_process(_lone_direct, [procs[0].frontend], burst_s))
            runs["direct_four"].append(in_process(_lone_direct, [p.frontend for p in procs], burst_s))
    return {name: statistics.median(values) for name, values in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs (indicative only)")
    parser.add_argument("--concurrency", type=int, default=64, help="requests of 8 rows in flight")
    parser.add_argument(
        "--baseline-source",
        type=Path,
        default=None,
        help="another source tree (git archive main | tar -x -C DIR) whose gateway over 1 broker "
        "is measured in the same turns",
    )
    parser.add_argument("--only-latency", action="store_true", help="the latency rows alone")
    args = parser.parse_args()
    handle_sigterm()
    if not many_brokers():
        sys.exit("benchmarks/cluster.py needs the gateway over many brokers (issue 31 item 1)")
    warmup_s, seconds = (1.0, 3.0) if args.quick else (2.0, 8.0)
    c = args.concurrency
    one = two = small = big = both = math.nan
    if not args.only_latency:
        one = throughput([2], c, warmup_s, seconds)
        two = throughput([2, 2], c, warmup_s, seconds)
        small = throughput([1], c, warmup_s, seconds)
        big = throughput([3], c, warmup_s, seconds)
        both = throughput([1, 3], c, warmup_s, seconds)
    rounds = 3 if args.quick else 7
    p50 = latency(rounds, 1.0 if args.quick else 2.0, args.baseline_source)
    p50_1, p50_4, direct, direct_4 = p50["one"], p50["four"], p50["direct"], p50["direct_four"]
    # What the gateway adds: its p50 over the brokers less the same brokers' p50 reached
    # straight (over 4, in turn as the gateway spreads lone requests).
    added_1, added_4 = p50_1 - direct, p50_4 - direct_4
    measured = (
        f"{added_4:.3f} - {added_1:.3f} ms (p50 {p50_4:.3f} and {p50_1:.3f}, "
        f"direct over 4 {direct_4:.3f} and over 1 {direct:.3f})"
    )
    rows = [
        [
            "two equal cells (2 + 2 workers) / one",
            f"{two:.0f} / {one:.0f} rows/s",
            f"{two / one:.2f}",
            f">= {EQUAL_TARGET}",
        ],
        [
            "unequal cells (1 + 3 workers) / sum alone",
            f"{both:.0f} / ({small:.0f} + {big:.0f}) rows/s",
            f"{both / (small + big):.2f}",
            f">= {UNEQUAL_TARGET}",
        ],
        [
            "gateway's added p50, 4 brokers - 1",
            measured,
            f"{added_4 - added_1:+.3f} ms",
            f"<= {ADDED_P50_SLACK_MS} ms",
        ],
    ]
    if "base" in p50:
        base = p50["base"] - direct
        rows.append(
            [
                "gateway's added p50, 1 broker - the baseline's",
                f"{added_1:.3f} - {base:.3f} ms (baseline {args.baseline_source})",
                f"{added_1 - base:+.3f} ms",
                "stays where it is",
            ]
        )
    table = md_table(["case", "measured", "ratio", "target"], rows)
    print(table)
    data = {
        "rows_per_s": {"one": one, "two": two, "one_worker": small, "three_workers": big, "unequal": both},
        "p50_ms": {**p50, "rounds": rounds},
        "concurrency": c,
        "rows_per_request": ROWS,
    }
    if not args.only_latency:  # a partial run does not replace the published one
        write_results("cluster", "Cells behind one gateway", table, data, args.quick)


if __name__ == "__main__":
    main()
