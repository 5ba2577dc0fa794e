"""The client core (batcher.client.core.BaseClient) on its own: request ids, matching replies
to requests, the nil-id rule, duplicates, timeouts with retries, and one exception class
per protocol error code. Without sockets, except the last tests, which drive Client's
public surface (start, receive_ready, forget, send_cancel, socket) over inproc.
"""

from __future__ import annotations

import inspect
import pydoc
import time
import typing
from collections.abc import Iterator
from enum import StrEnum
from typing import Any

import pytest
import zmq

import batcher.client.sync as client_module
import batcher.wire.errors as errors_module
from batcher.client.core import ManyArgs, StreamArgs, request_fields
from batcher.client.multi import MultiClient
from batcher.client.sync import (
    BadRequest,
    BaseClient,
    BatcherError,
    Cancelled,
    Client,
    ClientTimeout,
    DeadlineExceeded,
    Forbidden,
    InternalError,
    ModelError,
    Overloaded,
    PendingReply,
    ReplyError,
    ShuttingDown,
    Unavailable,
    UnknownModel,
    WorkerFailed,
    error_class_name,
    error_from_reply,
    timeout_reply,
)
from batcher.errors import SettingsError
from batcher.wire.protocol import ErrorCode
from tests.helpers import pack, unpack


class FakeWatch:
    """Stands in for a ConnectionWatch: the hint a timeout's message ends with."""

    def hint(self) -> str:
        return "the broker may be busy"


def core(timeout_s: float | None = 1.0, retries: int = 0) -> BaseClient[Any]:
    c: BaseClient[Any] = BaseClient("tcp://broker:5555", timeout_s, retries)
    c.watch = FakeWatch()  # type: ignore[assignment]
    return c


def track(c: BaseClient[Any], wait_s: float | None = 1.0) -> PendingReply:
    """A request in flight on the core, as Client.start leaves it (nothing sent)."""
    request_id = c._next_id()
    pending = PendingReply(c, request_id, b"body", wait_s, 100.0)  # type: ignore[arg-type]
    c._replies.add(request_id, pending)
    return pending


def ok(request_id: Any, output: Any = None) -> dict[str, Any]:
    return {"id": request_id, "ok": True, "output": output}


def error(request_id: Any, code: str = "bad_request") -> dict[str, Any]:
    return {"id": request_id, "ok": False, "error": {"code": code, "message": "no"}}


# --- ids and matching -----------------------------------------------------------------------------


def test_ids_count_from_one_and_each_client_has_its_own() -> None:
    a, b = core(), core()
    assert [a._next_id() for _ in range(3)] == [1, 2, 3]
    assert b._next_id() == 1


def test_replies_are_matched_by_id_in_any_order() -> None:
    c = core()
    p1, p2, p3 = track(c), track(c), track(c)
    assert c._match(ok(3)) is p3
    assert c._match(ok(1)) is p1
    assert len(c._replies) == 1 and c._replies.get(p2.request_id) is p2
    assert c.duplicates_dropped == 0


def test_a_second_or_late_reply_is_dropped_and_counted() -> None:
    c = core()
    p = track(c)
    assert c._match(ok(p.request_id)) is p
    assert c._match(ok(p.request_id)) is None  # a retried request's second reply
    assert c._match(ok(99)) is None  # never sent
    assert c.duplicates_dropped == 2


def test_forget_makes_a_later_reply_a_duplicate() -> None:
    c = core()
    p = track(c)
    c.forget(p.request_id)
    c.forget(p.request_id)  # twice is harmless
    assert c._match(ok(p.request_id)) is None
    assert c.duplicates_dropped == 1


def test_nil_id_error_answers_the_one_request_in_flight() -> None:
    c = core()
    p = track(c)
    assert c._match(error(None)) is p
    assert c.duplicates_dropped == 0


def test_nil_id_error_with_several_in_flight_or_nil_id_success_matches_none() -> None:
    c = core()
    p1, p2 = track(c), track(c)
    assert c._match(error(None)) is None  # ambiguous: matched to none
    assert c._match(ok(None)) is None  # only an error may carry a nil id
    assert len(c._replies) == 2
    assert c._replies.get(p1.request_id) is p1 and c._replies.get(p2.request_id) is p2
    assert c.duplicates_dropped == 2
    c.forget(p1.request_id)
    assert c._match(ok(None)) is None  # even with one in flight
    assert c._match(error(None)) is p2


@pytest.mark.parametrize("not_a_reply", [{}, [1, 2], "id", 7, {"id": [1]}])
def test_what_is_no_reply_raises_and_is_not_counted(not_a_reply: Any) -> None:
    c = core()
    track(c)
    with pytest.raises((KeyError, TypeError)):
        c._match(not_a_reply)
    assert c.duplicates_dropped == 0 and len(c._replies) == 1


# --- timeouts and retries -------------------------------------------------------------------------


def test_expire_sends_again_while_retries_last_then_answers_timeout() -> None:
    c = core(retries=2)
    p = track(c, wait_s=5.0)
    assert p.deadline == 105.0  # sent at 100.0 (the fake clock's)
    assert c._expire(p, 105.5) is True  # to be sent again, with a fresh deadline
    assert p.attempts == 2 and p.sent_at == 105.5 and p.deadline == 110.5
    assert p.reply is None and p.request_id in c._replies  # same id: either reply answers it
    assert c._expire(p, 110.5) is True
    assert p.attempts == 3 and p.deadline == 115.5
    assert c._expire(p, 115.5) is False  # retries spent
    assert p.reply == timeout_reply(
        p.request_id, "no reply from tcp://broker:5555 after 3 attempt(s): the broker may be busy"
    )
    assert p.request_id not in c._replies
    with pytest.raises(ClientTimeout) as err:
        p.result()
    assert err.value.code == "timeout" and "after 3 attempt(s)" in err.value.message
    assert c._match(ok(p.request_id)) is None and c.duplicates_dropped == 1  # the late reply


def test_expire_without_retries_answers_timeout_at_once() -> None:
    c = core(retries=0)
    p = track(c)
    assert c._expire(p, 101.0) is False
    assert p.reply is not None and p.reply["error"]["code"] == "timeout"
    assert "after 1 attempt(s)" in p.reply["error"]["message"]


def test_a_request_that_waits_forever_is_never_retried() -> None:
    c = core(timeout_s=None, retries=3)
    p = track(c, wait_s=None)
    assert p.deadline is None
    assert c._expire(p, 1e9) is False and p.attempts == 1


def test_negative_retries_are_refused_before_any_socket_is_opened() -> None:
    for make in (
        lambda: BaseClient("tcp://x:1", 1.0, -1),
        lambda: Client("tcp://x:1", retries=-1, context=None),
        lambda: MultiClient(["tcp://x:1"], retries=-1),
    ):
        with pytest.raises(ValueError, match="retries must be >= 0, got -1"):
            make()


# --- error classes --------------------------------------------------------------------------------


def test_every_error_code_has_a_class_of_its_own_named_after_it() -> None:
    classes = []
    for code in ErrorCode:
        exc = error_from_reply(error(1, code.value))
        cls = type(exc)
        classes.append(cls)
        assert cls is not ReplyError and issubclass(cls, ReplyError) and issubclass(cls, BatcherError), code
        assert cls.__name__ == error_class_name(code.value), code
        assert getattr(client_module, cls.__name__) is cls, f"{cls.__name__} is not importable"
        assert getattr(errors_module, cls.__name__) is cls, f"{cls.__name__} is not in batcher.wire.errors"
        assert cls.code == code.value and type(cls.code) is str
        assert exc.code == code.value and exc.message == "no" and exc.reply["id"] == 1
        assert str(exc) == f"{code.value}: no"
    assert len(set(classes)) == len(ErrorCode)


def test_the_error_class_names_users_import_keep_their_codes() -> None:
    expected = {
        BadRequest: "bad_request",
        UnknownModel: "unknown_model",
        ModelError: "model_error",
        DeadlineExceeded: "deadline_exceeded",
        Overloaded: "overloaded",
        Cancelled: "cancelled",
        WorkerFailed: "worker_failed",
        ShuttingDown: "shutting_down",
        Unavailable: "unavailable",
        Forbidden: "forbidden",
        InternalError: "internal_error",
        ClientTimeout: "timeout",
    }
    for cls, code in expected.items():
        assert cls.code == code
        assert type(error_from_reply(error(1, code))) is cls
    assert "timeout" not in {c.value for c in ErrorCode}  # the client's own code


def test_a_new_error_code_gets_its_class_made_from_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    class Extended(StrEnum):
        BAD_REQUEST = "bad_request"
        QUOTA_EXCEEDED = "quota_exceeded"  # added to the protocol, no class written for it

    monkeypatch.setattr(errors_module, "ErrorCode", Extended)
    monkeypatch.setattr(errors_module, "_ERRORS", dict(errors_module._ERRORS))  # the real one untouched
    monkeypatch.setattr(errors_module, "QuotaExceeded", None, raising=False)  # removed afterwards
    errors_module._make_missing_error_classes()
    cls = errors_module.QuotaExceeded
    assert issubclass(cls, ReplyError) and issubclass(cls, BatcherError)
    assert cls.__module__ == "batcher.wire.errors"
    assert cls.code == "quota_exceeded" and type(cls.code) is str
    assert type(error_from_reply(error(1, "quota_exceeded"))) is cls
    assert errors_module._ERRORS["bad_request"] is BadRequest  # a declared class is kept


def test_an_unknown_code_is_a_plain_reply_error_that_keeps_the_code() -> None:
    exc = error_from_reply(error(1, "from_the_future"))
    assert type(exc) is ReplyError and exc.code == "from_the_future"
    assert isinstance(exc, BatcherError)
    assert type(error_from_reply({"id": 1, "ok": False})) is ReplyError


def test_a_code_cannot_get_a_second_class() -> None:
    with pytest.raises(TypeError, match="already has its class BadRequest"):

        class Again(ReplyError, code="bad_request"):
            pass


def test_error_class_name() -> None:
    assert error_class_name("bad_request") == "BadRequest"
    assert error_class_name("overloaded") == "Overloaded"
    assert error_class_name("internal_error") == "InternalError"


# --- Client's public surface, over inproc -----------------------------------------------------------


@pytest.fixture
def router() -> Iterator[tuple[zmq.Context[Any], zmq.Socket[Any], str]]:
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    address = "inproc://client-core"
    sock.bind(address)
    yield ctx, sock, address
    ctx.destroy(linger=0)


def received(sock: zmq.Socket[Any]) -> tuple[list[bytes], dict[str, Any]]:
    assert sock.poll(2000, zmq.POLLIN), "nothing received"
    frames = sock.recv_multipart()
    return frames[:-1], unpack(frames[-1])


def test_start_receive_ready_forget_and_send_cancel(router) -> None:
    ctx, broker, address = router
    with Client(address, timeout_s=5, context=ctx) as c:
        first = c.start({"input": "a"}, 5.0)
        second = c.start({"op": "stats"}, None)
        envelope, body = received(broker)
        assert body == {"id": first.request_id, "input": "a"}
        _, body = received(broker)
        assert body == {"id": second.request_id, "op": "stats"} and second.deadline is None
        assert c.receive_ready() == []  # nothing waiting: returns at once

        broker.send_multipart([*envelope, pack(ok(second.request_id, "s"))])
        broker.send_multipart([*envelope, b"\xc1"])  # not msgpack: skipped, not counted
        broker.send_multipart([*envelope, pack(ok(first.request_id, "f"))])
        assert c.socket.poll(2000, zmq.POLLIN)
        answered: list[PendingReply] = []
        deadline = time.monotonic() + 2
        while len(answered) < 2 and time.monotonic() < deadline:
            c.socket.poll(100, zmq.POLLIN)
            answered += c.receive_ready()
        assert answered == [second, first]  # in order of arrival
        assert second.result() == "s" and first.result() == "f"
        assert c.duplicates_dropped == 0

        third = c.start({"input": "c"}, 5.0)
        _, body = received(broker)
        c.forget(third.request_id)
        assert c.send_cancel(third.request_id) is True
        _, body = received(broker)
        assert body == {"id": third.request_id, "op": "cancel"}
        broker.send_multipart([*envelope, pack(ok(third.request_id))])
        deadline = time.monotonic() + 2
        while c.duplicates_dropped == 0 and time.monotonic() < deadline:
            c.socket.poll(100, zmq.POLLIN)
            assert c.receive_ready() == []
        assert c.duplicates_dropped == 1 and third.reply is None


def test_a_stream_left_open_when_its_client_closes_ends_with_closed() -> None:
    """Nothing listens any more: iterating the stream raises at once instead of polling a
    closed socket."""
    c = Client("tcp://127.0.0.1:9", timeout_s=5)  # discard port: nothing answers
    stream = c.stream({"tokens": 3}, model="simlm")
    c.close()
    with pytest.raises(BatcherError, match="was closed") as raised:
        list(stream)
    assert raised.value.code == "closed" and stream.final is not None and stream.final["more"] is False


# --- a repository model's version, named on every client's request calls ------------------------------


@pytest.mark.parametrize("bad", [True, False, 0, -1, "x", "", 1.5, [2]])
def test_a_bad_version_is_refused_before_anything_is_sent(router, bad: Any) -> None:
    ctx, broker, address = router
    with Client(address, timeout_s=5, context=ctx) as c, MultiClient([address], context=ctx) as m:
        for call in (c.submit, c.request, c.request_reply, c.stream, m.submit, m.request, m.stream):
            with pytest.raises(SettingsError, match="version must be an integer >= 1"):
                call("a", "lin", version=bad)
        with pytest.raises(SettingsError, match="version must be an integer >= 1"):
            c.request_many(["a", "b"], "lin", version=bad)
    assert broker.poll(50, zmq.POLLIN) == 0  # nothing reached the broker


def test_a_named_version_is_sent_as_the_protocols_version_key_by_every_call(router) -> None:
    ctx, broker, address = router
    with Client(address, timeout_s=5, context=ctx) as c, MultiClient([address], context=ctx) as m:
        c.submit("a", "lin", version=2)
        m.submit("b", "lin", version="3")
        c.submit("c", "lin")
        c.request_many(["d", "e"], "lin", timeout_ms=500, version="1", return_exceptions=True)
        c.stream("f", "simlm", version=4)
        bodies = [received(broker)[1] for _ in range(6)]
    assert [(b["input"], b.get("version")) for b in bodies] == [
        ("a", 2), ("b", 3), ("c", None), ("d", 1), ("e", 1), ("f", 4)
    ]  # fmt: skip
    assert "version" not in bodies[2] and bodies[5]["stream"] is True


def test_the_async_client_sends_a_named_version_and_refuses_a_bad_one(router) -> None:
    import asyncio

    import zmq.asyncio

    from batcher.client.aio import AsyncClient

    ctx, broker, address = router

    async def main() -> list[dict[str, Any]]:
        actx = zmq.asyncio.Context.shadow(ctx.underlying)
        async with AsyncClient(address, timeout_s=5, context=actx) as c:
            first = c.submit("a", "lin", version=2)
            with pytest.raises(SettingsError):
                c.submit("x", "lin", version=True)
            with pytest.raises(SettingsError):
                await c.request_many(["x"], "lin", version="two", return_exceptions=True)
            with pytest.raises(SettingsError):
                await c.stream("x", "simlm", version=0).__anext__()
            second = c.submit("b", "lin", version="5")
            bodies = [(await asyncio.to_thread(received, broker))[1] for _ in range(2)]
            first.cancel()
            second.cancel()
            return bodies

    bodies = asyncio.run(main())
    assert [(b["input"], b["version"]) for b in bodies[:2]] == [("a", 2), ("b", 5)]


# --- one parameter list for every face's request calls (batcher.client.core.takes) -----------------

#: The request calls' parameters, in the order positional callers rely on: every face's
#: submit, request and request_reply takes them (request_fields declares them once),
#: its stream the same without `cost` (StreamArgs); its request_many its own (ManyArgs).
REQUEST_PARAMETERS = ["input", "model", "timeout_ms", "priority", "cost", "version"]
STREAM_PARAMETERS = ["input", "model", "timeout_ms", "priority", "version"]
MANY_PARAMETERS = ["inputs", "model", "timeout_ms", "return_exceptions", "version"]
DECLARED: dict[str, Any] = {
    "submit": request_fields,
    "request": request_fields,
    "request_reply": request_fields,
    "stream": StreamArgs,
    "request_many": ManyArgs,
}

#: The same request, called by position, by keyword and mixed (a version's digits are its number).
REQUEST_CALLS: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
    (("x", "lin", 500, 2.0, 3.0, 4), {}),
    (("x",), {"model": "lin", "timeout_ms": 500, "priority": 2.0, "cost": 3.0, "version": 4}),
    ((), {"version": 4, "cost": 3.0, "priority": 2.0, "timeout_ms": 500, "model": "lin", "input": "x"}),
    (("x", "lin", 500), {"version": "4", "cost": 3.0, "priority": 2.0}),
]
REQUEST_SENT = {"input": "x", "model": "lin", "timeout_ms": 500, "priority": 2.0, "cost": 3.0, "version": 4}
STREAM_CALLS: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
    (("x", "simlm", 500, 2.0, 4), {}),
    (("x",), {"model": "simlm", "timeout_ms": 500, "priority": 2.0, "version": 4}),
    ((), {"version": "4", "priority": 2.0, "timeout_ms": 500, "model": "simlm", "input": "x"}),
]
STREAM_SENT = {"input": "x", "model": "simlm", "timeout_ms": 500, "priority": 2.0, "version": 4}
STREAM_SENT["stream"] = True


def faces() -> list[type]:
    from batcher.client.aio import AsyncClient

    return [Client, MultiClient, AsyncClient]


def parameters_of(method: Any) -> list[tuple[str, Any, Any, Any]]:
    """A method's parameters as a caller sees them: name, kind, default and type (its
    annotations resolved, as mypy reads them)."""
    hints = typing.get_type_hints(method)
    return [
        (p.name, p.kind, p.default, hints.get(p.name)) for p in inspect.signature(method).parameters.values()
    ]


def test_the_declared_lists_keep_their_order_and_defaults() -> None:
    """Positional callers depend on this order: `version` is the sixth of a request's
    arguments and the fifth of a stream's or request_many's; every one but the first
    defaults to None (return_exceptions to False)."""
    for declared, names in (
        (request_fields, REQUEST_PARAMETERS),
        (StreamArgs, STREAM_PARAMETERS),
        (ManyArgs, MANY_PARAMETERS),
    ):
        params = inspect.signature(declared).parameters.values()
        assert [p.name for p in params] == names
        defaults = [p.default for p in params][1:]
        assert defaults == [False if n == "return_exceptions" else None for n in names[1:]]
        assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)


@pytest.mark.parametrize("name", DECLARED)
def test_every_face_shows_the_declared_parameters(name: str) -> None:
    """help(), inspect.signature and typing.get_type_hints show each face's real
    parameters (self and the declared list), the same on every face: a face whose
    list drifted from the declaration (another order, default or type) fails here."""
    declared = DECLARED[name]
    expected = [("self", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty, None)]
    expected += parameters_of(declared)
    for face in faces():
        method = getattr(face, name)
        assert parameters_of(method) == expected, f"{face.__name__}.{name}"
        assert method.__doc__ and method.__name__ == name, f"{face.__name__}.{name} keeps its docstring"
        shown = pydoc.render_doc(method, renderer=pydoc.plaintext)  # help()'s text
        first = next(iter(inspect.signature(declared).parameters))
        assert f"{name}(self, {first}: " in shown and "fields" not in shown and "args:" not in shown


def test_the_async_faces_request_calls_are_still_coroutine_functions() -> None:
    from batcher.client.aio import AsyncClient

    assert inspect.iscoroutinefunction(AsyncClient.request)
    assert inspect.iscoroutinefunction(AsyncClient.request_reply)
    assert inspect.iscoroutinefunction(AsyncClient.request_many)
    assert not inspect.iscoroutinefunction(AsyncClient.submit)  # it returns an AsyncPendingReply


def test_submit_sends_the_same_request_however_its_arguments_are_passed(router) -> None:
    ctx, broker, address = router
    with Client(address, timeout_s=5, context=ctx) as c, MultiClient([address], context=ctx) as m:
        for submit in (c.submit, m.submit):
            for args, kwargs in REQUEST_CALLS:
                submit(*args, **kwargs)
                assert {k: v for k, v in received(broker)[1].items() if k != "id"} == REQUEST_SENT
            submit("y")
            assert received(broker)[1].keys() == {"id", "input"}  # the defaults send nothing
            with pytest.raises(TypeError):
                submit("y", modle="lin")  # type: ignore[call-arg]
            with pytest.raises(TypeError):
                submit("y", "lin", 1, 2, 3, 4, 5)  # type: ignore[call-arg]
    assert broker.poll(50, zmq.POLLIN) == 0  # a wrong call sends nothing


def test_stream_sends_the_same_request_however_its_arguments_are_passed(router) -> None:
    ctx, broker, address = router
    with Client(address, timeout_s=5, context=ctx) as c, MultiClient([address], context=ctx) as m:
        for stream in (c.stream, m.stream):
            for args, kwargs in STREAM_CALLS:
                stream(*args, **kwargs).close()
                assert {k: v for k, v in received(broker)[1].items() if k != "id"} == STREAM_SENT
                received(broker)  # the cancel of the stream left
            with pytest.raises(TypeError):
                stream("y", cost=3)  # type: ignore[call-arg]


class Answered:
    """A request in flight that has its reply: the map it was sent with, echoed."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields

    def result(self) -> Any:
        return self.fields

    def wait(self) -> dict[str, Any]:
        return ok(1, self.fields)


def test_request_and_request_reply_get_the_same_request_however_called(router) -> None:
    """Client's and MultiClient's blocking calls hand the one request map to `_submit`,
    whose reply they return (here answered at once, with what was sent)."""
    ctx, _, address = router
    with Client(address, timeout_s=5, context=ctx) as c, MultiClient([address], context=ctx) as m:
        for client in (c, m):
            client._submit = Answered  # type: ignore[method-assign, assignment]
            for args, kwargs in REQUEST_CALLS:
                assert client.request(*args, **kwargs) == REQUEST_SENT
                assert client.request_reply(*args, **kwargs) == ok(1, REQUEST_SENT)


def test_the_async_face_gets_the_same_request_however_called(router) -> None:
    import asyncio

    import zmq.asyncio

    from batcher.client.aio import AsyncClient

    ctx, broker, address = router
    calls: list[tuple[dict[str, Any], float | None]] = []

    async def call(fields: dict[str, Any], wait_s: float | None) -> dict[str, Any]:
        calls.append((fields, wait_s))
        return ok(1, fields)

    async def main() -> None:
        actx = zmq.asyncio.Context.shadow(ctx.underlying)
        async with AsyncClient(address, timeout_s=5, context=actx) as c:
            for args, kwargs in REQUEST_CALLS:
                c.submit(*args, **kwargs)  # sent at once; left unanswered, closed with the client
                _, body = await asyncio.to_thread(received, broker)
                assert {k: v for k, v in body.items() if k != "id"} == REQUEST_SENT
            for args, kwargs in STREAM_CALLS:
                chunks = c.stream(*args, **kwargs)
                first = asyncio.ensure_future(chunks.__anext__())
                envelope, body = await asyncio.to_thread(received, broker)
                assert {k: v for k, v in body.items() if k != "id"} == STREAM_SENT
                broker.send_multipart([*envelope, pack({"id": body["id"], "ok": True, "output": "t"})])
                assert await first == "t"
            c._call = call  # type: ignore[method-assign, assignment]
            for args, kwargs in REQUEST_CALLS:
                assert await c.request(*args, **kwargs) == REQUEST_SENT
                assert await c.request_reply(*args, **kwargs) == ok(1, REQUEST_SENT)
            with pytest.raises(TypeError):
                await c.request("y", modle="lin")  # type: ignore[call-arg]

    asyncio.run(main())
    assert [wait_s for _, wait_s in calls] == [1.5] * 2 * len(REQUEST_CALLS)  # the 500 ms deadline's
