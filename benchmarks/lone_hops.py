"""A lone request hop by hop, from the system calls of the real processes (issue 30).

`lone_request.py` says how much a lone request's round trip adds over a minimal chain, in
steps of 16 us on this VM; this says where. `batcher broker` and `batcher worker --model
sim` (t(1) = 22.5 ms) run as processes of their own, and this process sends them lone
requests from a DEALER while `perf trace` records the system calls of all three (Linux,
root: `perf` must be installed). Each request's life is then cut at calls every version
makes:

- client send -> broker wakes: the client's eventfd write (its libzmq I/O thread told to
  send) to the broker's first call after its poll;
- broker, request: from there to its first write (the BATCH handed to its I/O thread);
- broker -> worker wakes, worker before the model (to its sleep, the model), the model
  and what follows it up to the worker's next call (the REPLY's encoding, which makes none),
  up to its write;
- worker -> broker wakes, broker, reply (to the write that hands the client's reply on),
  broker -> client wakes.

Medians over the requests; with --baseline DIR (a source tree, repeatable; v1's flat layout
works too), the trees alternate round by round.

    sudo python benchmarks/lone_hops.py [--requests 250] [--rounds 2] [--baseline /tmp/v1]
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import zmq
from common import handle_sigterm, md_table, write_results

HERE = Path(__file__).resolve().parent
SEGMENTS = (
    "client -> broker wakes", "broker, request", "broker -> worker wakes", "worker, before the model",
    "model and reply encoding", "worker, to its send", "worker -> broker wakes", "broker, reply",
    "broker -> client wakes", "round trip",
)  # fmt: skip
_LINE = re.compile(r"^\s*([\d.]+) \(\s*[\d.]*\s*(?:ms)?\): .+?/(\d+) (\w+)\(")


def free_address() -> str:
    with zmq.Context.instance().socket(zmq.ROUTER) as s:
        port = s.bind_to_random_port("tcp://127.0.0.1")
    return f"tcp://127.0.0.1:{port}"


def run_round(tree: Path, requests: int, trace: Path) -> dict[str, float]:
    """Lone requests to a broker and worker started from `tree`, under perf trace."""
    frontend, backend = free_address(), free_address()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    spawn = {"start_new_session": True, "cwd": tree, "env": env, "stderr": subprocess.DEVNULL}
    broker = subprocess.Popen(
        [sys.executable, "-m", "batcher", "broker", "--frontend", frontend, "--backend", backend,
         "--model", "sim", "--max-batch-size", "32", "--max-wait-ms", "10"], **spawn,
    )  # fmt: skip
    worker = subprocess.Popen(
        [sys.executable, "-m", "batcher", "worker", "--connect", backend, "--model", "sim"], **spawn
    )
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(frontend)
    perf = None
    try:
        for i in range(20):  # up, and warm
            sock.send_multipart([b"", msgpack.packb({"id": i, "input": i})])
            if not sock.poll(30_000):
                raise TimeoutError("no reply from the broker within 30 s")
            sock.recv_multipart()
        pids = f"{os.getpid()},{broker.pid},{worker.pid}"
        perf = subprocess.Popen(["perf", "trace", "-o", str(trace), "-p", pids], stderr=subprocess.DEVNULL)
        time.sleep(1.5)  # perf attached
        for i in range(requests):
            sock.send_multipart([b"", msgpack.packb({"id": i, "input": i})])
            if not sock.poll(30_000):
                raise TimeoutError("no reply from the broker within 30 s")
            sock.recv_multipart()
        time.sleep(0.2)
    finally:
        if perf is not None:
            perf.send_signal(signal.SIGINT)
            perf.wait(30)
        sock.close()
        ctx.term()
        for p in (worker, broker):
            os.killpg(p.pid, signal.SIGTERM)
        for p in (worker, broker):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)
    return segments(trace, os.getpid(), broker.pid, worker.pid)


def segments(trace: Path, client: int, broker: int, worker: int) -> dict[str, float]:
    """Median us of each segment, over the requests whose every mark was found (main
    threads only: a process's main thread id is its pid)."""
    calls: dict[int, list[tuple[float, str]]] = {}
    for line in trace.read_text(errors="replace").splitlines():
        m = _LINE.match(line)
        if m:
            calls.setdefault(int(m.group(2)), []).append((float(m.group(1)), m.group(3)))
    for seq in calls.values():
        seq.sort()

    def after(tid: int, t: float, names: tuple[str, ...] = ()) -> float | None:
        for at, name in calls.get(tid, ()):
            if at > t and (not names or name in names):
                return at
        return None

    found: dict[str, list[float]] = {s: [] for s in SEGMENTS}
    for sent, name in calls.get(client, ()):
        if name != "write":
            continue
        marks = [sent]
        for tid, names in (
            (broker, ()), (broker, ("write",)), (worker, ()), (worker, ("clock_nanosleep",)),
            (worker, ()), (worker, ("write",)), (broker, ()), (broker, ("write",)), (client, ()),
        ):  # fmt: skip
            at = after(tid, marks[-1], names)
            if at is None:
                break
            marks.append(at)
        else:
            if marks[5] - marks[4] < 20 or marks[-1] - marks[0] > 40:  # not the model's sleep; a stall
                continue
            for seg, (a, b) in zip(SEGMENTS, itertools.pairwise(marks), strict=False):
                found[seg].append((b - a) * 1000.0)  # perf trace's ms -> us
            found["round trip"].append((marks[-1] - marks[0]) * 1000.0)
    return {s: statistics.median(v) for s, v in found.items() if v}


def main(argv: list[str] | None = None) -> None:
    handle_sigterm()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=250)
    p.add_argument("--rounds", "--runs", dest="rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="1 round of 60 requests")
    p.add_argument("--baseline", type=Path, action="append", default=[], help="a source tree to measure too")
    args = p.parse_args(argv)
    if shutil.which("perf") is None:
        sys.exit("lone_hops.py needs `perf` (linux-perf) and root")
    rounds, requests = (1, 60) if args.quick else (args.rounds, args.requests)
    trees = {"this tree": HERE.parent, **{str(b): b.resolve() for b in args.baseline}}
    got: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            for name, tree in trees.items():
                for seg, us in run_round(tree, requests, Path(tmp) / "perf.trace").items():
                    got[name].setdefault(seg, []).append(us)
                last = ", ".join(f"{s} {v[-1]:.0f}" for s, v in got[name].items())
                print(f"round {i + 1}/{rounds} {name}: {last}", flush=True)
    rows = [[s, *(statistics.median(got[n][s]) if s in got[n] else "-" for n in trees)] for s in SEGMENTS]
    table = md_table(["segment (median us)", *trees], rows)
    print(table)
    body = (
        f"Lone requests to `batcher broker` and `batcher worker --model sim` (t(1) = 22.5 ms), {requests} a "
        f"round, {rounds} round(s), the trees alternating; each segment cut at the processes' system "
        "calls under `perf trace` (see the script's doc), the median over the requests, then over the "
        "rounds.\n\n" + table
    )
    write_results("lone_hops", "A lone request hop by hop", body, {"rounds": got}, args.quick)


if __name__ == "__main__":
    main()
