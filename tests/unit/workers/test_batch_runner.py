"""A worker's batch handling (`run_batch`, no sockets) and the model loader."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batcher.wire import protocol
from tests import unit_models
from workers import batch_runner
from workers.models import ModelSpec, SimModel, SimSettings, echo, load_model
from workers.worker import run_batch

WORKER = "host/gpu0/1234"


def run(
    model: Callable[[list[Any]], Any],
    requests: list[dict[str, Any]],
    queue_ms: list[float] | None = None,
    batch_id: int = 7,
) -> tuple[float, list[dict[str, Any]]]:
    """Send `requests` through `run_batch` as the broker would frame them.

    Returns the reply header's infer_ms and the decoded replies, after checking the
    REPLY frame layout and that the batch id is echoed."""
    if queue_ms is None:
        queue_ms = [float(i) for i in range(len(requests))]
    bodies = [protocol.pack(r) for r in requests]
    frames = protocol.batch_frames(batch_id, queue_ms, bodies)
    out = run_batch(model, frames[2], frames[3:], WORKER)
    assert out[:2] == [protocol.WORKER_PROTOCOL, protocol.CMD_REPLY]
    got_id, infer_ms, lengths, errors = protocol.unpack(out[2])
    assert got_id == batch_id
    assert len(lengths) == len(requests)
    replies = [protocol.unpack(r) for r in protocol.split_bodies(lengths, out[3:])]
    assert errors == sum(not r["ok"] for r in replies)  # the broker counts outcomes from this
    return infer_ms, replies


def double(inputs: list[Any]) -> list[Any]:
    return [x * 2 for x in inputs]


# --- run_batch ---------------------------------------------------------------------------------


def test_ok_replies_carry_ids_outputs_and_metadata() -> None:
    requests = [{"id": 1, "input": 10}, {"id": "two", "input": 20}, {"input": 30, "extra": True}]
    infer_ms, replies = run(double, requests, queue_ms=[1.5, 0.25, 0.0], batch_id=99)
    common = {"ok": True, "batch_size": 3, "worker": WORKER, "infer_ms": infer_ms}
    assert replies == [
        {"id": 1, "output": 20, "queue_ms": 1.5, **common},
        {"id": "two", "output": 40, "queue_ms": 0.25, **common},
        {"id": None, "output": 60, "queue_ms": 0.0, **common},
    ]


def test_model_sees_the_inputs_in_order_in_one_call() -> None:
    calls: list[list[Any]] = []

    def recorder(inputs: list[Any]) -> list[Any]:
        calls.append(list(inputs))
        return [None] * len(inputs)

    inputs: list[Any] = ["a", b"\x00", {"k": [1, 2]}, None, 3.5]
    run(recorder, [{"id": i, "input": x} for i, x in enumerate(inputs)])
    assert calls == [inputs]


def test_single_request_batch() -> None:
    _, (reply,) = run(double, [{"id": 5, "input": "ab"}], queue_ms=[2.0])
    assert reply["ok"] is True
    assert (reply["id"], reply["output"], reply["batch_size"]) == (5, "abab", 1)


def test_tuple_of_outputs_is_accepted() -> None:
    _, replies = run(lambda xs: tuple(x + 1 for x in xs), [{"id": i, "input": i} for i in range(3)])
    assert [r["output"] for r in replies] == [1, 2, 3]
    assert all(r["ok"] for r in replies)


def assert_model_error(replies: list[dict[str, Any]], ids: list[Any], message: str) -> None:
    assert [r["id"] for r in replies] == ids
    for r in replies:
        assert r == {"id": r["id"], "ok": False, "error": {"code": "model_error", "message": message}}


def test_model_that_raises_fails_every_request() -> None:
    def broken(inputs: list[Any]) -> list[Any]:
        raise RuntimeError("CUDA out of memory")

    requests = [{"id": 1, "input": 1}, {"id": "b", "input": 2}, {"input": 3}]
    _, replies = run(broken, requests)
    assert_model_error(replies, [1, "b", None], "RuntimeError: CUDA out of memory")


@pytest.mark.parametrize(("n_out", "n_in"), [(2, 3), (4, 3), (0, 1)])
def test_model_returning_the_wrong_count_fails_every_request(n_out: int, n_in: int) -> None:
    _, replies = run(lambda xs: [0] * n_out, [{"id": i, "input": i} for i in range(n_in)])
    assert_model_error(
        replies, list(range(n_in)), f"ValueError: model returned {n_out} outputs for a batch of {n_in}"
    )


@pytest.mark.parametrize(
    ("result", "type_repr"),
    [(None, "<class 'NoneType'>"), ({"a": 1, "b": 2}, "<class 'dict'>"), ("ab", "<class 'str'>")],
)
def test_model_returning_a_non_list_fails_every_request(result: object, type_repr: str) -> None:
    _, replies = run(lambda xs: result, [{"id": 1, "input": 1}, {"id": 2, "input": 2}])
    assert_model_error(replies, [1, 2], f"ValueError: model returned {type_repr} for a batch of 2")


def _self_containing() -> list[Any]:
    loop: list[Any] = []
    loop.append(loop)
    return loop


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(object(), id="object"),
        pytest.param(2**70, id="int-too-big"),
        pytest.param({"k": [1, 2j]}, id="nested-complex"),
        pytest.param(_self_containing(), id="self-containing"),
    ],
)
def test_unencodable_output_fails_only_its_request(bad: object) -> None:
    outputs = ["first", bad, {"third": [3]}]
    requests = [{"id": i, "input": i} for i in range(3)]
    infer_ms, replies = run(lambda xs: outputs, requests, queue_ms=[0.5, 0.5, 0.5])
    first, second, third = replies
    meta = {"batch_size": 3, "worker": WORKER, "queue_ms": 0.5, "infer_ms": infer_ms}
    assert first == {"id": 0, "ok": True, "output": "first", **meta}
    assert third == {"id": 2, "ok": True, "output": {"third": [3]}, **meta}
    assert second["id"] == 1
    assert second["ok"] is False
    assert second["error"]["code"] == "model_error"
    assert second["error"]["message"].startswith("output cannot be encoded: ")


# --- ModelSpec.parse ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "name", "target"),
    [
        ("sim", "sim", "sim"),
        ("echo", "echo", "echo"),
        ("pkg.mod:attr", "pkg.mod:attr", "pkg.mod:attr"),
        ("pkg.mod:Cls.method", "pkg.mod:Cls.method", "pkg.mod:Cls.method"),
        ("resnet=pkg.mod:attr", "resnet", "pkg.mod:attr"),
        ("fast=sim", "fast", "sim"),
        (" fast = echo ", "fast", "echo"),
    ],
)
def test_model_spec_parse(text: str, name: str, target: str) -> None:
    assert ModelSpec.parse(text) == ModelSpec(name, target)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "model must be NAME, NAME=SPEC or pkg.module:attr, got ''"),
        ("  ", "model must be NAME, NAME=SPEC or pkg.module:attr, got '  '"),
        ("=", "model must be NAME, NAME=SPEC or pkg.module:attr, got '='"),
        ("name=", "model must be NAME, NAME=SPEC or pkg.module:attr, got 'name='"),
        ("=sim", "model must be NAME, NAME=SPEC or pkg.module:attr, got '=sim'"),
        (
            "resnet50",
            "unknown model 'resnet50': use one of sim, echo, simlm or a user model as package.module:attr",
        ),
        (
            "fast=simulator",
            "unknown model 'simulator': use one of sim, echo, simlm or a user model as package.module:attr",
        ),
    ],
)
def test_model_spec_rejects_garbage(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        ModelSpec.parse(text)


@pytest.mark.parametrize("text", ["pkg.mod:", ":attr", ":", "name=pkg.mod:"])
def test_model_spec_rejects_empty_module_or_attribute(text: str) -> None:
    with pytest.raises(ValueError):
        ModelSpec.parse(text)


# --- SimModel and echo -----------------------------------------------------------------------


def test_sim_model_empty_batch() -> None:
    assert SimModel(SimSettings(base_ms=0.0, per_item_ms=0.0))([]) == []


def test_sim_settings_cost_model() -> None:
    default = SimSettings()
    assert default.batch_ms(4) == 30.0  # the README's "one call of 4 costs 30 ms"
    assert 4 * default.batch_ms(1) == 90.0  # "4 single calls cost 90 ms"
    assert SimModel().settings == default


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"base_ms": -1.0}, "sim base_ms must be a finite number >= 0, got -1.0"),
        ({"per_item_ms": -0.5}, "sim per_item_ms must be a finite number >= 0, got -0.5"),
        ({"base_ms": float("nan")}, "sim base_ms must be a finite number >= 0, got nan"),
    ],
)
def test_sim_settings_rejects_negative_costs(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        SimSettings(**kwargs)


def test_echo_returns_the_inputs() -> None:
    inputs = [1, "two", None]
    out = echo(inputs)
    assert out == inputs
    assert out is not inputs


# --- load_model --------------------------------------------------------------------------------


def test_load_builtin_models() -> None:
    sim = SimSettings(base_ms=1.0, per_item_ms=0.0)
    model = load_model(ModelSpec.parse("sim"), None, sim)
    assert isinstance(model, SimModel)
    assert model.settings == sim
    assert load_model(ModelSpec.parse("fast=echo"), 0) is echo


def test_load_user_function() -> None:
    model = load_model(ModelSpec.parse("dbl=tests.unit_models:double"), 0)
    assert model is unit_models.double
    assert model([1, "a"]) == [2, "aa"]


def test_load_user_class_is_instantiated_once_with_the_gpu_id() -> None:
    before = unit_models.GpuModel.instances
    model = load_model(ModelSpec.parse("tests.unit_models:GpuModel"), 3)
    assert isinstance(model, unit_models.GpuModel)
    assert unit_models.GpuModel.instances == before + 1
    assert model.gpu == 3
    assert model(["x", "y"]) == [{"input": "x", "gpu": 3}, {"input": "y", "gpu": 3}]


def test_load_user_class_without_gpu() -> None:
    model = load_model(ModelSpec.parse("tests.unit_models:GpuModel"), None)
    assert model(["x"]) == [{"input": "x", "gpu": None}]


def test_load_nested_attribute() -> None:
    model = load_model(ModelSpec.parse("tests.unit_models:Namespace.shout"), None)
    assert model(["a", 1]) == ["A", "1"]


def test_load_user_model_through_run_batch() -> None:
    model = load_model(ModelSpec.parse("tests.unit_models:GpuModel"), 1)
    _, replies = run(model, [{"id": 1, "input": "q"}])
    assert replies[0]["output"] == {"input": "q", "gpu": 1}


def test_load_not_callable() -> None:
    with pytest.raises(TypeError, match=re.escape("tests.unit_models:NOT_CALLABLE is not callable")):
        load_model(ModelSpec.parse("tests.unit_models:NOT_CALLABLE"), None)


def test_load_missing_module_or_attribute() -> None:
    with pytest.raises(ModuleNotFoundError):
        load_model(ModelSpec.parse("tests.no_such_module:fn"), None)
    with pytest.raises(AttributeError, match="no_such_fn"):
        load_model(ModelSpec.parse("tests.unit_models:no_such_fn"), None)


def test_a_body_only_a_full_decode_refuses_is_answered_bad_request_alone() -> None:
    # The broker reads only a body's header fields: what hides inside `input` is the worker's to refuse.
    requests = [
        {"id": 5, "input": {(1, 2): 3}},  # a map key that is an array
        {"id": 6, "input": "fine"},
    ]
    bodies = [protocol.pack(r) for r in requests]
    bodies.append(b"\x82\xa2id\x07\xa5input\xa2\xff\xfe")  # invalid UTF-8 in a str
    frames = protocol.batch_frames(1, [0.0] * 3, bodies)
    out = run_batch(lambda xs: xs, frames[2], frames[3:], WORKER)
    replies = [protocol.unpack(r) for r in protocol.split_bodies(protocol.unpack(out[2])[2], out[3:])]
    assert replies[0]["id"] == 5 and replies[0]["error"]["code"] == "bad_request"
    assert replies[0]["error"]["message"].startswith("body has a map key that is an array or a map")
    assert (replies[1]["id"], replies[1]["ok"], replies[1]["output"]) == (6, True, "fine")
    assert replies[1]["batch_size"] == 1  # the model saw the one good request only
    assert replies[2]["id"] == 7 and replies[2]["error"]["code"] == "bad_request"
    assert replies[2]["error"]["message"].startswith("body cannot be decoded: UnicodeDecodeError")


def test_small_tensors_joined_in_a_large_frame_still_reach_the_model_as_arrays() -> None:
    np = pytest.importorskip("numpy")
    arrays = [np.full(3000, i, np.float32) for i in range(8)]  # 12 KB each, 96 KB joined
    bodies = [protocol.pack({"id": i, "input": a}) for i, a in enumerate(arrays)]
    frames = protocol.batch_frames(1, [0.0] * 8, bodies)
    assert len(frames) == 4 and len(frames[3]) >= protocol.ZERO_COPY_BYTES  # one joined frame
    seen: list[object] = []
    run_batch(lambda xs: seen.extend(xs) or xs, frames[2], frames[3:], WORKER)
    assert all(isinstance(x, np.ndarray) for x in seen), [type(x) for x in seen]


class _Label(str):
    """A str subclass, as user models return (enum members, tagged strings)."""


def test_outputs_msgpack_encodes_go_back_unchanged_ext_types_and_subclasses_too() -> None:
    import msgpack

    stamp = msgpack.Timestamp(1_700_000_000, 5)
    outputs = [msgpack.ExtType(5, b"abc"), stamp, _Label("tag"), b"x" * 70_000, [b"a", b"b"]]
    _, replies = run(lambda xs: outputs, [{"id": i, "input": i} for i in range(len(outputs))])
    got = [r["output"] for r in replies]
    assert got[0] == msgpack.ExtType(5, b"abc")  # an ext, not the array [5, b"abc"]
    assert got[1] == stamp
    assert got[2] == "tag" and got[3] == b"x" * 70_000 and got[4] == [b"a", b"b"]


def test_a_large_body_refused_by_the_worker_echoes_its_id_wherever_it_stands() -> None:
    import msgpack

    # 70 KB of input before the id, then invalid UTF-8: only a full decode refuses it.
    body = b"\x83" + msgpack.packb("input") + msgpack.packb(bytes(70_000)) + msgpack.packb("id")
    body += msgpack.packb(5) + msgpack.packb("meta") + b"\xa2\xff\xfe"
    assert protocol.read_header(body).id == 5  # what the broker saw
    frames = protocol.batch_frames(1, [0.0], [body])
    out = run_batch(lambda xs: xs, frames[2], frames[3:], WORKER)
    (reply,) = [protocol.unpack(r) for r in protocol.split_bodies(protocol.unpack(out[2])[2], out[3:])]
    assert (reply["id"], reply["error"]["code"]) == (5, "bad_request")


_VALUES = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=3)
    | st.binary(max_size=3)
    | st.lists(st.integers(-1, 3) | st.booleans() | st.floats(allow_nan=False), max_size=3)
    | st.dictionaries(st.text(max_size=2), st.integers(-5, 5), max_size=2)
)  # fmt: skip
#: BATCH headers as the broker writes them, with one element made anything at all half the
#: time, and anything at all (no NaN in a list: a usable queue_ms list is compared by value).
_HEADERS = (
    st.tuples(
        st.integers(0, 2**64 - 1), st.lists(st.floats(0, 1e6), max_size=4) | st.none(),
        st.lists(st.integers(0, 2**20), max_size=4), st.none() | st.text(max_size=5), st.text(max_size=3),
        st.booleans(), st.integers(0, 5), _VALUES,
    ).map(lambda t: (list(t[:5])[: 3 + t[6] % 3], t[5], t[6], t[7]))
    .map(lambda h: h[0] if not h[1] else [*h[0][: h[2] % len(h[0])], h[3], *h[0][h[2] % len(h[0]) + 1 :]])
    | st.lists(_VALUES, max_size=6) | _VALUES
)  # fmt: skip


@given(_HEADERS)
def test_the_usual_batch_header_read_in_c_gets_the_verdict_the_checks_give(header: Any) -> None:
    frame = protocol.pack(header)

    def verdict(decode: Callable[[bytes], Any]) -> Any:
        try:
            return decode(frame)
        except batch_runner.MalformedBatch as exc:
            return (str(exc), exc.batch_id)

    assert verdict(batch_runner._decode_header) == verdict(batch_runner._checked_header)


def _nested(depth: int) -> bytes:
    """A msgpack value of `depth` arrays, one in another (0 innermost): deeper than
    Python's recursion limit (1000) at 1010, which msgpack still reads (1024 levels)."""
    return b"\x91" * depth + b"\x00"


#: BATCH headers with a value nested past Python's recursion limit: msgspec stops there
#: (RecursionError), msgpack reads up to 1024 levels, and repr of what it read stops again.
_DEEP_HEADERS = {
    "queue_ms readable": b"\x93\x07" + _nested(1010) + protocol.pack([12]),
    "queue_ms past msgpack": b"\x93\x07" + _nested(5000) + protocol.pack([12]),
    "lengths bad, queue_ms readable": b"\x93\x07" + _nested(1010) + protocol.pack("x"),
    "4th element readable": b"\x94\x07" + protocol.pack([0.5]) + protocol.pack([12]) + _nested(1010),
    "4th element past msgpack": b"\x94\x07" + protocol.pack([0.5]) + protocol.pack([12]) + _nested(5000),
}


@pytest.mark.parametrize("header", list(_DEEP_HEADERS.values()), ids=list(_DEEP_HEADERS))
def test_a_batch_header_nested_past_the_recursion_limit_is_answered_or_dropped_never_raised(
    header: bytes,
) -> None:
    """A peer's header that msgspec cannot read for its depth is read by the checks, with
    their verdict (the fast path raised RecursionError, which killed the worker)."""

    def verdict(decode: Callable[[bytes], Any]) -> Any:
        try:
            batch_id, queue_ms, lengths = decode(header)
        except batch_runner.MalformedBatch as exc:
            return (str(exc), exc.batch_id)
        return batch_id, type(queue_ms), lengths  # (a queue_ms this deep is not compared: == recurses)

    expected = verdict(batch_runner._checked_header)
    assert verdict(batch_runner._decode_header) == expected
    body = protocol.pack({"id": 1, "input": 2})
    assert len(body) == 12  # as the headers say
    reply = batch_runner._run_safely(echo, header, [body], WORKER)
    if isinstance(expected[0], str) and expected[1] is None:  # no batch id read: dropped
        assert reply is None
    elif isinstance(expected[0], str):  # an id but no lengths: every request fails
        assert reply is not None and protocol.unpack(reply[2])[:3] == [7, 0.0, []]
    else:  # the requests are fine: answered (without a queue_ms when it is not a list of numbers)
        assert reply is not None
        (answer,) = [
            protocol.unpack(r) for r in protocol.split_bodies(protocol.unpack(reply[2])[2], reply[3:])
        ]
        assert (answer["id"], answer["ok"], answer["output"], answer["queue_ms"]) == (
            1,
            True,
            2,
            0.5 if header.startswith(b"\x94") else None,
        )


def test_a_traced_batch_whose_4th_element_msgpack_refuses_is_run_untraced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """msgspec skips the elements past the third unread; the traceparent's own read must
    then ignore one msgpack refuses (docs/protocol.md 6.3: a malformed one is ignored),
    not fail the batch."""
    monkeypatch.setattr(batch_runner, "_tracer", object())  # tracing on (no span is recorded)
    body = protocol.pack({"id": 1, "input": 2})
    for fourth in (b"\xa2\xff\xfe", b"\x81\x91\x01\x02", b"\xd4\x85\x00"):  # bad UTF-8, array key, ext -123
        header = b"\x94\x07" + protocol.pack([0.5]) + protocol.pack([len(body)]) + fourth
        reply = batch_runner._run_safely(echo, header, [body], WORKER)
        assert reply is not None
        (answer,) = [
            protocol.unpack(r) for r in protocol.split_bodies(protocol.unpack(reply[2])[2], reply[3:])
        ]
        assert (answer["id"], answer["ok"], answer["output"]) == (1, True, 2), (fourth, answer)


def test_a_batch_of_more_bodies_than_any_broker_sends_is_failed_whole_not_answered_one_by_one() -> None:
    """A header of a million zero lengths (1 MB) and an empty frame made a million
    bad_request replies: 9 s and 780 MB in the worker. No broker sends more than
    --max-batch-size (at most MAX_BATCH_SIZE) bodies: one more fails the batch."""
    from batcher.settings import MAX_BATCH_SIZE

    body = protocol.pack({"id": 1, "input": 2})
    full = protocol.pack([7, None, [len(body)] * MAX_BATCH_SIZE])
    reply = batch_runner._run_safely(echo, full, [body * MAX_BATCH_SIZE], WORKER)
    assert reply is not None and len(protocol.unpack(reply[2])[2]) == MAX_BATCH_SIZE
    for n in (MAX_BATCH_SIZE + 1, 1_000_000):
        header = protocol.pack([7, None, [0] * n])
        for decode in (batch_runner._decode_header, batch_runner._checked_header):
            with pytest.raises(batch_runner.MalformedBatch) as raised:
                decode(header)
            assert (str(raised.value), raised.value.batch_id) == (
                f"a batch holds at most {MAX_BATCH_SIZE} bodies, got {n}",
                7,
            )
        reply = batch_runner._run_safely(echo, header, [b""], WORKER)
        assert reply is not None and protocol.unpack(reply[2])[:3] == [7, 0.0, []]


_BODY = protocol.pack({"id": 1, "input": 2})
#: Elements msgpack refuses (msgspec reads or skips them): invalid UTF-8, a map with an
#: array key, an ext of a reserved (negative) code.
_REFUSED = {"bad UTF-8": b"\xa2\xff\xfe", "array key": b"\x81\x91\x01\x02", "ext -123": b"\xd4\x85\x00"}


@pytest.mark.parametrize("element", list(_REFUSED.values()), ids=list(_REFUSED))
def test_what_msgpack_refuses_past_the_lengths_or_in_queue_ms_is_ignored_by_the_checks_too(
    element: bytes,
) -> None:
    """protocol.md 6.3: a worker ignores any element past the third, a malformed one too,
    and answers without queue_ms when it is unusable. The fast path (msgspec) does; the
    checks, reached when msgspec refuses something else, dropped the batch instead (its
    header "is not msgpack", so no id to answer): a verdict of their own."""
    n1 = protocol.pack([len(_BODY)])
    headers = {
        "past the third": b"\x94\x07" + protocol.pack([0.5]) + n1 + element,
        "past the third, lengths bad": b"\x94\x07" + protocol.pack([0.5]) + protocol.pack("x") + element,
    }
    if element != b"\xd4\x85\x00":  # (msgspec keeps an ext in a queue_ms list: not compared)
        headers["queue_ms"] = b"\x93\x07" + element + n1
        headers["queue_ms, lengths bad"] = b"\x93\x07" + element + protocol.pack([-1])

    def verdict(decode: Callable[[bytes], Any], header: bytes) -> Any:
        try:
            return decode(header)
        except batch_runner.MalformedBatch as exc:
            return (str(exc), exc.batch_id)

    for name, header in headers.items():
        expected = verdict(batch_runner._decode_header, header)
        assert verdict(batch_runner._checked_header, header) == expected, name
        reply = batch_runner._run_safely(echo, header, [_BODY], WORKER)
        assert reply is not None, name  # answered, not dropped
        replies = protocol.split_bodies(protocol.unpack(reply[2])[2], reply[3:])
        got = [(r["id"], r["ok"], r["queue_ms"]) for r in map(protocol.unpack, replies)]
        if "bad" in name:  # the bodies cannot be told apart: every request fails (an empty REPLY)
            assert protocol.unpack(reply[2])[:3] == [7, 0.0, []], name
        else:
            assert len(got) == 1 and got[0][:2] == (1, True), (name, got)
