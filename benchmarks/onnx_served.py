"""Served against offline: the generated ONNX MLP (benchmarks/onnx_mlp.py) through
`batcher serve`, against the same model run in one process.

- Offline: one onnxruntime session of one intra-op thread, in this process, at batch 32
  and at batch 1: requests/s = batch / median time of a session.run.
- Served: `batcher serve --model mlp=onnx:PATH --workers W --threads-per-worker T
  --max-batch-size 32 --max-wait-ms 5`, driven in a closed loop by a separate load
  process (a DEALER keeping --concurrency FP32 tensor requests in flight), for W x T = 1
  x 1 (the target: >= 0.9 of offline at batch 32), 1 x 2 and 2 x 1; and at batch size 1
  (--max-batch-size 1, concurrency 8) for the served batching gain.

    python benchmarks/onnx_served.py
    python benchmarks/onnx_served.py --quick
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq
from common import handle_sigterm, md_table, running_serve, write_results
from onnx_mlp import SIZES, write_mlp

from batcher import protocol

TARGET = 0.9


def offline_rps(path: Path, batch: int, seconds: float) -> float:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((batch, SIZES[0])).astype(np.float32)
    for _ in range(20):
        session.run(None, {"x": x})
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        session.run(None, {"x": x})
        times.append(time.perf_counter() - t0)
    return batch / statistics.median(times)


def load(address: str, concurrency: int, warmup_s: float, seconds: float, out: Any) -> None:
    """Closed loop from its own process: `concurrency` tensor requests in flight; puts
    (replies in the window, errors, latencies ms of the window) on `out`."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    x = np.random.default_rng(2).standard_normal(SIZES[0]).astype(np.float32)
    sent: dict[int, float] = {}
    next_id = 0

    def send() -> None:
        nonlocal next_id
        next_id += 1
        sent[next_id] = time.perf_counter()
        sock.send_multipart([b"", protocol.pack_carrying({"id": next_id, "model": "mlp", "input": x}, x)])

    for _ in range(concurrency):
        send()
    start = time.perf_counter()
    window_from, window_to = start + warmup_s, start + warmup_s + seconds
    ok = errors = 0
    latencies = []
    while True:
        now = time.perf_counter()
        if now >= window_to:
            break
        if not sock.poll(1000):
            continue
        reply = msgpack.unpackb(sock.recv_multipart()[-1])
        now = time.perf_counter()
        t0 = sent.pop(reply.get("id"), None)
        if t0 is not None and window_from <= now < window_to:
            if reply.get("ok"):
                ok += 1
                latencies.append((now - t0) * 1000.0)
            else:
                errors += 1
        send()
    sock.close(0)
    ctx.term()
    out.put((ok, errors, latencies))


def served_rps(
    path: Path, workers: int, threads: int, batch: int, concurrency: int, seconds: float
) -> dict[str, Any]:
    args = ["--model", f"mlp=onnx:{path}", "--workers", str(workers), "--threads-per-worker", str(threads),
            "--max-batch-size", str(batch), "--max-wait-ms", "5"]  # fmt: skip
    with running_serve(args, workers) as serve:
        mp = multiprocessing.get_context("spawn")
        out = mp.Queue()
        proc = mp.Process(target=load, args=(serve.frontend, concurrency, 1.0, seconds, out))
        proc.start()
        try:
            ok, errors, latencies = out.get(timeout=seconds + 60)
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else float("nan")

    return {"rps": ok / seconds, "errors": errors, "p50_ms": pct(0.5), "p99_ms": pct(0.99)}


def main(argv: list[str] | None = None) -> None:
    handle_sigterm()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short runs")
    p.add_argument("--duration", type=float, default=None, help="seconds per measurement (6; quick 2)")
    p.add_argument("--concurrency", type=int, default=64)
    args = p.parse_args(argv)
    seconds = args.duration or (2.0 if args.quick else 6.0)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_mlp(Path(tmp) / "mlp.onnx")
        offline32 = offline_rps(path, 32, seconds)
        offline1 = offline_rps(path, 1, seconds)
        served = {
            "1 worker x 1 thread": served_rps(path, 1, 1, 32, args.concurrency, seconds),
            "1 worker x 2 threads": served_rps(path, 1, 2, 32, args.concurrency, seconds),
            "2 workers x 1 thread": served_rps(path, 2, 1, 32, args.concurrency, seconds),
            "1 worker x 1 thread, batch 1": served_rps(path, 1, 1, 1, 8, seconds),
        }
        offline_again = offline_rps(path, 32, seconds)
    base = statistics.mean([offline32, offline_again])
    rows = [["offline, batch 32, 1 thread", base, 1.0, "-", "-", "-"],
            ["offline, batch 1, 1 thread", offline1, offline1 / base, "-", "-", "-"]]  # fmt: skip
    for name, r in served.items():
        verdict = ("met" if r["rps"] / base >= TARGET else "MISSED") if name == "1 worker x 1 thread" else "-"
        rows.append([f"served, {name}", r["rps"], r["rps"] / base, r["p50_ms"], r["p99_ms"], verdict])
    table = md_table(["", "requests/s", "/ offline batch 32", "p50 ms", "p99 ms", "target (>= 0.9)"], rows)
    gain_offline = base / offline1
    gain_served = served["1 worker x 1 thread"]["rps"] / served["1 worker x 1 thread, batch 1"]["rps"]
    body = (
        f"The generated ONNX MLP {' -> '.join(map(str, SIZES))} (FP32, ReLU). Offline: one session of one "
        "intra-op thread in this process (measured before and after the served runs, mean). Served: "
        f"`batcher serve --max-batch-size 32 --max-wait-ms 5`, a closed loop of {args.concurrency} FP32 "
        f"tensor requests from a separate process ({seconds:g} s after 1 s warm-up).\n\n{table}\n\n"
        f"Batching gain (batch 32 / batch 1): offline {gain_offline:.1f}x, served {gain_served:.1f}x.\n"
    )
    write_results(
        "onnx_served",
        "Served against offline: a real ONNX model",
        body,
        {"offline32": [offline32, offline_again], "offline1": offline1, "served": served},
        args.quick,
    )


if __name__ == "__main__":
    main()
