"""What warm-up changes: the first request's latency after a worker's READY, with and
without it (`--no-warmup`), on the generated ONNX MLP (benchmarks/onnx_mlp.py).

Each round starts `batcher serve --model mlp=onnx:PATH --workers 1 --threads-per-worker 1`
afresh, waits until its worker is ready, then sends one request and times it, then 20
more one at a time; warm and cold rounds alternate. Reported: the first request's
latency and the median of the next 20, per mode (medians over the rounds), and whether
the broker knew the model's cost before the first request.

    python benchmarks/warmup.py
    python benchmarks/warmup.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import handle_sigterm, md_table, running_serve, write_results
from onnx_mlp import SIZES, write_mlp

from batcher.client.sync import Client


def one_round(path: Path, warm: bool) -> dict[str, Any]:
    args = ["--model", f"mlp=onnx:{path}", "--workers", "1", "--threads-per-worker", "1"]
    if not warm:
        args.append("--no-warmup")
    x = np.random.default_rng(0).standard_normal(SIZES[0]).astype(np.float32)
    with running_serve(args, 1) as serve, Client(serve.frontend, timeout_s=60) as client:
        cost_known = client.control("stats")["models"]["mlp"]["batch_cost_ms"] is not None
        times = []
        for _ in range(21):
            t0 = time.perf_counter()
            client.request(x, model="mlp")
            times.append((time.perf_counter() - t0) * 1000.0)
    return {"first_ms": times[0], "next_p50_ms": statistics.median(times[1:]), "cost_known": cost_known}


def main(argv: list[str] | None = None) -> None:
    handle_sigterm()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 rounds of each")
    p.add_argument("--runs", type=int, default=None, help="rounds of each mode (5; quick 2)")
    args = p.parse_args(argv)
    runs = args.runs or (2 if args.quick else 5)
    rounds: dict[str, list[dict[str, Any]]] = {"warm-up": [], "--no-warmup": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_mlp(Path(tmp) / "mlp.onnx")
        for i in range(runs):
            for mode in rounds:
                r = one_round(path, mode == "warm-up")
                rounds[mode].append(r)
                print(f"round {i + 1}/{runs} {mode}: first {r['first_ms']:.2f} ms, "
                      f"then p50 {r['next_p50_ms']:.2f} ms", flush=True)  # fmt: skip
    rows = []
    for mode, rs in rounds.items():
        rows.append(
            [
                mode,
                statistics.median(r["first_ms"] for r in rs),
                statistics.median(r["next_p50_ms"] for r in rs),
                " ".join(f"{r['first_ms']:.1f}" for r in rs),
                "yes" if all(r["cost_known"] for r in rs) else "no",
            ]
        )
    table = md_table(
        ["worker", "first request ms (median)", "next 20: p50 ms (median)", "first request per round",
         "cost known before it"],
        rows,
    )  # fmt: skip
    body = (
        f"The generated ONNX MLP {' -> '.join(map(str, SIZES))} (FP32), one worker of one thread; a fresh "
        f"`batcher serve` per round, {runs} round(s) of each mode, alternating; the first request sent as "
        "soon as the worker is ready, then 20 more one at a time.\n\n"
        f"{table}\n"
    )
    write_results(
        "warmup", "Warm-up: the first request with and without it", body, {"rounds": rounds}, args.quick
    )


if __name__ == "__main__":
    main()
