"""A response's head and body leave the gateway in one write (http_server.CorkedTransport):
what is written between cork() and uncork() reaches the transport joined, in order; what
is held is sent before a close; anything else is the transport's own."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from batcher.gateway.http_api import Response, write
from batcher.gateway.http_server import CorkedTransport


class Recorded:
    """A transport that keeps what it was asked to do."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def write(self, data: bytes) -> None:
        self.calls.append(("write", data))

    def close(self) -> None:
        self.calls.append(("close", None))

    def is_closing(self) -> bool:
        return False


def corked() -> tuple[CorkedTransport, Recorded]:
    inner = Recorded()
    return CorkedTransport(cast(asyncio.Transport, inner)), inner


def test_writes_between_cork_and_uncork_leave_as_one_in_order() -> None:
    t, inner = corked()
    t.cork()
    t.write(b"HTTP/1.1 200 OK\r\n\r\n")
    t.write(b"{}")
    assert inner.calls == []
    t.uncork()
    assert inner.calls == [("write", b"HTTP/1.1 200 OK\r\n\r\n{}")]


def test_uncorked_writes_go_at_once_and_an_empty_cork_writes_nothing() -> None:
    t, inner = corked()
    t.write(b"a")
    t.cork()
    t.uncork()
    t.write(b"b")
    assert inner.calls == [("write", b"a"), ("write", b"b")]


def test_a_close_while_corked_sends_what_is_held_first() -> None:
    t, inner = corked()
    t.cork()
    t.write(b"head")
    t.write(b"body")
    t.close()
    t.uncork()  # write()'s finally, after uvicorn closed a connection: nothing left
    assert inner.calls == [("write", b"headbody"), ("close", None)]


def test_anything_else_is_the_transports_own() -> None:
    t, _ = corked()
    assert t.is_closing() is False


def test_write_sends_a_response_as_one_write_through_the_cork_even_when_send_fails() -> None:
    t, inner = corked()

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            t.write(b"head")
        else:
            t.write(message["body"])

    asyncio.run(write(send, Response(body=b"{}", content_type="application/json"), t))
    assert inner.calls == [("write", b"head{}")]

    async def broken(message: dict[str, Any]) -> None:
        t.write(b"head")
        raise ConnectionResetError

    with pytest.raises(ConnectionResetError):
        asyncio.run(write(broken, Response(body=b"{}"), t))
    assert inner.calls[-1] == ("write", b"head")  # uncorked all the same: nothing stays held
