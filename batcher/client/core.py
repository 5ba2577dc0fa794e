"""What every Python client shares, without any I/O (as httpx's BaseClient is for its
Client and AsyncClient): the table of requests waiting for a reply (the package's one,
batcher.core.replies.ReplyTable: ids, matching a reply to its request), the timeout and
retry rules, and the ConnectionWatch hints. `batcher.client.sync.Client` adds a blocking
socket, `batcher.client.aio.AsyncClient` an asyncio one; `batcher.client.multi.MultiClient`
combines Clients."""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import typing
from collections.abc import Callable, Iterable
from typing import Any, Concatenate, Generic, NamedTuple, ParamSpec, Protocol, TypeVar, cast

from batcher.core.expiry import Resend, check_retries, expire
from batcher.core.replies import ReplyTable
from batcher.core.replies import reply_key as reply_key  # its old home
from batcher.core.versions import parse_version
from batcher.errors import BatcherError, SettingsError
from batcher.transport.connection_watch import (
    ConnectionWatch,
)
from batcher.wire import protocol
from batcher.wire.errors import (
    TIMEOUT,
    error_from_reply,
)
from batcher.wire.tracecontext import format_traceparent

log = logging.getLogger("batcher.client")


#: How long a Client's request waits, by default, for a first connection to a broker
#: before failing `unreachable` (when the address refuses, or is no ZeroMQ peer).
CONNECT_TIMEOUT_S = 1.0


def request_body(
    input: Any,
    model: str | None,
    timeout_ms: float | None,
    priority: float | None,
    cost: float | None = None,
    stream: bool = False,
    version: int | str | None = None,
) -> dict[str, Any]:
    """A request map with only the fields that were given (protocol.md, 4.2), and the
    caller's trace context when it runs inside an OpenTelemetry span (docs/tracing.md).
    A `version` (a repository model's: docs/models.md) is checked here, as the broker
    checks it (an int >= 1 or its digits, never a bool): SettingsError before anything
    is sent."""
    body: dict[str, Any] = {"input": input}
    if stream:
        body["stream"] = True
    if model is not None:
        body["model"] = model
    if version is not None:
        body["version"] = parse_version(version)
    if timeout_ms is not None:
        body["timeout_ms"] = timeout_ms
    if priority is not None:
        body["priority"] = priority
    if cost is not None:
        body["cost"] = cost
    if (otel := sys.modules.get("opentelemetry.trace")) is not None:
        add_trace_context(body, otel)
    return body


def add_trace_context(body: dict[str, Any], otel: Any) -> None:
    """Set `traceparent` (and `tracestate`) from OpenTelemetry's current span, when it is
    a valid one: the request's spans at the broker are then its children. Never raises:
    a broken or absent OpenTelemetry sends the request without context."""
    try:
        ctx = otel.get_current_span().get_span_context()
        if not ctx.is_valid:
            return
        body["traceparent"] = format_traceparent(ctx.trace_id, ctx.span_id, int(ctx.trace_flags))
        state = ctx.trace_state.to_header() if ctx.trace_state else ""
        if state:
            body["tracestate"] = state
    except Exception:  # the caller's OpenTelemetry is theirs: never a failed request
        return


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


def reply_output(reply: dict[str, Any]) -> Any:
    """A reply's output, or its typed error raised (every face's `request` and `result`,
    and a stream's chunk)."""
    if reply.get("ok"):
        return reply.get("output")
    raise error_from_reply(reply)


def cancel_body(request_id: Any) -> bytes:
    """The body asking the broker to drop request `request_id` if it is still queued."""
    return protocol.pack({"id": request_id, "op": "cancel"})


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


_P = ParamSpec("_P")
_A = TypeVar("_A")
_S = TypeVar("_S")
_R = TypeVar("_R")


def request_fields(
    input: Any,
    model: str | None = None,
    timeout_ms: float | None = None,
    priority: float | None = None,
    cost: float | None = None,
    version: int | str | None = None,
) -> dict[str, Any]:
    """The arguments of every face's request calls (`submit`, `request`, `request_reply`
    on Client, MultiClient and AsyncClient), declared once: each takes them through
    `takes(request_fields)`, so their order, defaults and types cannot drift apart, and
    gets the request map they make (`request_body`; `timeout_ms` is in it when given).
    `version`: which version of a repository's model runs it (docs/models.md; none: its
    split, else its newest)."""
    return request_body(input, model, timeout_ms, priority, cost, version=version)


class StreamArgs(NamedTuple):
    """A streamed request's arguments, declared once for every face's `stream` (through
    `takes(StreamArgs)`): a request's without `cost` (so `version` is the fifth, as it
    always was). A value, not a map as `request_fields` gives: MultiClient hands them on
    to a Client, and AsyncClient's stream makes its map when first iterated."""

    input: Any
    model: str | None = None
    timeout_ms: float | None = None
    priority: float | None = None
    version: int | str | None = None

    def body(self) -> dict[str, Any]:
        """The request map to send, `"stream": true` (`request_body`)."""
        input, model, timeout_ms, priority, version = self
        return request_body(input, model, timeout_ms, priority, stream=True, version=version)


class ManyArgs(NamedTuple):
    """`request_many`'s arguments, declared once for every face's (through
    `takes(ManyArgs)`): many inputs, each sent as a request with the same model,
    deadline and version."""

    inputs: Iterable[Any]
    model: str | None = None
    timeout_ms: float | None = None
    return_exceptions: bool = False
    version: int | str | None = None


def takes(
    params: Callable[_P, _A],
) -> Callable[[Callable[[_S, _A], _R]], Callable[Concatenate[_S, _P], _R]]:
    """A method written over what `params` makes of its arguments (`@takes(request_fields)`
    over `def submit(self, fields)`), that callers still call with the arguments `params`
    declares, by position or keyword (`submit(x, "lin", 500)`): so a parameter list that
    many methods share is written once. A wrong call raises TypeError from `params`.
    help() and inspect.signature show the declared parameters (`__signature__`), and
    mypy checks callers against them (ParamSpec). A coroutine method stays one (awaiting
    it calls `params`); any other, a generator too, calls `params` at once. The cost: a
    call through `*args, **kwargs` and one to `params`, per call."""
    hints = typing.get_type_hints(params)
    shown = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + [
        p.replace(annotation=hints.get(p.name, p.annotation))
        for p in inspect.signature(params).parameters.values()
    ]

    def decorate(body: Callable[[_S, _A], _R]) -> Callable[Concatenate[_S, _P], _R]:
        run: Any = body  # a coroutine function's, awaited below

        def method(self: _S, *args: _P.args, **kwargs: _P.kwargs) -> _R:
            return body(self, params(*args, **kwargs))

        async def coroutine_method(self: _S, *args: _P.args, **kwargs: _P.kwargs) -> Any:
            return await run(self, params(*args, **kwargs))

        chosen: Any = coroutine_method if inspect.iscoroutinefunction(body) else method
        functools.update_wrapper(chosen, body)
        chosen.__signature__ = inspect.signature(body).replace(parameters=shown)
        chosen.__annotations__ = {
            **{p.name: p.annotation for p in shown[1:]},
            "return": chosen.__signature__.return_annotation,
        }
        return cast(Callable[Concatenate[_S, _P], _R], chosen)

    return decorate


class BlockingRequests:
    """The blocking faces' request calls, written once over their `submit` (Client and
    MultiClient): the same names, arguments and error rule on both (and, awaited, on
    AsyncClient)."""

    #: Send a request without waiting: takes request_fields' arguments.
    submit: Callable[..., _Awaited]

    def _submit(self, fields: dict[str, Any]) -> _Awaited:
        """Send the request map `fields` without waiting: `submit`, once its arguments
        are taken (a face's own)."""
        raise NotImplementedError

    @takes(request_fields)
    def request(self, fields: dict[str, Any]) -> Any:
        """Send one request and return its output, or raise its typed error. `version`:
        which version of a repository's model runs it (none: its split, else its newest)."""
        return self._submit(fields).result()

    @takes(request_fields)
    def request_reply(self, fields: dict[str, Any]) -> dict[str, Any]:
        """Send one request and return the whole reply map (output or error, with
        metadata such as batch_size, worker and a repository's `version`); an error is
        data here, never raised, and no reply in time is one with code `timeout` (or
        `unreachable`)."""
        return self._submit(fields).wait()

    @takes(ManyArgs)
    def request_many(self, args: ManyArgs) -> list[Any]:
        """Send all inputs at once (so the broker can batch them) and return the outputs
        in order, once every one has its reply. With return_exceptions, errors come back
        in place; otherwise the first one (in input order) is raised, after all finished."""
        inputs, model, timeout_ms, return_exceptions, version = args
        pendings = [self._submit(request_fields(x, model, timeout_ms, version=version)) for x in inputs]
        return collect(pendings, return_exceptions)


class _Awaited:
    """What every in-flight request offers: its reply once it came, as output or error."""

    reply: dict[str, Any] | None

    def done(self) -> bool:
        return self.reply is not None

    def result(self) -> Any:
        """The output; raises the typed error for an error reply, ClientTimeout for none."""
        return reply_output(self.wait())

    def wait(self) -> dict[str, Any]:
        """The whole reply map (with metadata such as batch_size), error or not."""
        if self.reply is None:
            self._wait()
        assert self.reply is not None
        return self.reply

    def _wait(self) -> None:
        raise NotImplementedError


PendingT = TypeVar("PendingT")


class Expirable(Protocol):
    """What `BaseClient._expire` needs of a blocking request in flight (PendingReply)."""

    request_id: Any
    attempts: int
    wait_s: float | None
    sent_at: float
    deadline: float | None
    reply: dict[str, Any] | None


class BaseClient(Generic[PendingT]):
    """What every client of one broker shares, without any I/O (in the manner of httpx's
    BaseClient): the request ids, the table of requests waiting for a reply, matching a
    reply to its request, the timeout and retry rules, and the ConnectionWatch hints.

    `PendingT` is what the table (`_replies`, a batcher.core.replies.ReplyTable) holds for
    a request: a PendingReply for Client, a future for AsyncClient. A subclass opens the
    socket and sets `watch`; it adds a request to `_replies` under its id (`_next_id`)
    when it sends it, and gives every reply it receives to `_match`.
    """

    watch: ConnectionWatch  # the socket's monitor, set by the subclass that opens the socket

    def __init__(
        self,
        address: str,
        timeout_s: float | None,
        retries: int,
        connect_timeout_s: float | None = CONNECT_TIMEOUT_S,
    ) -> None:
        check_retries(retries)
        if connect_timeout_s is not None and not connect_timeout_s > 0:
            raise SettingsError(f"connect_timeout_s must be > 0 or None, got {connect_timeout_s}")
        self.address = address
        self.timeout_s = timeout_s
        self.retries = retries
        #: Until a broker was reached, how long a request waits before it fails
        #: `unreachable` when none can be there (ConnectionWatch.unreachable).
        self.connect_timeout_s = connect_timeout_s
        #: The requests waiting for a reply, and their ids (batcher/core/replies.py).
        self._replies: ReplyTable[PendingT] = ReplyTable()
        #: Streamed requests by id: what takes their chunks (a closed one's stay until its last).
        self._streams: dict[Any, Any] = {}

    @property
    def duplicates_dropped(self) -> int:
        """Replies that matched no waiting request: a retried request's second reply, or
        a late one to a request that already timed out."""
        return self._replies.unmatched

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

    def _stream_body(self, args: StreamArgs) -> tuple[int, bytes, float | None]:
        """A streamed request (`"stream": true`) to send: its id, its body and how long to
        wait for each chunk. The caller puts what takes its chunks in `_streams` under the id."""
        request_id = self._next_id()
        body = protocol.pack_carrying({"id": request_id, **args.body()}, args.input)
        return request_id, body, reply_wait_s(self.timeout_s, args.timeout_ms)

    def _next_id(self) -> int:
        """A request id not used before on this client (1, 2, ...)."""
        return self._replies.new_id()

    def forget(self, request_id: Any) -> None:
        """Stop waiting for request `request_id`: a reply to it that still comes is
        dropped as a duplicate."""
        self._replies.forget(request_id)

    def _match(self, reply: dict[str, Any]) -> PendingT | None:
        """Take the request `reply` answers out of the table, by its id (or by the nil-id
        rule of `reply_key`). None when no request waits for it (a late reply, or a
        retried request's second), counted in `duplicates_dropped`. Raises (KeyError,
        TypeError) for what is no reply at all: the caller skips it, uncounted."""
        return self._replies.match_reply(reply)

    def _unreachable(self, since: float, now: float) -> str | None:
        """Why no broker can be reached, at `now`, for a request sent at `since` (None:
        one may be)."""
        if self.connect_timeout_s is None or self.watch.handshake_ever:
            return None
        return self.watch.unreachable(since, now, self.connect_timeout_s)

    def _verdict_due(self, since: float, now: float) -> float | None:
        """When `_unreachable` is next due to change its mind by time alone, seen at `now`
        (None: never, or only on a monitor event)."""
        if self.connect_timeout_s is None or self.watch.handshake_ever:
            return None
        due = self.watch.next_verdict_at(since, self.connect_timeout_s)
        return due if due is not None and due > now else None

    def _timeout_message(self, attempts: int) -> str:
        """Why a request got no reply after `attempts` sends, from the socket's monitor."""
        return f"no reply from {self.address} after {attempts} attempt(s): {self.watch.hint()}"

    def _expire(self, pending: Expirable, now: float) -> bool:
        """A blocking request past its deadline at `now` (batcher.core.expiry): True when
        it is to be sent again (its attempts and deadline are updated; the caller sends
        it), else it is answered with a `timeout` reply and forgotten."""
        verdict = expire(pending, now, self.retries)
        if isinstance(verdict, Resend):
            pending.attempts = verdict.attempt
            pending.sent_at = now
            pending.deadline = verdict.deadline
            return True
        self.forget(pending.request_id)
        pending.reply = timeout_reply(pending.request_id, self._timeout_message(verdict.attempts))
        return False
