"""A lone request: the broker against a minimal three-process chain.

One client sends one request at a time (closed loop, concurrency 1) to two servers in
turn (A B A B ... for --runs rounds):

- the chain (benchmarks/forwarder.py with a sleeping worker): a zero-copy pyzmq
  ROUTER -> ROUTER forwarder and one DEALER worker that sleeps t(1) before answering;
- `batcher serve --workers 4 --model sim --max-batch-size 32 --max-wait-ms 10` (issue
  30's setup) with its default policy, the sim model costing t(n) = 20 + 2.5 n ms, so
  t(1) = 22.5 ms.

Reported: each one's median round trip, and the broker's minus the chain's, taken
within each round (target: within 0.3 ms in every round), and their median. With
--baseline DIR (a source tree, e.g. `git archive main | tar -x -C /tmp/base`), a
`serve` run from DIR is measured too, in the same rounds: a same-run before/after.

    python benchmarks/lone_request.py
    python benchmarks/lone_request.py --quick
    python benchmarks/lone_request.py --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from pathlib import Path
from typing import Any

from common import (
    FORWARDER,
    SIM_BASE_MS,
    SIM_PER_ITEM_MS,
    EchoLoop,
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

TARGET_ADDED_MS = 0.3
WORKERS = 4
SERVE = serve_args(workers=WORKERS, max_batch_size=32, max_wait_ms=10.0)


def main(argv: list[str] | None = None) -> None:
    handle_sigterm()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 short rounds")
    p.add_argument("--runs", type=int, default=None, help="rounds A B A B ... (3; quick 2)")
    p.add_argument("--duration", type=float, default=None, help="measured seconds per load (5; quick 2)")
    p.add_argument("--baseline", type=Path, default=None, help="a source tree to measure too")
    args = p.parse_args(argv)
    runs = args.runs or (2 if args.quick else 3)
    duration = args.duration or (2.0 if args.quick else 5.0)
    t1_ms = SIM_BASE_MS + SIM_PER_ITEM_MS
    rounds: dict[str, list[dict[str, Any]]] = {"chain": [], "broker": []}
    if args.baseline is not None:
        rounds["baseline"] = []
    with contextlib.ExitStack() as stack:
        chain = stack.enter_context(EchoLoop(script=FORWARDER, extra=[free_tcp_address(), repr(t1_ms)]))
        serve = stack.enter_context(running_serve(SERVE, WORKERS))
        addresses = {"chain": chain.frontend, "broker": serve.frontend}
        if args.baseline is not None:
            base = stack.enter_context(running_serve(SERVE, WORKERS, source=args.baseline.resolve()))
            addresses["baseline"] = base.frontend
        for i in range(runs):
            for name in rounds:
                result = summarize(closed_loop(addresses[name], 1, duration, 0.5))
                rounds[name].append(result)
                print(
                    f"round {i + 1}/{runs} {name}: p50 {result['p50_ms']:.3f} ms "
                    f"p99 {result['p99_ms']:.3f} ms",
                    flush=True,
                )

    def added(name: str) -> list[float]:
        return [b["p50_ms"] - c["p50_ms"] for b, c in zip(rounds[name], rounds["chain"], strict=True)]

    def row(label: str, name: str) -> list[Any]:
        summary, per_round = median_summary(rounds[name]), added(name)
        met = all(x < TARGET_ADDED_MS for x in per_round)
        return [
            label, summary["p50_ms"], summary["p99_ms"], summary["throughput_rps"],
            f"{statistics.median(per_round):.3f} ({' '.join(f'{x:.3f}' for x in per_round)})",
            "met" if met else "MISSED",
        ]  # fmt: skip

    chain_s = median_summary(rounds["chain"])
    rows = [
        ["chain: forwarder + worker sleeping t(1)", chain_s["p50_ms"], chain_s["p99_ms"],
         chain_s["throughput_rps"], "(baseline)", "-"],
        row(f"broker + {WORKERS} sim workers", "broker"),
    ]  # fmt: skip
    if args.baseline is not None:
        rows.append(row(f"broker + {WORKERS} sim workers, from {args.baseline}", "baseline"))
    table = md_table(
        ["server", "round trip p50 ms", "p99 ms", "requests/s", "added p50 ms: median (per round)",
         "target (< 0.3 ms every round)"],
        rows,
    )  # fmt: skip
    body = (
        f"One request at a time (closed loop, concurrency 1); sim model, t(1) = {t1_ms:g} ms. {runs} "
        f"interleaved round(s) of {duration:g} s after 0.5 s warm-up; the added round trip is taken "
        "within each round.\n\n"
        "- chain: benchmarks/forwarder.py, a zero-copy ROUTER -> ROUTER forwarder and one DEALER worker "
        f"sleeping {t1_ms:g} ms per request\n"
        f"- broker: `batcher serve {' '.join(SERVE)}` (issue 30's setup, default policy)\n\n"
        f"{table}\n"
    )
    write_results(
        "lone_request",
        "A lone request: broker against a minimal three-process chain",
        body,
        {
            "settings": {**vars(args), "runs": runs, "duration": duration},
            "rounds": rounds,
            "added_p50_ms": {name: added(name) for name in rounds if name != "chain"},
        },
        args.quick,
    )


if __name__ == "__main__":
    main()
