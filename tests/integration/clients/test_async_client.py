"""batcher.client.aio.AsyncClient: many coroutines over one DEALER, typed errors, timeouts.

Against a real `batcher serve` for concurrency and errors, and against a scripted
ROUTER (tests/helpers.py) for what a real broker does only by accident: silence,
late replies, replies out of order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlparse

import psutil
import pytest
import zmq.asyncio

from batcher import AsyncClient
from batcher.client.aio import ClientClosed
from batcher.client.sync import BadRequest, BatcherError, ClientTimeout, ModelError, UnknownModel
from batcher.serve.launcher import free_tcp_address
from tests.helpers import FAST_SIM, FakeBroker

FLAKY = "flaky=tests.fixture_models:flaky"


@pytest.fixture
def actx() -> Iterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def until(predicate: Callable[[], Any], timeout_s: float, what: str) -> None:
    """Poll `predicate` until it holds, yielding to the client's tasks in between, or fail
    after `timeout_s` (the asyncio twin of tests.helpers.wait_until)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
        await asyncio.sleep(0.01)  # lets the client's tasks run while polling a condition


def connections_to(address: str) -> int:
    """TCP connections of this process to `address`'s port."""
    port = urlparse(address).port
    return sum(1 for c in psutil.Process().net_connections(kind="tcp") if c.raddr and c.raddr.port == port)


# --- against a real broker ----------------------------------------------------------------------


@pytest.mark.integration
def test_64_concurrent_requests_share_one_socket_and_batch(serve, actx):
    sp = serve("--workers", "1", "--model", "sim", *FAST_SIM, "--max-wait-ms", "20", "--max-batch-size", "8",
               workers=1)  # fmt: skip

    async def main() -> tuple[list[dict[str, Any]], int, dict[str, Any]]:
        async with AsyncClient(sp.frontend, timeout_s=10, context=actx) as client:
            replies = await asyncio.gather(*(client.request_reply({"n": i}) for i in range(64)))
            sockets = connections_to(sp.frontend)
            return replies, sockets, await client.control("stats")

    replies, sockets, stats = asyncio.run(main())
    assert sockets == 1, f"{sockets} connections to the broker; one socket should carry them all"
    for i, reply in enumerate(replies):
        assert reply["ok"] and reply["output"]["echo"] == {"n": i}, reply
    sizes = [r["batch_size"] for r in replies]
    assert 1 < max(sizes) <= 8, sizes
    sim = stats["models"]["sim"]
    assert sim["requests"] == 64 and sim["batches"] < 64, sim


@pytest.mark.integration
def test_typed_errors_and_request_many(serve, actx):
    sp = serve("--workers", "1", "--model", "sim", "--model", FLAKY, *FAST_SIM, workers=2)

    async def main() -> None:
        async with AsyncClient(sp.frontend, timeout_s=10, context=actx) as client:
            with pytest.raises(UnknownModel) as unknown:
                await client.request("x", model="nope")
            assert unknown.value.code == "unknown_model" and "nope" in unknown.value.message

            with pytest.raises(ModelError) as failed:
                await client.request("boom", model="flaky")
            assert isinstance(failed.value, BatcherError) and "boom" in failed.value.message

            with pytest.raises(BadRequest):
                await client.control("no-such-op")

            assert await client.request_many(["a", "b", "c"], model="flaky") == ["a", "b", "c"]
            mixed = await client.request_many(["ok", "x"], model="nope", return_exceptions=True)
            assert all(isinstance(e, UnknownModel) for e in mixed), mixed
            with pytest.raises(UnknownModel):
                await client.request_many([1, 2], model="nope")
            # Errors and successes at once, over the one socket, each to its own caller.
            results = await asyncio.gather(
                client.request("a", model="flaky"),
                client.request(1, model="nope"),
                client.request({"k": 1}),
                return_exceptions=True,
            )
            assert results[0] == "a", results
            assert isinstance(results[1], UnknownModel), results
            assert isinstance(results[2], dict) and results[2]["echo"] == {"k": 1}, results

    asyncio.run(main())


# --- against a scripted broker ------------------------------------------------------------------


@pytest.mark.integration
def test_timeout_of_one_request_leaves_the_others_answered(fake_broker, actx):
    # Odd inputs are never answered; even ones are, once all four have arrived, in reverse
    # order of arrival. So the evens are answered only if every request went out at once,
    # not each after the one before had its answer or its timeout.
    held: list[dict[str, Any]] = []

    def answer(body: dict[str, Any]) -> dict[str, Any] | None:
        if body.get("op") == "cancel":  # sent for each request that timed out
            return None
        if body["input"] % 2 == 0:
            held.append(body)
            if len(held) == 4:
                for h in reversed(held):
                    fb.reply_later({"id": h["id"], "ok": True, "output": h["input"] * 10})
        return None

    fb = fake_broker(answer)

    async def main() -> list[Any]:
        # timeout_s: long enough for the evens' replies to come in time on a busy machine.
        async with AsyncClient(fb.address, timeout_s=2, context=actx) as client:
            return await client.request_many(range(1, 9), return_exceptions=True)

    results = asyncio.run(main())
    for i, r in zip(range(1, 9), results, strict=True):
        if i % 2:
            assert isinstance(r, ClientTimeout) and r.code == "timeout", (i, r)
        else:
            assert r == i * 10, (i, r)
    requests = [b for b in fb.received if b.get("op") != "cancel"]
    assert sorted(b["input"] for b in requests) == list(range(1, 9)), fb.received  # each sent once
    # each request that timed out asked the broker to drop it, once; the answered ones not
    timed_out = sorted(b["id"] for b in requests if b["input"] % 2)
    fb.wait_received(lambda got: sum(b.get("op") == "cancel" for b in got) == 4)
    assert sorted(b["id"] for b in fb.received if b.get("op") == "cancel") == timed_out


@pytest.mark.integration
def test_per_request_timeout_retries_and_late_reply_is_dropped(fake_broker, actx):
    fb = fake_broker(lambda body: None)  # silent

    async def main() -> tuple[float, AsyncClient]:
        client = AsyncClient(fb.address, timeout_s=0.2, retries=1, context=actx)
        try:
            started = time.monotonic()
            with pytest.raises(ClientTimeout) as timed_out:
                await client.request("x")
            elapsed = time.monotonic() - started
            assert "2 attempt(s)" in timed_out.value.message
            # The same body (same id) was sent twice; a reply coming now is a late one.
            await until(lambda: len(got_ids(fb)) == 2, 10, "both attempts received")
            assert got_ids(fb) == [1, 1]
            fb.reply_later({"id": 1, "ok": True, "output": "late"})
            await until(lambda: client.duplicates_dropped > 0, 10, "the late reply arrived")
            fb.answer = lambda body: (
                None if body.get("op") else {"id": body["id"], "ok": True, "output": body["input"]}
            )
            assert await client.request("y") == "y"  # the late reply was not taken for this one
            return elapsed, client
        finally:
            await client.close()

    elapsed, client = asyncio.run(main())
    assert elapsed > 0.35, f"two attempts of 0.2 s over in {elapsed:.2f}s"  # no early timeout
    assert client.duplicates_dropped == 1, "the late reply was not recognised as one"
    assert got_ids(fb) == [1, 1, 2], "a request was sent more often than 1 + retries"
    # once its last attempt timed out, it asked the broker to drop it
    assert [b["id"] for b in fb.received if b.get("op") == "cancel"] == [1]


def got_ids(fb: FakeBroker) -> list[Any]:
    """The ids of the requests received (not of the cancels a timed-out request sends)."""
    return [b["id"] for b in fb.received if b.get("op") != "cancel"]


@pytest.mark.integration  # it measures how long the client waits
def test_timeout_against_an_address_nobody_listens_on(actx):
    async def main() -> list[float]:
        took = []
        async with AsyncClient(free_tcp_address(), timeout_s=0.2, context=actx) as client:
            started = time.monotonic()
            with pytest.raises(ClientTimeout):
                # The client waits its own 0.2 s, not the request's deadline plus a second (21 s).
                await client.request(1, timeout_ms=20_000)
            took.append(time.monotonic() - started)
            started = time.monotonic()
            with pytest.raises(ClientTimeout):
                await client.control("stats")
            took.append(time.monotonic() - started)
        return took

    # Each bound is ten times the client's timeout, and still far below what waiting for
    # the deadline (21 s) or for ever (a send to nobody blocks) would take.
    request_s, control_s = asyncio.run(main())
    assert request_s < 2.0, f"the request's timeout took {request_s:.2f}s, not about 0.2 s"
    assert control_s < 2.0, f"the control request's timeout took {control_s:.2f}s, not about 0.2 s"


@pytest.mark.integration
def test_cancelling_a_request_tells_the_broker_and_close_fails_waiters(fake_broker, actx):
    fb = fake_broker(lambda body: None)

    async def main() -> None:
        client = AsyncClient(fb.address, timeout_s=None, context=actx)
        task = asyncio.ensure_future(client.request("first"))
        waiter = asyncio.ensure_future(client.request("second"))
        await until(lambda: len(fb.received) == 2, 10, "both requests sent")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: any(b.get("op") == "cancel" for b in fb.received), 10, "the cancel sent")
        await client.close()
        with pytest.raises(ClientClosed):
            await waiter
        with pytest.raises(ClientClosed):
            await client.request("after close")

    asyncio.run(main())
    cancel = next(b for b in fb.received if b.get("op") == "cancel")
    first = next(b for b in fb.received if b.get("input") == "first")
    assert cancel["id"] == first["id"]
