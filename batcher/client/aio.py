"""The asyncio client: one DEALER socket on zmq.asyncio, any number of requests in flight.

A single reader task takes every reply off the socket and resolves the future of the
request with that `id`, so thousands of coroutines can await their own replies over
one connection, and the broker can batch them together:

    async with AsyncClient("tcp://127.0.0.1:5555") as client:
        outputs = await asyncio.gather(*(client.request(x) for x in range(64)))

Errors raise the same typed exceptions as the blocking client (batcher.client.sync):
`ModelError`, `UnknownModel`, ... and `ClientTimeout` when no reply came in time.
The ids, the matching of replies and the retry rule are the blocking client's too
(batcher.client.sync.BaseClient); only the waiting is asyncio's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Generator
from types import TracebackType
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from batcher.client.core import ManyArgs, StreamArgs, reply_output, request_fields, takes
from batcher.client.sync import (
    CONNECT_TIMEOUT_S,
    BaseClient,
    BatcherError,
    ClientClosed,
    ClientTimeout,
    Unreachable,
    cancel_body,
    open_dealer,
    reply_wait_s,
    request_body,
    timeout_reply,
)
from batcher.core.expiry import Attempts, TimedOut, expire
from batcher.errors import SettingsError
from batcher.transport.connection_watch import CLIENT_EVENTS
from batcher.wire import protocol, tensor
from batcher.wire.protocol import ZERO_COPY_BYTES

_T = TypeVar("_T")
log = logging.getLogger("batcher.aio")


class AsyncClient(BaseClient[asyncio.Future[dict[str, Any]]]):
    """Talks to a broker's frontend over one zmq.asyncio DEALER socket.

    Use it from one event loop. `timeout_s` bounds the wait for each reply (None: wait
    forever); with `retries`, a request that got no reply in time is sent again (only
    for idempotent models: the first attempt may still run; a second reply is dropped).
    Cancelling a coroutine that awaits `request`, or its timing out, asks the broker to
    drop the request if it is still queued. Until a broker was reached, a request fails
    `unreachable` after `connect_timeout_s` when none can be there, as with Client.
    """

    def __init__(
        self,
        address: str = "tcp://127.0.0.1:5555",
        timeout_s: float | None = 30.0,
        retries: int = 0,
        context: zmq.asyncio.Context | None = None,
        curve_server_key: str | None = None,
        curve_secret_key: str | None = None,
        connect_timeout_s: float | None = CONNECT_TIMEOUT_S,
    ) -> None:
        super().__init__(address, timeout_s, retries, connect_timeout_s)
        if timeout_s is not None and timeout_s <= 0:
            raise SettingsError(f"timeout_s must be > 0 or None, got {timeout_s}")
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket
        self._sock, self.watch = open_dealer(
            self._ctx, address, curve_server_key, curve_secret_key, CLIENT_EVENTS
        )
        self._reader: asyncio.Task[None] | None = None
        self._closed = False

    # --- lifecycle --------------------------------------------------------------------------

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        """Stop the reader, close the socket; requests still waiting raise ClientClosed."""
        if self._closed:
            return
        self._closed = True
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        self.watch.close()
        self._sock.close(0)
        self._fail_pending(ClientClosed(f"the client of {self.address} was closed"))

    def _fail_pending(self, exc: BatcherError) -> None:
        for fut in self._replies.take_all().values():
            if not fut.done():
                fut.set_exception(exc)
        streams, self._streams = self._streams, {}
        for queue in streams.values():
            queue.take(exc)

    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(
                self._read_replies(), name=f"batcher-reader {self.address}"
            )

    async def _read_replies(self) -> None:
        """The one task that receives: each reply resolves the future of its id."""
        try:
            while True:
                frames = await self._sock.recv_multipart(copy=False)  # no copy of a large reply
                try:
                    reply = tensor.unpack_arrays(frames[-1])
                    if self._route_chunk(reply):
                        continue
                    fut = self._match(reply)  # None: dropped as a duplicate, and counted
                except Exception:
                    continue  # not a reply of ours; nothing to match it to
                if fut is None:
                    continue
                if fut.done():
                    self._replies.unmatched += 1  # answered already: a duplicate too
                else:
                    fut.set_result(reply)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the socket broke: nobody would ever be answered
            log.error("reply reader for %s stopped: %s", self.address, exc)
            self._fail_pending(ClientClosed(f"reply reader stopped: {exc}"))

    # --- requests ---------------------------------------------------------------------------

    async def _call(
        self,
        fields: dict[str, Any],
        wait_s: float | None,
        request_id: int | None = None,
        on_sent: Callable[[], None] | None = None,
    ) -> dict[str, Any]:
        """Send one request and return its whole reply map (an error reply included);
        `on_sent` is called after each send of it."""
        if self._closed:
            raise ClientClosed(f"the client of {self.address} is closed")
        self._ensure_reader()
        self.watch.poll()  # keeps the monitor's queue short, so no event is dropped
        if request_id is None:
            request_id = self._next_id()
        body = protocol.pack_carrying({"id": request_id, **fields}, fields.get("input"))
        fut = self._replies.add(request_id, asyncio.get_running_loop().create_future())
        attempts = 0
        sent = False
        try:
            while True:
                attempts += 1
                try:
                    # The send counts against the timeout too: it waits for ever on a
                    # socket whose handshake was refused (libzmq gives such a one up).
                    async with asyncio.timeout(wait_s):
                        await self._sock.send_multipart([b"", body], copy=len(body) < ZERO_COPY_BYTES)
                        sent = True
                        if on_sent is not None:
                            on_sent()
                        return await self._reply_or_unreachable(fut, request_id)
                except TimeoutError:
                    verdict = expire(Attempts(attempts, wait_s), time.monotonic(), self.retries)
                    if isinstance(verdict, TimedOut):
                        if sent:
                            _cancel_soon(self, request_id, fut.done() or "op" in fields)
                        raise ClientTimeout(
                            self._timeout_message(attempts), reply={"id": request_id}
                        ) from None
        except asyncio.CancelledError:
            _cancel_soon(self, request_id, fut.done() or "op" in fields)
            raise
        finally:
            self._replies.release(request_id, fut)
            if not fut.done():
                fut.cancel()

    async def _reply_or_unreachable(self, fut: asyncio.Future[_T], request_id: Any) -> _T:
        """`fut`'s result; raises Unreachable once no broker can be reached (the verdict
        is looked at when due by time: the monitor is read then, not awaited)."""
        since = time.monotonic()
        while True:
            now = time.monotonic()
            why = self._unreachable(since, now)
            if why is not None:
                raise Unreachable(why, reply={"id": request_id})
            due = self._verdict_due(since, now)
            if due is None:
                return await asyncio.shield(fut)  # shield: a timed-out wait leaves it for a retry
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.001, due - now)):
                    return await asyncio.shield(fut)

    @takes(request_fields)
    def submit(self, fields: dict[str, Any]) -> AsyncPendingReply:
        """Send a request without waiting for it (call from the client's event loop);
        returns its AsyncPendingReply, to await (its output) when the answer is wanted."""
        if self._closed:
            raise ClientClosed(f"the client of {self.address} is closed")
        return AsyncPendingReply(self, fields, reply_wait_s(self.timeout_s, fields.get("timeout_ms")))

    @takes(request_fields)
    async def request_reply(self, fields: dict[str, Any]) -> dict[str, Any]:
        """Send one request and return the whole reply map (output or error, with
        metadata such as batch_size and worker); an error is data here, never raised, and
        no reply in time is one with code `timeout` (or `unreachable`), as on Client."""
        try:
            return await self._call(fields, reply_wait_s(self.timeout_s, fields.get("timeout_ms")))
        except ClientTimeout as exc:
            return timeout_reply(exc.reply.get("id"), exc.message, exc.code)

    @takes(request_fields)
    async def request(self, fields: dict[str, Any]) -> Any:
        """Send one request and return its output, or raise its typed error."""
        wait_s = reply_wait_s(self.timeout_s, fields.get("timeout_ms"))
        return reply_output(await self._call(fields, wait_s))

    @takes(ManyArgs)
    async def request_many(self, args: ManyArgs) -> list[Any]:
        """Send all inputs at once (so the broker can batch them) and return the outputs
        in order. With return_exceptions, BatcherErrors come back in place; otherwise
        the first one (in input order) is raised once every request has finished."""
        inputs, model, timeout_ms, return_exceptions, version = args
        request_body(None, model, None, None, version=version)  # a bad version raises, not per input
        results = await asyncio.gather(
            *(self.request(x, model, timeout_ms, version=version) for x in inputs), return_exceptions=True
        )
        for r in results:
            if isinstance(r, BaseException) and not (return_exceptions and isinstance(r, BatcherError)):
                raise r
        return list(results)

    @takes(StreamArgs)
    async def stream(self, args: StreamArgs) -> AsyncIterator[Any]:
        """Send a streamed request (`"stream": true`) and iterate over its chunks as they
        come: `async for chunk in client.stream(x)`. An error reply raises its typed
        error. Leaving the loop early (break, an exception, cancellation) tells the
        broker to cancel it, and the worker stops generating; for that to happen at once
        rather than when the generator is collected, wrap it in contextlib.aclosing.
        `timeout_s` bounds the wait for each chunk; a stream is never retried."""
        if self._closed:
            raise ClientClosed(f"the client of {self.address} is closed")
        self._ensure_reader()
        self.watch.poll()
        request_id, body, wait_s = self._stream_body(args)
        chunks = self._streams[request_id] = _StreamQueue()
        finished = False
        try:
            try:
                async with asyncio.timeout(wait_s):
                    await self._sock.send_multipart([b"", body], copy=len(body) < ZERO_COPY_BYTES)
            except TimeoutError:
                raise ClientTimeout(self._timeout_message(1), reply={"id": request_id}) from None
            while not finished:
                # Until a broker was ever reached, the first chunk's wait fails `unreachable`
                # after connect_timeout_s, as a request's does.
                getter = asyncio.ensure_future(chunks.get())
                try:
                    async with asyncio.timeout(wait_s):
                        reply = await self._reply_or_unreachable(getter, request_id)
                except TimeoutError:
                    raise ClientTimeout(self._timeout_message(1), reply={"id": request_id}) from None
                finally:
                    if not getter.done():
                        getter.cancel()
                if isinstance(reply, BaseException):
                    raise reply
                finished = reply.get("more") is not True
                yield reply_output(reply)
        finally:
            if not finished:
                chunks.closed = True  # what still comes is dropped, until its last reply
                if self._streams.get(request_id) is chunks and not self._closed:
                    with contextlib.suppress(zmq.ZMQError):
                        sent = asyncio.ensure_future(
                            self._sock.send_multipart([b"", cancel_body(request_id)])
                        )
                        sent.add_done_callback(_ignore_result)
                else:
                    self._streams.pop(request_id, None)

    async def control(self, op: str, **fields: Any) -> Any:
        """Send a control request (`stats`; `reload` with model=NAME) and return its output."""
        return reply_output(await self._call({"op": op, **fields}, self.timeout_s))


class AsyncPendingReply:
    """A request sent by `AsyncClient.submit`: `await pending` (or `await pending.result()`)
    for its output or typed error, `await pending.wait()` for the whole reply map,
    `cancel()` to ask the broker to drop it. The request is sent, and waited for, by a
    task of its own, so it goes out whether or not anyone awaits it."""

    def __init__(self, client: AsyncClient, fields: dict[str, Any], wait_s: float | None) -> None:
        self._client = client
        self.request_id = client._next_id()
        self._sent = False
        self._cancel_wanted = False
        self._task = asyncio.get_running_loop().create_task(
            self._run(fields, wait_s), name=f"batcher-request {client.address} {self.request_id}"
        )
        self._task.add_done_callback(_ignore_result)  # an error nobody awaited is no warning

    async def _run(self, fields: dict[str, Any], wait_s: float | None) -> dict[str, Any]:
        try:
            return await self._client._call(fields, wait_s, self.request_id, self._on_sent)
        except ClientTimeout as exc:  # a reply map, as the blocking client's wait() gives
            return timeout_reply(self.request_id, exc.message, exc.code)

    def done(self) -> bool:
        """Whether the reply (or the timeout) is in."""
        return self._task.done()

    async def wait(self) -> dict[str, Any]:
        """The whole reply map (with metadata such as batch_size), error or not; a
        timeout is an error reply with code `timeout`. Raises ClientClosed if the client
        is closed first."""
        return await asyncio.shield(self._task)

    async def result(self) -> Any:
        """The output; raises the typed error for an error reply, ClientTimeout for none."""
        return reply_output(await self.wait())

    def __await__(self) -> Generator[Any, None, Any]:
        return self.result().__await__()

    def cancel(self) -> None:
        """Ask the broker to drop this request if it is still queued; it is then answered
        with `cancelled` (a request already running is answered normally). Called before
        the request went out, the cancel follows it."""
        if self._sent:
            self._send_cancel()
        else:
            self._cancel_wanted = True

    def _on_sent(self) -> None:
        self._sent = True
        if self._cancel_wanted:
            self._cancel_wanted = False
            self._send_cancel()

    def _send_cancel(self) -> None:
        _cancel_soon(self._client, self.request_id, self._task.done())


class _StreamQueue:
    """The replies of one streamed request, as the reader task hands them over."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[dict[str, Any] | BaseException] = asyncio.Queue()
        self.closed = False

    def take(self, reply: dict[str, Any] | BaseException) -> None:
        if not self.closed:
            self._queue.put_nowait(reply)

    async def get(self) -> dict[str, Any] | BaseException:
        return await self._queue.get()


def _cancel_soon(client: AsyncClient, request_id: int, answered: bool) -> None:
    """Best effort, without awaiting: drop an unanswered request from the broker's queue
    (nothing for one `answered` already, or once the client is closed)."""
    if answered or client._closed:
        return
    with contextlib.suppress(zmq.ZMQError):
        sent = asyncio.ensure_future(client._sock.send_multipart([b"", cancel_body(request_id)]))
        sent.add_done_callback(_ignore_result)


def _ignore_result(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved, so asyncio does not log it
