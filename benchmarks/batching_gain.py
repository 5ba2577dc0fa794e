"""Batching gain: the same sim load with batching off (max batch 1) and on (max batch 32).

4 sim workers, a closed loop of 256 requests in flight. Both servers are up at once
and loaded in turn (off, on, off, on, ...), and the on/off throughput ratio is taken
within each round, then the median. The sim model's arithmetic predicts
(32 / t(32)) / (1 / t(1)) = 7.2x; Triton's documentation reports 3.7x for its example.

    python benchmarks/batching_gain.py
    python benchmarks/batching_gain.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from typing import Any

from common import (
    client_note,
    closed_loop,
    default_policy_note,
    handle_sigterm,
    md_table,
    median_summary,
    running_serve,
    serve_args,
    summarize,
    theoretical_capacity,
    write_results,
)

TRITON_REPORTED_GAIN = 3.7


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one short round")
    p.add_argument("--runs", type=int, default=None, help="rounds off/on (3; quick 1)")
    p.add_argument("--duration", type=float, default=None, help="measured seconds per load (4; quick 2)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up seconds per load (1; quick 0.5)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--max-batch-size", type=int, default=32, help="max batch with batching on")
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    p.add_argument("--processes", type=int, default=1, help="load generator processes")
    args = p.parse_args(argv)
    args.runs = args.runs or (1 if args.quick else 3)
    args.duration = args.duration or (2.0 if args.quick else 4.0)
    args.warmup = args.warmup if args.warmup is not None else (0.5 if args.quick else 1.0)
    return args


def main(argv: list[str] | None = None) -> None:
    handle_sigterm()
    args = parse_args(argv)
    w = args.workers
    sizes = {"off": 1, "on": args.max_batch_size}
    rounds: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    with contextlib.ExitStack() as stack:
        addresses = {
            name: stack.enter_context(
                running_serve(serve_args(workers=w, max_batch_size=b, max_wait_ms=args.max_wait_ms), w)
            ).frontend
            for name, b in sizes.items()
        }
        for i in range(args.runs):
            for name in ("off", "on"):
                res = summarize(
                    closed_loop(
                        addresses[name],
                        args.concurrency,
                        args.duration,
                        args.warmup,
                        processes=args.processes,
                    )
                )
                rounds[name].append(res)
                print(
                    f"round {i + 1}/{args.runs} batching {name}: {res['throughput_rps']:.0f} req/s, "
                    f"p50 {res['p50_ms']:.0f} ms, p99 {res['p99_ms']:.0f} ms, "
                    f"mean batch {res['mean_batch_size']:.1f}",
                    flush=True,
                )
    gains = [
        on["throughput_rps"] / off["throughput_rps"]
        for on, off in zip(rounds["on"], rounds["off"], strict=True)
    ]
    gain = statistics.median(gains)
    theory = {name: theoretical_capacity(w, b) for name, b in sizes.items()}
    theory_gain = theory["on"] / theory["off"]
    med = {name: median_summary(rs) for name, rs in rounds.items()}
    table = md_table(
        ["batching", "max batch", "theoretical req/s", "measured req/s", "of theoretical", "p50 ms", "p99 ms",
         "mean batch", "client"],
        [
            [
                name, sizes[name], theory[name], med[name]["throughput_rps"],
                med[name]["throughput_rps"] / theory[name], med[name]["p50_ms"], med[name]["p99_ms"],
                med[name]["mean_batch_size"], client_note(med[name]) or "kept up",
            ]
            for name in ("off", "on")
        ],
    )  # fmt: skip
    body = (
        f"sim model, {w} workers, closed loop with {args.concurrency} in flight from {args.processes} load "
        f"process(es), max-wait-ms {args.max_wait_ms:g}; {args.runs} interleaved round(s) of "
        f"{args.duration:g} s after {args.warmup:g} s warm-up.{default_policy_note()}\n\n"
        f"{table}\n\n"
        f"**Batching gain (on / off throughput, median of per-round ratios): {gain:.2f}x** "
        f"(per round: {', '.join(f'{g:.2f}' for g in gains)}); the sim model's arithmetic predicts "
        f"{theory_gain:.2f}x; Triton reports {TRITON_REPORTED_GAIN}x for its example.\n"
    )
    write_results(
        "batching_gain",
        "Batching gain: max batch 32 against batching off",
        body,
        {
            "settings": vars(args),
            "gain": gain,
            "per_round_gain": gains,
            "theoretical_gain": theory_gain,
            "theoretical_rps": theory,
            "median": med,
            "rounds": rounds,
        },
        args.quick,
    )


if __name__ == "__main__":
    main()
