"""Memory under sustained saturation: the broker's RSS must stay flat while it is overloaded.

One fast `sim` worker (2 ms a batch of up to 32) is kept saturated by a client holding
1,000 requests of 1 KB in flight, so the queue always holds full batches and every
worker slot is busy: the state in which v1 kept every body it ever accepted (hardening
issue, defect 1). After a warm-up, the broker's RSS is sampled every second; the target
is growth < 10 MB from the end of the warm-up to the end of the run.

Mixes: `plain` (priority 0, no deadline: the FIFO lane) and `mixed` (priorities 0-2 and
deadlines from 20 ms to 10 s, some of which pass in the queue: the heap lane, the
deadline heap and expiry).

    python benchmarks/saturation_memory.py                  # 60 s per mix, the issue's target
    python benchmarks/saturation_memory.py --duration-s 10 --warmup-s 3 --json out.json

Exits 1 if any mix grew by the limit or more. Only 127.0.0.1; every loop is bounded by the
run's duration.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from typing import Any

import msgpack
import psutil
import zmq

from batcher.serve.launcher import ServeProcess

IN_FLIGHT = 1000
PAYLOAD_BYTES = 1000
GROWTH_LIMIT_MB = 10.0
SERVE_ARGS = ["--workers", "1", "--model", "sim", "--max-batch-size", "32"]
SERVE_ARGS += ["--sim-base-ms", "2", "--sim-per-item-ms", "0", "--max-queue", "100000"]


def request_body(rng: random.Random, mix: str, req_id: int) -> bytes:
    body: dict[str, Any] = {"id": req_id, "input": "x" * PAYLOAD_BYTES}
    if mix == "mixed":
        body["priority"] = rng.choice((0, 0, 1, 2))
        if rng.random() < 0.7:
            body["timeout_ms"] = rng.choice((20, 200, 10_000))
    return msgpack.packb(body, use_bin_type=True)


def saturate(frontend: str, mix: str, duration_s: float, warmup_s: float, pid: int) -> dict[str, Any]:
    """Hold IN_FLIGHT requests in flight for warmup_s + duration_s; sample RSS each second."""
    rng = random.Random(7)
    proc = psutil.Process(pid)
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(frontend)
    outcomes: Counter[str] = Counter()
    samples: list[tuple[float, float]] = []  # (seconds since start, RSS MB)
    in_flight = sent = 0
    start = time.monotonic()
    end = start + warmup_s + duration_s
    next_sample = start
    try:
        while (now := time.monotonic()) < end:
            while in_flight < IN_FLIGHT:
                sock.send_multipart([b"", request_body(rng, mix, sent)])
                sent += 1
                in_flight += 1
            while sock.poll(0):
                reply = msgpack.unpackb(sock.recv_multipart()[-1], raw=False)
                outcomes["ok" if reply["ok"] else reply["error"]["code"]] += 1
                in_flight -= 1
            sock.poll(1)
            if now >= next_sample:
                samples.append((now - start, proc.memory_info().rss / 2**20))
                next_sample += 1.0
        drain_end = time.monotonic() + 30.0
        while in_flight and sock.poll(max(1, int((drain_end - time.monotonic()) * 1000))):
            sock.recv_multipart()
            in_flight -= 1
    finally:
        ctx.destroy(linger=0)
    after_warmup = [mb for t, mb in samples if t >= warmup_s]
    return {
        "mix": mix,
        "requests": sent,
        "outcomes": dict(outcomes),
        "unanswered_after_drain": in_flight,
        "rss_mb_at_warmup_end": after_warmup[0],
        "rss_mb_at_end": after_warmup[-1],
        "rss_mb_max_after_warmup": max(after_warmup),
        "growth_mb": after_warmup[-1] - after_warmup[0],
        "samples": samples,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration-s", type=float, default=60.0, help="measured seconds per mix")
    parser.add_argument("--warmup-s", type=float, default=5.0, help="seconds of load before measuring")
    parser.add_argument("--mix", default="plain,mixed", help="comma-separated: plain, mixed")
    parser.add_argument("--json", dest="json_path", default=None, help="write the results here")
    args = parser.parse_args()
    if not 1 <= args.duration_s <= 3600 or not 1 <= args.warmup_s <= 600:
        parser.error("--duration-s must be in [1, 3600] and --warmup-s in [1, 600]")
    results = []
    for mix in args.mix.split(","):
        with ServeProcess(SERVE_ARGS) as serve:
            serve.wait_ready(1)
            assert serve.process is not None
            result = saturate(serve.frontend, mix, args.duration_s, args.warmup_s, serve.process.pid)
        results.append(result)
        verdict = "met" if result["growth_mb"] < GROWTH_LIMIT_MB else "MISSED"
        print(
            f"{mix:6s} {result['requests']:8d} requests  RSS {result['rss_mb_at_warmup_end']:.1f} -> "
            f"{result['rss_mb_at_end']:.1f} MB (max {result['rss_mb_max_after_warmup']:.1f}) over "
            f"{args.duration_s:.0f}s: growth {result['growth_mb']:+.1f} MB, target < {GROWTH_LIMIT_MB:.0f} "
            f"({verdict}); outcomes {result['outcomes']}",
            flush=True,
        )
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"duration_s": args.duration_s, "warmup_s": args.warmup_s, "results": results}, f)
    return 0 if all(r["growth_mb"] < GROWTH_LIMIT_MB for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
