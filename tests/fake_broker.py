"""A scripted stand-in for a broker's frontend: a ROUTER in a thread of its own.

For client tests that need a broker that stays silent, answers late or refuses, in a
way a real one only does by accident. Every request body is recorded; `answer`
decides the reply (None: no reply).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import zmq

Answer = Callable[[dict[str, Any]], dict[str, Any] | None]


def echo(body: dict[str, Any]) -> dict[str, Any] | None:
    """A broker that answers every request at once: its input back, `stats` with {}."""
    if body.get("op") == "stats":
        return {"id": body["id"], "ok": True, "output": {}}
    if "input" in body:
        return {"id": body["id"], "ok": True, "output": body["input"]}
    return None


def silent(body: dict[str, Any]) -> dict[str, Any] | None:
    return None


class FakeBroker:
    """A ROUTER on a free loopback port; `answer(body)` is called for each request."""

    def __init__(self, ctx: zmq.Context[Any], answer: Answer) -> None:
        self.answer = answer
        self.received: list[dict[str, Any]] = []
        self._sock: zmq.Socket[Any] = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind("tcp://127.0.0.1:*")
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._envelopes: dict[Any, list[bytes]] = {}  # request id -> envelope, for `reply_later`
        self._later: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"fake broker {self.address}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sock = self._sock
        try:
            while not self._stop.is_set():
                while not self._later.empty():
                    reply = self._later.get()
                    sock.send_multipart([*self._envelopes[reply["id"]], msgpack.packb(reply)])
                if not sock.poll(20, zmq.POLLIN):  # wakes to look at _stop and _later
                    continue
                frames = sock.recv_multipart()
                body = msgpack.unpackb(frames[-1], raw=False)
                self.received.append(body)
                self._envelopes[body.get("id")] = frames[:-1]
                reply = self.answer(body)
                if reply is not None:
                    sock.send_multipart([*frames[:-1], msgpack.packb(reply)])
        finally:
            sock.close(0)

    def reply_later(self, reply: dict[str, Any]) -> None:
        """Send `reply` to whoever sent the request with its id (from the broker's thread)."""
        self._later.put(reply)

    def wait_received(
        self, predicate: Callable[[list[dict[str, Any]]], bool], timeout_s: float = 5.0
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate(list(self.received)):
            assert time.monotonic() < deadline, f"condition not met; received {self.received}"
            time.sleep(0.01)  # polling a condition the broker thread updates

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@contextlib.contextmanager
def fake_brokers() -> Iterator[Callable[[Answer], FakeBroker]]:
    """A factory `make(answer)` of FakeBrokers, all stopped on leaving the block (a test
    module wraps it in a fixture)."""
    ctx: zmq.Context[Any] = zmq.Context()
    made: list[FakeBroker] = []

    def make(answer: Answer) -> FakeBroker:
        fb = FakeBroker(ctx, answer)
        made.append(fb)
        return fb

    try:
        yield make
    finally:
        for fb in made:
            fb.stop()
        ctx.destroy(linger=0)
