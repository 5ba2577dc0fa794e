"""Large bodies: the broker with one echo worker against a minimal zero-copy forwarder.

For each body size (4 KiB, 64 KiB and 1 MiB by default), three servers answer the same
closed-loop load (--concurrency requests in flight, each a bin `input` of that size),
loaded in turn (A B C A B C ... for --runs rounds, so drift on a noisy machine hits all):

- the floor (benchmarks/forwarder.py): a pyzmq ROUTER -> ROUTER forwarder that never
  copies a frame, with one DEALER worker that decodes each body and encodes a
  protocol-shaped reply, one request at a time;
- the same floor with glibc's allocator set as batcher sets its own (batcher.transport.allocator:
  freed buffers reused, not unmapped), so that the comparison is of the code alone;
- `batcher serve --model echo --workers 1 --max-batch-size 8 --max-wait-ms 1`.

Reported per size: broker / floor throughput for each floor, taken within each round,
then the median. The target (>= 0.8 at 1 MiB) is judged against the stricter floor,
the tuned one.

    python benchmarks/large_bodies.py            # 5 rounds
    python benchmarks/large_bodies.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from typing import Any

from common import (
    FORWARDER,
    EchoLoop,
    client_note,
    closed_loop,
    handle_sigterm,
    md_table,
    median_summary,
    running_serve,
    serve_args,
    summarize,
    write_results,
)

from batcher.serve.launcher import free_tcp_address
from batcher.transport.allocator import MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES

TARGET_RATIO_1MIB = 0.8
#: The allocator settings of batcher.transport.allocator, for the forwarder's processes.
TUNED_MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES),
    "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD_BYTES),
}
SIZES = (4096, 65536, 1048576)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 short rounds")
    p.add_argument("--runs", type=int, default=None, help="rounds A B A B ... (5; quick 2)")
    p.add_argument("--duration", type=float, default=None, help="measured seconds per load (3; quick 1)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up seconds per load (0.5; quick 0.3)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated body sizes in bytes")
    args = p.parse_args(argv)
    args.runs = args.runs or (2 if args.quick else 5)
    args.duration = args.duration or (1.0 if args.quick else 3.0)
    args.warmup = args.warmup if args.warmup is not None else (0.3 if args.quick else 0.5)
    args.sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    return args


def main(argv: list[str] | None = None) -> None:
    handle_sigterm()
    args = parse_args(argv)
    servers = ("forwarder", "tuned forwarder", "broker")
    # rounds[size][server] -> one summary per round
    rounds: dict[int, dict[str, list[dict[str, Any]]]] = {s: {n: [] for n in servers} for s in args.sizes}
    with contextlib.ExitStack() as stack:
        forwarder = stack.enter_context(EchoLoop(script=FORWARDER, extra=[free_tcp_address()]))
        tuned = stack.enter_context(EchoLoop(script=FORWARDER, extra=[free_tcp_address()], env=TUNED_MALLOC))
        serve = stack.enter_context(
            running_serve(serve_args(workers=1, model="echo", max_batch_size=8, max_wait_ms=1.0), 1)
        )
        addresses = {
            "forwarder": forwarder.frontend,
            "tuned forwarder": tuned.frontend,
            "broker": serve.frontend,
        }
        for i in range(args.runs):
            for size in args.sizes:
                for name in servers:
                    result = summarize(
                        closed_loop(
                            addresses[name], args.concurrency, args.duration, args.warmup, payload_bytes=size
                        )
                    )
                    rounds[size][name].append(result)
                    print(
                        f"round {i + 1}/{args.runs} {size} B {name}: {result['throughput_rps']:.0f} req/s "
                        f"(client {result['client_cpu_share']:.0%} of a core)",
                        flush=True,
                    )
    rows = []
    for size in args.sizes:
        fwd, tfwd, brk = (rounds[size][name] for name in servers)
        ratios = [b["throughput_rps"] / f["throughput_rps"] for b, f in zip(brk, fwd, strict=True)]
        tuned_ratios = [b["throughput_rps"] / f["throughput_rps"] for b, f in zip(brk, tfwd, strict=True)]
        rows.append(
            {
                "size_bytes": size,
                "forwarder": median_summary(fwd),
                "tuned forwarder": median_summary(tfwd),
                "broker": median_summary(brk),
                "ratio": statistics.median(ratios),
                "per_round_ratio": ratios,
                "tuned_ratio": statistics.median(tuned_ratios),
                "per_round_tuned_ratio": tuned_ratios,
            }
        )

    def verdict(row: dict[str, Any]) -> str:
        if row["size_bytes"] != 1048576:
            return "-"
        return "met" if row["tuned_ratio"] >= TARGET_RATIO_1MIB else "MISSED"

    table = md_table(
        ["body", "forwarder req/s", "tuned forwarder req/s", "broker req/s", "ratio to forwarder",
         "ratio to tuned forwarder", "per-round ratios (tuned)", "broker mean batch", "broker p50 ms",
         "target (1 MiB >= 0.8 of tuned)"],
        [
            [
                f"{r['size_bytes']:,} B", r["forwarder"]["throughput_rps"],
                r["tuned forwarder"]["throughput_rps"], r["broker"]["throughput_rps"],
                r["ratio"], r["tuned_ratio"],
                " ".join(f"{x:.2f}" for x in r["per_round_tuned_ratio"]),
                r["broker"]["mean_batch_size"] or "-", r["broker"]["p50_ms"], verdict(r),
            ]
            for r in rows
        ],
    )  # fmt: skip
    notes = sorted(
        {f"{r['size_bytes']} B {k}: {n}" for r in rows for k in servers for n in [client_note(r[k])] if n}
    )
    body = (
        f"Closed loop, {args.concurrency} in flight, each request a bin `input` of the given size. "
        f"{args.runs} interleaved round(s) of {args.duration:g} s after {args.warmup:g} s warm-up per load; "
        "the ratio is taken within each round, then the median.\n\n"
        "- forwarder: benchmarks/forwarder.py, zero-copy ROUTER -> ROUTER, one DEALER worker decoding "
        "each body and encoding a protocol-shaped reply\n"
        "- tuned forwarder: the same, with glibc's allocator set as batcher sets its own "
        f"(MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD_BYTES}, MALLOC_TRIM_THRESHOLD_={TRIM_THRESHOLD_BYTES})\n"
        "- broker: `batcher serve --model echo --workers 1 --max-batch-size 8 --max-wait-ms 1`\n\n"
        f"{table}\n"
    )
    if notes:
        body += "\nThe load generator was busy (so a ceiling may be the client's): " + "; ".join(notes) + "\n"
    write_results(
        "large_bodies",
        "Large bodies: broker against a zero-copy forwarder",
        body,
        {"settings": vars(args), "rows": rows},
        args.quick,
    )


if __name__ == "__main__":
    main()
