"""A client pointed where no broker can be (issue 28 item 17) is told so within about a
second, and truly: nothing listening (every connection refused), or a peer that is no
ZeroMQ one (the gateway's HTTP and gRPC ports) - not a 30 s wait ending in "may be busy".
A real broker, and a client with connect_timeout_s=None, are unaffected."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from batcher.client.aio import AsyncClient
from batcher.client.sync import Client, ClientTimeout, Unreachable
from batcher.serve.launcher import free_tcp_address
from tests.helpers import start_broker
from tests.integration.gateway.test_gateway import free_port, wait_gateway

pytestmark = pytest.mark.integration

#: Far below the client's 30 s timeout, far above its 1 s connect_timeout_s.
SOON_S = 8.0


def fails_fast(address: str, **kwargs: object) -> Unreachable:
    started = time.monotonic()
    with Client(address, timeout_s=30, **kwargs) as c, pytest.raises(Unreachable) as err:  # type: ignore[arg-type]
        c.request(1)
    assert time.monotonic() - started < SOON_S
    assert isinstance(err.value, ClientTimeout) and err.value.code == "unreachable"
    return err.value


def test_nothing_listening_is_said_within_a_second(tmp_path) -> None:
    for address in (free_tcp_address(), f"ipc://{tmp_path}/none.sock"):
        assert f"nothing listening at {address}" in fails_fast(address).message


def test_the_gateways_ports_are_not_taken_for_a_busy_broker(spawn, zctx) -> None:
    frontend, _ = start_broker(spawn, zctx, "--model", "echo")
    http_port, grpc_port = free_port(), free_port()
    spawn("gateway", "--connect", frontend, "--http-port", str(http_port), "--grpc-port", str(grpc_port))
    wait_gateway(http_port)
    for port in (http_port, grpc_port):
        message = fails_fast(f"tcp://127.0.0.1:{port}").message
        assert "is not a batcher broker" in message and "busy" not in message, message


def test_the_async_client_says_it_too() -> None:
    address = free_tcp_address()

    async def main() -> str:
        async with AsyncClient(address, timeout_s=30) as c:
            with pytest.raises(Unreachable) as err:
                await c.request(1)
            return err.value.message

    started = time.monotonic()
    assert f"nothing listening at {address}" in asyncio.run(main())
    assert time.monotonic() - started < SOON_S


def test_streams_are_told_too_on_both_faces() -> None:
    """A stream's first chunk waits no longer than a request's reply: `unreachable`
    within connect_timeout_s, from Client.stream and AsyncClient.stream."""
    address = free_tcp_address()
    started = time.monotonic()
    with Client(address, timeout_s=30) as c, pytest.raises(Unreachable) as err:
        list(c.stream({"tokens": 2}, model="simlm"))
    assert f"nothing listening at {address}" in err.value.message
    assert time.monotonic() - started < SOON_S

    async def main() -> str:
        async with AsyncClient(address, timeout_s=30) as c:
            with pytest.raises(Unreachable) as aerr:
                async for _ in c.stream({"tokens": 2}, model="simlm"):
                    pass
            return aerr.value.message

    started = time.monotonic()
    assert f"nothing listening at {address}" in asyncio.run(main())
    assert time.monotonic() - started < SOON_S


def test_a_client_started_before_its_broker_waits_with_connect_timeout_none(spawn, zctx) -> None:
    frontend = free_tcp_address()
    with Client(frontend, timeout_s=30, context=zctx, connect_timeout_s=None) as c:
        pending = c.submit(1, model="echo")
        # Past the moment a fast verdict would have come (1 s), with the broker not up yet:
        # the request is still waiting (a poll of the socket, not a sleep, spends the time).
        c.socket.poll(1500, zmq.POLLIN)
        assert not pending.done()
        spawn(
            "broker",
            "--frontend",
            frontend,
            "--backend",
            free_tcp_address(),
            "--model",
            "echo",
            "--no-worker-timeout-ms",
            "500",
        )
        reply = pending.wait()
    assert reply["error"]["code"] == "unavailable"  # the broker's answer: it was waited for


def test_the_cli_says_it_sooner(cli) -> None:
    address = free_tcp_address()
    started = time.monotonic()
    result = cli("send", "--connect", address, "1", timeout_s=30)
    assert time.monotonic() - started < SOON_S + 5
    assert result.returncode == 1
    assert f"unreachable: nothing listening at {address}" in result.stderr, result.stderr
    result = cli("ready", "--connect", address, "--timeout-s", "2", timeout_s=30)
    assert result.returncode == 1 and f"nothing listening at {address}" in result.stderr, result.stderr
