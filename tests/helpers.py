"""The one set of helpers the test modules share: msgpack in and out, receiving replies with
a deadline, waiting on a condition (never sleeping to let things settle), asking a broker
for its stats, fast simulated-model settings, and a scripted stand-in broker.

Fixtures that wrap these (`fake_broker`, `spawn`, `serve`, ...) live in conftest.py."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import zmq
from prometheus_client.parser import text_string_to_metric_families

from batcher.client.sync import BatcherError, Client
from batcher.serve.launcher import free_tcp_address
from batcher.wire import protocol

#: The simulated model's cost for tests that need batches to take a little time but not much:
#: t(n) = 5 ms + 0.5 ms per item.
FAST_SIM = ("--sim-base-ms", "5", "--sim-per-item-ms", "0.5")
#: The same with no per-item cost, for tests that count batches and not their cost.
FLAT_SIM = ("--sim-base-ms", "5", "--sim-per-item-ms", "0")
#: A heartbeat short enough that losing a worker is seen within a second (3 x 250 ms of
#: silence, found on the next 250 ms tick), and long enough that a live worker starved of
#: CPU on a loaded 2-core machine is not taken for dead (at 100 ms it now and then was:
#: the chaos and multihost tests' exact loss counts broke).
HEARTBEAT = ("--heartbeat-ms", "250")


def pack(obj: object) -> bytes:
    """A body as clients send it (bin type for bytes)."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    """A body as the broker and workers read it (non-string map keys allowed)."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def recv_frames(sock: zmq.Socket[Any], timeout_s: float = 10.0) -> list[bytes]:
    """The next message's frames on `sock`, or an assertion error after `timeout_s`."""
    assert sock.poll(int(timeout_s * 1000), zmq.POLLIN), f"no reply within {timeout_s}s"
    return sock.recv_multipart()


def recv_reply(sock: zmq.Socket[Any], timeout_s: float = 10.0) -> dict[str, Any]:
    """The next reply's body (its last frame) on `sock`, or fail after `timeout_s`."""
    return dict(unpack(recv_frames(sock, timeout_s)[-1]))


def wait_until(
    predicate: Callable[[], Any],
    timeout_s: float,
    what: str,
    interval_s: float = 0.02,
    error: type[Exception] = AssertionError,
) -> Any:
    """Poll `predicate` until it returns something truthy (returned), or raise `error` after
    `timeout_s` (RuntimeError for set-up steps, so a broken set-up reads as such)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise error(f"{what}: not within {timeout_s}s")
        time.sleep(interval_s)  # between probes of the condition


def broker_stats(
    address: str,
    ctx: zmq.Context[Any],
    timeout_s: float = 0.5,
    curve_server_key: str | None = None,
    curve_secret_key: str | None = None,
) -> dict[str, Any]:
    """The broker's `stats`, or {} when it does not answer within `timeout_s`; for a CURVE
    broker, asked with its public key file and, if given, a client's key pair (else a
    throwaway one)."""
    with Client(
        address,
        timeout_s=timeout_s,
        context=ctx,
        curve_server_key=curve_server_key,
        curve_secret_key=curve_secret_key,
    ) as c:
        try:
            return dict(c.control("stats"))
        except BatcherError:
            return {}


def recv_replies(sock: zmq.Socket[Any], n: int, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """n decoded replies (the last frame of each message), or fail after timeout_s."""
    out = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n:
        left_ms = int((deadline - time.monotonic()) * 1000)
        assert left_ms > 0 and sock.poll(left_ms), f"{len(out)} of {n} replies within {timeout_s}s"
        out.append(unpack(sock.recv_multipart()[-1]))
    return out


def start_broker(spawn: Callable[..., Any], ctx: zmq.Context[Any], *args: str) -> tuple[str, str]:
    """`batcher broker ARGS` on free loopback ports (the `spawn` fixture cleans it up), once
    it answers `stats`; returns (frontend, backend)."""
    frontend, backend = free_tcp_address(), free_tcp_address()
    spawn("broker", "--frontend", frontend, "--backend", backend, *args)
    wait_until(lambda: broker_stats(frontend, ctx), 20, "the broker answers", error=RuntimeError)
    return frontend, backend


def curve_broker_stats(
    address: str,
    ctx: zmq.Context[Any],
    curve_server_key: str,
    curve_secret_key: str | None = None,
    timeout_s: float = 0.5,
) -> dict[str, Any]:
    """broker_stats of a CURVE broker (its public key file is required here)."""
    return broker_stats(address, ctx, timeout_s, curve_server_key, curve_secret_key)


def model_stats(address: str, ctx: zmq.Context[Any], model: str, timeout_s: float = 2.0) -> dict[str, Any]:
    """`model`'s entry in the broker's `stats`, or {} when the broker does not answer within
    `timeout_s` or does not list the model."""
    return dict(broker_stats(address, ctx, timeout_s).get("models", {}).get(model, {}))


# --- a scripted stand-in broker ---------------------------------------------------------------
# A ROUTER in a thread of its own, for client tests that need a broker that stays silent,
# answers late or refuses, in a way a real one only does by accident. Every request body is
# recorded; `answer` decides the reply (None: no reply).

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


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of http://127.0.0.1:PORT/metrics as {(name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"no sample {name}{labels}; have {sorted(k for k in samples if k[0] == name)}"
    return samples[key]


class FakeBackend:
    """A broker's backend (ROUTER) driven by the test: sends BATCH messages, reads REPLYs."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self.sock: zmq.Socket[Any] = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.address: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def next(self, command: bytes, timeout_s: float) -> list[bytes]:
        """The next message with `command` (heartbeats skipped): [identity, *rest]."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and self.sock.poll(int(left * 1000)), f"no {command!r} within {timeout_s}s"
            frames = self.sock.recv_multipart()
            if frames[2] == command:
                return frames
            assert frames[2] == protocol.CMD_HEARTBEAT, frames

    def send_batch(self, worker: bytes, header: bytes, bodies: list[bytes]) -> None:
        frames = [worker, protocol.WORKER_PROTOCOL, protocol.CMD_BATCH, header, b"".join(bodies)]
        self.sock.send_multipart(frames)
