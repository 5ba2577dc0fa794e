"""The gateway's one connection to the broker (batcher.gateway.core.BrokerLink), against
a scripted stand-in broker: replies matched to their rows, a row given up on dropped at
the broker and forgotten by the gateway, nothing queued for a broker not connected."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import zmq

from batcher.gateway import oip
from batcher.gateway.core import BrokerLink, Gateway, GatewaySettings
from batcher.serve.launcher import free_tcp_address

pytestmark = pytest.mark.integration  # a broker thread and real sockets


def settings(address: str, **extra: Any) -> GatewaySettings:
    return GatewaySettings(connect=address, http_port=1, **extra)


async def connected(link: BrokerLink, timeout_s: float = 5.0) -> None:
    """Until a control request goes through (the connection is up)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            await link.call({"op": "stats"}, 0.5)
            return
        except oip.OipError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.02)  # between attempts while the connection comes up


class DroppingPeer:
    """A TCP peer on a free loopback port that accepts each connection, does `on_accept`
    with it (errors ignored), closes it, and counts them."""

    def __init__(self, on_accept: Callable[[socket.socket], None]) -> None:
        self.on_accept = on_accept
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)  # wakes to look at `done`
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.accepted = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve)

    def _serve(self) -> None:
        while not self.done.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            with contextlib.suppress(OSError):
                self.on_accept(conn)
            conn.close()


@contextlib.contextmanager
def dropping_peer(on_accept: Callable[[socket.socket], None]) -> Iterator[DroppingPeer]:
    peer = DroppingPeer(on_accept)
    peer.thread.start()
    try:
        yield peer
    finally:
        peer.done.set()
        peer.thread.join(5)
        peer.listener.close()


def test_replies_in_any_order_reach_their_rows(fake_broker: Any) -> None:
    held: list[dict[str, Any]] = []

    def answer(body: dict[str, Any]) -> dict[str, Any] | None:
        if body.get("op"):
            return {"id": body["id"], "ok": True, "output": {}}
        held.append(body)
        if len(held) == 3:
            for h in reversed(held):
                fb.reply_later({"id": h["id"], "ok": True, "output": h["input"] * 2})
        return None

    fb = fake_broker(answer)

    async def main() -> list[Any]:
        link = BrokerLink(settings(fb.address))
        try:
            await connected(link)
            calls = [link.call({"input": i, "model": "m"}, 5.0) for i in (1, 2, 3)]
            replies = await asyncio.gather(*calls)
            assert link.outstanding == 0
            return [r["output"] for r in replies]
        finally:
            link.close()

    assert asyncio.run(main()) == [2, 4, 6]


def test_a_row_given_up_on_is_cancelled_at_the_broker_and_forgotten(fake_broker: Any) -> None:
    """A timeout, and a caller cancelled (its client went away), each send the broker one
    `cancel` for the row, and the link keeps no future of it."""

    def answer(body: dict[str, Any]) -> dict[str, Any] | None:
        return {"id": body["id"], "ok": True, "output": {}} if body.get("op") == "stats" else None

    fb = fake_broker(answer)

    async def main() -> tuple[list[int], BrokerLink]:
        link = BrokerLink(settings(fb.address))
        await connected(link)
        ids: list[int] = []
        with pytest.raises(oip.OipError) as timed_out:
            await link.call({"input": 1, "model": "m"}, 0.1)
        assert timed_out.value.code == "timeout"
        task = asyncio.ensure_future(link.call({"input": 2, "model": "m"}, 30.0))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        ids = [b["id"] for b in fb.received if b.get("input") in (1, 2)]
        return ids, link

    ids, link = asyncio.run(main())
    try:
        assert link.outstanding == 0
        fb.wait_received(lambda got: sum(b.get("op") == "cancel" for b in got) == 2)
        assert sorted(b["id"] for b in fb.received if b.get("op") == "cancel") == sorted(ids)
    finally:
        asyncio.run(_close(link))


async def _close(link: BrokerLink) -> None:
    link.close()


def test_no_broker_is_unavailable_at_once_and_rows_are_answered_when_closing() -> None:
    """Nothing is queued for a broker that is not there: 503 `unavailable` at once, not a
    wait; a gateway closing answers its waiting rows `closed`."""

    async def main() -> None:
        gateway = Gateway(settings(free_tcp_address()))
        try:
            request = oip.InferRequest(
                model="m", inputs=[oip.json_input("x", "FP32", [2], [1.0, 2.0])], timeout_ms=10_000
            )
            started = asyncio.get_running_loop().time()
            with pytest.raises(oip.OipError) as refused:
                await gateway.infer(request)
            assert refused.value.code == "unavailable"
            assert asyncio.get_running_loop().time() - started < 1.0
            assert gateway.link.outstanding == 0
            assert not await gateway.ready()
        finally:
            await gateway.close()

    asyncio.run(main())


def test_a_reply_waiting_when_a_cancel_is_sent_is_still_read(fake_broker: Any) -> None:
    """Sending (a cancel among them) may take the socket descriptor's edge while a reply
    waits unread: the link reads what is there after every send, so that reply, and the
    ones after it, still reach their rows."""

    def answer(body: dict[str, Any]) -> dict[str, Any] | None:
        if body.get("op") == "stats":
            return {"id": body["id"], "ok": True, "output": {}}
        return {"id": body["id"], "ok": True, "output": "b"} if body.get("input") == "b" else None

    fb = fake_broker(answer)

    async def main() -> Any:
        link = BrokerLink(settings(fb.address))
        try:
            await connected(link)
            a_id, _ = link.send({"input": "a", "model": "m"})
            _, b = link.send({"input": "b", "model": "m"})
            # Without yielding to the loop: until b's reply sits in the socket, unread.
            deadline = asyncio.get_running_loop().time() + 5
            while not link._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN and not b.done():
                assert asyncio.get_running_loop().time() < deadline, "b's reply never came"
            link.forget(a_id, cancel=True)
            return await asyncio.wait_for(b, 2.0)
        finally:
            link.close()

    assert asyncio.run(main())["output"] == "b"


def test_closing_answers_the_rows_still_waiting(fake_broker: Any) -> None:
    fb = fake_broker(lambda body: {"id": body["id"], "ok": True, "output": {}} if body.get("op") else None)

    async def main() -> None:
        gateway = Gateway(settings(fb.address))
        await connected(gateway.link)
        request = oip.InferRequest(model="m", inputs=[oip.json_input("x", "FP32", [3], [1.0, 2.0, 3.0])])
        task = asyncio.ensure_future(gateway.infer(request))
        await asyncio.to_thread(fb.wait_received, lambda got: sum("input" in b for b in got) == 3)
        await gateway.close()
        with pytest.raises(oip.OipError) as closed:
            await task
        assert closed.value.code == "closed" and gateway.link.outstanding == 0

    asyncio.run(main())


def test_the_last_reply_of_a_broker_that_closes_still_reaches_its_row() -> None:
    """A draining broker sends its last reply and closes at once: the reply, there before
    the connection went, still answers its row (with ZMQ_IMMEDIATE libzmq dropped it
    unless it had been read already). A broker at the same address later is used anew."""

    def answer_one(router: zmq.Socket[Any]) -> None:
        assert router.poll(5000), "the broker got no request"
        *envelope, body = router.recv_multipart()
        request = msgpack.unpackb(body)
        router.send_multipart([*envelope, msgpack.packb({"id": request["id"], "ok": True, "output": "last"})])

    async def send_when_connected(link: BrokerLink) -> asyncio.Future[dict[str, Any]]:
        deadline = asyncio.get_running_loop().time() + 5
        while True:
            try:
                return link.send({"input": "x", "model": "m"})[1]
            except oip.OipError:
                assert asyncio.get_running_loop().time() < deadline, "never connected"
                await asyncio.sleep(0.01)  # between attempts while the connection comes up

    async def main() -> None:
        ctx: zmq.Context[Any] = zmq.Context()
        address = free_tcp_address()
        router = ctx.socket(zmq.ROUTER)
        router.bind(address)
        link = BrokerLink(settings(address))
        try:
            row = await send_when_connected(link)
            answer_one(router)
            router.close(linger=1000)  # as the broker closes its frontend after a drain
            # Without yielding to the loop: until the link's monitor holds the disconnect.
            poller = zmq.Poller()
            poller.register(link._watch.monitor, zmq.POLLIN)
            assert poller.poll(5000), "the disconnect was never seen"
            assert (await asyncio.wait_for(row, 2.0))["output"] == "last"
            router = ctx.socket(zmq.ROUTER)
            router.bind(address)
            row = await send_when_connected(link)
            answer_one(router)
            assert (await asyncio.wait_for(row, 2.0))["output"] == "last"
        finally:
            link.close()
            router.close(0)
            ctx.term()

    asyncio.run(main())


def test_a_peer_that_drops_every_connection_is_retried_with_back_off_not_in_a_loop() -> None:
    """A connection that never got through its handshake left nothing unsent: the link
    keeps its socket, so libzmq's reconnect back-off holds (a fresh socket each time
    would reconnect at once, for ever)."""

    async def main(address: str) -> None:
        link = BrokerLink(settings(address))
        try:
            await asyncio.sleep(1.5)  # the window in which connections are counted
            with pytest.raises(oip.OipError) as refused:
                link.send({"input": 1, "model": "m"})
            assert refused.value.code == "unavailable"
        finally:
            link.close()

    with dropping_peer(lambda conn: None) as peer:
        asyncio.run(main(peer.address))
    # RECONNECT_IVL 100 ms (a TCP connect that succeeded restarts libzmq's back-off):
    # about 15 attempts in 1.5 s; a fresh socket each time made thousands
    assert 1 <= peer.accepted <= 40, peer.accepted


def test_rows_past_their_deadline_are_cancelled_before_their_client_is_given_up_on(
    fake_broker: Any,
) -> None:
    """A broker that does not answer (paused): the gateway cancels the rows there half a
    second before it answers the client 504, so a broker that resumes finds the cancels
    already waiting ahead of anything that could run those rows."""
    fb = fake_broker(
        lambda body: (
            {"id": body["id"], "ok": True, "output": {}}
            if body.get("op") in ("stats", "limits", "metadata")
            else None
        )
    )

    async def main() -> None:
        gateway = Gateway(settings(fb.address))
        try:
            await connected(gateway.link)
            request = oip.InferRequest(
                model="m", inputs=[oip.json_input("x", "FP32", [2], [1.0, 2.0])], timeout_ms=200
            )
            with pytest.raises(oip.OipError) as timed_out:
                await gateway.infer(request)
            assert timed_out.value.code == "timeout"
            rows = [b["id"] for b in fb.received if "input" in b]
            cancels = [b["id"] for b in fb.received if b.get("op") == "cancel"]
            assert len(rows) == 2 and sorted(cancels) == sorted(rows), fb.received
            assert gateway.link.outstanding == 0
        finally:
            await gateway.close()

    asyncio.run(main())


def test_a_peer_that_drops_every_connection_after_its_handshake_is_retried_with_back_off() -> None:
    """After a connection whose handshake succeeded, the link takes a new socket (rows
    may wait unsent in the old one), but only after a back-off that doubles while
    connections do not last: without it, a fresh socket connects at once, for ever."""
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL" + b"\x00" * 16 + b"\x00" + b"\x00" * 31
    ready_body = b"\x05READY" + b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"ROUTER"
    ready = b"\x04" + bytes([len(ready_body)]) + ready_body  # a ZMTP 3.0 NULL handshake, as a ROUTER

    def handshake(conn: Any) -> None:
        conn.settimeout(0.5)
        conn.sendall(greeting + ready)
        got = b""
        while len(got) < 64 + 2 + 22:  # their greeting and their READY
            chunk = conn.recv(4096)
            if not chunk:
                break
            got += chunk
        time.sleep(0.02)  # the peer holds the connection a moment, then drops it

    async def main(address: str) -> None:
        link = BrokerLink(settings(address))
        try:
            await asyncio.sleep(2.0)  # the window in which connections are counted
        finally:
            link.close()

    with dropping_peer(handshake) as peer:
        asyncio.run(main(peer.address))
    # back-offs 0.1, 0.2, 0.4, 0.8 s: about 5 connections in 2 s; without, about 300
    assert 2 <= peer.accepted <= 15, peer.accepted


def test_a_socket_that_cannot_be_opened_after_a_lost_connection_is_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a lost connection the link opens a new socket; when that fails (a CURVE key
    file unreadable for a moment, no descriptors left), rows get 503 meanwhile and the
    link tries again after its back-off, instead of being left without a socket."""
    from batcher.gateway import core

    failures = [OSError("cannot load key file gw.key_secret")] * 2
    real_open = core.open_dealer

    def flaky_open(*args: Any) -> Any:
        if failures and opened:
            raise failures.pop()
        opened.append(1)
        return real_open(*args)

    opened: list[int] = []
    monkeypatch.setattr(core, "open_dealer", flaky_open)

    async def main() -> None:
        ctx: zmq.Context[Any] = zmq.Context()
        address = free_tcp_address()
        router = ctx.socket(zmq.ROUTER)
        router.bind(address)
        link = BrokerLink(settings(address))
        try:
            deadline = asyncio.get_running_loop().time() + 10
            while link._watch is None or not link._watch.handshake_ok:
                assert asyncio.get_running_loop().time() < deadline, "never connected"
                link._on_monitor()
                await asyncio.sleep(0.01)  # between looks while the connection comes up
            router.close(0)  # the broker goes: the link drops its socket, then fails to open one
            while failures:
                assert asyncio.get_running_loop().time() < deadline, "no new socket was tried"
                await asyncio.sleep(0.01)  # between looks while the link backs off
            with pytest.raises(oip.OipError) as refused:
                link.send({"input": 1, "model": "m"})
            assert refused.value.code == "unavailable" and "cannot load key file" in str(refused.value)
            router = ctx.socket(zmq.ROUTER)
            router.bind(address)  # the broker is back, and the key file readable again
            while True:
                try:
                    row = link.send({"input": 1, "model": "m"})[1]
                    break
                except oip.OipError:
                    assert asyncio.get_running_loop().time() < deadline, "never reconnected"
                    await asyncio.sleep(0.01)  # between attempts while the link reconnects
            assert router.poll(5000)
            *envelope, body = router.recv_multipart()
            reply = {"id": msgpack.unpackb(body)["id"], "ok": True, "output": "back"}
            router.send_multipart([*envelope, msgpack.packb(reply)])
            assert (await asyncio.wait_for(row, 5.0))["output"] == "back"
        finally:
            link.close()
            router.close(0)
            ctx.term()

    asyncio.run(main())
