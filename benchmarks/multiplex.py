"""Many models per worker (issue 33, item 5): K Python models, each a simulated GPU batch
(the sim model's cost, t(n) = 20 + 2.5 * n ms), served by dedicated workers (one each,
`workers = 1` in its config.toml) against the same K served by a shared pool of W = K
multiplexed workers (`multiplexed = true`, `memory_mb = 100`, `--multiplex-workers W`):
the target is multiplexed throughput >= 0.95 of dedicated when the working set fits.

Two budgets are measured: tight, `--multiplex-memory-mb` K / W * 100 (the pool holds the K
models between its workers, one worker's worth each), and roomy, K * 100 (every worker
may hold every model). Each is a `batcher serve --model-repository DIR` of its own, all
started at once and kept up; every round loads each of them in turn (the order reversed
every other round), a closed loop of 2 * B requests in flight per model, one load process
per model, all K at once. Throughput is the sum of the K models' served requests/s; the
ratio multiplexed / dedicated is taken round by round (paired) and its median reported.
Cold loads and unloads are the stats' counters over each measured round (its short
warm-up included): once the pool is warm they should stay at 0 when the working set fits.

    python benchmarks/multiplex.py
    python benchmarks/multiplex.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import (
    SIM_BASE_MS,
    SIM_PER_ITEM_MS,
    client_note,
    closed_loop,
    handle_sigterm,
    md_table,
    running_serve,
    summarize,
    theoretical_capacity,
    write_results,
)

from batcher.client import Client
from batcher.serve.launcher import ServeProcess

#: A model's share of a multiplexed worker's budget (its config.toml's memory_mb).
MODEL_MB = 100
MAX_BATCH = 32
MAX_WAIT_MS = 5.0

MODEL = """
import time


def model(inputs):
    \"\"\"A simulated GPU batch, the sim model's cost: {base_ms} + {per_item_ms} ms per input.\"\"\"
    time.sleep(({base_ms} + {per_item_ms} * len(inputs)) / 1000.0)
    return [len(x) + {k} for x in inputs]
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 rounds of 1.5 s, to check it works")
    p.add_argument("--runs", type=int, default=None, help="rounds, each setup once a round (5; quick 2)")
    p.add_argument("--duration", type=float, default=None, help="measured seconds a round (4; quick 1.5)")
    p.add_argument("--warmup", type=float, default=0.5, help="warm-up seconds of each round's load")
    p.add_argument("--models", type=int, default=2, help="K: models, and workers (one each, or a pool of K)")
    args = p.parse_args(argv)
    args.runs = args.runs or (2 if args.quick else 5)
    args.duration = args.duration or (1.5 if args.quick else 4.0)
    if args.models < 1:
        p.error(f"--models must be >= 1, got {args.models}")
    return args


def names(k: int) -> list[str]:
    return [f"m{i}" for i in range(k)]


def make_repository(root: Path, k: int, multiplexed: bool) -> Path:
    """K models, version 1 each: one worker of its own each, or multiplexed at MODEL_MB."""
    config = f'kind = "python"\nmultiplexed = true\nmemory_mb = {MODEL_MB}\n' if multiplexed else (
        'kind = "python"\nworkers = 1\n'
    )  # fmt: skip
    for i, name in enumerate(names(k)):
        vdir = root / name / "1"
        vdir.mkdir(parents=True)
        (vdir / "model.py").write_text(MODEL.format(base_ms=SIM_BASE_MS, per_item_ms=SIM_PER_ITEM_MS, k=i))
        (root / name / "config.toml").write_text(config)
    return root


def setups(tmp: Path, k: int) -> dict[str, tuple[list[str], int]]:
    """Each setup's `serve` arguments and the workers its stats count when ready (a pool's
    workers are counted once per model they may serve)."""
    batching = ["--max-batch-size", str(MAX_BATCH), "--max-wait-ms", repr(MAX_WAIT_MS)]
    dedicated = make_repository(tmp / "dedicated", k, multiplexed=False)
    pooled = make_repository(tmp / "multiplexed", k, multiplexed=True)
    out = {"dedicated": (["--model-repository", str(dedicated), *batching], k)}
    for label, budget in (("tight", MODEL_MB), ("roomy", k * MODEL_MB)):  # K / W * 100 with W = K
        pool = ["--multiplex-workers", str(k), "--multiplex-memory-mb", str(budget)]
        out[f"multiplexed, {label} budget {budget} MB"] = (
            ["--model-repository", str(pooled), *pool, *batching],
            k * k,
        )
    return out


def counters(serve: ServeProcess) -> dict[str, Any]:
    """The multiplexing counters of `stats`, summed over the models, and each model's held_by."""
    with Client(serve.frontend, timeout_s=10) as client:
        models = client.control("stats")["models"]
    return {
        "cold_loads": sum(int(m.get("cold_loads", 0)) for m in models.values()),
        "unloads": sum(int(m.get("unloads", 0)) for m in models.values()),
        "cold_load_ms_total": sum(float(m.get("cold_load_ms_total", 0.0)) for m in models.values()),
        "held_by": {key: m.get("held_by") for key, m in models.items()},
    }


def load(serve: ServeProcess, k: int, duration_s: float, warmup_s: float) -> dict[str, Any]:
    """A closed loop of 2 * B in flight on each of the K models at once, one load process each;
    the served requests/s summed, and the multiplexing counters over the run."""
    before = counters(serve)
    with ThreadPoolExecutor(k) as pool:
        futures = {
            name: pool.submit(closed_loop, serve.frontend, 2 * MAX_BATCH, duration_s, warmup_s, model=name)
            for name in names(k)
        }
        runs = {name: summarize(f.result()) for name, f in futures.items()}
    after = counters(serve)
    return {
        "throughput_rps": sum(r["throughput_rps"] for r in runs.values()),
        "per_model_rps": {name: r["throughput_rps"] for name, r in runs.items()},
        "mean_batch_size": statistics.mean(r["mean_batch_size"] for r in runs.values()),
        "p99_ms": max(r["p99_ms"] for r in runs.values()),
        "errors": sum(r["errors"] + r["lost"] for r in runs.values()),
        "client": "; ".join(n for r in runs.values() if (n := client_note(r))) or "kept up",
        "cold_loads": after["cold_loads"] - before["cold_loads"],
        "unloads": after["unloads"] - before["unloads"],
        "cold_load_ms": after["cold_load_ms_total"] - before["cold_load_ms_total"],
        "held_by": after["held_by"],
    }


def measure(args: argparse.Namespace, tmp: Path) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """Every setup's rounds, and the counters each warm-up (before the rounds) left."""
    plan = setups(tmp, args.models)
    rounds: dict[str, list[dict[str, Any]]] = {label: [] for label in plan}
    warm: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        serves = {
            label: stack.enter_context(running_serve(serve_args, ready))
            for label, (serve_args, ready) in plan.items()
        }
        for label, serve in serves.items():  # each model loaded and its batch cost learnt
            load(serve, args.models, 2.0, 0.5)
            warm[label] = counters(serve)
            print(f"warm-up {label}: {warm[label]}", flush=True)
        order = list(plan)
        for r in range(args.runs):
            for label in order if r % 2 == 0 else order[::-1]:
                run = load(serves[label], args.models, args.duration, args.warmup)
                rounds[label].append(run)
                print(
                    f"round {r + 1} {label}: {run['throughput_rps']:.0f} req/s, mean batch "
                    f"{run['mean_batch_size']:.1f}, cold loads {run['cold_loads']}, "
                    f"unloads {run['unloads']}, held_by {run['held_by']}",
                    flush=True,
                )
    return rounds, warm


def main(argv: list[str] | None = None) -> None:
    handle_sigterm()
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rounds, warm = measure(args, Path(tmp))
    dedicated = [r["throughput_rps"] for r in rounds["dedicated"]]
    ceiling = theoretical_capacity(args.models, MAX_BATCH)
    rows, ratios = [], {}
    for label, runs in rounds.items():
        rps = [r["throughput_rps"] for r in runs]
        paired = [m / d for m, d in zip(rps, dedicated, strict=True)]
        ratios[label] = statistics.median(paired)
        rows.append(
            [
                label,
                statistics.median(rps),
                statistics.median(rps) / ceiling,
                "1 (itself)"
                if label == "dedicated"
                else f"{ratios[label]:.3f} ({', '.join(f'{x:.3f}' for x in paired)})",
                statistics.median(r["mean_batch_size"] for r in runs),
                statistics.median(r["p99_ms"] for r in runs),
                sum(r["cold_loads"] for r in runs),
                sum(r["unloads"] for r in runs),
                f"{warm[label]['cold_loads']} / {warm[label]['unloads']}",
                sum(r["errors"] for r in runs),
                "; ".join(sorted({r["client"] for r in runs})),
            ]
        )
    table = md_table(
        ["setup", "req/s (median)", "of K * B / t(B)", "multiplexed / dedicated (median of rounds; rounds)",
         "mean batch", "p99 ms", "cold loads in rounds", "unloads in rounds", "warm-up: cold loads / unloads",
         "errors", "client"],
        rows,
    )  # fmt: skip
    print(table)
    k = args.models
    body = (
        f"K = {k} Python models, each `time.sleep(({SIM_BASE_MS:g} + {SIM_PER_ITEM_MS:g} * n) / 1000)` a "
        f"batch of n (the sim model's cost), `--max-batch-size {MAX_BATCH} --max-wait-ms {MAX_WAIT_MS:g}`. "
        f"Dedicated: `workers = 1` each in config.toml ({k} workers). Multiplexed: `multiplexed = true`, "
        f"`memory_mb = {MODEL_MB}` each, `--multiplex-workers {k} --multiplex-memory-mb M` (tight: "
        f"M = K / W * {MODEL_MB}; roomy: M = K * {MODEL_MB}). Closed loop of {2 * MAX_BATCH} in flight per "
        f"model, all {k} at once; {args.runs} rounds of {args.duration:g} s "
        f"(after {args.warmup:g} s warm-up), "
        "each setup once a round, alternating; served req/s summed over the models. Cold loads and unloads: "
        "the stats' counters over the rounds, after a 2.5 s warm-up of each setup (its own counts after "
        "the slash). Target: multiplexed / dedicated >= 0.95 with a working set that fits.\n\n" + table
    )
    data = {"settings": vars(args), "ratios": ratios, "warmup": warm, "rounds": rounds}
    write_results(
        "multiplex", "Many models per worker: multiplexed against dedicated", body, data, args.quick
    )


if __name__ == "__main__":
    main()
