"""The client core (batcher.client.core.BaseClient) on its own: request ids, matching replies
to requests, the nil-id rule, duplicates, timeouts with retries, and one exception class
per protocol error code. Without sockets, except the last tests, which drive Client's
public surface (start, receive_ready, forget, send_cancel, socket) over inproc.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from enum import StrEnum
from typing import Any

import pytest
import zmq

import batcher.client.sync as client_module
import batcher.wire.errors as errors_module
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
