"""The response cache (issue 33, item 6): a hit's round trip against the broker's fastest
refusal, and the served rate of `sim` at saturation with half the requests hits.

1. One client, one request at a time, to one `serve --model sim --cache-model sim`:
   rounds of N cache hits, then N requests for an unknown model (`unknown_model`, refused
   at once by the broker), in turns; the medians' difference (target: within 0.05 ms).
2. `sim` at saturation (64 in flight, 2 workers): all misses (every input new), then half
   hits (every other input one of 32 hot inputs, warmed first); the ratio of served rates
   (target: about 2).

    python benchmarks/cache.py
    python benchmarks/cache.py --quick
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections import deque
from typing import Any

from common import md_table, write_results

from batcher.client import Client
from batcher.serve.launcher import ServeProcess


def round_trips(client: Client, n: int, **kwargs: Any) -> list[float]:
    """n sequential round trips (ms) of `client.request_reply("hot", **kwargs)`."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.request_reply("hot", **kwargs)
        out.append((time.perf_counter() - t0) * 1000.0)
    return out


def served_rate(client: Client, inputs: Any, duration_s: float, window: int = 64) -> float:
    """Replies per second with `window` requests in flight for `duration_s`."""
    inflight: deque[Any] = deque(client.submit(next(inputs), model="sim") for _ in range(window))
    done, end = 0, time.monotonic() + duration_s
    while time.monotonic() < end:
        inflight.popleft().result()
        done += 1
        inflight.append(client.submit(next(inputs), model="sim"))
    for p in inflight:
        p.result()
    return done / duration_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rounds, n, duration_s = (3, 300, 3.0) if args.quick else (5, 1000, 8.0)
    serve_args = ["--model", "sim", "--workers", "2", "--cache-bytes", "10000000", "--cache-model", "sim"]
    with ServeProcess(serve_args) as serve:
        serve.wait_ready(2)
        with Client(serve.frontend, timeout_s=30) as client:
            client.request("hot", model="sim")
            diffs = []
            for _ in range(rounds):
                hit = statistics.median(round_trips(client, n, model="sim"))
                refusal = statistics.median(round_trips(client, n, model="no-such-model"))
                diffs.append(hit - refusal)
                print(
                    f"hit p50 {hit:.4f} ms, unknown_model p50 {refusal:.4f} ms, diff {hit - refusal:+.4f} ms"
                )
            print(f"median diff {statistics.median(diffs):+.4f} ms (target: within 0.05 ms)")
            fresh = (f"new {i}" for i in itertools.count())
            misses = served_rate(client, fresh, duration_s)
            hot = [f"hot {i}" for i in range(32)]
            client.request_many(hot, model="sim")
            mixed = (x for i in itertools.count() for x in (hot[i % 32], f"fresh {i}"))
            half = served_rate(client, mixed, duration_s)
            stats = client.control("stats")["cache"]["models"]["sim"]
            print(f"sim at saturation: all misses {misses:.0f}/s, half hits {half:.0f}/s, "
                  f"ratio {half / misses:.2f} (target: about 2); cache {stats}")  # fmt: skip
    rows = [
        [
            f"cache hit p50 - `unknown_model` refusal p50, one at a time, {rounds} rounds of {n} in turns",
            f"median {statistics.median(diffs):+.3f} ms (rounds {', '.join(f'{d:+.3f}' for d in diffs)})",
            "within 0.05 ms",
        ],
        [
            "`sim` at saturation (64 in flight): half hits / all misses",
            f"{half:.0f}/s / {misses:.0f}/s = {half / misses:.2f}x",
            "about 2x",
        ],
    ]
    table = md_table(["measure", "result", "target"], rows)
    print(table)
    data = {"hit_minus_refusal_ms": diffs, "served_per_s": {"all_misses": misses, "half_hits": half}}
    body = f"`serve {' '.join(serve_args)}`.\n\n{table}"
    write_results("cache", "Response cache", body, data, args.quick)


if __name__ == "__main__":
    main()
