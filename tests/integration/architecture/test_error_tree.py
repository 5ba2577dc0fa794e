"""One error tree (issue 29, item 5): every exception class batcher defines derives from
BatcherError; one class for a model that will not load; ClientClosed and the
`request_many` rule the same on Client, MultiClient and AsyncClient."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import pkgutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq.asyncio

import batcher
import workers
from batcher import AsyncClient, BatcherError, Client, ModelLoadError, MultiClient
from batcher.client import ClientClosed, ModelError, Overloaded, ReplyError
from tests.helpers import FakeBroker

#: Exception classes that do not derive from BatcherError, on purpose, and why. Each is a
#: private signal raised and caught a few lines apart; none can reach a user.
NOT_BATCHER_ERRORS = {
    "_HoldsTensor": "batcher.wire.aligned's packer hook says 'this value holds an array' to the packer",
    "_NotStrictJSON": "`batcher send`'s JSON reader, turned into click.BadParameter where it is caught",
}

#: Builtin bases the classes had before the tree, kept so `except ValueError` still works.
BUILTIN_BASES = {
    "BindError": OSError,
    "BenchFailed": RuntimeError,
    "ConfigError": ValueError,
    "NoSuchModel": KeyError,
    "MissingExtra": ImportError,
    "GatewayExited": RuntimeError,
    "ModelLoadError": RuntimeError,
    "SettingsError": ValueError,
    "KeyFileError": ValueError,
    "KeyExistsError": ValueError,
    "WorkerProtocolError": ValueError,
    "TensorError": ValueError,
    "NotEncodable": TypeError,
    "BadInput": ValueError,
    "MalformedBatch": ValueError,
}


def exception_classes() -> list[type[BaseException]]:
    """Every exception class defined in a module of batcher/ or workers/."""
    found: list[type[BaseException]] = []
    for package in (batcher, workers):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name == "batcher.__main__":  # runs the command line when imported
                continue
            module = importlib.import_module(info.name)
            for obj in vars(module).values():
                if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == info.name:
                    found.append(obj)
    return found


def test_every_exception_class_batcher_defines_is_a_batcher_error() -> None:
    classes = exception_classes()
    names = {cls.__name__ for cls in classes}
    assert len(classes) >= 38, sorted(names)  # the walk found them (40 when the tree was made)
    assert set(NOT_BATCHER_ERRORS) <= names, "an exception listed here no longer exists: drop it"
    strays = [
        f"{cls.__module__}.{cls.__qualname__}"
        for cls in classes
        if not issubclass(cls, BatcherError) and cls.__name__ not in NOT_BATCHER_ERRORS
    ]
    assert strays == [], "derive these from batcher.errors.BatcherError (or list them, with why)"
    for cls in classes:
        if cls.__name__ in NOT_BATCHER_ERRORS:
            assert not issubclass(cls, BatcherError), f"{cls.__name__} is a BatcherError now: unlist it"
        if cls.__name__ in BUILTIN_BASES:
            assert issubclass(cls, BUILTIN_BASES[cls.__name__]), f"{cls.__name__} lost its builtin base"
    assert set(BUILTIN_BASES) <= names


def test_every_batcher_error_has_a_code_and_a_message() -> None:
    from batcher.broker.loop import BindError
    from batcher.core.scheduler import NoSuchModel
    from batcher.wire.tensor import TensorError

    assert BatcherError("x").code == "error" and BatcherError("x").message == "x"
    bind = BindError(98, "Address already in use")
    assert bind.errno == 98 and isinstance(bind, OSError) and bind.message == str(bind)
    assert isinstance(NoSuchModel("m"), LookupError) and NoSuchModel("m").args == ("m",)
    assert str(TensorError("bad shape")) == "bad shape" and TensorError("bad shape").message == "bad shape"
    reply = ModelError("boom", reply={"id": 1})
    assert (reply.code, reply.message, reply.reply, str(reply)) == (
        "model_error",
        "boom",
        {"id": 1},
        "model_error: boom",
    )


def test_a_model_that_will_not_load_has_one_class() -> None:
    from batcher.serve.serving import ModelLoadFailed
    from workers.onnx_model import OnnxLoadError, OnnxModel
    from workers.worker import ModelLoadError as WorkerModelLoadError

    assert ModelLoadFailed is ModelLoadError and OnnxLoadError is ModelLoadError
    assert WorkerModelLoadError is ModelLoadError
    assert issubclass(ModelLoadError, BatcherError) and issubclass(ModelLoadError, RuntimeError)
    with pytest.raises(ModelLoadError, match=r"cannot serve /nonexistent/model\.onnx"):
        OnnxModel("/nonexistent/model.onnx", None, 1)


def test_a_refused_setting_is_a_settings_error_and_still_a_value_error() -> None:
    from batcher.broker.loop import BrokerSettings
    from batcher.core.limits import BatchSettings
    from batcher.errors import SettingsError
    from batcher.gateway.access import parse_api_keys
    from batcher.transport.addresses import check_address
    from batcher.wire.protocol import Heartbeat
    from batcher.wire.signature import TensorSpec
    from workers.models import ModelSpec
    from workers.placement import parse_cpus
    from workers.worker import WorkerSettings

    refusals: list[tuple[Callable[[], object], str]] = [
        (lambda: BrokerSettings(models=()), "models must name at least one model"),
        (lambda: BatchSettings(max_batch_size=0), "max_batch_size must be >= 1, got 0"),
        (lambda: Heartbeat(interval_ms=0), "heartbeat_ms must be > 0"),
        (lambda: check_address("localhost:5555", bind=False), "no scheme"),
        (lambda: MultiClient([]), "MultiClient needs at least one address"),
        (lambda: Client("tcp://127.0.0.1:1", retries=-1), "retries must be >= 0"),
        (lambda: WorkerSettings(model="echo", gpu=-1), "gpu must be >= 0"),
        (lambda: ModelSpec.parse("=echo"), "model must be NAME, NAME=SPEC"),
        (lambda: parse_cpus("3-1"), "runs backwards"),
        (lambda: parse_api_keys("# only a comment", "keys.txt"), "holds no API key"),
        (lambda: TensorSpec("", "FP32", (1,)), "a tensor's name must be"),
    ]
    for make, says in refusals:
        with pytest.raises(SettingsError, match=says) as refused:
            make()
        assert isinstance(refused.value, ValueError) and isinstance(refused.value, BatcherError)


def test_a_value_msgpack_cannot_carry_is_not_encodable_and_still_a_type_error() -> None:
    from batcher.wire import protocol
    from batcher.wire.tensor import NotEncodable

    with pytest.raises(NotEncodable, match="can not serialize 'object' object") as refused:
        protocol.pack_carrying({"id": 1, "input": object()}, None)
    assert isinstance(refused.value, TypeError) and isinstance(refused.value, BatcherError)


def test_the_error_tree_loads_no_zmq() -> None:
    code = (
        "import sys; from batcher import BatcherError, ModelLoadError; import batcher.wire.errors; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('zmq', 'asyncio')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# --- the same rules on every client face -------------------------------------------------------

FACES = ["Client", "MultiClient", "AsyncClient"]


def run_on(face: str, address: str, body: Callable[[Any], Any]) -> Any:
    """Run `body(client)` on a client of `face` at `address` (awaiting what it returns, for
    the AsyncClient), and close the client."""
    if face == "AsyncClient":

        async def main() -> Any:
            ctx = zmq.asyncio.Context()
            client = AsyncClient(address, timeout_s=20, context=ctx)
            try:
                return await body(client)
            finally:
                await client.close()
                ctx.destroy(linger=0)

        return asyncio.run(main())
    client: Client | MultiClient = (
        Client(address, timeout_s=20) if face == "Client" else MultiClient([address], 20)
    )
    with client:
        return body(client)


async def _await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


@pytest.fixture
def error_then_slow(fake_broker: Callable[..., FakeBroker]) -> Iterator[tuple[FakeBroker, threading.Event]]:
    """A broker that answers `bad` with model_error at once, `slow` 0.3 s later (setting the
    event just before), `slow overloaded` with overloaded as late, and anything else with
    itself."""
    answered = threading.Event()
    fb: FakeBroker

    def later(reply: dict[str, Any]) -> None:
        answered.set()
        fb.reply_later(reply)

    def answer(body: dict[str, Any]) -> dict[str, Any] | None:
        if body.get("input") == "bad":
            return {"id": body["id"], "ok": False, "error": {"code": "model_error", "message": "boom"}}
        if body.get("input") == "slow":
            threading.Timer(0.3, later, [{"id": body["id"], "ok": True, "output": "slow"}]).start()
            return None
        if body.get("input") == "slow overloaded":
            refusal = {"code": "overloaded", "message": "later"}
            threading.Timer(0.3, later, [{"id": body["id"], "ok": False, "error": refusal}]).start()
            return None
        return {"id": body["id"], "ok": True, "output": body.get("input")}

    fb = fake_broker(answer)
    yield fb, answered


@pytest.mark.integration
@pytest.mark.parametrize("face", FACES)
def test_request_many_raises_the_first_error_after_every_request_finished(face, error_then_slow) -> None:
    fb, slow_answered = error_then_slow

    def body(client: Any) -> Any:
        async def go() -> Any:
            with pytest.raises(ModelError, match="boom"):
                await _await(client.request_many(["ok", "bad", "slow"]))
            return slow_answered.is_set()

        return go() if face == "AsyncClient" else asyncio.run(go())

    assert run_on(face, fb.address, body), "request_many raised while a request was still in flight"


@pytest.mark.integration
@pytest.mark.parametrize("face", FACES)
def test_request_many_raises_the_first_error_by_input_not_by_arrival(face, error_then_slow) -> None:
    fb, _ = error_then_slow

    def body(client: Any) -> Any:
        async def go() -> None:
            with pytest.raises(Overloaded, match="later"):  # `bad`'s model_error came first
                await _await(client.request_many(["slow overloaded", "bad"]))

        return go() if face == "AsyncClient" else asyncio.run(go())

    run_on(face, fb.address, body)


@pytest.mark.integration
@pytest.mark.parametrize("face", FACES)
def test_request_many_with_return_exceptions_puts_each_error_in_place(face, error_then_slow) -> None:
    fb, _ = error_then_slow
    # A list from a blocking client, a coroutine (that run_on awaits) from the AsyncClient.
    out = run_on(
        face, fb.address, lambda client: client.request_many(["ok", "bad", "slow"], return_exceptions=True)
    )
    assert out[0] == "ok" and out[2] == "slow"
    assert type(out[1]) is ModelError and out[1].message == "boom"


@pytest.mark.integration
@pytest.mark.parametrize("face", FACES)
def test_close_fails_waiting_requests_and_later_ones_with_client_closed(face, fake_broker) -> None:
    fb = fake_broker(lambda body: None)  # never answers

    async def main(client: Any) -> list[BaseException]:
        if face == "AsyncClient":
            waiting: Any = asyncio.ensure_future(client.request("first"))
        else:
            waiting = client.submit("first")
        await asyncio.to_thread(fb.wait_received, lambda got: len(got) == 1)
        await _await(client.close())
        errors: list[BaseException] = []
        later = [
            lambda: client.request("after"),
            lambda: client.request_many(["after"]),
            lambda: client.control("stats"),
            lambda: client.submit("after"),
        ]
        for call in [waiting.result if face != "AsyncClient" else (lambda: waiting), *later]:
            with pytest.raises(ClientClosed) as closed:
                await _await(call())
            errors.append(closed.value)
        return errors

    if face == "AsyncClient":
        errors = run_on(face, fb.address, main)
    else:
        errors = run_on(face, fb.address, lambda client: asyncio.run(main(client)))
    for exc in errors:
        assert isinstance(exc, ReplyError) and isinstance(exc, BatcherError) and exc.code == "closed"
        assert fb.address in exc.message
    assert [b.get("input") for b in fb.received] == ["first"]  # nothing was sent after close


@pytest.mark.integration
def test_a_stream_open_when_the_client_closes_raises_client_closed_and_so_does_a_new_one(fake_broker) -> None:
    fb = fake_broker(lambda body: None)  # never answers
    with Client(fb.address, timeout_s=20) as client:
        chunks = client.stream("tokens")
        fb.wait_received(lambda got: len(got) == 1)
        client.close()
        with pytest.raises(ClientClosed, match="was closed"):
            next(chunks)
        with pytest.raises(ClientClosed, match="is closed"):
            client.stream("after")


@pytest.mark.integration
@pytest.mark.parametrize("face", FACES)
def test_request_reply_returns_every_reply_as_a_map_on_every_face(face, error_then_slow) -> None:
    fb, _ = error_then_slow

    def body(client: Any) -> Any:
        async def go() -> list[dict[str, Any]]:
            return [await _await(client.request_reply(x)) for x in ("fine", "bad")]

        return go() if face == "AsyncClient" else asyncio.run(go())

    good, bad = run_on(face, fb.address, body)
    assert good["ok"] is True and good["output"] == "fine"
    # An error is data here, not raised.
    assert bad["ok"] is False and bad["error"] == {"code": "model_error", "message": "boom"}


@pytest.mark.integration
@pytest.mark.parametrize("face", FACES)
def test_request_reply_answers_no_reply_in_time_with_a_timeout_map(face, fake_broker) -> None:
    fb = fake_broker(lambda body: None)  # never answers
    if face == "AsyncClient":

        async def main() -> dict[str, Any]:
            ctx = zmq.asyncio.Context()
            try:
                async with AsyncClient(fb.address, timeout_s=0.2, context=ctx) as client:
                    return await client.request_reply("x")
            finally:
                ctx.destroy(linger=0)

        reply = asyncio.run(main())
    else:
        client: Client | MultiClient
        if face == "Client":
            client = Client(fb.address, timeout_s=0.2)
        else:
            client = MultiClient([fb.address], 0.2, retries=0)
        with client:
            reply = client.request_reply("x")
    assert reply["ok"] is False and reply["error"]["code"] == "timeout"
    assert "after 1 attempt(s)" in reply["error"]["message"]


@pytest.mark.integration
@pytest.mark.parametrize("face", FACES)
def test_control_sends_its_fields_on_every_face(face, fake_broker) -> None:
    fb = fake_broker(
        lambda body: {"id": body["id"], "ok": True, "output": {"op": body["op"], "model": body.get("model")}}
    )
    out = run_on(face, fb.address, lambda client: client.control("reload", model="sim"))
    assert out == {"op": "reload", "model": "sim"}
    assert fb.received[-1]["op"] == "reload" and fb.received[-1]["model"] == "sim"


def _streaming_answer(fb_box: list[FakeBroker]) -> Callable[[dict[str, Any]], dict[str, Any] | None]:
    """Answers a streamed request with two chunks and a last reply; others with themselves."""

    def answer(body: dict[str, Any]) -> dict[str, Any] | None:
        if not body.get("stream"):
            return {"id": body["id"], "ok": True, "output": body.get("input")}
        for i in range(2):
            fb_box[0].reply_later({"id": body["id"], "ok": True, "output": i, "more": True})
        fb_box[0].reply_later({"id": body["id"], "ok": True, "output": "end"})
        return None

    return answer


@pytest.mark.integration
@pytest.mark.parametrize("face", FACES)
def test_stream_yields_every_chunk_on_every_face(face, fake_broker) -> None:
    box: list[FakeBroker] = []
    fb = fake_broker(_streaming_answer(box))
    box.append(fb)

    def body(client: Any) -> Any:
        if face == "AsyncClient":

            async def go() -> list[Any]:
                return [chunk async for chunk in client.stream("x")]

            return go()
        with client.stream("x") as chunks:
            return list(chunks)

    assert run_on(face, fb.address, body) == [0, 1, "end"]
    assert fb.received[-1]["stream"] is True
