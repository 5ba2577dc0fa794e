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
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import sys
from collections import deque
from typing import Any

import msgpack
import zmq

from batcher.transport.zmqio import recv_frames, send_frames, send_reply

MAX_BATCH = 32
SLOTS = 2  # batches the worker holds at once (serve's default --worker-prefetch)


def forward(frontend_address: str, backend_address: str, max_batch: int = MAX_BATCH) -> None:
    """Batch the client messages waiting, send each batch as one message, answer each
    client from the reply's frame, until SIGTERM."""
    ctx: zmq.Context[Any] = zmq.Context()
    frontend, backend = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    for sock, address in ((frontend, frontend_address), (backend, backend_address)):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.bind(address)
    worker = backend.recv_multipart()[0]  # its hello
    poller = zmq.Poller()
    poller.register(frontend, zmq.POLLIN)
    poller.register(backend, zmq.POLLIN)
    waiting: deque[list[Any]] = deque()  # client messages: [*envelope, body]
    held: dict[int, list[list[Any]]] = {}  # batch id -> its messages
    packb, unpackb = msgpack.Packer().pack, msgpack.unpackb
    next_id = 0
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
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
    except KeyboardInterrupt:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up
    finally:
        frontend.close(0)
        backend.close(0)
        ctx.term()


def echo_worker(backend_address: str) -> None:
    """Decode each body of a batch, encode a protocol-shaped reply to each, send them
    back joined in one frame with their lengths."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(backend_address)
    sock.send(b"hello")
    packb, unpackb = msgpack.Packer().pack, msgpack.unpackb
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    try:
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
    except KeyboardInterrupt:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    finally:
        sock.close(0)
        ctx.term()


if __name__ == "__main__":
    front, back = sys.argv[1], sys.argv[2]
    max_batch = int(sys.argv[3]) if len(sys.argv) > 3 else MAX_BATCH
    proc = multiprocessing.get_context("spawn").Process(target=echo_worker, args=(back,), daemon=True)
    proc.start()
    try:
        forward(front, back, max_batch)
    finally:
        proc.terminate()
        proc.join(5)
