"""The ceiling for one Python process: a plain pyzmq ROUTER that decodes each request
and encodes a reply, with no batching, queueing or workers. Speaks the frontend
protocol, so `batcher bench --connect` can load it exactly like a broker.

    python benchmarks/echo_loop.py tcp://127.0.0.1:5999
"""

from __future__ import annotations

import signal
import sys
from typing import Any

import msgpack
import zmq


def serve(address: str) -> None:
    """Answer every request with {id, ok, output: input} until SIGTERM/SIGINT."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock: zmq.Socket[Any] = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.bind(address)
    packb, unpackb = msgpack.Packer().pack, msgpack.unpackb
    recv, send = sock.recv_multipart, sock.send_multipart
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        while True:
            frames = recv()
            req = unpackb(frames[-1])
            frames[-1] = packb({"id": req.get("id"), "ok": True, "output": req.get("input")})
            send(frames)
    except KeyboardInterrupt:
        pass
    finally:
        sock.close(0)
        ctx.term()


if __name__ == "__main__":
    serve(sys.argv[1] if len(sys.argv) > 1 else "tcp://127.0.0.1:5999")
