"""Overhead: the broker against the plain pyzmq echo loop, the ceiling for one Python process.

Five kinds of server answer the same requests, all up at once and loaded in turn
(A B C, then B C A, ... for --runs rounds, so drift on a noisy machine hits them alike and
no server always runs right after another):

- the echo loop (benchmarks/echo_loop.py): decode, encode, reply; nothing else; and a
  second one ("echo loop, again"), whose ratio to the first is what two identical
  servers differ by in the run: its resolution;
- the minimal three-process chain (benchmarks/forwarder.py): a zero-copy forwarder and
  one DEALER echo worker, no batching: what the hops of any client -> broker -> worker
  design cost before any broker logic;
- the batching floor (benchmarks/batching_floor.py): a forwarder that batches what waits
  (up to --max-batch-size, 2 batches held by its worker) with one frame each way and no
  logic: what a broker of batcher's design costs before its own work (reading headers,
  ordering queues, admission, counts and metrics); and the same forwarder speaking the
  backend protocol to batcher's own echo worker (what the broker's scheduling costs is
  what separates the broker's row from this one);
- the broker with one `echo` worker, batching on (max-batch-size 32, for each
  --max-wait-ms given: 0 dispatches a lone request at once, 1 waits up to 1 ms);
- the broker with one `echo` worker, batching off (max-batch-size 1).

For each: closed-loop throughput at concurrency 64, and the single-request round trip
(closed loop at concurrency 1: median and p99). Reported per round and as medians:
broker / echo-loop throughput (the table's target, 1.0, is the moonshot; issue 30's bar is
0.85) and broker - echo-loop median round trip (target < 0.15 ms), each taken within a
round, then the median over the rounds.

With --baseline DIR (a source tree, e.g. v1: `git archive 26ecab0 | tar -x -C /tmp/v1`;
repeatable), the batching broker at the first --max-wait-ms runs from that tree too, in
the same rounds: a before/after (or against v1) in one run.

    python benchmarks/overhead.py            # 5 rounds
    python benchmarks/overhead.py --quick
    python benchmarks/overhead.py --max-wait-ms 0 --baseline /tmp/v1 --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import (
    BENCH_DIR,
    FORWARDER,
    EchoLoop,
    client_note,
    closed_loop,
    default_policy_note,
    handle_sigterm,
    md_table,
    median_summary,
    running_serve,
    serve_args,
    summarize,
    write_results,
)

from batcher.serve.launcher import free_tcp_address

TARGET_RATIO = 1.0
BATCHING_FLOOR = BENCH_DIR / "batching_floor.py"
TARGET_ADDED_MS = 0.15


@dataclass
class Config:
    """One server under test and how it was started."""

    name: str
    settings: str
    serve: list[str] | None  # `batcher serve` arguments; None for the echo loop or a floor script
    floor: Path | None = None  # a floor script speaking the frontend protocol (FRONTEND BACKEND ...)
    floor_args: list[str] = field(default_factory=list)  # its arguments after the two addresses
    source: Path | None = None  # another source tree to run `serve` from (--baseline)


def float_list(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 short rounds")
    p.add_argument("--runs", type=int, default=None, help="rounds A B C ... (5; quick 2)")
    p.add_argument("--duration", type=float, default=None, help="measured seconds per load (3; quick 1)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up seconds per load (0.5; quick 0.3)")
    p.add_argument("--concurrency", type=int, default=64, help="closed loop for throughput")
    p.add_argument(
        "--max-wait-ms",
        type=float_list,
        default=[0.0, 1.0],
        help="comma-separated max-wait-ms values for the batching broker (one config each)",
    )
    p.add_argument("--max-batch-size", type=int, default=32, help="batching broker's max batch")
    p.add_argument("--processes", type=int, default=1, help="load generator processes (throughput)")
    p.add_argument(
        "--baseline", type=Path, action="append", default=[], help="a source tree to run the broker from too"
    )
    args = p.parse_args(argv)
    args.runs = args.runs or (2 if args.quick else 5)
    args.duration = args.duration or (1.0 if args.quick else 3.0)
    args.warmup = args.warmup if args.warmup is not None else (0.3 if args.quick else 0.5)
    return args


def configs(args: argparse.Namespace) -> list[Config]:
    out = [
        Config("echo loop", "plain pyzmq ROUTER", None),
        Config(
            "echo loop, again",
            "a second plain pyzmq ROUTER echo loop: what two identical servers differ by in this run",
            None,
        ),
        Config(
            "three-process chain",
            "benchmarks/forwarder.py: zero-copy ROUTER -> ROUTER forwarder, one DEALER echo worker",
            None,
            floor=FORWARDER,
        ),
        Config(
            "batching floor",
            f"benchmarks/batching_floor.py: batches of up to {args.max_batch_size}, one frame each way, "
            "no broker logic, one DEALER echo worker",
            None,
            floor=BATCHING_FLOOR,
            floor_args=[str(args.max_batch_size)],
        ),
        Config(
            "batching floor, batcher's worker",
            f"benchmarks/batching_floor.py: the same forwarder (batches of up to {args.max_batch_size}) "
            "speaking the backend protocol to batcher's own echo worker",
            None,
            floor=BATCHING_FLOOR,
            floor_args=[str(args.max_batch_size), "batcher"],
        ),
    ]
    first = args.max_wait_ms[0] if args.max_wait_ms else 0.0
    batching = [(wait, None) for wait in args.max_wait_ms] + [(first, tree) for tree in args.baseline]
    for wait, tree in batching:
        out.append(
            Config(
                f"broker, batching (wait {wait:g} ms)" + ("" if tree is None else f", from {tree}"),
                f"1 echo worker, max-batch-size {args.max_batch_size}, max-wait-ms {wait:g}"
                + ("" if tree is None else f", `serve` run from the source tree {tree}"),
                serve_args(workers=1, model="echo", max_batch_size=args.max_batch_size, max_wait_ms=wait),
                source=None if tree is None else tree.resolve(),
            )
        )
    out.append(
        Config(
            "broker, batching off",
            "1 echo worker, max-batch-size 1, max-wait-ms 0",
            serve_args(workers=1, model="echo", max_batch_size=1, max_wait_ms=0.0),
        )
    )
    return out


def main(argv: list[str] | None = None) -> None:
    handle_sigterm()
    args = parse_args(argv)
    cfgs = configs(args)
    # per config: a list (one per round) of {"throughput": summary, "single": summary}
    rounds: dict[str, list[dict[str, Any]]] = {c.name: [] for c in cfgs}
    with contextlib.ExitStack() as stack:
        addresses: dict[str, str] = {}
        for c in cfgs:
            if c.floor is not None:
                floor = EchoLoop(script=c.floor, extra=[free_tcp_address(), *c.floor_args])
                addresses[c.name] = stack.enter_context(floor).frontend
            elif c.serve is None:
                addresses[c.name] = stack.enter_context(EchoLoop()).frontend
            else:
                addresses[c.name] = stack.enter_context(running_serve(c.serve, 1, source=c.source)).frontend
        for i in range(args.runs):
            for c in cfgs[i % len(cfgs) :] + cfgs[: i % len(cfgs)]:  # no server always after another
                addr = addresses[c.name]
                tput = summarize(
                    closed_loop(addr, args.concurrency, args.duration, args.warmup, processes=args.processes)
                )
                single = summarize(closed_loop(addr, 1, args.duration, args.warmup))
                rounds[c.name].append({"throughput": tput, "single": single})
                print(
                    f"round {i + 1}/{args.runs} {c.name}: {tput['throughput_rps']:.0f} req/s at "
                    f"c={args.concurrency} (client {tput['client_cpu_share']:.0%} of a core), "
                    f"round trip p50 {single['p50_ms']:.3f} ms p99 {single['p99_ms']:.3f} ms",
                    flush=True,
                )
    base = cfgs[0].name
    rows = []
    for c in cfgs:
        rs = rounds[c.name]
        tput = median_summary([r["throughput"] for r in rs])
        single = median_summary([r["single"] for r in rs])
        ratios = [
            r["throughput"]["throughput_rps"] / b["throughput"]["throughput_rps"]
            for r, b in zip(rs, rounds[base], strict=True)
        ]
        added = [r["single"]["p50_ms"] - b["single"]["p50_ms"] for r, b in zip(rs, rounds[base], strict=True)]
        rows.append(
            {
                "config": c.name,
                "settings": c.settings,
                "throughput": tput,
                "single": single,
                "ratio_to_echo_loop": statistics.median(ratios),
                "added_p50_ms": statistics.median(added),
                "per_round_ratio": ratios,
                "per_round_added_p50_ms": added,
                "rounds": rs,
            }
        )

    def verdict(row: dict[str, Any]) -> str:
        if row["config"] == base:
            return "(baseline)"
        if row["config"] == "echo loop, again":
            return "(the same server again: the run's resolution)"
        if row["config"] == "three-process chain":
            return "(the floor of any client -> broker -> worker design)"
        if row["config"] == "batching floor":
            return "(the floor of a batching broker of this design)"
        if row["config"] == "batching floor, batcher's worker":
            return "(that floor with batcher's worker: what the broker's scheduling costs is the rest)"
        ok_ratio = row["ratio_to_echo_loop"] >= TARGET_RATIO
        ok_added = row["added_p50_ms"] < TARGET_ADDED_MS
        return f"ratio {'met' if ok_ratio else 'MISSED'}, round trip {'met' if ok_added else 'MISSED'}"

    table = md_table(
        ["server", f"req/s at c={args.concurrency}", "ratio to echo loop", "mean batch", "client CPU",
         "round trip p50 ms", "p99 ms", "added p50 ms", "targets"],
        [
            [
                r["config"], r["throughput"]["throughput_rps"], r["ratio_to_echo_loop"],
                r["throughput"]["mean_batch_size"] or "-", f"{r['throughput']['client_cpu_share']:.0%}",
                r["single"]["p50_ms"], r["single"]["p99_ms"], r["added_p50_ms"], verdict(r),
            ]
            for r in rows
        ],
    )  # fmt: skip
    settings = "\n".join(f"- {r['config']}: {r['settings']}" for r in rows)
    notes = sorted({f"{r['config']}: {n}" for r in rows for n in [client_note(r["throughput"])] if n})
    body = (
        f"Throughput: closed loop, {args.concurrency} in flight, {args.processes} load process(es). "
        "Round trip: closed loop, 1 in flight. "
        f"{args.runs} interleaved round(s) of {args.duration:g} s after {args.warmup:g} s warm-up per load; "
        "ratio and added round trip are taken within each round, then the median. "
        f"Targets: ratio >= {TARGET_RATIO}, added median round trip < {TARGET_ADDED_MS} ms."
        f"{default_policy_note()}\n\n"
        f"{settings}\n\n{table}\n"
    )
    if notes:
        body += "\nThe load generator was busy (so a ceiling may be the client's): " + "; ".join(notes) + "\n"
    write_results(
        "overhead",
        "Overhead: broker against a plain pyzmq echo loop",
        body,
        {"settings": vars(args), "rows": rows},
        args.quick,
    )


if __name__ == "__main__":
    main()
