"""A lone request: the broker against a minimal three-process chain.

One client sends one request at a time (closed loop, concurrency 1) to two servers in
turn (A B A B ... for --runs rounds):

- the chain (benchmarks/forwarder.py with a sleeping worker): a zero-copy pyzmq
  ROUTER -> ROUTER forwarder and one DEALER worker that sleeps t(1) before answering;
- `batcher serve --model sim --workers 1` with its default policy, the sim model
  costing t(n) = 20 + 2.5 n ms, so t(1) = 22.5 ms.

Reported: each one's median round trip, and the broker's minus the chain's, taken
within each round, then the median (target: within 0.3 ms).

    python benchmarks/lone_request.py
    python benchmarks/lone_request.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
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

from batcher.launcher import free_tcp_address

TARGET_ADDED_MS = 0.3


def main(argv: list[str] | None = None) -> None:
    handle_sigterm()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 short rounds")
    p.add_argument("--runs", type=int, default=None, help="rounds A B A B ... (5; quick 2)")
    p.add_argument("--duration", type=float, default=None, help="measured seconds per load (5; quick 2)")
    args = p.parse_args(argv)
    runs = args.runs or (2 if args.quick else 5)
    duration = args.duration or (2.0 if args.quick else 5.0)
    t1_ms = SIM_BASE_MS + SIM_PER_ITEM_MS
    rounds: dict[str, list[dict[str, Any]]] = {"chain": [], "broker": []}
    with contextlib.ExitStack() as stack:
        chain = stack.enter_context(EchoLoop(script=FORWARDER, extra=[free_tcp_address(), repr(t1_ms)]))
        serve = stack.enter_context(
            running_serve(serve_args(workers=1, max_batch_size=8, max_wait_ms=5.0), 1)
        )
        addresses = {"chain": chain.frontend, "broker": serve.frontend}
        for i in range(runs):
            for name in rounds:
                result = summarize(closed_loop(addresses[name], 1, duration, 0.5))
                rounds[name].append(result)
                print(
                    f"round {i + 1}/{runs} {name}: p50 {result['p50_ms']:.3f} ms "
                    f"p99 {result['p99_ms']:.3f} ms",
                    flush=True,
                )
    added = [b["p50_ms"] - c["p50_ms"] for b, c in zip(rounds["broker"], rounds["chain"], strict=True)]
    chain_s, broker_s = median_summary(rounds["chain"]), median_summary(rounds["broker"])
    median_added = statistics.median(added)
    verdict = "met" if median_added < TARGET_ADDED_MS else "MISSED"
    table = md_table(
        ["server", "round trip p50 ms", "p99 ms", "requests/s", "added p50 ms (per round)",
         "target (< 0.3 ms)"],
        [
            ["chain: forwarder + worker sleeping t(1)", chain_s["p50_ms"], chain_s["p99_ms"],
             chain_s["throughput_rps"], "(baseline)", "-"],
            ["broker + 1 sim worker", broker_s["p50_ms"], broker_s["p99_ms"], broker_s["throughput_rps"],
             f"{median_added:.3f} ({' '.join(f'{x:.3f}' for x in added)})", verdict],
        ],
    )  # fmt: skip
    body = (
        f"One request at a time (closed loop, concurrency 1); sim model, t(1) = {t1_ms:g} ms. {runs} "
        f"interleaved round(s) of {duration:g} s after 0.5 s warm-up; the added round trip is taken "
        "within each round, then the median.\n\n"
        "- chain: benchmarks/forwarder.py, a zero-copy ROUTER -> ROUTER forwarder and one DEALER worker "
        f"sleeping {t1_ms:g} ms per request\n"
        "- broker: `batcher serve --model sim --workers 1 --max-batch-size 8 --max-wait-ms 5` (default "
        "policy)\n\n"
        f"{table}\n"
    )
    write_results(
        "lone_request",
        "A lone request: broker against a minimal three-process chain",
        body,
        {
            "settings": {**vars(args), "runs": runs, "duration": duration},
            "rounds": rounds,
            "added_p50_ms": added,
        },
        args.quick,
    )


if __name__ == "__main__":
    main()
