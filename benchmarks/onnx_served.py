"""Served against offline: the generated ONNX MLP (benchmarks/onnx_mlp.py) through
`batcher serve`, against the same model run in one process.

- Offline: one onnxruntime session of one intra-op thread, in this process, at batch 32
  and at batch 1, back to back: requests done over the time taken (slow calls count, as
  they do served).
- Served: `batcher serve --model mlp=onnx:PATH --workers W --threads-per-worker T
  --max-batch-size 32 --max-wait-ms 5`, driven in a closed loop by a separate load
  process (a DEALER keeping --concurrency FP32 tensor requests in flight), for W x T = 1
  x 1 (the target: >= 0.9 of offline at batch 32), 1 x 2 and 2 x 1; and at batch size 1
  (--max-batch-size 1, concurrency 8) for the served batching gain.
- Pinned: the target's serve again with `--pin-cpus` (the worker on the last core, the
  broker on the others, where the load process is pinned too), in the same slices
  (`--no-pinned` leaves it out).

The target rows take turns in --slices short slices of --slice-s seconds (offline,
served, pinned, then the reverse, ...), one `serve` of each kept up and its load process
paused between its slices; a ratio is the served total over the offline total. This
VM's speed drifts by up to 1.5x within a minute (offline alone: 5.4 to 9.8 ms a batch of
32, docs/benchmarks-history.md): slices of half a second give every row the same machine, where
rounds of seconds did not (four runs of 6 rounds of 4 s gave 0.73 to 1.00). The load
process encodes its request tensor once (every body is still what pack_carrying writes)
and checks every reply.

    python benchmarks/onnx_served.py
    python benchmarks/onnx_served.py --quick
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import multiprocessing
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq
from common import handle_sigterm, md_table, running_serve, write_results
from onnx_mlp import SIZES, write_mlp

from batcher.wire import protocol
from workers.placement import plan_cpus, usable_cpus

TARGET = 0.9
#: Each slice of the target starts after this much unmeasured work (the pipeline filling;
#: the offline session's first call after the serve's slice), and a served slice ends by
#: letting its requests in flight finish unmeasured.
RAMP_S = 0.1


def offline_session(path: Path) -> Any:
    """The offline side: one onnxruntime session of one intra-op thread, in this process."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


def offline_run(session: Any, batch: int, seconds: float) -> float:
    """Requests/s of back-to-back session.run calls at `batch` for `seconds`: requests done
    over the time taken, as served requests/s are counted (slow calls included)."""
    x = np.random.default_rng(1).standard_normal((batch, SIZES[0])).astype(np.float32)
    calls, start = 0, time.perf_counter()
    end = start + seconds
    while (now := time.perf_counter()) < end:
        session.run(None, {"x": x})
        calls += 1
    return batch * calls / (now - start)


def offline_rps(path: Path, batch: int, seconds: float) -> float:
    session = offline_session(path)
    offline_run(session, batch, RAMP_S)
    return offline_run(session, batch, seconds)


class RestOfBody:
    """The bytes of a request body {"id": req_id, "model": "mlp", "input": x} after its id,
    as pack_carrying writes them: the load process encodes its tensor once per size of an
    encoded id (the tensor's pad, which aligns its data, follows that size), not once a
    request (the same bytes: test_the_load_process_sends_what_pack_carrying_writes)."""

    def __init__(self, x: Any) -> None:
        self.x = x
        self._by_id_size: dict[int, bytes] = {}

    def after(self, id_bytes: bytes) -> bytes:
        rest = self._by_id_size.get(len(id_bytes))
        if rest is None:
            whole = protocol.pack_carrying(
                {"id": protocol.unpack(id_bytes), "model": "mlp", "input": self.x}, self.x
            )
            head = b"\x83\xa2id" + id_bytes
            assert whole.startswith(head)
            rest = self._by_id_size[len(id_bytes)] = whole[len(head) :]
        return rest


def request_body(req_id: int, rest: RestOfBody) -> bytes:
    """A request body {"id": req_id, "model": "mlp", "input": x}, as pack_carrying writes it."""
    id_bytes = protocol.pack(req_id)
    return b"\x83\xa2id" + id_bytes + rest.after(id_bytes)


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
        load = GatedLoad.start(serve.frontend, concurrency, None)
        load.slice(1.0)  # warm-up
        window = load.slice(seconds)
        times, latencies, errors = load.results()
    first, last = in_window(times, *window)
    return {"rps": (last - first) / seconds, "errors": errors, **percentiles(latencies[first:last])}


def in_window(times: list[float], t0: float, t1: float) -> tuple[int, int]:
    """The indexes [first, last) of the sorted `times` within [t0, t1)."""
    return bisect.bisect_left(times, t0), bisect.bisect_left(times, t1)


@dataclass
class GatedLoad:
    """A load process that keeps `concurrency` requests in flight while `go` is set, sends
    nothing while it is clear (setting `idle` once its last request is answered), and at
    `stop` puts (the perf_counter time of every ok reply, its latency ms, errors) on `out`.
    perf_counter is CLOCK_MONOTONIC on Linux, one clock for every process."""

    process: Any
    go: Any
    idle: Any
    stop: Any
    out: Any

    @classmethod
    def start(cls, address: str, concurrency: int, cpus: tuple[int, ...] | None) -> GatedLoad:
        mp = multiprocessing.get_context("spawn")
        go, idle, stop, out = mp.Event(), mp.Event(), mp.Event(), mp.Queue()
        proc = mp.Process(target=gated_load, args=(address, concurrency, cpus, go, idle, stop, out))
        proc.start()
        return cls(proc, go, idle, stop, out)

    def slice(self, seconds: float) -> tuple[float, float]:
        """Load for RAMP_S + `seconds`, then let the requests in flight finish; the window
        measured."""
        self.idle.clear()
        self.go.set()
        time.sleep(RAMP_S)
        t0 = time.perf_counter()
        time.sleep(seconds)
        t1 = time.perf_counter()
        self.go.clear()
        if not self.idle.wait(60):
            raise RuntimeError("the served requests in flight did not finish within 60 s")
        return t0, t1

    def results(self) -> tuple[list[float], list[float], int]:
        self.stop.set()
        try:
            times, latencies, errors = self.out.get(timeout=60)
            return times, latencies, errors
        finally:
            self.process.join(10)
            if self.process.is_alive():
                self.process.kill()


def gated_load(
    address: str, concurrency: int, cpus: tuple[int, ...] | None, go: Any, idle: Any, stop: Any, out: Any
) -> None:
    """GatedLoad's process: every reply is decoded and checked (its id one in flight, `ok`
    set); the request's tensor is encoded once."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)  # before the zmq context starts its thread
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    rest = RestOfBody(np.random.default_rng(2).standard_normal(SIZES[0]).astype(np.float32))
    sent: dict[int, float] = {}
    next_id, errors = 0, 0
    times: list[float] = []
    latencies: list[float] = []
    while not stop.is_set():
        if go.is_set():
            while len(sent) < concurrency:
                next_id += 1
                sent[next_id] = time.perf_counter()
                sock.send_multipart([b"", request_body(next_id, rest)])
        elif not sent:
            idle.set()
            go.wait(0.05)
            continue
        if not sock.poll(100):
            continue
        reply = msgpack.unpackb(sock.recv_multipart()[-1])
        now = time.perf_counter()
        t0 = sent.pop(reply.get("id"), None)
        if t0 is not None and reply.get("ok"):
            times.append(now)
            latencies.append((now - t0) * 1000.0)
        else:
            errors += 1
    sock.close(0)
    ctx.term()
    out.put((times, latencies, errors))


def target_slices(path: Path, slices: int, concurrency: int, seconds: float, pinned: bool) -> dict[str, Any]:
    """The target: one serve of 1 worker x 1 thread, batch 32, kept up (and, `pinned`, a
    second one with --pin-cpus, its load process on the broker's cores), measured in
    `slices` short slices of `seconds` each, offline and each serve in turn (the order
    reversed every other time), so that the machine's drift falls on all of them alike."""
    session = offline_session(path)
    offline: list[float] = []
    windows: dict[str, list[tuple[float, float]]] = {"served": []}
    with contextlib.ExitStack() as stack:
        serves: dict[str, tuple[Any, tuple[int, ...] | None]] = {
            "served": (stack.enter_context(running_serve(serve_args(path, 1, 1, 32), 1)), None)
        }
        if pinned:
            windows["pinned"] = []
            serve = stack.enter_context(running_serve([*serve_args(path, 1, 1, 32), "--pin-cpus"], 1))
            serves["pinned"] = (serve, tuple(plan_cpus(usable_cpus(), 1, 1).broker))
        loads = {
            name: GatedLoad.start(serve.frontend, concurrency, cpus) for name, (serve, cpus) in serves.items()
        }
        stack.callback(lambda: [load.stop.set() for load in loads.values()])
        order = ["offline", *serves]
        for i in range(slices):
            for name in order if i % 2 == 0 else order[::-1]:
                if name == "offline":
                    offline_run(session, 32, RAMP_S)
                    offline.append(offline_run(session, 32, seconds))
                else:
                    windows[name].append(loads[name].slice(seconds))
        replies = {name: load.results() for name, load in loads.items()}
    result: dict[str, Any] = {"offline": offline, "offline_rps": statistics.mean(offline)}
    for name, (times, latencies, errors) in replies.items():
        served, in_windows = [], []
        for t0, t1 in windows[name]:
            first, last = in_window(times, t0, t1)
            served.append((last - first) / (t1 - t0))
            in_windows += latencies[first:last]
        ratios = [s / o for s, o in zip(served, offline, strict=True)]
        thirds = [sum(served[k::3]) / sum(offline[k::3]) for k in range(3)]
        result[name] = {
            "served": served,
            "ratios": ratios,
            "ratio": sum(served) / sum(offline),
            "median_ratio": statistics.median(ratios),
            "thirds": thirds,
            "rps": statistics.mean(served),
            "errors": errors,
            **percentiles(in_windows),
        }
    return result


def main(argv: list[str] | None = None) -> None:
    handle_sigterm()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short runs")
    p.add_argument("--duration", type=float, default=None, help="seconds per other row (4; quick 2)")
    p.add_argument(
        "--concurrency",
        type=int,
        default=128,
        help="requests in flight (128: four batches of 32, so a batch always waits for the worker)",
    )
    p.add_argument("--slices", type=int, default=None, help="the target's slices of each (40; quick 10)")
    p.add_argument("--slice-s", type=float, default=0.5, help="seconds a slice (0.5)")
    p.add_argument(
        "--no-pinned",
        action="store_true",
        help="leave out the pinned serve (serve --pin-cpus; it needs Linux and 2 cores)",
    )
    args = p.parse_args(argv)
    seconds = args.duration or (2.0 if args.quick else 4.0)
    slices = args.slices or (10 if args.quick else 40)
    pinned = not args.no_pinned and len(usable_cpus()) >= 2
    with tempfile.TemporaryDirectory() as tmp:
        path = write_mlp(Path(tmp) / "mlp.onnx")
        target = target_slices(path, slices, args.concurrency, args.slice_s, pinned)
        offline1 = offline_rps(path, 1, seconds)
        served = {
            "1 worker x 2 threads": served_rps(path, 1, 2, 32, args.concurrency, seconds),
            "2 workers x 1 thread": served_rps(path, 2, 1, 32, args.concurrency, seconds),
            "1 worker x 1 thread, batch 1": served_rps(path, 1, 1, 1, 8, seconds),
        }
        offline_again = offline_rps(path, 32, seconds)
    base = target["offline_rps"]
    rows: list[list[Any]] = [["offline, batch 32, 1 thread (mean of the slices)", base, 1.0, "-", "-", "-"]]
    labels = {"served": "served, 1 worker x 1 thread (mean of the slices)",
              "pinned": "served, 1 worker x 1 thread, `--pin-cpus` (mean of the slices)"}  # fmt: skip
    for name, label in labels.items():
        if name in target:
            t = target[name]
            verdict = "met" if t["ratio"] >= TARGET else "MISSED"
            rows.append([label, t["rps"], t["ratio"], t["p50_ms"], t["p99_ms"], verdict])
    rows.append(["offline, batch 1, 1 thread", offline1, offline1 / base, "-", "-", "-"])
    for name, r in served.items():
        rows.append([f"served, {name}", r["rps"], r["rps"] / base, r["p50_ms"], r["p99_ms"], "-"])
    table = md_table(["", "requests/s", "/ offline batch 32", "p50 ms", "p99 ms", "target (>= 0.9)"], rows)
    spread = "; ".join(
        f"{name}: median of the slices' ratios {target[name]['median_ratio']:.3f}, by thirds of the "
        "slices (1st, 4th, ...; 2nd, 5th, ...; 3rd, ...) "
        f"{', '.join(f'{r:.3f}' for r in target[name]['thirds'])}, {target[name]['errors']} errors"
        for name in labels
        if name in target
    )
    offline_range = f"{min(target['offline']):,.0f} to {max(target['offline']):,.0f}"
    gain_offline = base / offline1
    gain_served = target["served"]["rps"] / served["1 worker x 1 thread, batch 1"]["rps"]
    body = (
        f"The generated ONNX MLP {' -> '.join(map(str, SIZES))} (FP32, ReLU). Offline: one session of one "
        "intra-op thread in this process, back to back, requests done over the time taken. Served: "
        "`batcher serve --max-batch-size 32 --max-wait-ms 5`, a closed loop of "
        f"{args.concurrency} FP32 tensor requests from a separate process, replies counted. The target "
        f"rows take turns in {slices} slices of {args.slice_s:g} s each (offline, served, pinned, then "
        "the reverse), each after 0.1 s unmeasured, each `serve` kept up and its load process paused "
        "between its slices: a ratio is served over offline, summed over the slices. The pinned `serve` "
        "runs its worker on the last core and its broker on the others, where its load process runs "
        "too. The other rows each start their own `serve` and run "
        f"{seconds:g} s after 1 s warm-up, compared with the slices' offline mean (offline batch 32 "
        f"once more at the end: {offline_again:,.0f} req/s).\n\n{table}\n\n"
        f"Offline slices: {offline_range} req/s. {spread}.\n\n"
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
