"""The Python client: one DEALER socket, many requests in flight, typed errors.

The client sets each request's `id` to a counter of its own and matches replies by
it, so replies can arrive in any order and a late reply to a request that already
timed out is recognised and dropped.

What every client shares, without any I/O, is `BaseClient` (as httpx's BaseClient is
for its Client and AsyncClient): the request ids, the table of requests waiting for a
reply, matching a reply to its request, the timeout and retry rules, and the
ConnectionWatch hints. `Client` adds a blocking socket, `batcher.client.aio.AsyncClient` an
asyncio one, and `MultiClient` combines Clients through their public methods.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import zmq

from batcher.client.core import (
    CONNECT_TIMEOUT_S,
    BaseClient,
    BlockingRequests,
    StreamArgs,
    _Awaited,
    cancel_body,
    collect,
    reply_key,
    reply_output,
    reply_wait_s,
    request_body,
    request_fields,
    takes,
    timeout_reply,
)
from batcher.errors import BatcherError
from batcher.transport.connection_watch import (
    CLIENT_EVENTS,
    FATAL_HANDSHAKE_FAILURES,
    HANDSHAKE_FAILED,
    WATCHED_EVENTS,
    ConnectionWatch,
)
from batcher.transport.security import secure_client
from batcher.transport.zmqio import recv_frames, send_frames
from batcher.wire import protocol, tensor
from batcher.wire.errors import (
    CLOSED,
    TIMEOUT,
    UNREACHABLE,
    BadRequest,
    Cancelled,
    ClientClosed,
    ClientTimeout,
    DeadlineExceeded,
    Forbidden,
    InternalError,
    ModelError,
    Overloaded,
    ReplyError,
    ShuttingDown,
    TooLarge,
    Unavailable,
    UnknownModel,
    Unreachable,
    WorkerFailed,
    error_class_name,
    error_from_reply,
)

#: The public names, the errors among them: they live in batcher.errors and batcher.wire.errors
#: and are re-exported here, where they were first defined.
__all__ = [
    "CLIENT_EVENTS",
    "CLOSED",
    "CONNECT_TIMEOUT_S",
    "FATAL_HANDSHAKE_FAILURES",
    "HANDSHAKE_FAILED",
    "TIMEOUT",
    "UNREACHABLE",
    "WATCHED_EVENTS",
    "BadRequest",
    "BaseClient",
    "BatcherError",
    "Cancelled",
    "Client",
    "ClientClosed",
    "ClientTimeout",
    "ConnectionWatch",
    "DeadlineExceeded",
    "Forbidden",
    "InternalError",
    "ModelError",
    "Overloaded",
    "PendingReply",
    "ReplyError",
    "ShuttingDown",
    "Stream",
    "TooLarge",
    "Unavailable",
    "UnknownModel",
    "Unreachable",
    "WorkerFailed",
    "cancel_body",
    "collect",
    "error_class_name",
    "error_from_reply",
    "open_dealer",
    "reply_key",
    "reply_wait_s",
    "request_body",
    "timeout_reply",
]

log = logging.getLogger("batcher.client")


def open_dealer(
    ctx: Any,
    address: str,
    curve_server_key: str | None,
    curve_secret_key: str | None,
    events: int | None = None,
) -> tuple[Any, ConnectionWatch]:
    """The client's DEALER (linger 0, quick reconnects, CurveZMQ when a server key is
    given) and its ConnectionWatch, which watches from before the connect (`events`:
    the monitor's, WATCHED_EVENTS unless given)."""
    sock = ctx.socket(zmq.DEALER)
    watch = None
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if curve_server_key:  # the broker's public key file; ours from curve_secret_key
            secure_client(sock, curve_server_key, curve_secret_key)
        watch = ConnectionWatch(sock, address, "--curve-clients", curve_secret_key, events)
        sock.connect(address)
    except BaseException:
        if watch is not None:
            watch.close()
        sock.close(0)
        raise
    return sock, watch


class PendingReply(_Awaited):
    """A request in flight; `result()` waits for it while serving the others too."""

    def __init__(
        self, client: Client, request_id: int, body: bytes, wait_s: float | None, sent_at: float
    ) -> None:
        self._client = client
        self.request_id = request_id
        self.body = body
        self.wait_s = wait_s
        self.attempts = 1
        self.sent_at = sent_at  # of the latest attempt
        self.deadline = None if wait_s is None else self.sent_at + wait_s
        self.reply: dict[str, Any] | None = None
        #: Whose request this is, when a client of clients started it (MultiClient: its
        #: own request, found again from the reply `receive_ready` hands back).
        self.owner: Any = None

    def _wait(self) -> None:
        self._client._wait_for(self)

    def cancel(self) -> None:
        """Ask the broker to drop this request if it is still queued; it is then answered
        with `cancelled` (a request already running is answered normally)."""
        if self.reply is None:
            self._client.send_cancel(self.request_id)


class Client(BaseClient[PendingReply], BlockingRequests):
    """Talks to a broker's frontend over one DEALER socket. Not thread-safe.

    `timeout_s` bounds the wait for each reply (None: wait forever). With `retries`,
    a request that got no reply in time is sent again, up to that many times: only for
    idempotent models, since the first attempt may still run; whichever reply comes
    first is the answer and a duplicate is dropped. ZeroMQ reconnects to a restarted
    broker by itself; requests lost with the old one time out (and are retried). A
    refused handshake (our CURVE key not listed, plaintext against CURVE) is for good
    on this socket: requests time out, and the ClientTimeout says why (`watch`).

    Beyond request, submit and control, `start`, `receive_ready`, `forget`,
    `send_cancel` and `socket` let a caller wait on several clients at once, as
    MultiClient does.

    Until the first handshake with a broker, a request fails `unreachable` (Unreachable,
    a ClientTimeout) after `connect_timeout_s` rather than its whole `timeout_s` when
    no broker can be there: the address refuses every connection (nothing listens), or
    what answers is no ZeroMQ peer (an HTTP port). None waits out `timeout_s`, for a
    client started before its broker; once a broker was reached, never.
    """

    def __init__(
        self,
        address: str = "tcp://127.0.0.1:5555",
        timeout_s: float | None = 30.0,
        retries: int = 0,
        context: zmq.Context[Any] | None = None,
        curve_server_key: str | None = None,
        curve_secret_key: str | None = None,
        connect_timeout_s: float | None = CONNECT_TIMEOUT_S,
    ) -> None:
        super().__init__(address, timeout_s, retries, connect_timeout_s)
        self._ctx: zmq.Context[Any] = context or zmq.Context.instance()
        self._sock: zmq.Socket[Any]
        self._sock, self.watch = open_dealer(
            self._ctx, address, curve_server_key, curve_secret_key, CLIENT_EVENTS
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the socket; a request or stream still waiting for its reply raises
        ClientClosed (code `closed`), and so does any request made after."""
        if not self._sock.closed:
            self.watch.close()
            self._sock.close(0)
        error = {"code": CLOSED, "message": f"the client of {self.address} was closed"}
        for request_id, waiting in self._replies.take_all().items():
            waiting.reply = {"id": request_id, "ok": False, "error": error}
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            stream.take({"id": request_id, "ok": False, "error": error, "more": False})

    @property
    def socket(self) -> zmq.Socket[Any]:
        """The DEALER socket, to poll for POLLIN together with others (zmq.Poller); when
        it is readable, call `receive_ready`. Never send or receive on it directly."""
        return self._sock

    @takes(request_fields)
    def submit(self, fields: dict[str, Any]) -> PendingReply:
        """Send a request without waiting; many can be in flight over the one socket."""
        return self._submit(fields)

    def _submit(self, fields: dict[str, Any]) -> PendingReply:
        return self.start(fields, reply_wait_s(self.timeout_s, fields.get("timeout_ms")))

    def control(self, op: str, **fields: Any) -> Any:
        """Send a control request (`stats`; `reload` with model=NAME) and return its output."""
        return self.start({"op": op, **fields}, self.timeout_s).result()

    @takes(StreamArgs)
    def stream(self, args: StreamArgs) -> Stream:
        """Send a streamed request (`"stream": true`) and iterate over its chunks as they
        come: `for chunk in client.stream(x)`. An error reply raises its typed error.
        Leaving early, use `with client.stream(x) as chunks:` (or `close()`): the broker
        is told to cancel it and the worker stops generating. `timeout_s` bounds the wait
        for each chunk; a stream is never retried."""
        if self._sock.closed:
            raise ClientClosed(f"the client of {self.address} is closed")
        request_id, body, wait_s = self._stream_body(args)
        stream = self._streams[request_id] = Stream(self, request_id, wait_s)
        if not self._send_body(body, None if stream.wait_s is None else time.monotonic() + stream.wait_s):
            del self._streams[request_id]
            stream.take(timeout_reply(request_id, self._timeout_message(1)))
        return stream

    def _wait_chunk(self, stream: Stream) -> None:
        """Wait until `stream` has a reply, or past its wait for one (it then times out),
        or until no broker can be reached (`unreachable`, as for a request)."""
        since = time.monotonic()
        deadline = None if stream.wait_s is None else since + stream.wait_s
        while not stream.received:
            why = self._unreachable(since, time.monotonic())
            if why is not None:
                self._streams.pop(stream.request_id, None)
                stream.take(timeout_reply(stream.request_id, why, UNREACHABLE))
                return
            timeout_ms = -1
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._streams.pop(stream.request_id, None)
                    self.send_cancel(stream.request_id)
                    stream.take(timeout_reply(stream.request_id, self._timeout_message(1)))
                    return
                timeout_ms = max(1, math.ceil(remaining * 1000))
            if self._poll_reply(timeout_ms, since):
                self.receive_ready()

    def start(self, fields: dict[str, Any], wait_s: float | None) -> PendingReply:
        """Send the request map `fields`, with an `id` of ours added, without waiting;
        returns its PendingReply, which times out `wait_s` seconds after each send
        (None: never). Its reply is taken by whoever waits on this client next, or by
        `receive_ready`; `PendingReply.result()` waits for it and retries as configured.
        Raises ClientClosed once the client is closed."""
        if self._sock.closed:
            raise ClientClosed(f"the client of {self.address} is closed")
        request_id = self._next_id()
        body = protocol.pack_carrying({"id": request_id, **fields}, fields.get("input"))
        pending = PendingReply(self, request_id, body, wait_s, time.monotonic())
        self._replies.add(request_id, pending)
        self._send_body(body, pending.deadline)
        return pending

    def send_cancel(self, request_id: int) -> bool:
        """Ask the broker to drop request `request_id` if it is still queued (it is then
        answered `cancelled`; one already running is answered normally). One try, never
        blocking; returns whether it went (never, once the client is closed)."""
        if self._sock.closed:
            return False
        return self._send_body(cancel_body(request_id), time.monotonic())

    def receive_ready(self) -> list[PendingReply]:
        """Take every reply waiting on the socket, without blocking. Each answers its
        request (its `reply` is set); those are returned, in order of arrival. A reply
        that matches no waiting request is dropped, counted in `duplicates_dropped`."""
        answered: list[PendingReply] = []
        while True:
            try:
                frames = recv_frames(self._sock, copied=1)  # a large body stays a zmq.Frame
            except zmq.Again:
                return answered
            try:
                reply = tensor.unpack_arrays(frames[-1])
                if self._route_chunk(reply):
                    continue
                pending = self._match(reply)
            except Exception:
                continue  # not a reply of ours; nothing to match it to
            if pending is not None:
                pending.reply = reply
                answered.append(pending)

    def _send_body(self, body: bytes, deadline: float | None) -> bool:
        """Send without ever blocking past `deadline` (None: as long as it takes); returns
        whether it went. A message that cannot go (the broker's queue for us is full, or
        libzmq gave up on the connection after a refused handshake) is not sent: its
        request times out, with the reason in the message."""
        frames = [b"", body]
        while True:
            try:
                send_frames(self._sock, frames)  # a large body goes without a copy
                return True
            except zmq.Again:
                pass
            self.watch.poll()
            if self.watch.dead:
                return False
            wait_ms = 100  # then the monitor is read again: after a refusal, waiting is pointless
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                wait_ms = min(wait_ms, max(1, math.ceil(remaining * 1000)))
            self._sock.poll(wait_ms, zmq.POLLOUT)

    def _wait_for(self, target: PendingReply) -> None:
        self.watch.poll()  # keeps the monitor's queue short, so no event is dropped
        while target.reply is None:
            now = time.monotonic()
            why = self._unreachable(target.sent_at, now)
            if why is not None:
                self.forget(target.request_id)
                target.reply = timeout_reply(target.request_id, why, UNREACHABLE)
                return
            timeout_ms = -1
            if target.deadline is not None:
                remaining = target.deadline - now
                if remaining <= 0:
                    if self._expire(target, now):  # sent again, while retries last
                        self._send_body(target.body, target.deadline)
                    continue
                timeout_ms = max(1, math.ceil(remaining * 1000))
            if self._poll_reply(timeout_ms, target.sent_at):
                self.receive_ready()

    def _poll_reply(self, timeout_ms: int, since: float) -> bool:
        """Wait up to `timeout_ms` (-1: for ever) for a reply; True if one waits. Until a
        broker was reached, the wait also ends on a monitor event or when the verdict of
        `_unreachable` is due, so that it is given at once."""
        if self.connect_timeout_s is None or self.watch.handshake_ever:
            return bool(self._sock.poll(timeout_ms, zmq.POLLIN))
        now = time.monotonic()
        due = self._verdict_due(since, now)
        if due is not None:
            due_ms = max(1, math.ceil((due - now) * 1000))
            timeout_ms = due_ms if timeout_ms < 0 else min(timeout_ms, due_ms)
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self.watch.monitor, zmq.POLLIN)
        return self._sock in dict(poller.poll(timeout_ms))


class Stream:
    """A streamed request in flight: iterate for its chunks' outputs (an error reply
    raises its typed error; a `timeout` one ClientTimeout), or `replies()` for the whole
    reply maps; `final` is its last reply once it came. Use it in a `with` block, or
    `close()` it, to cancel what is left when leaving early."""

    def __init__(self, client: Client, request_id: int, wait_s: float | None) -> None:
        self._client = client
        self.request_id = request_id
        self.wait_s = wait_s
        self.received: deque[dict[str, Any]] = deque()  # replies not taken yet
        self.final: dict[str, Any] | None = None
        self.closed = False

    def take(self, reply: dict[str, Any]) -> None:
        """A reply for this stream (the client's reader calls this)."""
        if not self.closed:
            self.received.append(reply)

    def next_reply(self) -> dict[str, Any] | None:
        """The next reply map, waiting for it; None once the last one was taken."""
        if self.final is not None or self.closed:
            return None
        if not self.received:
            self._client._wait_chunk(self)
        reply = self.received.popleft()
        if reply.get("more") is not True:
            self.final = reply
        return reply

    def replies(self) -> Iterator[dict[str, Any]]:
        """Every reply map, the last included, error or not."""
        while (reply := self.next_reply()) is not None:
            yield reply

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        reply = self.next_reply()
        if reply is None:
            raise StopIteration
        return reply_output(reply)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Cancel what is left of the stream (nothing if it ended): the broker answers it
        `cancelled` and the worker stops generating; chunks still coming are dropped."""
        if self.final is None and not self.closed:
            self.closed = True
            self.received.clear()
            self._client.send_cancel(self.request_id)
