"""CPU time per request of each process of a serve, tracing off and at sampling 1 (issue
32): the broker (serve), its worker, and the broker's trace exporter process, from psutil
over a closed loop of 64 on the echo model (warm-up included). Prints one line a setting.

    python benchmarks/tracing_cpu.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import psutil
from common import closed_loop, running_serve, serve_args

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.otlp_collector import Collector


def main() -> None:
    collector = Collector(mode="sink")
    base = serve_args(workers=1, model="echo", max_batch_size=32, max_wait_ms=0.0)
    traced = ["--trace-endpoint", collector.endpoint, "--trace-sample-ratio", "1"]
    try:
        for label, extra in (("off", []), ("sampling 1", traced)):
            with running_serve([*base, *extra], 1) as sp:
                assert sp.process is not None
                root = psutil.Process(sp.process.pid)
                procs = [root, *root.children(recursive=True)]
                before = {p.pid: sum(p.cpu_times()[:2]) for p in procs}
                result = closed_loop(sp.frontend, 64, 3.0, 0.5)
                after = {p.pid: sum(p.cpu_times()[:2]) for p in procs}
                split = {
                    " ".join(p.cmdline()[2:3]): round((after[p.pid] - before[p.pid]) / result.ok * 1e6, 1)
                    for p in procs
                }
                print(f"{label}: {result.throughput_rps:.0f} req/s; CPU us per request by process: {split}")
    finally:
        collector.close()


if __name__ == "__main__":
    main()
