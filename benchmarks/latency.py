"""Latency under load: open-loop Poisson arrivals from 10% to 95% of capacity, and a lone client.

sim model, 4 workers, max batch 32: capacity 4 * 32 / t(32) = 1280 requests/s. For each
load level, p50 and p99 latency counted from when each request was due (an open loop:
a slow server cannot slow the load down). The "lone client" row is a closed loop with
one request in flight, against t(1) = 22.5 ms, the least the model itself needs.

Each scheduling policy named by --policies is run in turn; `default` runs `batcher serve`
without a --policy option (the current behaviour), any other name is passed as
`--policy NAME`, and only when `batcher serve --help` lists a --policy option
(otherwise it is skipped with a note). `--policies all` means every
choice that the help lists (each passed explicitly).

    python benchmarks/latency.py
    python benchmarks/latency.py --quick --policies default
"""

from __future__ import annotations

import argparse
from typing import Any

from common import (
    closed_loop,
    handle_sigterm,
    load_note,
    md_table,
    median_summary,
    open_loop,
    policy_option,
    running_serve,
    save_plot,
    serve_args,
    serve_help,
    sim_batch_ms,
    summarize,
    theoretical_capacity,
    write_results,
)

DEFAULT_POLICY = "default"
LOAD_LEVELS = (0.10, 0.25, 0.50, 0.75, 0.90, 0.95)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short single runs")
    p.add_argument("--runs", type=int, default=None, help="runs per load level, median (3; quick 1)")
    p.add_argument("--duration", type=float, default=None, help="measured seconds per run (4; quick 2)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up seconds per run (1; quick 0.5)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    p.add_argument(
        "--levels",
        type=lambda s: [float(x) for x in s.split(",") if x.strip()],
        default=list(LOAD_LEVELS),
        help="comma-separated fractions of capacity",
    )
    p.add_argument(
        "--policies",
        default=DEFAULT_POLICY,
        help="comma-separated scheduling policies, each NAME or NAME@MAX_WAIT_MS; 'default' = no "
        "--policy flag; 'all' = every choice `batcher serve --help` lists",
    )
    p.add_argument("--processes", type=int, default=1, help="load generator processes")
    p.add_argument("--no-plot", action="store_true", help="do not draw results/latency.png")
    args = p.parse_args(argv)
    args.runs = args.runs or (1 if args.quick else 3)
    args.duration = args.duration or (2.0 if args.quick else 4.0)
    args.warmup = args.warmup if args.warmup is not None else (0.5 if args.quick else 1.0)
    return args


def resolve_policies(requested: str) -> tuple[list[str], list[str], list[str], dict[str, str]]:
    """(policies to run, policies skipped, notes, a table label for each policy run)."""
    supported, choices, default = policy_option(serve_help())
    names = [p.strip() for p in requested.split(",") if p.strip()]
    if "all" in names:
        every = choices if supported and choices else [DEFAULT_POLICY]
        names = [*every, *(n for n in names if n != "all")]
        if supported and not choices:
            print("`batcher serve --help` lists --policy without its choices: name them in --policies")
    names = list(dict.fromkeys(names))  # no duplicates, order kept
    run, skipped, notes = [], [], []
    for name in names:
        base = name.partition("@")[0]  # NAME@WAIT_MS runs NAME with --max-wait-ms WAIT_MS
        if base == DEFAULT_POLICY or (supported and (not choices or base in choices)):
            run.append(name)
        elif not supported:
            skipped.append(name)
            notes.append(f"policy {name!r} skipped: `batcher serve --help` lists no --policy option")
        else:
            skipped.append(name)
            notes.append(f"policy {name!r} skipped: `batcher serve --help` lists only {', '.join(choices)}")
    labels = {n: n for n in run}
    if DEFAULT_POLICY in labels:
        labels[DEFAULT_POLICY] = f"default ({default})" if supported and default else "default"
    return run, skipped, notes, labels


def measure_policy(args: argparse.Namespace, policy: str, capacity: float) -> dict[str, Any]:
    base, _, wait = policy.partition("@")
    extra = [] if base == DEFAULT_POLICY else ["--policy", base]
    max_wait_ms = float(wait) if wait else args.max_wait_ms
    srv = serve_args(
        workers=args.workers, max_batch_size=args.max_batch_size, max_wait_ms=max_wait_ms, extra=extra
    )
    levels = []
    with running_serve(srv, args.workers) as serve:
        for li, level in enumerate(args.levels):
            rate = level * capacity
            runs = [
                summarize(
                    open_loop(
                        serve.frontend,
                        rate,
                        args.duration,
                        args.warmup,
                        processes=args.processes,
                        seed=1000 * run + li,
                    )
                )
                for run in range(args.runs)
            ]
            med = median_summary(runs)
            levels.append({"level": level, "rate": rate, "median": med, "runs": runs})
            print(
                f"{policy}: {level:.0%} of capacity ({rate:.0f} req/s): p50 {med['p50_ms']:.1f} ms, "
                f"p99 {med['p99_ms']:.1f} ms, mean batch {med['mean_batch_size']:.1f}",
                flush=True,
            )
        lone_runs = [
            summarize(closed_loop(serve.frontend, 1, args.duration, args.warmup)) for _ in range(args.runs)
        ]
    lone = median_summary(lone_runs)
    print(f"{policy}: lone client: p50 {lone['p50_ms']:.2f} ms, p99 {lone['p99_ms']:.2f} ms", flush=True)
    return {
        "policy": policy, "max_wait_ms": max_wait_ms, "levels": levels, "lone": lone, "lone_runs": lone_runs,
    }  # fmt: skip


def plot(results: list[dict[str, Any]], capacity: float) -> str | None:
    """Draw p50/p99 against load into results/latency.png when matplotlib is importable."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for res in results:
        x = [lv["level"] * 100 for lv in res["levels"]]
        for key, style in (("p50_ms", "-o"), ("p99_ms", "--s")):
            ax.plot(x, [lv["median"][key] for lv in res["levels"]], style, label=f"{res['label']} {key[:3]}")
    ax.set_xlabel(f"offered load, % of capacity ({capacity:.0f} req/s)")
    ax.set_ylabel("latency, ms")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return save_plot(fig, "latency")


def main(argv: list[str] | None = None) -> None:
    handle_sigterm()
    args = parse_args(argv)
    capacity = theoretical_capacity(args.workers, args.max_batch_size)
    t1 = sim_batch_ms(1)
    policies, skipped, notes, labels = resolve_policies(args.policies)
    for n in notes:
        print(n, flush=True)
    results = [measure_policy(args, p, capacity) for p in policies]
    for res in results:
        res["label"] = labels[res["policy"]]
    rows = []
    for res in results:
        for lv in res["levels"]:
            m = lv["median"]
            rows.append(
                [
                    res["label"], f"{res['max_wait_ms']:g}", f"{lv['level']:.0%}", lv["rate"],
                    m["throughput_rps"], m["p50_ms"], m["p99_ms"], m["mean_batch_size"],
                    m["errors"] + m["lost"], load_note(m),
                ]
            )  # fmt: skip
    table = md_table(
        ["policy", "max-wait-ms", "load", "offered req/s", "answered req/s", "p50 ms", "p99 ms", "mean batch",
         "errors", "load"],
        rows,
    )  # fmt: skip
    lone_table = md_table(
        ["policy", "max-wait-ms", "lone client p50 ms", "p99 ms", "t(1) ms", "p50 - t(1) ms"],
        [
            [
                r["label"],
                f"{r['max_wait_ms']:g}",
                r["lone"]["p50_ms"],
                r["lone"]["p99_ms"],
                t1,
                r["lone"]["p50_ms"] - t1,
            ]
            for r in results
        ],
    )
    png = None if args.no_plot else plot(results, capacity)
    body = (
        f"sim model, {args.workers} workers, max batch {args.max_batch_size}, "
        f"max-wait-ms as in each row (default {args.max_wait_ms:g}): "
        f"capacity {args.workers} * {args.max_batch_size} / t({args.max_batch_size}) = {capacity:.0f} req/s. "
        f"Open loop (Poisson arrivals, latency from each request's due time) from {args.processes} load "
        f"process(es); median of {args.runs} run(s) of {args.duration:g} s after {args.warmup:g} s warm-up "
        f"per level. Answered req/s: ok replies that arrived inside the window; load: whether the "
        f"broker fell behind the offered load (its backlog grew: latency then depends on the run's "
        f"length) and whether the load generator kept up.\n\n{table}\n\n"
        f"Lone client: closed loop, 1 request in flight, against t(1) = {t1:g} ms.\n\n{lone_table}\n"
    )
    if notes:
        body += "\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    if png:
        body += "\nPlot: `benchmarks/results/latency.png`.\n"
    write_results(
        "latency",
        "Latency against offered load",
        body,
        {
            "settings": vars(args),
            "capacity_rps": capacity,
            "t1_ms": t1,
            "policies": policies,
            "skipped_policies": skipped,
            "notes": notes,
            "results": results,
            "plot": png,
        },
        args.quick,
    )


if __name__ == "__main__":
    main()
