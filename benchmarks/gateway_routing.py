"""Routing over unequal brokers: the power of two choices on outstanding rows against round robin.

Two `batcher serve` brokers of the same `sim` model, one slow (1 worker) and one fast
(3 workers), behind one `batcher gateway --connect A --connect B --routing R`, for R in
p2c and round-robin (each with fresh brokers and gateway). --clients HTTP clients (threads,
keep-alive) each POST one-row v2 JSON requests, one after another, for --seconds after a
one-second warm-up. Reported: rows/s, p50 and p99 latency, and the fast broker's share of
rows (its own stats), against the capacity of the two brokers (sim's time per batch).

    python benchmarks/gateway_routing.py [--quick] [--seconds 8] [--clients 48]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from common import handle_sigterm, md_table, running_serve, serve_args, wait_http_200, write_results

from batcher.client.sync import Client
from batcher.serve.launcher import free_tcp_address

NAME = "gateway_routing"
TITLE = "The gateway over a slow and a fast broker: p2c against round robin"
BASE_MS, PER_ITEM_MS, MAX_BATCH = 40.0, 2.0, 8


def capacity_rows_s(workers: int) -> float:
    """What `workers` sim workers serve at full batches."""
    return workers * MAX_BATCH / ((BASE_MS + PER_ITEM_MS * MAX_BATCH) / 1000.0)


@contextlib.contextmanager
def gateway(addresses: list[str], routing: str) -> Iterator[int]:
    port = int(free_tcp_address().rsplit(":", 1)[1])
    cmd = [sys.executable, "-m", "batcher", "gateway", "--http-port", str(port), "--routing", routing]
    for address in addresses:
        cmd += ["--connect", address]
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        wait_http_200(f"http://127.0.0.1:{port}/v2/health/ready")
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def drive(port: int, clients: int, seconds: float) -> list[float]:
    """Every request's latency (s) in the measured window; a failure raises."""
    stop = threading.Event()
    measuring = threading.Event()
    latencies: list[float] = []
    failures: list[str] = []
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]})

    def run() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        while not stop.is_set():
            t0 = time.perf_counter()
            conn.request("POST", "/v2/models/sim/infer", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                failures.append(str(response.status))
            elif measuring.is_set():
                latencies.append(time.perf_counter() - t0)
        conn.close()

    threads = [threading.Thread(target=run, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # the warm-up
    measuring.set()
    time.sleep(seconds)  # the measured window
    measuring.clear()
    stop.set()
    for t in threads:
        t.join(30)
    if failures:
        raise RuntimeError(f"{len(failures)} requests failed: {failures[:5]}")
    return latencies


def served_rows(frontend: str) -> int:
    """The rows the broker at `frontend` was sent (its `stats`)."""
    with Client(frontend, timeout_s=5.0) as client:
        return int(client.control("stats")["models"]["sim"]["requests"])


def one_run(routing: str, clients: int, seconds: float) -> dict[str, Any]:
    sim = ["--sim-base-ms", repr(BASE_MS), "--sim-per-item-ms", repr(PER_ITEM_MS)]
    slow_args = serve_args(workers=1, max_batch_size=MAX_BATCH, max_wait_ms=2, extra=sim)
    fast_args = serve_args(workers=3, max_batch_size=MAX_BATCH, max_wait_ms=2, extra=sim)
    with contextlib.ExitStack() as stack:
        slow = stack.enter_context(running_serve(slow_args, 1))
        fast = stack.enter_context(running_serve(fast_args, 3))
        port = stack.enter_context(gateway([slow.frontend, fast.frontend], routing))
        latencies = drive(port, clients, seconds)
        rows = {name: served_rows(sp.frontend) for name, sp in (("slow", slow), ("fast", fast))}
    latencies.sort()
    return {
        "routing": routing,
        "rows_per_s": len(latencies) / seconds,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))],
        "fast_share": rows["fast"] / max(1, rows["fast"] + rows["slow"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 s windows")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=48)
    args = parser.parse_args()
    handle_sigterm()
    seconds = 3.0 if args.quick else args.seconds
    runs = [one_run(r, args.clients, seconds) for r in ("p2c", "round-robin")]
    capacity = capacity_rows_s(1) + capacity_rows_s(3)
    p2c, rr = runs
    table = md_table(
        ["routing", "rows/s", "of capacity", "p50 ms", "p99 ms", "fast broker's share"],
        [
            [
                r["routing"],
                f"{r['rows_per_s']:.0f}",
                f"{r['rows_per_s'] / capacity:.2f}",
                f"{r['p50_ms']:.1f}",
                f"{r['p99_ms']:.1f}",
                f"{r['fast_share']:.2f}",
            ]
            for r in runs
        ],
    )
    body = (
        f"A slow broker (1 sim worker) and a fast one (3), {MAX_BATCH}-row batches of "
        f"{BASE_MS:g} + {PER_ITEM_MS:g} n ms: capacity {capacity:.0f} rows/s (the fast one 0.75 of it); "
        f"{args.clients} closed-loop HTTP clients, one row a request, {seconds:g} s.\n\n{table}\n\n"
        f"p2c / round robin: rows/s x{p2c['rows_per_s'] / rr['rows_per_s']:.2f}, "
        f"p99 x{p2c['p99_ms'] / rr['p99_ms']:.2f}.\n"
    )
    write_results(NAME, TITLE, body, {"runs": runs, "capacity_rows_s": capacity}, args.quick)
    print(body)


if __name__ == "__main__":
    main()
