"""Operations issue, the clients' side, against real `batcher broker` processes and keys
made by `batcher keygen`:

2. A ClientTimeout says why no reply came: no broker at the address, our CURVE key
   refused, plaintext against CURVE, or connected but unanswered. A refused handshake
   never makes a later request hang.
5. AsyncClient.submit(): an awaitable pending reply with result(), wait() and cancel().
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from batcher.client.aio import AsyncClient, AsyncPendingReply, ClientClosed
from batcher.client.sync import Client, ClientTimeout
from batcher.serve.launcher import free_tcp_address
from tests.helpers import curve_broker_stats, start_broker, wait_until

pytestmark = pytest.mark.integration

NO_BROKER = "nothing listening at {address} (every connection was refused)"
REFUSED = "the broker refused our CURVE key"
MISMATCH = "plaintext vs CURVE mismatch"
UNANSWERED = "connected, but no reply came in time"
#: A deadline for requests a broker queues for good (no worker): it answers them
#: `deadline_exceeded` after the client gave up, so its drain at teardown is quick.
DEADLINE_MS = 700


@pytest.fixture
def actx() -> Iterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


class Secured:
    """A CURVE broker admitting the client key `alice` only, and the key files around it."""

    def __init__(self, root: Path, cli: Callable[..., Any], spawn: Callable[..., Any]) -> None:
        self.root = root
        for name in ("broker", "alice", "stranger"):
            result = cli("keygen", str(root / name), "--name", name)
            assert result.returncode == 0, result.stderr
        clients = root / "clients"
        clients.mkdir()
        shutil.copy(root / "alice" / "alice.key", clients)
        self.frontend, backend = free_tcp_address(), free_tcp_address()
        spawn(
            "broker", "--frontend", self.frontend, "--backend", backend, "--model", "held",
            "--no-worker-timeout-ms", "0",
            "--curve-secret-key", str(self.secret("broker")), "--curve-clients", str(clients),
        )  # fmt: skip

    def secret(self, name: str) -> Path:
        return self.root / name / f"{name}.key_secret"

    def curve(self, name: str) -> dict[str, str]:
        """Client keyword arguments for CURVE with `name`'s key pair."""
        return {
            "curve_server_key": str(self.root / "broker" / "broker.key"),
            "curve_secret_key": str(self.secret(name)),
        }


@pytest.fixture
def secured(
    tmp_path: Path, cli: Callable[..., Any], spawn: Callable[..., Any], zctx: zmq.Context[Any]
) -> Secured:
    s = Secured(tmp_path, cli, spawn)
    wait_until(
        lambda: curve_broker_stats(s.frontend, zctx, **s.curve("alice")),
        20,
        "the CURVE broker answering alice",
        error=RuntimeError,
    )
    return s


@pytest.fixture
def plain_broker(spawn: Callable[..., Any], zctx: zmq.Context[Any]) -> str:
    """The frontend of a plaintext broker that knows model `held`, has no worker for it,
    and keeps its requests waiting for one (no `unavailable`)."""
    frontend, _ = start_broker(spawn, zctx, "--model", "held", "--no-worker-timeout-ms", "0")
    return frontend


def timeout_message(client: Client, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(ClientTimeout) as err:
        client.request(*args, **kwargs)
    return err.value.message


# --- 2. why a Client got no reply --------------------------------------------------------------


def test_timeout_hint_no_broker(zctx):
    address = free_tcp_address()
    with Client(address, timeout_s=0.3, context=zctx) as c:
        message = timeout_message(c, 1)
    assert message == f"no reply from {address} after 1 attempt(s): " + NO_BROKER.format(address=address)


def test_timeout_hint_refused_key_and_no_hang_after_it(secured, zctx):
    with Client(secured.frontend, timeout_s=0.5, retries=1, context=zctx, **secured.curve("stranger")) as c:
        first = timeout_message(c, 1, model="held")
        # libzmq gives up on a refused connection, so a send would block for ever: the
        # next request, and the retry, must still time out on time.
        started = time.monotonic()
        second = timeout_message(c, 2, model="held")
        assert time.monotonic() - started < 10.0  # 2 attempts of 0.5 s, tenfold slack
    for message in (first, second):
        assert "after 2 attempt(s)" in message, message
        assert REFUSED in message and "in its --curve-clients directory?" in message, message


def test_timeout_hint_plaintext_against_curve(secured, zctx):
    with Client(secured.frontend, timeout_s=0.5, context=zctx) as c:
        message = timeout_message(c, 1, model="held")
        started = time.monotonic()
        timeout_message(c, 2, model="held")
        assert time.monotonic() - started < 5.0  # its 0.5 s, tenfold slack
    assert MISMATCH in message and "does the broker use CURVE (--curve-server-key)?" in message, message


def test_timeout_hint_connected_but_unanswered(plain_broker, zctx):
    with Client(plain_broker, timeout_s=0.5, context=zctx) as c:
        message = timeout_message(c, 1, model="held", timeout_ms=DEADLINE_MS)  # no worker: it waits
    assert UNANSWERED in message, message


def test_admitted_key_gets_answers(secured, zctx):
    """The control case: the same broker answers the listed key."""
    with Client(secured.frontend, timeout_s=5, context=zctx, **secured.curve("alice")) as c:
        assert "held" in c.control("stats")["models"]


# --- 2. the same hints from AsyncClient ----------------------------------------------------------


def async_timeout_message(address: str, actx: zmq.asyncio.Context, **kwargs: Any) -> str:
    async def main() -> str:
        async with AsyncClient(address, timeout_s=0.5, context=actx, **kwargs) as client:
            with pytest.raises(ClientTimeout) as err:
                await client.request(1, model="held", timeout_ms=DEADLINE_MS)
            started = time.monotonic()
            with pytest.raises(ClientTimeout):  # never hangs on a refused connection
                await client.request(2, model="held", timeout_ms=DEADLINE_MS)
            assert time.monotonic() - started < 5.0  # its 0.5 s, tenfold slack
            return err.value.message

    return asyncio.run(main())


def test_async_timeout_hints(secured, plain_broker, actx):
    nowhere = free_tcp_address()
    assert NO_BROKER.format(address=nowhere) in async_timeout_message(nowhere, actx)
    refused = async_timeout_message(secured.frontend, actx, **secured.curve("stranger"))
    assert REFUSED in refused and "--curve-clients" in refused, refused
    assert MISMATCH in async_timeout_message(secured.frontend, actx)
    assert UNANSWERED in async_timeout_message(plain_broker, actx)


# --- 5. AsyncClient.submit ----------------------------------------------------------------------


def test_async_submit_awaits_like_request(serve, actx):
    sp = serve("--workers", "1", "--model", "echo", "--max-batch-size", "8", "--max-wait-ms", "50",
               "--policy", "window", workers=1)  # fmt: skip

    async def main() -> None:
        async with AsyncClient(sp.frontend, timeout_s=10, context=actx) as client:
            pendings = [client.submit({"n": i}) for i in range(8)]
            assert all(isinstance(p, AsyncPendingReply) for p in pendings)
            assert await pendings[0] == {"n": 0}  # awaitable itself
            assert [await p.result() for p in pendings] == [{"n": i} for i in range(8)]
            replies = [await p.wait() for p in pendings]
            assert all(p.done() for p in pendings)
            assert {r["batch_size"] for r in replies} == {8}, replies  # sent at once: one batch
            assert await asyncio.gather(*(client.submit(i) for i in range(3))) == [0, 1, 2]

    asyncio.run(main())


def test_async_submit_cancel_timeout_and_close(plain_broker, actx):
    async def main() -> None:
        client = AsyncClient(plain_broker, timeout_s=10, context=actx)
        early = client.submit("early", model="held")
        early.cancel()  # before it even went out: the cancel follows it
        assert (await early.wait())["error"]["code"] == "cancelled"

        late = client.submit("late", model="held")
        deadline = time.monotonic() + 10
        while (await client.control("stats"))["models"]["held"]["queued"] != 1:
            assert time.monotonic() < deadline, "the request was never queued"
        late.cancel()  # sent by now: the broker queues it
        reply = await late.wait()
        assert reply["ok"] is False and reply["error"]["code"] == "cancelled", reply

        client.timeout_s = 0.3
        silent = client.submit("nobody serves this", model="held", timeout_ms=DEADLINE_MS)
        timed_out = await silent.wait()
        assert timed_out["error"]["code"] == "timeout"
        assert UNANSWERED in timed_out["error"]["message"], timed_out
        with pytest.raises(ClientTimeout):
            await silent

        client.timeout_s = None
        waiting = client.submit("until close", model="held", timeout_ms=DEADLINE_MS)
        await client.close()
        with pytest.raises(ClientClosed):
            await waiting.wait()
        with pytest.raises(ClientClosed):
            client.submit("after close")

    asyncio.run(main())
