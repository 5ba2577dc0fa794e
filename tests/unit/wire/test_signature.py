"""Model signatures (batcher/wire/signature.py): their wire form, and the broker's check of a
request's tensors against them, from the tensor headers alone."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from batcher.wire.signature import Signature, TensorSpec, signature_of


def body(input: Any) -> bytes:
    return msgpack.packb({"id": 1, "input": input})


def t(datatype: str = "FP32", shape: list[int] | None = None, data: bytes = b"") -> dict[str, Any]:
    return {"datatype": datatype, "shape": [4] if shape is None else shape, "data": data}


ONE = Signature((TensorSpec("x", "FP32", (-1, 4)),), (TensorSpec("y", "FP32", (-1, 3)),))
TWO = Signature(
    (TensorSpec("tokens", "INT64", (-1, -1)), TensorSpec("mask", "BOOL", (-1, -1))),
    (TensorSpec("logits", "FP32", (-1, 2)),),
)


@pytest.mark.parametrize(
    ("signature", "given", "why"),
    [
        (ONE, t(), None),
        (ONE, {"x": t()}, None),
        (ONE, t("FP64"), "input 'x' must be FP32, got 'FP64'"),
        (ONE, t(shape=[5]), "input 'x' must have shape [4] (-1: any), without the batch axis; got [5]"),
        (ONE, t(shape=[1, 4]), "input 'x' must have shape [4] (-1: any), without the batch axis; got [1, 4]"),
        (ONE, [1, 2, 3, 4], "the input must be a FP32 tensor of shape [4] (or a map of 'x' to it)"),
        (ONE, {"z": t()}, "the input must be a FP32 tensor of shape [4] (or a map of 'x' to it); "
                          "missing ['x'], unknown ['z']"),
        (TWO, {"tokens": t("INT64", [7]), "mask": t("BOOL", [7])}, None),
        (TWO, {"tokens": t("INT64", [3])}, "the input must be a map of the tensors ['tokens', 'mask']; "
                                            "missing ['mask'], unknown []"),
        (TWO, {"tokens": t("INT64", [3]), "mask": t("UINT8", [3])}, "input 'mask' must be BOOL, got 'UINT8'"),
        (TWO, t("INT64", [3]), "the input must be a map of the tensors ['tokens', 'mask'], got one tensor"),
    ],
)  # fmt: skip
def test_a_request_fits_its_models_signature_or_is_told_why(
    signature: Signature, given: Any, why: str | None
) -> None:
    assert signature.misfit(body(given)) == why


def test_the_wire_form_round_trips_and_bad_ones_are_refused() -> None:
    assert Signature.from_wire(TWO.wire()) == TWO
    for raw, message in [
        ({"inputs": []}, "at least one input"),
        ({"inputs": [{"name": "x", "datatype": "FP128", "shape": [-1]}]}, "datatype must be one of"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [-2]}]}, "shape must be 1 to 33 ints >= -1"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": []}]}, "shape must be 1 to 33 ints >= -1"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}] * 2}, "input names must differ"),
        ({"inputs": [{"name": "x", "datatype": "FP32"}]}, "a map of name, datatype and shape"),
        ({"inputs": [], "extra": 1}, "a map of inputs and outputs"),
        ("sig", "a map of inputs and outputs"),
    ]:
        with pytest.raises(ValueError, match=message):
            Signature.from_wire(raw)


def test_a_model_declares_a_signature_as_an_attribute_and_nothing_else_counts() -> None:
    class Declared:
        signature = ONE.wire()

    class Instance:
        signature = TWO

    class Method:
        def signature(self) -> str:
            return "not a declaration"

    assert signature_of(Declared()) == ONE
    assert signature_of(Instance()) == TWO
    assert signature_of(Method()) is None
    assert signature_of(object()) is None

    class Broken:
        signature = {"inputs": "x"}

    with pytest.raises(ValueError, match="signature inputs must be a list"):
        signature_of(Broken())


def test_a_ready_with_a_malformed_signature_is_refused_and_a_good_one_kept() -> None:
    from batcher.core.pool import worker_info

    info = worker_info({"model": "m", "gpu": None, "pid": 1, "signature": ONE.wire()})
    assert info.signature == ONE
    with pytest.raises(ValueError, match=r"bad READY signature: .*datatype must be one of"):
        worker_info(
            {"model": "m", "pid": 1, "signature": {"inputs": [{"name": "x", "datatype": "X", "shape": [1]}]}}
        )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"name": "x\nforged line", "datatype": "FP32", "shape": [-1]}, "a printable str"),
        ({"name": "x" * 257, "datatype": "FP32", "shape": [-1]}, "1 to 256 characters"),
        ({"name": "x", "datatype": ["FP32"], "shape": [-1]}, "datatype must be one of"),
        ({"name": "x", "datatype": {"k": 1}, "shape": [-1]}, "datatype must be one of"),
        ({"name": "x", "datatype": "FP32", "shape": [-1, 2**64 - 1]}, "ints >= -1"),
    ],
)
def test_what_a_worker_announces_is_bounded_and_typed(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Signature.from_wire({"inputs": [spec]})
    with pytest.raises(ValueError, match="at most 1024 inputs"):
        Signature.from_wire(
            {"inputs": [{"name": f"x{i}", "datatype": "FP32", "shape": [-1]} for i in range(1025)]}
        )


def test_a_models_signature_is_its_newest_live_workers() -> None:
    from batcher.core.pool import WorkerInfo, WorkerPool
    from batcher.core.scheduler import Scheduler
    from batcher.wire.protocol import Heartbeat

    pool = WorkerPool(Scheduler(models=["m"]), Heartbeat(), 1, 0.0)
    pool.joined(b"a", WorkerInfo("m", None, 1, ONE), None, 0.0)
    assert pool.signature("m") == ONE
    pool.joined(b"b", WorkerInfo("m", None, 2, TWO), None, 0.0)
    assert pool.signature("m") == TWO  # a reload's new model
    pool.lose(b"b", failed=True)
    assert pool.signature("m") == ONE  # the dead worker's signature went with it
    pool.joined(b"c", WorkerInfo("m", None, 3, None), None, 0.0)
    assert pool.signature("m") is None  # the newest announces none: nothing is checked
    assert pool.signature("other") is None


def spec(name: str = "x", shape: object = (-1,)) -> dict[str, Any]:
    return {"name": name, "datatype": "FP32", "shape": list(shape) if isinstance(shape, tuple) else shape}


def test_the_limits_a_worker_may_announce_are_inclusive() -> None:
    """The bounds of docs/protocol.md: 256-character names, 1024 inputs and outputs, rank 32
    past the batch axis, dimensions up to 2**45 elements."""
    Signature.from_wire({"inputs": [spec("x" * 256)]})
    Signature.from_wire({"inputs": [spec(shape=(-1,) * 33)]})
    Signature.from_wire({"inputs": [spec(shape=(-1, 2**45))]})
    many = [spec(f"x{i}") for i in range(1024)]
    Signature.from_wire({"inputs": many, "outputs": many})
    for bad in ({"inputs": [spec(shape=(-1,) * 34)]}, {"inputs": [spec(shape=(-1, 2**45 + 1))]}):
        with pytest.raises(ValueError, match=r"shape must be 1 to 33 ints >= -1 \(the batch axis first\)"):
            Signature.from_wire(bad)
    with pytest.raises(ValueError, match="at most 1024 inputs and 1024 outputs"):
        Signature.from_wire({"inputs": [spec()], "outputs": [*many, spec("y")]})


def test_every_refusal_of_an_announced_signature_says_what_is_wrong() -> None:
    def why(raw: object) -> str:
        with pytest.raises(ValueError) as info:
            Signature.from_wire(raw)
        return str(info.value)

    assert why({"inputs": []}) == "a signature must name at least one input"
    assert (
        why({"inputs": [spec()], "outputs": [spec("y"), spec("y")]})
        == "output names must differ, got ['y', 'y']"
    )
    assert why({"inputs": [spec(), spec()]}) == "input names must differ, got ['x', 'x']"
    assert why({"inputs": [spec(shape=5)]}) == (
        "tensor 'x': shape must be 1 to 33 ints >= -1 (the batch axis first), got 5"
    )  # a shape that is no list is refused as such, not taken apart
    assert why({"inputs": [{"name": "x", "datatype": "FP8", "shape": [-1]}]}).startswith(
        "tensor 'x': datatype must be one of BOOL, "
    )
    assert (
        why({"inputs": [spec(5)]}) == "a tensor's name must be a printable str of 1 to 256 characters, got 5"
    )  # type: ignore[arg-type]


def test_a_huge_bad_value_in_a_signature_is_cut_from_the_message() -> None:
    for raw, cut in [
        ({"inputs": "x" * 1000}, 200),
        ("x" * 1000, 200),
        ({"inputs": [{"name": "x" * 1000}]}, 200),
        ({"inputs": [spec("x" * 1000)]}, 300),
    ]:
        with pytest.raises(ValueError) as info:
            Signature.from_wire(raw)
        assert len(str(info.value)) <= cut and str(info.value).endswith("...")  # cut, not whole


def test_a_tensor_of_the_wrong_rank_misfits_even_when_its_first_dimensions_fit() -> None:
    sig = Signature((TensorSpec("x", "FP32", (-1, 4)),), ())
    for shape in ([4, 4], [], [4, 1]):
        assert sig.misfit(body(t(shape=shape))) == (
            f"input 'x' must have shape [4] (-1: any), without the batch axis; got {shape}"
        )


def test_a_request_tensor_of_a_shape_nested_too_deep_is_told_so_in_a_short_message() -> None:
    """What a client sends is shown clipped: a shape nested 1000 deep (msgpack reads 1024
    levels), or a datatype of megabytes, is named in a message of a few hundred characters."""
    deep: list[Any] = [1]
    for _ in range(1000):
        deep = [deep]
    spec = ONE.inputs[0]
    why = spec.misfit(spec.datatype, deep)
    assert why is not None and "nested too deeply to show" in why and len(why) < 400
    why = spec.misfit("x" * 1_000_000, [])
    assert why is not None and len(why) < 400 and why.endswith("...")
