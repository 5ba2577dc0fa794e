"""uvicorn serving the v2 REST API (`http_api`) inside the gateway's event loop, on
httptools, with what its httptools protocol lacks for a server open to any client: a
bound on a request's head, requests that ask to upgrade served as HTTP/1.1, and a lost
connection cancelling the requests it was waiting for (`BoundedHttpToolsProtocol`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
from collections import deque
from collections.abc import Iterator
from typing import Any, cast

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from batcher.errors import BindError
from batcher.gateway.access import ApiKeys
from batcher.gateway.core import Gateway
from batcher.gateway.http_api import BODY_COMPLETE, CORK, GONE, HANDLER, HttpApi, json_encode

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
        self,
        gateway: Gateway,
        host: str,
        port: int,
        max_body_bytes: int,
        grace_s: float,
        stop: asyncio.Event,
        api_keys: ApiKeys | None = None,
        tls_files: tuple[str | None, str | None] | None = None,
        reuse_port: bool = False,
    ) -> None:
        cert_file, key_file = tls_files or (None, None)
        config = uvicorn.Config(
            HttpApi(gateway, max_body_bytes, api_keys),
            http=BoundedHttpToolsProtocol,
            ws="none",
            lifespan="off",
            log_config=None,
            access_log=False,
            server_header=False,
            proxy_headers=False,  # nothing here reads the client's address
            timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=max(1, round(grace_s)),
            ssl_certfile=cert_file,
            ssl_keyfile=key_file,
        )
        config.load()  # here, so that a TLS pair that does not load stops the start
        self._socket = listen(host, port, reuse_port)
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)  # its start and stop lines
        self._server = _Server(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._socket]))
        self._task.add_done_callback(lambda _: stop.set())

    @property
    def port(self) -> int:
        """The port it listens on (the one asked for, or the one the system gave for 0)."""
        return int(self._socket.getsockname()[1])

    async def close(self) -> None:
        self._server.should_exit = True
        await self._task


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # no handlers of its own: serve's pipe or the gateway's own handlers stop it


def listen(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket on (host, port); OSError, saying where, if it cannot be.
    Its protocol is named: asyncio sets TCP_NODELAY on the connections of an IPPROTO_TCP
    socket only (without it, uvicorn's response body waits 40 ms behind its headers).
    With `reuse_port`, one of several gateway processes' sockets on the port
    (SO_REUSEPORT: the kernel spreads connections over them; batcher.gateway.processes)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise BindError(exc.errno, f"cannot listen for HTTP on {host}:{port}: {exc.strerror}") from None
    sock.setblocking(False)
    return sock


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with what the gateway needs beyond it:

    - A request's head is read whole before httptools parses it, and bounded:
      MAX_HEAD_BYTES, then 431 and the connection closed (httptools alone keeps an
      endless header growing); in time too: a connection that sends no whole head
      within the keep-alive timeout of its start or of its last response is closed,
      and a head pipelined behind another (fed to httptools as it comes, since its
      start shared a read with the request before) is counted and timed the same.
    - An `Upgrade` header is renamed before parsing (the gateway upgrades to nothing:
      no h2c, no websockets), so the request is served as HTTP/1.1, as aiohttp served
      it: httptools drops the body of a request that asks to upgrade, and would parse a
      body that comes later as a request of its own (uvicorn issue 2722). Should a
      request reach httptools as an upgrade anyway (in a pipelined burst), nothing more
      is read from that connection.
    - A connection lost before its responses are complete cancels the handlers of its
      requests (each scope's HANDLER, set while it waits on the broker), and so their
      rows at the broker; the scope of a request whose body came whole with its head
      says so (BODY_COMPLETE), so that reading it needs no timer.
    """

    _head: bytes | None = b""  # the head read so far, while between messages; else None
    _between = True  # httptools has no message begun
    _in_head = False  # httptools has begun a message whose head has not ended
    _partial = 0  # bytes fed while httptools is inside a head (of a pipelined request)
    _partial_timer: asyncio.TimerHandle | None = None  # closes a pipelined head that never ends
    _deaf = False  # a request httptools took as an upgrade, or a head refused: read no more

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(cast(asyncio.Transport, CorkedTransport(transport)))
        self._open: deque[dict[str, Any]] = deque()  # scopes whose response is not complete
        # A new connection has as long to send its first head as an idle one its next:
        # the keep-alive timeout, which only a whole head stops (partial heads are held
        # here, before uvicorn sees them), so a client that never finishes one is closed.
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def data_received(self, data: bytes) -> None:
        if self._deaf:
            return
        if self._head is not None:
            seen = max(0, len(self._head) - 3)  # searched already, but for a blank line's start
            if self._head:
                data = self._head + data
            end = _head_end(data, seen)
            if end < 0 and len(data) <= MAX_HEAD_BYTES:
                self._head = data  # not whole yet
                return
            if end < 0 or end > MAX_HEAD_BYTES:
                self._refuse_head()
                return
            if _UPGRADE.search(data, 0, end):
                data = _UPGRADE.sub(b"\\1X-Upgrade-Ignored:", data[:end]) + data[end:]
        elif self._partial:
            self._partial += len(data)
            if self._partial > MAX_HEAD_BYTES:
                self._refuse_head()
                return
        super().data_received(data)
        if self.transport.is_closing():
            return
        # Past this read: between messages, the next head is read whole first; inside a
        # head already begun (a pipelined request's), its bytes are counted instead.
        self._head = b"" if self._between else None
        if not self._in_head:
            self._partial = 0
        elif not self._partial:  # a pipelined head begun: counted from here, and timed
            self._partial = 1
            self._partial_timer = self.loop.call_later(self.timeout_keep_alive, self._head_too_slow)
        if self.parser is not None and self.parser.should_upgrade():
            self._deaf = True
            if self.cycle is not None:
                self.cycle.keep_alive = False  # answered, then closed

    def on_message_begin(self) -> None:
        self._between, self._in_head = False, True
        super().on_message_begin()

    def _refuse_head(self) -> None:
        self._refuse(
            b"431 Request Header Fields Too Large", f"the request's head is over {MAX_HEAD_BYTES} bytes"
        )

    def _head_too_slow(self) -> None:
        self._refuse(
            b"408 Request Timeout", f"the request's head did not end within {self.timeout_keep_alive} s"
        )

    def _refuse(self, status: bytes, error: str) -> None:
        """Answer `status` as a v2 error, close, and read nothing more."""
        self._deaf = True
        if self.transport.is_closing():
            return
        message = json_encode({"error": error})
        self.transport.write(
            b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (status, len(message), message)
        )
        self.transport.close()

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._partial_timer is not None:
            self._partial_timer.cancel()
            self._partial_timer = None
        super().on_headers_complete()
        self.scope[CORK] = self.transport  # type: ignore[literal-required]
        self._open.append(cast(dict[str, Any], self.scope))

    def on_message_complete(self) -> None:
        self.scope[BODY_COMPLETE] = True  # type: ignore[literal-required]
        self._between = True
        super().on_message_complete()

    def on_response_complete(self) -> None:
        if self._open:
            self._open.popleft()  # responses complete in the order their requests came
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._partial_timer is not None:
            self._partial_timer.cancel()
        super().connection_lost(exc)
        for scope in getattr(self, "_open", ()):
            handler: asyncio.Task[None] | None = scope.get(HANDLER)
            if handler is not None and not handler.done():
                scope[GONE] = True
                handler.cancel()


class CorkedTransport:
    """A connection's transport whose writes between `cork()` and `uncork()` leave as one:
    uvicorn writes a response's head and its body apart, two sends on the socket, each a
    system call that cost about a tenth of the gateway's CPU per HTTP request. Anything
    else is the transport's own; closing it sends what is held first."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held: list[bytes] | None = None

    def cork(self) -> None:
        self._held = []

    def uncork(self) -> None:
        held, self._held = self._held, None
        if held:
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def write(self, data: bytes) -> None:
        if self._held is not None:
            self._held.append(data)
        else:
            self._transport.write(data)

    def close(self) -> None:
        self.uncork()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


#: A header line naming an upgrade (its name is replaced, keeping the line's start).
_UPGRADE = re.compile(rb"(\n)upgrade[ \t]*:", re.IGNORECASE)


def _head_end(data: bytes, start: int = 0) -> int:
    """Where a request's head ends in `data` (just past its blank line), searching from
    `start`, or -1. A bare LF line counts too, so that httptools sees, and refuses, such
    a head at once."""
    crlf = data.find(b"\r\n\r\n", start, MAX_HEAD_BYTES + 4)
    lf = data.find(b"\n\n", start, crlf + 4 if crlf >= 0 else MAX_HEAD_BYTES + 2)
    if lf >= 0 and (crlf < 0 or lf < crlf):
        return lf + 2
    return crlf + 4 if crlf >= 0 else -1
