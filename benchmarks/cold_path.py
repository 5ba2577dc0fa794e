"""A lone request's path through the broker and the worker on a cold CPU (issue 30), in
process, so that a change of a few tens of microseconds shows where `lone_request.py`
cannot tell it from noise.

After 22 ms idle (a lone request's model time) every line of Python runs 10 to 20 times
slower than warm on this VM: whatever the host ran meanwhile took the caches
(docs/benchmarks-history.md, "A lone request, hop by hop"). So what a lone request pays is
roughly how much code and data its path touches, not its warm cost. Each part sleeps
22.5 ms before every step it times, as the processes do between a request and its reply:

- worker, before the model: `run_batch` of a BATCH of one small request (the sim model's
  kind), from the call to the model's start (header and body decoded, checks);
- worker, after the model: from the model's return to the REPLY frames (the reply encoded);
- broker, request: a lone request waiting on the frontend, to its BATCH sent to an idle
  worker (the loop's turn as `Broker.run` makes it: the frontend's drain, timers, dispatch);
- broker, reply: the worker's REPLY waiting on the backend, to the reply sent to the client.

The broker runs in this process on inproc sockets, with one worker faked by a DEALER.
Each part runs in a fresh process per tree and round, the trees alternating (with
--baseline DIR, a source tree: `git archive 26ecab0 | tar -x -C /tmp/v1` for v1, whose
worker is measured; its broker is not, its layout being another); medians of the steps,
then the median over the rounds.

    python benchmarks/cold_path.py [--rounds 5] [--steps 150] [--baseline /tmp/base ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
IDLE_S = 0.0225  # the sim model's t(1): what a lone request's processes sleep through
PARTS = ("worker", "broker")


def sim_outputs(inputs: list[Any]) -> list[Any]:
    """The sim model's outputs (workers.models.SimModel), without its sleep."""
    n = len(inputs)
    return [{"echo": x, "amortized_ms": IDLE_S * 1000.0 / n, "batch_size": n} for x in inputs]


def part_worker(steps: int) -> dict[str, float]:
    """us from run_batch's call to the model, and from the model's return to the REPLY."""
    import msgpack

    v1 = not (Path.cwd() / "workers" / "batch_runner.py").exists()
    if v1:
        from batcher import protocol  # type: ignore[attr-defined]
        from workers.worker import run_batch  # type: ignore[attr-defined]
    else:
        from batcher.wire import protocol
        from workers.batch_runner import run_batch
    clock = time.perf_counter
    stamps: dict[str, float] = {}

    def model(inputs: list[Any]) -> list[Any]:
        stamps["begun"] = clock()
        time.sleep(IDLE_S)
        stamps["ended"] = clock()
        return sim_outputs(inputs)

    body = msgpack.packb({"id": 7, "input": 7})
    before, after = [], []
    for i in range(steps):
        frames = protocol.batch_frames(i, [0.1], [body])
        time.sleep(IDLE_S)
        t0 = clock()
        if v1:
            run_batch(model, frames[2], frames[3], "host/gpu-/1")
        else:
            run_batch(model, frames[2], frames[3:], "host/gpu-/1", time.monotonic())
        t1 = clock()
        before.append(stamps["begun"] - t0)
        after.append(t1 - stamps["ended"])
    return {"worker, before the model": _median_us(before), "worker, after the model": _median_us(after)}


def part_broker(steps: int) -> dict[str, float]:
    """us from a lone request waiting to its BATCH sent, and from its REPLY waiting to the
    client's reply sent."""
    if not (Path.cwd() / "batcher" / "broker" / "loop.py").exists():
        return {}  # another layout (v1's): its broker is not measured here
    import msgpack
    import zmq

    import batcher.broker.frontend as frontend_module
    from batcher.broker.loop import Broker, BrokerSettings
    from batcher.core.limits import BatchSettings
    from batcher.wire import protocol

    ctx = zmq.Context()
    settings = BrokerSettings(
        frontend="inproc://cold-fe", backend="inproc://cold-be", models=("sim",),
        batch=BatchSettings(max_batch_size=32, max_wait_ms=10),
    )  # fmt: skip
    broker = Broker(settings, ctx)
    client, worker = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    client.connect("inproc://cold-fe")
    worker.connect("inproc://cold-be")
    worker.send_multipart(protocol.ready_frames("sim", None, os.getpid()))
    _wait_readable(broker.backend)
    broker.workers.drain(time.monotonic())
    clock = time.perf_counter
    sent: list[float] = []
    send_replies, send_batch = frontend_module.send_replies, broker.workers.send

    def replies_sent(*args: Any) -> Any:
        out = send_replies(*args)
        sent.append(clock())
        return out

    def batch_sent(*args: Any) -> Any:
        out = send_batch(*args)
        sent.append(clock())
        return out

    frontend_module.send_replies = replies_sent  # type: ignore[assignment]
    broker.workers.send = batch_sent  # type: ignore[method-assign]

    def turn(sock: Any) -> float:
        """The loop's turn after a poll that found `sock` readable (Broker.run's steps)."""
        time.sleep(IDLE_S)
        sent.clear()
        t0 = clock()
        now = time.monotonic()
        if sock is broker.backend:
            broker._guard(broker.workers.drain, now)
        else:
            broker._guard(broker.clients.drain, now)
        for fn in broker.timers.due(time.monotonic()):
            broker._guard(fn, time.monotonic())
        broker._guard(broker._dispatch)
        return sent[0] - t0

    request, reply = [], []
    try:
        for i in range(steps):
            client.send_multipart([b"", msgpack.packb({"id": i, "input": i})])
            _wait_readable(broker.frontend)
            request.append(turn(broker.frontend))
            frames = worker.recv_multipart()
            while frames[1] != protocol.CMD_BATCH:  # (a heartbeat)
                frames = worker.recv_multipart()
            batch_id = protocol.unpack(frames[2])[0]
            body = protocol.ok_reply(i, sim_outputs([i])[0], {"batch_size": 1, "queue_ms": 0.1})
            worker.send_multipart(protocol.reply_frames(batch_id, IDLE_S * 1000.0, [body], 0, 0.05))
            _wait_readable(broker.backend)
            reply.append(turn(broker.backend))
            client.recv_multipart()
    finally:
        for sock in (client, worker):
            sock.close(linger=0)
        broker.close()
        ctx.term()
    return {
        "broker, request to its batch": _median_us(request),
        "broker, reply to its client": _median_us(reply),
    }


def _wait_readable(sock: Any, timeout_s: float = 10.0) -> None:
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError("no message within 10 s")


def _median_us(values: list[float]) -> float:
    return statistics.median(values) * 1e6


def measure(part: str, tree: Path, steps: int) -> dict[str, float]:
    """One round of `part` in a fresh process importing batcher from `tree`."""
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{HERE}"}
    out = subprocess.run(
        [sys.executable, str(HERE / "cold_path.py"), "--part", part, "--steps", str(steps)],
        capture_output=True, text=True, cwd=tree, env=env, timeout=600, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", "--runs", dest="rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=150, help="timed steps a round (each after 22.5 ms idle)")
    p.add_argument("--quick", action="store_true", help="1 round of 40 steps")
    p.add_argument("--baseline", type=Path, action="append", default=[], help="a source tree to measure too")
    p.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # (one round, in a child)
    args = p.parse_args(argv)
    if args.part:
        print(json.dumps(part_worker(args.steps) if args.part == "worker" else part_broker(args.steps)))
        return
    # Imported here, not by a child measuring another tree (common imports this tree's batcher).
    from common import handle_sigterm, md_table, write_results

    handle_sigterm()
    rounds, steps = (1, 40) if args.quick else (args.rounds, args.steps)
    trees = {"this tree": HERE.parent, **{str(b): b.resolve() for b in args.baseline}}
    got: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    for i in range(rounds):
        for part in PARTS:
            for name, tree in trees.items():
                for step, us in measure(part, tree, steps).items():
                    got[name].setdefault(step, []).append(us)
        print(f"round {i + 1}/{rounds}: " + json.dumps(got), flush=True)
    columns = list(dict.fromkeys(step for g in got.values() for step in g))
    rows = []
    for name, g in got.items():
        cells = [statistics.median(g[c]) if c in g else "-" for c in columns]
        known = [v for v in cells if isinstance(v, float)]
        rows.append([name, *cells, sum(known) if len(known) == len(columns) else "-"])
    table = md_table(["tree", *(f"{c} us" for c in columns), "sum us"], rows)
    print(table)
    body = (
        f"A lone request's steps in process, each timed after {IDLE_S * 1000:g} ms idle (a cold CPU), "
        f"medians of {steps} steps, then over {rounds} round(s), the trees alternating, each part "
        "in a fresh process (see the script's doc for what each step holds).\n\n" + table
    )
    write_results("cold_path", "A lone request's path on a cold CPU", body, {"rounds": got}, args.quick)


if __name__ == "__main__":
    main()
