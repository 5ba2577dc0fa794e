"""uvicorn serving the v2 REST API (`http_api`) inside the gateway's event loop, on
httptools, with the bound uvicorn lacks on a request's head."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from typing import Any, cast

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from batcher.gateway.core import Gateway
from batcher.gateway.http_api import GONE, HANDLER, HttpApi, json_encode

#: How long an idle connection is kept open (aiohttp's default, which clients that pool
#: connections, such as tritonclient's, have met so far).
KEEP_ALIVE_S = 75
#: The most bytes of a request's line and headers (431 past it, and the connection
#: closes): httptools keeps a head whole until it ends, and uvicorn sets no bound.
MAX_HEAD_BYTES = 64 * 1024


class HttpServer:
    """The REST API on a socket bound here (so a port in use is an OSError, not
    uvicorn's exit), without uvicorn's signal handlers: the gateway stops on its own
    terms. `close` lets what is in flight finish, for up to `grace_s`; `stop` is set if
    uvicorn ends by itself."""

    def __init__(
        self, gateway: Gateway, host: str, port: int, max_body_bytes: int, grace_s: float, stop: asyncio.Event
    ) -> None:
        self._socket = listen(host, port)
        config = uvicorn.Config(
            HttpApi(gateway, max_body_bytes),
            http=BoundedHttpToolsProtocol,
            ws="none",
            lifespan="off",
            log_config=None,
            access_log=False,
            server_header=False,
            timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=max(1, round(grace_s)),
        )
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)  # its start and stop lines
        self._server = _Server(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._socket]))
        self._task.add_done_callback(lambda _: stop.set())

    async def close(self) -> None:
        self._server.should_exit = True
        await self._task


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # no handlers of its own: serve's pipe or the gateway's own handlers stop it


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); OSError, saying where, if it cannot be.
    Its protocol is named: asyncio sets TCP_NODELAY on the connections of an IPPROTO_TCP
    socket only (without it, uvicorn's response body waits 40 ms behind its headers)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen for HTTP on {host}:{port}: {exc.strerror}") from None
    sock.setblocking(False)
    return sock


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bound on a request's head: MAX_HEAD_BYTES of
    request line and headers, then 431 and the connection closed (unbounded, a client
    sending one endless header grows the gateway's memory without end). A connection
    lost before its response is complete cancels the request's handler (the scope's
    HANDLER), and so its rows at the broker."""

    def connection_lost(self, exc: Exception | None) -> None:
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and not cycle.response_complete:
            scope = cast(dict[str, Any], cycle.scope)
            handler: asyncio.Task[None] | None = scope.get(HANDLER)
            if handler is not None and not handler.done():
                scope[GONE] = True
                handler.cancel()

    _head_bytes = 0
    _in_head = True

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
            message = json_encode({"error": f"the request's head is over {MAX_HEAD_BYTES} bytes"})
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(message), message)
            )
            self.transport.close()

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes = False, 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_head = True
        super().on_message_complete()
