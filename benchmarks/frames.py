"""One frame per batch or one frame per request: what a BATCH costs either way.

The broker sends a batch's request bodies to its worker either joined in one frame
(one send, but a copy of every body into the joined frame) or as one frame each (one
send per body, each passed to libzmq by reference, no copy). This measures both for a
range of body sizes: a ROUTER sends batches of --batch-size bodies over TCP loopback to
a DEALER in another process, which receives each batch and cuts it back into its bodies
(the worker's side), then acknowledges it, --depth batches in flight. Reported per
size: microseconds per batch each way, and joined / per-frame. protocol.ZERO_COPY_BYTES
(where the broker switches to one frame per body) is chosen from this.

    python benchmarks/frames.py
    python benchmarks/frames.py --quick
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from typing import Any

import zmq
from common import handle_sigterm, md_table, write_results

from batcher.serve.launcher import free_tcp_address
from batcher.transport.zmqio import recv_frames, send_frames
from batcher.wire import protocol

SIZES = (256, 4096, 16384, 65536, 262144, 1048576)


def receiver(address: str) -> None:
    """The worker's side: receive each BATCH, cut it into bodies, acknowledge it."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send(b"hello")
    try:
        while True:
            sock.poll()  # recv_frames never blocks
            frames = recv_frames(sock, copied=3)
            if frames[0] == b"stop":
                return
            lengths = protocol.unpack(frames[2])[2]
            bodies = protocol.split_bodies(lengths, frames[3:])
            sock.send(len(bodies).to_bytes(4, "little"))
    finally:
        sock.close(0)
        ctx.term()


def measure(
    sock: zmq.Socket[Any], peer: bytes, bodies: list[bytes], joined: bool, batches: int, depth: int
) -> float:
    """Microseconds per batch, `batches` sent with `depth` in flight."""
    header = protocol.pack([1, [0.0] * len(bodies), [len(b) for b in bodies]])
    body_frames = [b"".join(bodies)] if joined else bodies
    frames = [peer, protocol.WORKER_PROTOCOL, protocol.CMD_BATCH, header]
    in_flight = 0
    t0 = time.perf_counter()
    for _ in range(batches):
        if in_flight >= depth:
            sock.recv_multipart()
            in_flight -= 1
        # Joined: the copy into one frame is made per batch, as the broker makes it.
        message = [*frames, b"".join(bodies)] if joined else [*frames, *body_frames]
        send_frames(sock, message)
        in_flight += 1
    while in_flight:
        sock.recv_multipart()
        in_flight -= 1
    return (time.perf_counter() - t0) / batches * 1e6


def main(argv: list[str] | None = None) -> None:
    handle_sigterm()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer batches and rounds")
    p.add_argument("--runs", type=int, default=None, help="interleaved rounds (5; quick 2)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--depth", type=int, default=2, help="batches in flight (the worker prefetch)")
    args = p.parse_args(argv)
    runs = args.runs or (2 if args.quick else 5)
    address = free_tcp_address()
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    proc = multiprocessing.get_context("spawn").Process(target=receiver, args=(address,), daemon=True)
    proc.start()
    results: dict[int, dict[str, list[float]]] = {s: {"joined": [], "per_frame": []} for s in SIZES}
    try:
        if not sock.poll(30_000):
            raise SystemExit("the receiver did not connect within 30 s")
        peer = sock.recv_multipart()[0]
        for i in range(runs):
            for size in SIZES:
                # As the broker holds them: a large body as the zmq.Frame it arrived in.
                bodies: list[Any] = [bytes([j]) * size for j in range(args.batch_size)]
                if size >= protocol.ZERO_COPY_BYTES:
                    bodies = [zmq.Frame(b) for b in bodies]
                total = size * args.batch_size
                batches = max(50, min(20_000, int((2e8 if not args.quick else 5e7) / max(total, 1))))
                for joined in (True, False):
                    us = measure(sock, peer, bodies, joined, batches, args.depth)
                    results[size]["joined" if joined else "per_frame"].append(us)
                print(
                    f"round {i + 1}/{runs} {size} B: joined {results[size]['joined'][-1]:.1f} us, "
                    f"one frame each {results[size]['per_frame'][-1]:.1f} us per batch of {args.batch_size}",
                    flush=True,
                )
        sock.send_multipart([peer, b"stop"])
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
        sock.close(0)
        ctx.term()
    rows: list[dict[str, Any]] = []
    for size in SIZES:
        joined_us, per_frame_us = (statistics.median(results[size][k]) for k in ("joined", "per_frame"))
        ratios = [j / f for j, f in zip(results[size]["joined"], results[size]["per_frame"], strict=True)]
        rows.append({"size_bytes": size, "joined_us": joined_us, "per_frame_us": per_frame_us,
                     "ratio": statistics.median(ratios), "per_round_ratio": ratios})  # fmt: skip
    table = md_table(
        ["body", "joined us/batch", "one frame each us/batch", "joined / one frame each", "per-round",
         "the broker sends"],
        [
            [f"{r['size_bytes']:,} B", r["joined_us"], r["per_frame_us"], r["ratio"],
             " ".join(f"{x:.2f}" for x in r["per_round_ratio"]),
             "one frame each" if r["size_bytes"] >= protocol.ZERO_COPY_BYTES else "joined"]
            for r in rows
        ],
    )  # fmt: skip
    body = (
        f"A ROUTER sends batches of {args.batch_size} bodies over TCP loopback to a DEALER in another "
        f"process, which cuts each batch into its bodies and acknowledges it; {args.depth} batches in "
        f"flight; {runs} interleaved round(s), medians. Joined: the bodies copied into one frame per "
        "batch (as the broker does below protocol.ZERO_COPY_BYTES = "
        f"{protocol.ZERO_COPY_BYTES:,} B); one frame each: every body its own frame, passed to libzmq by "
        "reference. A ratio above 1 means one frame each is faster.\n\n"
        f"{table}\n"
    )
    write_results(
        "frames",
        "One frame per batch or one frame per request",
        body,
        {"settings": {**vars(args), "runs": runs}, "rows": rows},
        args.quick,
    )


if __name__ == "__main__":
    main()
