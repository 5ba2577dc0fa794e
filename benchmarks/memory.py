"""Memory: the broker's resident memory with nothing queued and with 100,000 small requests queued.

`batcher serve --workers 0 --model sim` starts a broker that knows model sim but has no
worker for it, so every request stays queued. This script sends 100,000 small requests
over one raw DEALER socket, waits until the broker's `stats` reports them all queued,
and reads the broker's RSS (the `serve` process itself: workers would be its children).
Bytes per queued request = (RSS full - RSS empty) / requests; target < 2048.

When `batcher serve --help` lists --max-queue, it is raised to the number of requests
so none is refused as overloaded.

    python benchmarks/memory.py
    python benchmarks/memory.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import time
from typing import Any

import msgpack
import zmq
from common import broker_rss_bytes, handle_sigterm, md_table, serve_args, serve_help, write_results

from batcher.client.sync import BatcherError, Client
from batcher.serve.launcher import ServeProcess

TARGET_BYTES_PER_REQUEST = 2048
MODEL = "sim"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one run")
    p.add_argument(
        "--runs", type=int, default=None, help="runs, each with a fresh broker; median (3; quick 1)"
    )
    p.add_argument("--requests", type=int, default=100_000, help="requests to queue")
    p.add_argument("--payload-bytes", type=int, default=16, help="size of each request's input")
    p.add_argument("--fill-timeout", type=float, default=120.0, help="seconds to wait for the queue to fill")
    args = p.parse_args(argv)
    args.runs = args.runs or (1 if args.quick else 3)
    return args


def settled_rss(serve: ServeProcess, samples: int = 5, interval_s: float = 0.1) -> int:
    """The median of a few RSS readings, so one allocator hiccup does not count."""
    readings = []
    for _ in range(samples):
        readings.append(broker_rss_bytes(serve))
        time.sleep(interval_s)  # between readings of a quiet process only
    return int(statistics.median(readings))


def queued(client: Client) -> int:
    stats: dict[str, Any] = client.control("stats")
    return int(stats["models"][MODEL]["queued"])


def fill(sock: zmq.Socket[Any], n: int, payload: bytes) -> float:
    """Send n requests as fast as the socket takes them; returns the seconds it took."""
    packb = msgpack.Packer().pack
    send = sock.send_multipart
    t0 = time.perf_counter()
    for i in range(1, n + 1):
        send([b"", packb({"id": i, "input": payload, "model": MODEL})])
    return time.perf_counter() - t0


def replies_waiting(sock: zmq.Socket[Any]) -> dict[str, int]:
    """Count the replies already on the socket (with no worker, only errors can come)."""
    codes: dict[str, int] = {}
    for _ in range(10_000_000):  # bounded: at most every request answered
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            break
        reply = msgpack.unpackb(frames[-1], raw=False)
        code = "ok" if reply.get("ok") else str((reply.get("error") or {}).get("code", "unknown"))
        codes[code] = codes.get(code, 0) + 1
    return codes


def stop_now(serve: ServeProcess) -> float:
    """Stop a broker with a full queue without the shutdown grace period: the first SIGTERM
    starts draining, the second (from ServeProcess.stop) answers everything and exits."""
    t0 = time.perf_counter()
    if serve.process is not None and serve.process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(serve.process.pid, signal.SIGTERM)
        time.sleep(0.2)  # let the first signal be handled on its own
    serve.stop()
    return time.perf_counter() - t0


def one_run(args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    serve = ServeProcess(serve_args(workers=0, model=MODEL, max_batch_size=32, max_wait_ms=5.0, extra=extra))
    ctx: zmq.Context[Any] = zmq.Context()
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    stop_s = None
    try:
        serve.start()
        serve.wait_ready(0)
        with Client(serve.frontend, timeout_s=10.0) as client:
            if queued(client) != 0:
                raise RuntimeError("a fresh broker reports queued requests")
            rss_empty = settled_rss(serve)
            sock.connect(serve.frontend)
            send_s = fill(sock, args.requests, b"x" * args.payload_bytes)
            deadline = time.monotonic() + args.fill_timeout
            t0 = time.perf_counter()
            seen = queued(client)
            while seen < args.requests and time.monotonic() < deadline:
                if replies_waiting(sock):
                    break  # refused requests: the queue will never fill
                time.sleep(0.05)  # between stats probes only
                seen = queued(client)
            fill_s = time.perf_counter() - t0 + send_s
            codes = replies_waiting(sock)
            if seen != args.requests:
                raise RuntimeError(
                    f"broker reports {seen} queued of {args.requests} sent "
                    f"(replies so far: {codes or 'none'})"
                )
            rss_full = settled_rss(serve)
        sock.close(0)  # the broker's shutting_down replies go nowhere
        stop_s = stop_now(serve)
    except BatcherError as exc:
        raise RuntimeError(f"stats control request failed: {exc}") from exc
    finally:
        sock.close(0)
        serve.stop()
        ctx.term()
    per_request = (rss_full - rss_empty) / args.requests
    print(
        f"RSS empty {rss_empty / 2**20:.1f} MiB, with {args.requests:,} queued {rss_full / 2**20:.1f} MiB: "
        f"{per_request:.0f} bytes per queued request "
        f"(queue filled in {fill_s:.2f} s, stop took {stop_s:.2f} s)",
        flush=True,
    )
    return {
        "rss_empty_bytes": rss_empty,
        "rss_full_bytes": rss_full,
        "bytes_per_request": per_request,
        "fill_s": fill_s,
        "stop_s": stop_s,
    }


def main(argv: list[str] | None = None) -> None:
    handle_sigterm()
    args = parse_args(argv)
    extra = ["--max-queue", str(args.requests)] if "--max-queue" in serve_help() else []
    runs = [one_run(args, extra) for _ in range(args.runs)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    met = med["bytes_per_request"] < TARGET_BYTES_PER_REQUEST
    table = md_table(
        ["queued requests", "RSS empty MiB", "RSS full MiB", "bytes per queued request", "target", "fill s",
         "stop s"],
        [[
            args.requests, med["rss_empty_bytes"] / 2**20, med["rss_full_bytes"] / 2**20,
            med["bytes_per_request"], f"< {TARGET_BYTES_PER_REQUEST} ({'met' if met else 'MISSED'})",
            med["fill_s"], med["stop_s"],
        ]],
    )  # fmt: skip
    body = (
        f"`batcher serve --workers 0 --model sim{' ' + ' '.join(extra) if extra else ''}`: no worker, so "
        f"every request stays queued. {args.requests:,} requests with a {args.payload_bytes}-byte input, "
        "from one DEALER socket; RSS of the broker process (median of 5 readings) before and once `stats` "
        f"reports them all queued; median of {args.runs} run(s), each with a fresh broker. "
        "Fill s: from the first send until `stats` saw them all; stop s: SIGTERM twice (drain, then "
        "answer everything shutting_down and exit).\n\n" + table
    )
    write_results(
        "memory",
        "Memory: broker RSS per queued request",
        body,
        {"settings": vars(args), "serve_extra": extra, "median": med, "runs": runs},
        args.quick,
    )


if __name__ == "__main__":
    main()
