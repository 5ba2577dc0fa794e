"""The floor for small messages through a batching broker: a minimal ROUTER -> ROUTER
forwarder that batches, with one DEALER worker that answers each request as batcher's
echo worker would (decode the msgpack body, encode {id, ok, output: input}).

The forwarder does only what any client -> broker -> worker design that batches must:
it reads every request waiting (a batch holds up to MAX_BATCH, or its third argument),
keeps each envelope, sends the bodies to the worker joined in one frame with their
lengths (at most 2 batches held by the worker, as `batcher serve`'s default
--worker-prefetch), and cuts the worker's one reply frame back into one reply per
client. No header is read, no
queue is ordered, nothing is checked, counted or timed. Frames move with the calls
batcher's broker uses (batcher.transport.zmqio: pyzmq's Cython socket methods, a
frame's `more` read in C), so what the broker costs over this floor is its own logic.
Speaks the frontend protocol, so `batcher bench --connect` loads it like a broker.

    python benchmarks/batching_floor.py tcp://127.0.0.1:5999 tcp://127.0.0.1:6000
    python benchmarks/batching_floor.py FRONTEND BACKEND 8   # batches of at most 8
    python benchmarks/batching_floor.py FRONTEND BACKEND 32 batcher

With `batcher` as its fourth argument the worker is batcher's own (`batcher worker
--model echo`, a process of its own) and the forwarder speaks the backend protocol to
it: BATCH frames as the broker writes them (queue times included), each REPLY's header
parsed and checked and its frame cut by batcher.wire.frames, a HEARTBEAT every 0.5 s so
the worker keeps its link. What the broker costs over this row is its scheduling:
header reads, queues, admission, counts and metrics.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import deque
from typing import Any

import msgpack
import zmq
from forwarder import dealer, routers, until_sigterm, with_worker

from batcher.transport.zmqio import recv_frames, send_frames, send_reply
from batcher.wire import protocol
from batcher.wire.frames import batch_frames, parse_reply_header, split_replies

MAX_BATCH = 32
SLOTS = 2  # batches the worker holds at once (serve's default --worker-prefetch)


def forward(frontend_address: str, backend_address: str, max_batch: int = MAX_BATCH) -> None:
    """Batch the client messages waiting, send each batch as one message, answer each
    client from the reply's frame, until SIGTERM."""
    ctx, frontend, backend, worker, poller = routers(frontend_address, backend_address)
    waiting: deque[list[Any]] = deque()  # client messages: [*envelope, body]
    held: dict[int, list[list[Any]]] = {}  # batch id -> its messages
    packb, unpackb = msgpack.Packer().pack, msgpack.unpackb
    next_id = 0
    with until_sigterm(ctx, frontend, backend):
        while True:
            events = dict(poller.poll())
            if frontend in events:
                with contextlib.suppress(zmq.Again):
                    while True:
                        waiting.append(recv_frames(frontend))
            if backend in events:
                with contextlib.suppress(zmq.Again):
                    while True:
                        _, header, blob = recv_frames(backend)
                        batch_id, lengths = unpackb(header)
                        pos = 0
                        for message, length in zip(held.pop(batch_id), lengths, strict=True):
                            send_reply(frontend, message[:-1], blob[pos : pos + length])
                            pos += length
            while waiting and len(held) < SLOTS:
                batch = [waiting.popleft() for _ in range(min(max_batch, len(waiting)))]
                bodies = [m[-1] for m in batch]
                header = packb([next_id, [len(b) for b in bodies]])
                send_frames(backend, [worker, header, b"".join(bodies)])
                held[next_id] = batch
                next_id += 1


def echo_worker(backend_address: str) -> None:
    """Decode each body of a batch, encode a protocol-shaped reply to each, send them
    back joined in one frame with their lengths."""
    ctx, sock = dealer(backend_address)
    packb, unpackb = msgpack.Packer().pack, msgpack.unpackb
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    with until_sigterm(ctx, sock):
        while True:
            poller.poll()
            with contextlib.suppress(zmq.Again):
                while True:
                    header, blob = recv_frames(sock)
                    batch_id, lengths = unpackb(header)
                    unpacker = msgpack.Unpacker()
                    unpacker.feed(blob)
                    replies = []
                    for _ in lengths:
                        req = unpacker.unpack()
                        replies.append(packb({"id": req.get("id"), "ok": True, "output": req.get("input")}))
                    send_frames(sock, [packb([batch_id, [len(r) for r in replies]]), b"".join(replies)])


def forward_to_batcher(frontend_address: str, backend_address: str, max_batch: int = MAX_BATCH) -> None:
    """`forward`, to batcher's own worker over the backend protocol, until SIGTERM."""
    ctx, frontend, backend, worker, poller = routers(frontend_address, backend_address)
    waiting: deque[tuple[float, list[Any]]] = deque()  # (arrived at, client message)
    held: dict[int, list[list[Any]]] = {}
    heartbeat = [protocol.WORKER_PROTOCOL, protocol.CMD_HEARTBEAT]
    next_id, beat_at = 0, time.monotonic()
    with until_sigterm(ctx, frontend, backend):
        while True:
            events = dict(poller.poll(500))
            now = time.monotonic()
            if frontend in events:
                with contextlib.suppress(zmq.Again):
                    while True:
                        waiting.append((now, recv_frames(frontend)))
            if backend in events:
                with contextlib.suppress(zmq.Again):
                    while True:
                        frames = recv_frames(backend, copied=4)
                        if frames[2] == protocol.CMD_READY:  # (again, after a reconnect)
                            worker = frames[0]
                        if frames[2] != protocol.CMD_REPLY:
                            continue
                        header = parse_reply_header(frames[3])
                        replies = split_replies(header.lengths, frames[4]) if len(frames) == 5 else frames[4:]
                        for message, reply in zip(held.pop(header.batch_id), replies, strict=True):
                            send_reply(frontend, message[:-1], reply)
            while waiting and len(held) < SLOTS:
                batch = [waiting.popleft() for _ in range(min(max_batch, len(waiting)))]
                queue_ms = [round((now - at) * 1000.0, 3) for at, _ in batch]
                send_frames(backend, [worker, *batch_frames(next_id, queue_ms, [m[-1] for _, m in batch])])
                held[next_id] = [m for _, m in batch]
                next_id += 1
            if now - beat_at >= 0.5:
                send_frames(backend, [worker, *heartbeat])
                beat_at = now


def batcher_worker(backend_address: str) -> subprocess.Popen[bytes]:
    """batcher's echo worker, connected to the forwarder, in a process group of its own."""
    command = [sys.executable, "-m", "batcher", "worker", "--connect", backend_address, "--model", "echo"]
    return subprocess.Popen(command, start_new_session=True)


if __name__ == "__main__":
    front, back = sys.argv[1], sys.argv[2]
    max_batch = int(sys.argv[3]) if len(sys.argv) > 3 else MAX_BATCH
    if sys.argv[4:5] == ["batcher"]:
        proc = batcher_worker(back)
        try:
            forward_to_batcher(front, back, max_batch)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    else:
        with_worker(lambda: forward(front, back, max_batch), echo_worker, back)
