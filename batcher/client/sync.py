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

import heapq
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar

import zmq

from batcher.core.link import Backoff, Drop, PeerLink
from batcher.errors import BatcherError, SettingsError
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
from batcher.wire.protocol import ErrorCode

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
    "MultiClient",
    "MultiPending",
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

#: How long a Client's request waits, by default, for a first connection to a broker
#: before failing `unreachable` (when the address refuses, or is no ZeroMQ peer).
CONNECT_TIMEOUT_S = 1.0


def reply_key(reply: dict[str, Any], pending: dict[Any, Any]) -> Any:
    """The id a reply answers. An error with `id: nil` (the broker could not read the id
    of a request it refused) answers the one request in flight, when there is just one."""
    req_id = reply["id"]
    if req_id is None and reply.get("ok") is False and len(pending) == 1:
        return next(iter(pending))
    return req_id


def request_body(
    input: Any,
    model: str | None,
    timeout_ms: float | None,
    priority: float | None,
    cost: float | None = None,
    stream: bool = False,
) -> dict[str, Any]:
    """A request map with only the fields that were given (protocol.md, 4.2)."""
    body: dict[str, Any] = {"input": input}
    if stream:
        body["stream"] = True
    if model is not None:
        body["model"] = model
    if timeout_ms is not None:
        body["timeout_ms"] = timeout_ms
    if priority is not None:
        body["priority"] = priority
    if cost is not None:
        body["cost"] = cost
    return body


def reply_wait_s(timeout_s: float | None, timeout_ms: float | None) -> float | None:
    """How long a client waits for a reply: its own timeout, but no longer than a
    request's deadline plus a second for the trip back (the broker answers by then)."""
    if not timeout_ms:
        return timeout_s
    limit = timeout_ms / 1000.0 + 1.0
    return limit if timeout_s is None else min(timeout_s, limit)


def timeout_reply(request_id: Any, message: str, code: str = TIMEOUT) -> dict[str, Any]:
    """The reply map a request is answered with when no reply came in time (`timeout`),
    or none can come (`unreachable`)."""
    return {"id": request_id, "ok": False, "error": {"code": code, "message": message}}


def cancel_body(request_id: Any) -> bytes:
    """The body asking the broker to drop request `request_id` if it is still queued."""
    return protocol.pack({"id": request_id, "op": "cancel"})


def _check_retries(retries: int) -> None:
    if retries < 0:
        raise SettingsError(f"retries must be >= 0, got {retries}")


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


def collect(pendings: Iterable[_Awaited], return_exceptions: bool) -> list[Any]:
    """The outputs of requests in flight, in order, once every one has its reply (the
    `request_many` rule, the same on every client: docs/architecture.md, "Errors"): with
    return_exceptions an error takes its output's place, else the first error in input
    order is raised, after all have finished, so none is left in flight behind it."""
    pendings = list(pendings)
    for p in pendings:
        p.wait()
    out: list[Any] = []
    for p in pendings:
        try:
            out.append(p.result())
        except BatcherError as exc:
            if not return_exceptions:
                raise
            out.append(exc)
    return out


class _Awaited:
    """What every in-flight request offers: its reply once it came, as output or error."""

    reply: dict[str, Any] | None

    def done(self) -> bool:
        return self.reply is not None

    def result(self) -> Any:
        """The output; raises the typed error for an error reply, ClientTimeout for none."""
        reply = self.wait()
        if reply.get("ok"):
            return reply.get("output")
        raise error_from_reply(reply)

    def wait(self) -> dict[str, Any]:
        """The whole reply map (with metadata such as batch_size), error or not."""
        if self.reply is None:
            self._wait()
        assert self.reply is not None
        return self.reply

    def _wait(self) -> None:
        raise NotImplementedError


class PendingReply(_Awaited):
    """A request in flight; `result()` waits for it while serving the others too."""

    def __init__(self, client: Client, request_id: int, body: bytes, wait_s: float | None) -> None:
        self._client = client
        self.request_id = request_id
        self.body = body
        self.wait_s = wait_s
        self.attempts = 1
        self.sent_at = time.monotonic()  # of the latest attempt
        self.deadline = None if wait_s is None else self.sent_at + wait_s
        self.reply: dict[str, Any] | None = None

    def _wait(self) -> None:
        self._client._wait_for(self)

    def cancel(self) -> None:
        """Ask the broker to drop this request if it is still queued; it is then answered
        with `cancelled` (a request already running is answered normally)."""
        if self.reply is None:
            self._client.send_cancel(self.request_id)


PendingT = TypeVar("PendingT")


class BaseClient(Generic[PendingT]):
    """What every client of one broker shares, without any I/O (in the manner of httpx's
    BaseClient): the request ids, the table of requests waiting for a reply, matching a
    reply to its request, the timeout and retry rules, and the ConnectionWatch hints.

    `PendingT` is what the table holds for a request: a PendingReply for Client, a
    future for AsyncClient. A subclass opens the socket and sets `watch`; it adds a
    request to `_pending` under its id (from `_ids`) when it sends it, and gives every
    reply it receives to `_match`.
    """

    watch: ConnectionWatch  # the socket's monitor, set by the subclass that opens the socket

    def __init__(
        self,
        address: str,
        timeout_s: float | None,
        retries: int,
        connect_timeout_s: float | None = CONNECT_TIMEOUT_S,
    ) -> None:
        _check_retries(retries)
        if connect_timeout_s is not None and not connect_timeout_s > 0:
            raise SettingsError(f"connect_timeout_s must be > 0 or None, got {connect_timeout_s}")
        self.address = address
        self.timeout_s = timeout_s
        self.retries = retries
        #: Until a broker was reached, how long a request waits before it fails
        #: `unreachable` when none can be there (ConnectionWatch.unreachable).
        self.connect_timeout_s = connect_timeout_s
        self._ids = itertools.count(1)
        self._pending: dict[Any, PendingT] = {}
        #: Streamed requests by id: what takes their chunks (a closed one's stay until its last).
        self._streams: dict[Any, Any] = {}
        #: Replies that matched no waiting request: a retried request's second reply,
        #: or a late one to a request that already timed out.
        self.duplicates_dropped = 0

    def _route_chunk(self, reply: dict[str, Any]) -> bool:
        """Give a reply to the stream it belongs to, if it does (True); a stream's last
        reply (`more` not true) ends it here."""
        req_id = reply.get("id")
        stream = self._streams.get(req_id) if isinstance(req_id, int | str) else None
        if stream is None:
            return False
        if reply.get("more") is not True:
            del self._streams[req_id]
        stream.take(reply)
        return True

    def _next_id(self) -> int:
        """A request id not used before on this client (1, 2, ...)."""
        return next(self._ids)

    def forget(self, request_id: Any) -> None:
        """Stop waiting for request `request_id`: a reply to it that still comes is
        dropped as a duplicate."""
        self._pending.pop(request_id, None)

    def _match(self, reply: dict[str, Any]) -> PendingT | None:
        """Take the request `reply` answers out of the table, by its id (or by the nil-id
        rule of `reply_key`). None when no request waits for it (a late reply, or a
        retried request's second), counted in `duplicates_dropped`. Raises (KeyError,
        TypeError) for what is no reply at all: the caller skips it, uncounted."""
        key = reply["id"]
        if key is None:
            key = reply_key(reply, self._pending)
        pending = self._pending.pop(key, None)
        if pending is None:
            self.duplicates_dropped += 1
        return pending

    def _unreachable(self, since: float) -> str | None:
        """Why no broker can be reached, for a request sent at `since` (None: one may be)."""
        if self.connect_timeout_s is None or self.watch.handshake_ever:
            return None
        return self.watch.unreachable(since, time.monotonic(), self.connect_timeout_s)

    def _verdict_due(self, since: float) -> float | None:
        """When `_unreachable` is next due to change its mind by time alone (None: never,
        or only on a monitor event)."""
        if self.connect_timeout_s is None or self.watch.handshake_ever:
            return None
        due = self.watch.next_verdict_at(since, self.connect_timeout_s)
        return due if due is not None and due > time.monotonic() else None

    def _retry_allowed(self, attempts: int) -> bool:
        """Whether a request sent `attempts` times without a reply in time goes again."""
        return attempts <= self.retries

    def _timeout_message(self, attempts: int) -> str:
        """Why a request got no reply after `attempts` sends, from the socket's monitor."""
        return f"no reply from {self.address} after {attempts} attempt(s): {self.watch.hint()}"

    def _expire(self, pending: PendingReply) -> bool:
        """A blocking request past its deadline: True when it is to be sent again (its
        attempts and deadline are updated; the caller sends it), else it is answered
        with a `timeout` reply and forgotten."""
        if pending.wait_s is not None and self._retry_allowed(pending.attempts):
            pending.attempts += 1
            pending.sent_at = time.monotonic()
            pending.deadline = pending.sent_at + pending.wait_s
            return True
        self.forget(pending.request_id)
        pending.reply = timeout_reply(pending.request_id, self._timeout_message(pending.attempts))
        return False


class Client(BaseClient[PendingReply]):
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
        pending, self._pending = self._pending, {}
        for request_id, waiting in pending.items():
            waiting.reply = {"id": request_id, "ok": False, "error": error}
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            stream.take({"id": request_id, "ok": False, "error": error, "more": False})

    @property
    def socket(self) -> zmq.Socket[Any]:
        """The DEALER socket, to poll for POLLIN together with others (zmq.Poller); when
        it is readable, call `receive_ready`. Never send or receive on it directly."""
        return self._sock

    def submit(
        self,
        input: Any,
        model: str | None = None,
        timeout_ms: float | None = None,
        priority: float | None = None,
        cost: float | None = None,
    ) -> PendingReply:
        """Send a request without waiting; many can be in flight over the one socket."""
        body = request_body(input, model, timeout_ms, priority, cost)
        return self.start(body, reply_wait_s(self.timeout_s, timeout_ms))

    def request(
        self,
        input: Any,
        model: str | None = None,
        timeout_ms: float | None = None,
        priority: float | None = None,
        cost: float | None = None,
    ) -> Any:
        """Send one request and return its output, or raise its typed error."""
        return self.submit(input, model, timeout_ms, priority, cost).result()

    def request_many(
        self,
        inputs: Iterable[Any],
        model: str | None = None,
        timeout_ms: float | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Send all inputs at once (so the broker can batch them) and return the outputs
        in order, once every one has its reply. With return_exceptions, errors come back
        in place; otherwise the first one (in input order) is raised, after all finished."""
        return collect([self.submit(x, model, timeout_ms) for x in inputs], return_exceptions)

    def control(self, op: str, **fields: Any) -> Any:
        """Send a control request (`stats`; `reload` with model=NAME) and return its output."""
        return self.start({"op": op, **fields}, self.timeout_s).result()

    def stream(
        self,
        input: Any,
        model: str | None = None,
        timeout_ms: float | None = None,
        priority: float | None = None,
    ) -> Stream:
        """Send a streamed request (`"stream": true`) and iterate over its chunks as they
        come: `for chunk in client.stream(x)`. An error reply raises its typed error.
        Leaving early, use `with client.stream(x) as chunks:` (or `close()`): the broker
        is told to cancel it and the worker stops generating. `timeout_s` bounds the wait
        for each chunk; a stream is never retried."""
        if self._sock.closed:
            raise ClientClosed(f"the client of {self.address} is closed")
        request_id = next(self._ids)
        fields = request_body(input, model, timeout_ms, priority, stream=True)
        body = protocol.pack_carrying({"id": request_id, **fields}, input)
        stream = Stream(self, request_id, reply_wait_s(self.timeout_s, timeout_ms))
        self._streams[request_id] = stream
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
            why = self._unreachable(since)
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
        request_id = next(self._ids)
        body = protocol.pack_carrying({"id": request_id, **fields}, fields.get("input"))
        pending = PendingReply(self, request_id, body, wait_s)
        self._pending[request_id] = pending
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
            why = self._unreachable(target.sent_at)
            if why is not None:
                self.forget(target.request_id)
                target.reply = timeout_reply(target.request_id, why, UNREACHABLE)
                return
            timeout_ms = -1
            if target.deadline is not None:
                remaining = target.deadline - time.monotonic()
                if remaining <= 0:
                    if self._expire(target):  # sent again, while retries last
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
        due = self._verdict_due(since)
        if due is not None:
            due_ms = max(1, math.ceil((due - time.monotonic()) * 1000))
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
        if not reply.get("ok"):
            raise error_from_reply(reply)
        return reply.get("output")

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


# --- several frontends --------------------------------------------------------------------------


class _Frontend:
    """One broker frontend of a MultiClient: its Client and whether it is taken for down
    (until `down_until`, then probed); its back-off is a link's (batcher/core/link.py)."""

    def __init__(self, client: Client, down_s: float, max_down_s: float) -> None:
        self.client = client
        self.address = client.address
        self.link = PeerLink(Backoff(initial_s=down_s, cap_s=max_down_s))
        self.down_until: float | None = None  # None: up
        self.probe: PendingReply | None = None  # a `stats` request asking whether it is back
        self.owners: dict[int, MultiPending] = {}  # the Client's request id -> our request
        self.sent = 0  # attempts sent here, for spreading and for tests
        self.timeouts = 0

    @property
    def up(self) -> bool:
        return self.down_until is None

    def mark_up(self, now: float) -> None:
        """It answered: up, and its back-off starts again from `down_s`."""
        self.down_until = None
        self.link.heard(now)

    def mark_down(self, now: float, why: str) -> float:
        """No answer (or `why`): down for the back-off's next wait, which it returns."""
        drop = self.link.refused(why, now)
        assert isinstance(drop, Drop)  # a frontend is never given up on
        self.down_until = now + drop.retry_in_s
        return drop.retry_in_s


class MultiPending(_Awaited):
    """A MultiClient request in flight; `result()` waits for it while serving the others."""

    def __init__(self, multi: MultiClient, fields: dict[str, Any], wait_s: float | None) -> None:
        self._multi = multi
        self.fields = fields
        self.wait_s = wait_s
        self.attempts = 0  # sends, on whichever frontend
        self.timeouts = 0
        self.tried: list[str] = []  # the frontend of each attempt, in order
        self.reply: dict[str, Any] | None = None
        self._frontend: _Frontend | None = None
        self._inner: PendingReply | None = None
        self._pinned = False  # a control request for one given frontend: never moved

    @property
    def address(self) -> str | None:
        """The frontend of the latest attempt."""
        return self.tried[-1] if self.tried else None

    def _wait(self) -> None:
        self._multi._wait_for(self)

    def cancel(self) -> None:
        """Ask the broker holding it to drop this request if it is still queued."""
        if self.reply is None and self._frontend is not None and self._inner is not None:
            self._frontend.client.send_cancel(self._inner.request_id)


class MultiClient:
    """Spreads requests round-robin over several broker frontends (one Client each,
    driven through its public methods: start, receive_ready, forget, send_cancel).

    A frontend whose request gets no reply within `timeout_s` is taken for down: new
    requests skip it for `down_s` seconds, after which it is asked for `stats` (a probe,
    never a user's request); an answer brings it back, silence doubles its back-off (up
    to `max_down_s`). The timed-out request is sent again on another frontend while
    `retries` last, so, as with Client, retries are only for idempotent models: the
    first attempt may still run, and whichever reply comes first is the answer.
    A `shutting_down` reply (a draining broker, which never queued the request) also
    takes its frontend down, and the request goes to another one whatever `retries` says.
    When every frontend is down, requests go to the one due back soonest. Not thread-safe.
    """

    def __init__(
        self,
        addresses: Iterable[str],
        timeout_s: float = 5.0,
        retries: int = 1,
        down_s: float = 1.0,
        max_down_s: float = 30.0,
        context: zmq.Context[Any] | None = None,
        curve_server_key: str | None = None,
        curve_secret_key: str | None = None,
    ) -> None:
        addresses = list(addresses)
        if not addresses:
            raise SettingsError("MultiClient needs at least one address")
        if len(set(addresses)) != len(addresses):
            raise SettingsError(f"duplicate addresses in {addresses}")
        if not timeout_s > 0:
            raise SettingsError(
                f"timeout_s must be > 0 (it is how a down frontend is found), got {timeout_s}"
            )
        _check_retries(retries)
        if not 0 < down_s <= max_down_s:
            raise ValueError(f"need 0 < down_s <= max_down_s, got {down_s} and {max_down_s}")
        self.timeout_s = timeout_s
        self.retries = retries
        self.max_down_s = max_down_s
        self._ctx: zmq.Context[Any] = context or zmq.Context.instance()
        self._frontends: list[_Frontend] = []
        self._closed = False
        try:
            for a in addresses:
                c = Client(a, timeout_s, 0, self._ctx, curve_server_key, curve_secret_key)
                self._frontends.append(_Frontend(c, down_s, max_down_s))
        except BaseException:
            self.close()
            raise
        self._poller = zmq.Poller()
        self._by_socket: dict[zmq.Socket[Any], _Frontend] = {}
        for fe in self._frontends:
            self._poller.register(fe.client.socket, zmq.POLLIN)
            self._by_socket[fe.client.socket] = fe
        self._next = 0  # round-robin position
        self._deadlines: list[tuple[float, int, MultiPending, PendingReply]] = []
        self._seq = itertools.count()
        #: Requests sent again on another frontend after a timeout or `shutting_down`.
        self.resent = 0

    # --- lifecycle and state ----------------------------------------------------------------

    def __enter__(self) -> MultiClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every socket; a request still waiting for its reply raises ClientClosed,
        and so does any request made after."""
        self._closed = True
        error = {"code": CLOSED, "message": f"the client of {', '.join(self.addresses)} was closed"}
        for fe in self._frontends:
            fe.client.close()
            for request_id, waiting in fe.owners.items():
                if waiting.reply is None:
                    waiting.reply = {"id": request_id, "ok": False, "error": error}
            fe.owners.clear()
        self._deadlines.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed(f"the client of {', '.join(self.addresses)} is closed")

    @property
    def addresses(self) -> list[str]:
        return [fe.address for fe in self._frontends]

    def down(self) -> list[str]:
        """The frontends currently taken for down."""
        return [fe.address for fe in self._frontends if not fe.up]

    def sent(self) -> dict[str, int]:
        """Attempts sent to each frontend so far (probes not counted)."""
        return {fe.address: fe.sent for fe in self._frontends}

    @property
    def duplicates_dropped(self) -> int:
        """Replies that matched no waiting request (late, or a resent request's second)."""
        return sum(fe.client.duplicates_dropped for fe in self._frontends)

    # --- requests ---------------------------------------------------------------------------

    def submit(
        self,
        input: Any,
        model: str | None = None,
        timeout_ms: float | None = None,
        priority: float | None = None,
        cost: float | None = None,
    ) -> MultiPending:
        """Send a request to the next frontend that is up, without waiting."""
        self._check_open()
        body = request_body(input, model, timeout_ms, priority, cost)
        wait_s = reply_wait_s(self.timeout_s, timeout_ms)
        assert wait_s is not None  # a MultiClient always has a timeout: it is how it finds a dead broker
        pending = MultiPending(self, body, wait_s)
        self._send(pending, time.monotonic())
        return pending

    def request(
        self,
        input: Any,
        model: str | None = None,
        timeout_ms: float | None = None,
        priority: float | None = None,
        cost: float | None = None,
    ) -> Any:
        """Send one request and return its output, or raise its typed error."""
        return self.submit(input, model, timeout_ms, priority, cost).result()

    def request_many(
        self,
        inputs: Iterable[Any],
        model: str | None = None,
        timeout_ms: float | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Send all inputs at once, spread over the frontends, and return the outputs in
        order, once every one has its reply. With return_exceptions, errors come back in
        place; otherwise the first one (in input order) is raised, after all finished."""
        return collect([self.submit(x, model, timeout_ms) for x in inputs], return_exceptions)

    def control(self, op: str, address: str | None = None) -> Any:
        """Send a control request (`stats`) to the next frontend that is up, or to
        `address` only (no resend elsewhere), and return its output."""
        self._check_open()
        pending = MultiPending(self, {"op": op}, self.timeout_s)
        if address is None:
            self._send(pending, time.monotonic())
        else:
            matches = [fe for fe in self._frontends if fe.address == address]
            if not matches:
                raise SettingsError(f"{address} is not one of {self.addresses}")
            pending._pinned = True
            self._send_to(pending, matches[0])
        return pending.result()

    # --- machinery --------------------------------------------------------------------------

    def _pick(self, now: float, avoid: _Frontend | None) -> _Frontend:
        """The next frontend that is up, round-robin; else the one due back soonest."""
        n = len(self._frontends)
        for k in range(n):
            fe = self._frontends[(self._next + k) % n]
            if fe.up and fe is not avoid:
                self._next = (self._next + k + 1) % n
                return fe
        others = [fe for fe in self._frontends if fe is not avoid] or self._frontends
        return min(others, key=lambda fe: fe.down_until or now)

    def _send(self, pending: MultiPending, now: float, avoid: _Frontend | None = None) -> None:
        self._send_to(pending, self._pick(now, avoid))

    def _send_to(self, pending: MultiPending, fe: _Frontend) -> None:
        inner = fe.client.start(pending.fields, pending.wait_s)
        fe.owners[inner.request_id] = pending
        fe.sent += 1
        pending._frontend, pending._inner = fe, inner
        pending.attempts += 1
        pending.tried.append(fe.address)
        if inner.deadline is not None:
            heapq.heappush(self._deadlines, (inner.deadline, next(self._seq), pending, inner))

    def _mark_down(self, fe: _Frontend, now: float, why: str) -> None:
        if fe.up:
            down_s = fe.mark_down(now, why)
            log.warning("frontend %s taken for down for %.1fs: %s", fe.address, down_s, why)

    def _wait_for(self, target: MultiPending) -> None:
        while target.reply is None:
            now = time.monotonic()
            self._expire_due(now)
            self._probe(now)
            if target.reply is not None:
                return
            wakes = [self._deadlines[0][0]] if self._deadlines else []
            wakes += [fe.probe.deadline for fe in self._frontends if fe.probe and fe.probe.deadline]
            timeout_ms = -1
            if wakes:
                timeout_ms = max(0, math.ceil((min(wakes) - now) * 1000))
            for sock, _ in self._poller.poll(timeout_ms):
                self._receive(self._by_socket[sock])

    def _receive(self, fe: _Frontend) -> None:
        now = time.monotonic()
        for inner in fe.client.receive_ready():
            assert inner.reply is not None
            if not fe.up:
                log.info("frontend %s answers again", fe.address)
            fe.mark_up(now)  # any answer shows it is up
            if fe.probe is inner:
                fe.probe = None
                continue
            owner = fe.owners.pop(inner.request_id, None)
            if owner is not None:
                self._settle(owner, fe, inner.reply)

    def _settle(self, pending: MultiPending, fe: _Frontend, reply: dict[str, Any]) -> None:
        error = reply.get("error") if not reply.get("ok") else None
        if (
            isinstance(error, dict)
            and error.get("code") == ErrorCode.SHUTTING_DOWN
            and not pending._pinned
            and len(set(pending.tried)) < len(self._frontends)
        ):
            now = time.monotonic()
            self._mark_down(fe, now, "it is shutting down")
            self.resent += 1
            self._send(pending, now, avoid=fe)
            return
        pending.reply = reply

    def _expire_due(self, now: float) -> None:
        """Requests past their deadline: take their frontend for down and send them again
        elsewhere while retries last, else answer them with a timeout."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, pending, inner = heapq.heappop(self._deadlines)
            if pending.reply is not None or pending._inner is not inner:
                continue  # answered, or already sent again
            fe = pending._frontend
            assert fe is not None
            fe.client.forget(inner.request_id)
            fe.owners.pop(inner.request_id, None)
            fe.timeouts += 1
            self._mark_down(fe, now, f"no reply within {pending.wait_s}s")
            pending.timeouts += 1
            if pending.timeouts <= self.retries and not pending._pinned:
                self.resent += 1
                self._send(pending, now, avoid=fe)
                continue
            message = f"no reply after {pending.attempts} attempt(s): {', '.join(pending.tried)}"
            pending.reply = timeout_reply(inner.request_id, message)

    def _probe(self, now: float) -> None:
        """Ask each down frontend whose back-off is over whether it is back; a probe
        that goes unanswered doubles the back-off."""
        for fe in self._frontends:
            if fe.probe is not None:
                if fe.probe.deadline is not None and now >= fe.probe.deadline:
                    fe.client.forget(fe.probe.request_id)
                    fe.probe = None
                    down_s = fe.mark_down(now, "the probe went unanswered")
                    log.info("frontend %s still down; next try in %.1fs", fe.address, down_s)
            elif fe.down_until is not None and now >= fe.down_until:
                fe.probe = fe.client.start({"op": "stats"}, self.timeout_s)
