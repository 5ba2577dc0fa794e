"""Served against offline: the generated ONNX MLP (benchmarks/onnx_mlp.py) through
`batcher serve`, against the same model run in one process.

- Offline: one onnxruntime session of one intra-op thread, in this process, at batch 32
  and at batch 1: requests/s = batch / median time of a session.run.
- Served: `batcher serve --model mlp=onnx:PATH --workers W --threads-per-worker T
  --max-batch-size 32 --max-wait-ms 5`, driven in a closed loop by a separate load
  process (a DEALER keeping --concurrency FP32 tensor requests in flight), for W x T = 1
  x 1 (the target: >= 0.9 of offline at batch 32), 1 x 2 and 2 x 1; and at batch size 1
  (--max-batch-size 1, concurrency 8) for the served batching gain.

- Pinned: the target's serve again with `--pin-cpus` (the worker on the last core, the
  broker on the others, where the load process is pinned too), in the same rounds
  (`--no-pinned` leaves it out).

The target row alternates: one `serve` of 1 worker x 1 thread stays up, and each of
--rounds rounds measures offline and served for --duration seconds each (offline first,
then served first, and so on); its ratio is the served total over the offline total.
This VM's speed drifts by up to 1.5x within a minute (the same offline measurement: 5.4
to 9.8 ms a batch of 32, docs/benchmarks.md), so an offline figure taken a minute before
or after the served one says more about the drift than about serving; alternating gives
both the same machine. The offline side is what it was: the same model in this one
process, batch 32, one intra-op thread. The load process encodes its request tensor
once (every body is still what pack_carrying writes) and checks every reply.

    python benchmarks/onnx_served.py
    python benchmarks/onnx_served.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
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
from workers.placement import plan_cpus, usable_cpus

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


def request_body(req_id: int, encoded_rest: bytes) -> bytes:
    """A request body {"id": req_id, "model": "mlp", "input": x}, as pack_carrying writes it,
    from `encoded_rest` (rest_of_body: everything after the id, encoded once)."""
    return b"\x83\xa2id" + protocol.pack(req_id) + encoded_rest


def rest_of_body(x: Any) -> bytes:
    """The bytes of a request body after its id: the load process encodes its tensor once,
    not once a request (the same bytes: test_the_load_process_sends_what_pack_carrying_writes)."""
    whole = protocol.pack_carrying({"id": 0, "model": "mlp", "input": x}, x)
    head = b"\x83\xa2id" + protocol.pack(0)
    assert whole.startswith(head)
    return whole[len(head) :]


def load(
    address: str,
    concurrency: int,
    warmup_s: float,
    seconds: float,
    out: Any,
    cpus: tuple[int, ...] | None = None,
) -> None:
    """Closed loop from its own process: `concurrency` tensor requests in flight; puts
    (replies in the window, errors, latencies ms of the window) on `out`. Every reply is
    decoded and checked (its id one in flight, `ok` set); the request's tensor is encoded
    once, so the load process spends its core on the loop, not on re-encoding it. With
    `cpus`, it runs there only (beside a `serve --pin-cpus` broker)."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)  # before the zmq context starts its thread
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    x = np.random.default_rng(2).standard_normal(SIZES[0]).astype(np.float32)
    rest = rest_of_body(x)
    sent: dict[int, float] = {}
    next_id = 0

    def send() -> None:
        nonlocal next_id
        next_id += 1
        sent[next_id] = time.perf_counter()
        sock.send_multipart([b"", request_body(next_id, rest)])

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


def drive(
    frontend: str, concurrency: int, seconds: float, cpus: tuple[int, ...] | None = None
) -> tuple[int, int, list[float]]:
    """One closed-loop run of the load process against `frontend`: (ok, errors, latencies)."""
    mp = multiprocessing.get_context("spawn")
    out = mp.Queue()
    proc = mp.Process(target=load, args=(frontend, concurrency, 1.0, seconds, out, cpus))
    proc.start()
    try:
        ok, errors, latencies = out.get(timeout=seconds + 60)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return ok, errors, latencies


def percentiles(latencies: list[float]) -> dict[str, float]:
    latencies = sorted(latencies)

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else float("nan")

    return {"p50_ms": pct(0.5), "p99_ms": pct(0.99)}


def serve_args(path: Path, workers: int, threads: int, batch: int) -> list[str]:
    return ["--model", f"mlp=onnx:{path}", "--workers", str(workers), "--threads-per-worker", str(threads),
            "--max-batch-size", str(batch), "--max-wait-ms", "5"]  # fmt: skip


def served_rps(
    path: Path, workers: int, threads: int, batch: int, concurrency: int, seconds: float
) -> dict[str, Any]:
    with running_serve(serve_args(path, workers, threads, batch), workers) as serve:
        ok, errors, latencies = drive(serve.frontend, concurrency, seconds)
    return {"rps": ok / seconds, "errors": errors, **percentiles(latencies)}


def target_rounds(path: Path, rounds: int, concurrency: int, seconds: float, pinned: bool) -> dict[str, Any]:
    """The target: one serve of 1 worker x 1 thread, batch 32, kept up (and, `pinned`, a
    second one with --pin-cpus, its load process on the broker's cores); each round
    measures offline (batch 32, one thread, this process) and each serve, `seconds`
    each, in an order reversed every round, so that a drift of the machine cancels."""
    runs: dict[str, dict[str, Any]] = {"offline": {"rps": []}, "served": {"rps": [], "errors": 0, "lat": []}}
    with contextlib.ExitStack() as stack:
        serves = {"served": (stack.enter_context(running_serve(serve_args(path, 1, 1, 32), 1)), None)}
        if pinned:
            runs["pinned"] = {"rps": [], "errors": 0, "lat": []}
            serve = stack.enter_context(running_serve([*serve_args(path, 1, 1, 32), "--pin-cpus"], 1))
            serves["pinned"] = (serve, tuple(plan_cpus(usable_cpus(), 1, 1).broker))
        order = list(runs)
        for r in range(rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                if name == "offline":
                    runs[name]["rps"].append(offline_rps(path, 32, seconds))
                    continue
                serve, cpus = serves[name]
                ok, errs, lat = drive(serve.frontend, concurrency, seconds, cpus)
                runs[name]["rps"].append(ok / seconds)
                runs[name]["errors"] += errs
                runs[name]["lat"] += lat
    offline = runs["offline"]["rps"]
    result: dict[str, Any] = {"offline": offline, "offline_rps": statistics.mean(offline)}
    for name in order[1:]:
        served = runs[name]["rps"]
        result[name] = {
            "served": served,
            "ratios": [s / o for s, o in zip(served, offline, strict=True)],
            "ratio": sum(served) / sum(offline),
            "median_ratio": statistics.median(s / o for s, o in zip(served, offline, strict=True)),
            "rps": statistics.mean(served),
            "errors": runs[name]["errors"],
            **percentiles(runs[name]["lat"]),
        }
    return result


def main(argv: list[str] | None = None) -> None:
    handle_sigterm()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short runs")
    p.add_argument("--duration", type=float, default=None, help="seconds per measurement (4; quick 2)")
    p.add_argument(
        "--concurrency",
        type=int,
        default=128,
        help="requests in flight (128: four batches of 32, so a batch always waits for the worker)",
    )
    p.add_argument("--rounds", type=int, default=None, help="the target's offline/served rounds (6; quick 2)")
    p.add_argument(
        "--no-pinned",
        action="store_true",
        help="leave out the pinned serve (serve --pin-cpus; it needs Linux and 2 cores)",
    )
    args = p.parse_args(argv)
    seconds = args.duration or (2.0 if args.quick else 4.0)
    rounds = args.rounds or (2 if args.quick else 6)
    pinned = not args.no_pinned and len(usable_cpus()) >= 2
    with tempfile.TemporaryDirectory() as tmp:
        path = write_mlp(Path(tmp) / "mlp.onnx")
        target = target_rounds(path, rounds, args.concurrency, seconds, pinned)
        offline1 = offline_rps(path, 1, seconds)
        served = {
            "1 worker x 2 threads": served_rps(path, 1, 2, 32, args.concurrency, seconds),
            "2 workers x 1 thread": served_rps(path, 2, 1, 32, args.concurrency, seconds),
            "1 worker x 1 thread, batch 1": served_rps(path, 1, 1, 1, 8, seconds),
        }
        offline_again = offline_rps(path, 32, seconds)
    base = target["offline_rps"]
    rows: list[list[Any]] = [["offline, batch 32, 1 thread (mean of the rounds)", base, 1.0, "-", "-", "-"]]
    labels = {"served": "served, 1 worker x 1 thread (mean of the rounds)",
              "pinned": "served, 1 worker x 1 thread, `--pin-cpus` (mean of the rounds)"}  # fmt: skip
    for name, label in labels.items():
        if name in target:
            t = target[name]
            verdict = "met" if t["ratio"] >= TARGET else "MISSED"
            rows.append([label, t["rps"], t["ratio"], t["p50_ms"], t["p99_ms"], verdict])
    rows.append(["offline, batch 1, 1 thread", offline1, offline1 / base, "-", "-", "-"])
    for name, r in served.items():
        rows.append([f"served, {name}", r["rps"], r["rps"] / base, r["p50_ms"], r["p99_ms"], "-"])
    table = md_table(["", "requests/s", "/ offline batch 32", "p50 ms", "p99 ms", "target (>= 0.9)"], rows)
    medians = "; ".join(f"{name} {target[name]['median_ratio']:.3f}" for name in labels if name in target)
    per_round = "; ".join(
        f"{name}: "
        + ", ".join(
            f"{s:,.0f} / {o:,.0f} = {r:.3f}"
            for s, o, r in zip(target[name]["served"], target["offline"], target[name]["ratios"], strict=True)
        )
        for name in labels
        if name in target
    )
    gain_offline = base / offline1
    gain_served = target["served"]["rps"] / served["1 worker x 1 thread, batch 1"]["rps"]
    body = (
        f"The generated ONNX MLP {' -> '.join(map(str, SIZES))} (FP32, ReLU). Offline: one session of one "
        "intra-op thread in this process. Served: `batcher serve --max-batch-size 32 --max-wait-ms 5`, a "
        f"closed loop of {args.concurrency} FP32 tensor requests from a separate process ({seconds:g} s "
        f"after 1 s warm-up). The target rows alternate in {rounds} rounds, offline and each served "
        f"row {seconds:g} s each (in the table's order in rounds 1, 3, ..., reversed in rounds 2, 4, "
        "...), each `serve` kept up: a ratio is served over offline, summed over the rounds. The "
        "pinned `serve` runs its worker on the last core and its broker on the others, where its "
        "load process runs too (the issue's setup: one core for the model, the other for the "
        "broker and the load). The other "
        "rows each start their own `serve`, compared with the rounds' offline mean "
        f"(offline batch 32 once more at the end: {offline_again:,.0f} req/s).\n\n{table}\n\n"
        f"Per round, served / offline req/s: {per_round}. Median of the rounds' ratios: {medians}.\n\n"
        f"Batching gain (batch 32 / batch 1): offline {gain_offline:.1f}x, served {gain_served:.1f}x.\n"
    )
    write_results(
        "onnx_served",
        "Served against offline: a real ONNX model",
        body,
        {"target": target, "offline32_end": offline_again, "offline1": offline1, "served": served},
        args.quick,
    )


if __name__ == "__main__":
    main()
