"""Waiting on a condition with a deadline (never sleeping to let things settle), and
asking a broker for its stats: shared by the integration test modules."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import zmq

from batcher.client import BatcherError, Client
from batcher.launcher import free_tcp_address
from batcher.protocol import unpack


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


def broker_stats(address: str, ctx: zmq.Context[Any], timeout_s: float = 0.5) -> dict[str, Any]:
    """The broker's `stats`, or {} when it does not answer within `timeout_s`."""
    with Client(address, timeout_s=timeout_s, context=ctx) as c:
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
