"""Capacity: saturating closed-loop throughput of the sim model against its theoretical ceiling.

For W workers and max batch B, the ceiling is W * B / t(B) with t(B) = 20 + 2.5 * B ms:
every worker always busy with a full batch. A closed loop of 2 * W * B requests in
flight keeps a full batch waiting for every worker; the ratio measured / ceiling is
what the broker delivers of the hardware (here: of the simulated GPUs).

    python benchmarks/capacity.py            # ~4 s per run, 3 runs per configuration
    python benchmarks/capacity.py --quick    # short single runs, to check it works
"""

from __future__ import annotations

import argparse
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
    sim_batch_ms,
    summarize,
    theoretical_capacity,
    write_results,
)

from batcher.cli.bench import CLIENT_BUSY_LIMIT

#: The most load processes a run is given when one cannot keep up (the machine has 2 cores).
MAX_PROCESSES = 3


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short single runs (1.5 s + 0.5 s warm-up)")
    p.add_argument("--runs", type=int, default=None, help="runs per configuration, median (3; quick 1)")
    p.add_argument("--duration", type=float, default=None, help="measured seconds per run (4; quick 1.5)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up seconds per run (1; quick 0.5)")
    p.add_argument("--workers", type=int_list, default=[1, 2, 4, 8], help="comma-separated W values")
    p.add_argument("--batch-sizes", type=int_list, default=[8, 32], help="comma-separated B values")
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    p.add_argument("--concurrency-factor", type=float, default=2.0, help="concurrency = factor * W * B")
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        help="load generator processes to start with; a run whose load process saturated its core "
        f"is redone with one more (up to {MAX_PROCESSES})",
    )
    args = p.parse_args(argv)
    args.runs = args.runs or (1 if args.quick else 3)
    args.duration = args.duration or (1.5 if args.quick else 4.0)
    args.warmup = args.warmup if args.warmup is not None else (0.5 if args.quick else 1.0)
    return args


def measure(args: argparse.Namespace, workers: int, batch: int) -> dict[str, Any]:
    concurrency = max(1, round(args.concurrency_factor * workers * batch))
    srv_args = serve_args(workers=workers, max_batch_size=batch, max_wait_ms=args.max_wait_ms)
    runs = []
    processes = args.processes
    with running_serve(srv_args, workers) as srv:
        for _ in range(args.runs):
            for _attempt in range(MAX_PROCESSES):  # bounded: one more process per attempt
                run = summarize(
                    closed_loop(srv.frontend, concurrency, args.duration, args.warmup, processes=processes)
                )
                if run["client_cpu_share"] <= CLIENT_BUSY_LIMIT or processes >= MAX_PROCESSES:
                    break
                processes += 1
                print(f"load process saturated ({run['client_cpu_share']:.0%}); retrying with {processes}")
            run["processes"] = processes
            runs.append(run)
    med = median_summary(runs)
    theory = theoretical_capacity(workers, batch)
    row = {
        "workers": workers,
        "max_batch_size": batch,
        "max_wait_ms": args.max_wait_ms,
        "concurrency": concurrency,
        "processes": processes,
        "t_B_ms": sim_batch_ms(batch),
        "theoretical_rps": theory,
        "ratio": med["throughput_rps"] / theory,
        "median": med,
        "runs": runs,
    }
    print(
        f"W={workers} B={batch} c={concurrency}: {med['throughput_rps']:.0f} req/s "
        f"of {theory:.0f} ({row['ratio']:.2f}), p50 {med['p50_ms']:.1f} ms, p99 {med['p99_ms']:.1f} ms, "
        f"mean batch {med['mean_batch_size']:.1f}",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> None:
    handle_sigterm()
    args = parse_args(argv)
    rows = [measure(args, w, b) for b in args.batch_sizes for w in args.workers]
    table = md_table(
        ["W", "B", "concurrency", "load procs", "theoretical req/s", "measured req/s", "ratio", "p50 ms",
         "p99 ms", "mean batch", "errors", "client"],
        [
            [
                r["workers"], r["max_batch_size"], r["concurrency"], r["processes"], r["theoretical_rps"],
                r["median"]["throughput_rps"], r["ratio"], r["median"]["p50_ms"], r["median"]["p99_ms"],
                r["median"]["mean_batch_size"], r["median"]["errors"] + r["median"]["lost"],
                client_note(r["median"]) or "kept up",
            ]
            for r in rows
        ],
    )  # fmt: skip
    body = (
        f"sim model, t(B) = 20 + 2.5 * B ms, max-wait-ms {args.max_wait_ms:g}; closed loop with "
        f"{args.concurrency_factor:g} * W * B requests in flight from {args.processes} load "
        "process(es) (more when one saturated its core: see load procs); "
        f"median of {args.runs} run(s) of {args.duration:g} s after {args.warmup:g} s warm-up. "
        "Theoretical = W * B / t(B); ratio = measured / theoretical." + default_policy_note() + "\n\n" + table
    )
    write_results(
        "capacity",
        "Capacity: throughput against W * B / t(B)",
        body,
        {"settings": vars(args), "rows": rows},
        args.quick,
    )


if __name__ == "__main__":
    main()
