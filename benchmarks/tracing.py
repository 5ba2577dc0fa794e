"""Tracing's cost (issue 32): the broker and its worker with tracing off, with tracing on
at sampling 0, and at sampling 1, all up at once and loaded in turn (off, 0, 1, then 0, 1,
off, ... for --runs rounds, so drift on a noisy machine hits them alike), each traced serve
exporting to a collector in this process that takes OTLP/HTTP bodies and answers 200
without decoding them (its own CPU is the benchmark's, not the broker's; it shares the
machine's cores all the same).

Two more run sampling 1: one with its exporter process at the broker's own priority (not
niced), one with the SDK in the broker's process
(BATCHER_TRACE_IN_PROCESS=1), the design the exporter process replaced, for comparison.
With --baseline DIR (a source tree, e.g. `git archive main | tar -x -C /tmp/base`), one
more runs sampling 1 from that tree: a before/after in the same run.

A second serve with tracing off ("off, again") runs in the same rounds: its ratio to the
first is what two identical serves differ by on this machine, the run's resolution, against
which the targets' 2% can be read. Each round starts one serve further along the list (so no
serve always runs right after another), and each load waits for every serve to fall quiet
first (the exporters of the sampling-1 serves posting what the last load left them), so
one serve's leftover work does not count against the next.

Two loads: small messages (the `echo` model, max batch 32, wait 0: the broker's own
cost dominates) and `sim` at saturation (2 workers of the simulated GPU, 20 ms + 1 ms an
item, max batch 32: the model's time dominates). Reported per round and as the median of
the within-round ratios to tracing off. Targets: sampling 0 within 2% of off on both
loads; sampling 1 within 15% on small messages and within 2% on `sim`.

    python benchmarks/tracing.py            # 3 rounds
    python benchmarks/tracing.py --quick
    python benchmarks/tracing.py --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil
from common import closed_loop, handle_sigterm, md_table, running_serve, serve_args, summarize, write_results

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from batcher.serve.launcher import free_tcp_address
from tests.helpers import sample, scrape
from tests.otlp_collector import Collector

LOADS = {
    # name: (serve args, workers, concurrency)
    "small": (serve_args(workers=1, model="echo", max_batch_size=32, max_wait_ms=0.0), 1, 64),
    "sim": (
        serve_args(
            workers=2,
            max_batch_size=32,
            max_wait_ms=5.0,
            extra=["--sim-base-ms", "20", "--sim-per-item-ms", "1"],
        ),
        2,
        128,
    ),
}
TARGETS = {("small", "0"): 0.98, ("sim", "0"): 0.98, ("small", "1"): 0.85, ("sim", "1"): 0.98}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 short rounds")
    p.add_argument("--runs", type=int, default=None, help="rounds (3; quick 2)")
    p.add_argument("--duration", type=float, default=None, help="measured seconds per load (3; quick 1.5)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up seconds per load (0.5; quick 0.3)")
    p.add_argument("--loads", default="small,sim", help="comma-separated: small, sim")
    p.add_argument("--baseline", type=Path, default=None, help="a source tree to run sampling 1 from too")
    args = p.parse_args(argv)
    args.runs = args.runs or (2 if args.quick else 3)
    args.duration = args.duration or (1.5 if args.quick else 3.0)
    args.warmup = args.warmup or (0.3 if args.quick else 0.5)
    return args


def stack_pids(served: list[Any]) -> list[int]:
    """The pids of the serves and of every process each started (workers, exporters)."""
    pids = []
    for sp in served:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(sp.process.pid)
            pids += [root.pid, *(c.pid for c in root.children(recursive=True))]
    return pids


def wait_quiet(
    pids: list[int], busy_cores: float = 0.1, window_s: float = 0.2, most_s: float = 10.0
) -> float:
    """Wait until the processes `pids` together use under `busy_cores` of a core over a
    `window_s` window (at most `most_s`); the seconds waited."""
    begun = time.monotonic()
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))

    def cpu_s() -> float:
        total = 0.0
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                total += sum(proc.cpu_times()[:2])
        return total

    while time.monotonic() - begun < most_s:
        before = cpu_s()
        time.sleep(window_s)  # the window CPU is measured over, not a wait for anything to settle
        if cpu_s() - before < busy_cores * window_s:
            break
    return time.monotonic() - begun


def measure(
    load: str, args: argparse.Namespace, collector: Collector, dropped: dict[str, float]
) -> dict[str, list[dict[str, Any]]]:
    base, workers, concurrency = LOADS[load]
    configs = {
        "off": base,
        "off, again": base,
        "0": [*base, "--trace-endpoint", collector.endpoint, "--trace-sample-ratio", "0"],
        "1": [*base, "--trace-endpoint", collector.endpoint, "--trace-sample-ratio", "1"],
        "1, exporter not niced": [*base, "--trace-endpoint", collector.endpoint, "--trace-sample-ratio", "1"],
        "1, SDK in the broker": [*base, "--trace-endpoint", collector.endpoint, "--trace-sample-ratio", "1"],
    }
    sources: dict[str, Path | None] = {name: None for name in configs}
    if args.baseline is not None:
        configs["1, baseline tree"] = configs["1"]
        sources["1, baseline tree"] = args.baseline.resolve()
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    ports = {name: int(free_tcp_address().rsplit(":", 1)[1]) for name in configs}
    with contextlib.ExitStack() as stack:
        addresses = {}
        served: list[Any] = []
        for name, a in configs.items():
            a = [*a, "--metrics-port", str(ports[name])]
            if "SDK" in name:  # the earlier design: spans made and exported in the broker's process
                os.environ["BATCHER_TRACE_IN_PROCESS"] = "1"
            if "not niced" in name:  # the exporter process at the broker's own priority
                os.environ["BATCHER_TRACE_EXPORTER_NICE"] = "0"
            served.append(stack.enter_context(running_serve(a, workers, source=sources[name])))
            addresses[name] = served[-1].frontend
            os.environ.pop("BATCHER_TRACE_IN_PROCESS", None)
            os.environ.pop("BATCHER_TRACE_EXPORTER_NICE", None)
        names = list(addresses)
        for i in range(args.runs):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                wait_quiet(stack_pids(served))
                result = summarize(closed_loop(addresses[name], concurrency, args.duration, args.warmup))
                rounds[name].append(result)
                print(
                    f"{load} round {i + 1}/{args.runs} sampling {name}: "
                    f"{result['throughput_rps']:.0f} req/s, "
                    f"p50 {result['p50_ms']:.2f} ms, mean batch {result['mean_batch_size']}",
                    flush=True,
                )
        for name in configs:  # the spans each broker dropped (its exporter fell behind, or failed)
            dropped[name] = sample(scrape(ports[name]), "batcher_trace_spans_dropped_total")
    return rounds


def main(argv: list[str] | None = None) -> None:
    handle_sigterm()
    args = parse_args(argv)
    collector = Collector(mode="sink")
    results: dict[str, Any] = {}
    rows = []
    try:
        for load in [x.strip() for x in args.loads.split(",") if x.strip()]:
            dropped: dict[str, float] = {}
            rounds = measure(load, args, collector, dropped)
            results[load] = {"rounds": rounds, "spans_dropped": dropped}
            for name in rounds:
                ratios = [
                    r["throughput_rps"] / b["throughput_rps"]
                    for r, b in zip(rounds[name], rounds["off"], strict=True)
                ]
                target = TARGETS.get((load, name))
                ratio = statistics.median(ratios)
                met = "" if target is None else ("met" if ratio >= target else "**missed**")
                rows.append(
                    [
                        load,
                        name if name.startswith("off") else f"on, sampling {name}",
                        f"{statistics.median(r['throughput_rps'] for r in rounds[name]):.0f}",
                        f"{statistics.median(r['p50_ms'] for r in rounds[name]):.2f}",
                        f"{ratio:.3f}",
                        ", ".join(f"{x:.3f}" for x in ratios),
                        f"{dropped.get(name, 0):.0f}",
                        "" if target is None else f">= {target} ({met})",
                    ]
                )
    finally:
        spans_posts = collector.posts
        collector.close()
    table = md_table(
        [
            "load",
            "tracing",
            "req/s (median)",
            "p50 ms",
            "ratio to off",
            "per round",
            "spans dropped",
            "target",
        ],
        rows,
    )
    body = (
        "The broker and its worker(s), tracing off, on at sampling 0 and on at sampling 1, up at once and "
        "loaded in turn each round, each round begun one serve further along and each load once every serve "
        "is quiet (closed loop; `small`: the echo model, concurrency 64; `sim`: 2 workers, "
        '20 ms + 1 ms an item, concurrency 128). "off, again" is a second serve with tracing off: its ratio '
        "to the first is what two identical serves differ by in the run. "
        "The traced serves export to a collector in the benchmark's "
        f"process that answers without decoding ({spans_posts} OTLP posts in all).\n\n" + table
    )
    write_results("tracing", "Tracing: off, sampling 0 and sampling 1", body, {"rounds": results}, args.quick)


if __name__ == "__main__":
    main()
