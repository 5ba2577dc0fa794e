"""The floor for large bodies: a minimal zero-copy pyzmq ROUTER -> ROUTER forwarder with
one DEALER worker that answers each request as batcher's echo worker would (decode the
msgpack body, encode {id, ok, output: input}). No batching, queueing or checks: what
the wire and one decode/encode per request allow. Speaks the frontend protocol, so
`batcher bench --connect` loads it exactly like a broker.

    python benchmarks/forwarder.py tcp://127.0.0.1:5999 tcp://127.0.0.1:6000
    python benchmarks/forwarder.py FRONTEND BACKEND 22.5   # the worker sleeps 22.5 ms a request

With a third argument, the worker sleeps that many milliseconds before each reply: a
minimal three-process chain (client, forwarder, worker) for a model of that cost.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import zmq


def routers(
    frontend_address: str, backend_address: str
) -> tuple[zmq.Context[Any], zmq.Socket[Any], zmq.Socket[Any], bytes, zmq.Poller]:
    """A forwarder's two bound ROUTERs (the clients', the worker's), its worker's routing
    id once that worker said hello, and a poller on both; SIGTERM then raises
    KeyboardInterrupt (see `until_sigterm`). Shared with benchmarks/batching_floor.py."""
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
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    return ctx, frontend, backend, worker, poller


def dealer(backend_address: str) -> tuple[zmq.Context[Any], zmq.Socket[Any]]:
    """A worker's DEALER, connected to its forwarder and its hello sent; SIGTERM then
    raises KeyboardInterrupt (see `until_sigterm`)."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(backend_address)
    sock.send(b"hello")
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    return ctx, sock


@contextlib.contextmanager
def until_sigterm(ctx: zmq.Context[Any], *socks: zmq.Socket[Any]) -> Iterator[None]:
    """Run the body until SIGTERM, then close the sockets and the context (a second
    SIGTERM must not cut the clean-up)."""
    try:
        yield
    except KeyboardInterrupt:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()


def with_worker(forward: Callable[[], None], worker: Callable[..., None], *args: Any) -> None:
    """Run `forward()` with `worker(*args)` in a process of its own, stopped after."""
    proc = multiprocessing.get_context("spawn").Process(target=worker, args=args, daemon=True)
    proc.start()
    try:
        forward()
    finally:
        proc.terminate()
        proc.join(5)


def forward(frontend_address: str, backend_address: str) -> None:
    """Client messages to the worker and its replies back, frames never copied."""
    ctx, frontend, backend, worker, poller = routers(frontend_address, backend_address)
    with until_sigterm(ctx, frontend, backend):
        while True:
            events = dict(poller.poll())
            if frontend in events:
                while frontend.poll(0):
                    backend.send_multipart([worker, *frontend.recv_multipart(copy=False)], copy=False)
            if backend in events:
                while backend.poll(0):
                    frontend.send_multipart(backend.recv_multipart(copy=False)[1:], copy=False)


def echo_worker(backend_address: str, sleep_ms: float = 0.0) -> None:
    """Decode each body, sleep `sleep_ms` (a model's cost), encode a protocol-shaped
    reply, send it (zero-copy past 64 KiB)."""
    ctx, sock = dealer(backend_address)
    packb = msgpack.Packer().pack
    with until_sigterm(ctx, sock):
        while True:
            *envelope, body = sock.recv_multipart(copy=False)
            req = msgpack.unpackb(body.buffer)
            if sleep_ms:
                time.sleep(sleep_ms / 1000.0)
            reply = packb({"id": req.get("id"), "ok": True, "output": req.get("input")})
            sock.send_multipart([*envelope, reply], copy=False)


if __name__ == "__main__":
    front, back = sys.argv[1], sys.argv[2]
    sleep_ms = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    with_worker(lambda: forward(front, back), echo_worker, back, sleep_ms)
