"""CPU time per request of each process of a serve (issue 32): tracing off, on at sampling
0, and on at sampling 1, all up at once and loaded in turn for --runs rounds; the broker
(serve), its worker and the broker's trace exporter process, from psutil over a closed
loop of 64 on the echo model. CPU per request moves less than throughput on a machine
other work shares. Prints each round and the medians.

    python benchmarks/tracing_cpu.py [--runs 5]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path
from typing import Any

import psutil
from common import closed_loop, running_serve, serve_args

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.otlp_collector import Collector


def cpu_s(root: psutil.Process) -> dict[str, float]:
    """CPU seconds so far of serve and each of its children, by role."""
    out = {}
    for p in [root, *root.children(recursive=True)]:
        line = " ".join(p.cmdline())
        role = "exporter" if "relay_exporter" in line else "worker" if " worker" in line else "broker"
        out[role] = out.get(role, 0.0) + sum(p.cpu_times()[:2])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--duration", type=float, default=3.0)
    args = p.parse_args()
    collector = Collector(mode="sink")
    base = serve_args(workers=1, model="echo", max_batch_size=32, max_wait_ms=0.0)
    traced = ["--trace-endpoint", collector.endpoint]
    configs = {
        "off": base,
        "0": [*base, *traced, "--trace-sample-ratio", "0"],
        "1": [*base, *traced, "--trace-sample-ratio", "1"],
    }
    per: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    try:
        with contextlib.ExitStack() as stack:
            served = {name: stack.enter_context(running_serve(a, 1)) for name, a in configs.items()}
            for i in range(args.runs):
                for name, sp in served.items():
                    assert sp.process is not None
                    root = psutil.Process(sp.process.pid)
                    before = cpu_s(root)
                    result = closed_loop(sp.frontend, 64, args.duration, 0.3)
                    after = cpu_s(root)
                    us = {k: round((after[k] - before.get(k, 0.0)) / result.ok * 1e6, 2) for k in after}
                    per[name].append({"rps": result.throughput_rps, **us})
                    print(
                        f"round {i + 1} sampling {name}: {result.throughput_rps:.0f} req/s, "
                        f"CPU us/request {us}"
                    )
    finally:
        collector.close()
    for name, rows in per.items():
        keys = sorted({k for r in rows for k in r})
        print(
            f"median, sampling {name}: "
            + ", ".join(f"{k} {statistics.median(r.get(k, 0) for r in rows):.2f}" for k in keys)
        )
    broker_ratio = [r0["broker"] / roff["broker"] for r0, roff in zip(per["0"], per["off"], strict=True)]
    print("broker CPU per request, sampling 0 / off, per round:", ", ".join(f"{x:.3f}" for x in broker_ratio))


if __name__ == "__main__":
    main()
