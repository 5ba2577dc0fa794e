"""ONNX models served as they are (`--model onnx:PATH`, workers/onnx_model.py): the served
outputs are exactly what onnxruntime gives offline, with one input or several named
inputs and outputs; a file that does not load stops `serve` with its reason."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

np = pytest.importorskip("numpy")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install 'batcher[onnx]')")
pytest.importorskip("onnx", reason="the onnx package builds the test models")

from batcher.wire import tensor  # noqa: E402
from tests import onnx_models  # noqa: E402
from tests.unit.wire.test_tensor import batch, replies_of  # noqa: E402
from workers.models import ModelSpec, load_model  # noqa: E402
from workers.onnx_model import OnnxModel, device_index, providers  # noqa: E402
from workers.worker import run_batch  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


def offline(path: Path, feed: dict[str, Any]) -> list[Any]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, feed)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("text", "name", "target"),
    [
        ("onnx:/models/mlp.onnx", "mlp", "onnx:/models/mlp.onnx"),
        ("digits=onnx:d.onnx", "digits", "onnx:d.onnx"),
        ("onnx:relative/net.v2.onnx", "net.v2", "onnx:relative/net.v2.onnx"),
    ],
)
def test_an_onnx_model_spec_is_named_after_its_file_unless_named(text: str, name: str, target: str) -> None:
    spec = ModelSpec.parse(text)
    assert (spec.name, spec.target) == (name, target)


@pytest.mark.parametrize("text", ["onnx:", "m=onnx:", "=onnx:x.onnx"])
def test_an_onnx_spec_without_a_path_or_name_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        ModelSpec.parse(text)


def test_one_input_batches_give_exactly_the_offline_outputs(tmp_path: Path) -> None:
    path = onnx_models.linear(tmp_path / "linear.onnx")
    model = load_model(ModelSpec.parse(f"onnx:{path}"), None, threads=1)
    rows = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    out = replies_of(run_batch(model, *batch(*map(tensor.from_array, rows)), "w"))
    (expected,) = offline(path, {"x": rows})
    assert [r["ok"] for r in out] == [True] * 5
    for i, r in enumerate(out):
        assert r["output"].dtype == np.float32 and r["output"].shape == (3,)
        assert np.array_equal(r["output"], expected[i])  # exactly, not approximately


def test_named_inputs_and_outputs_go_by_name(tmp_path: Path) -> None:
    path = onnx_models.sum_and_product(tmp_path / "sp.onnx")
    model = load_model(ModelSpec.parse(f"sp=onnx:{path}"), None, threads=1)
    a = np.arange(6, dtype=np.float32).reshape(3, 2)
    b = np.full((3, 2), 2.0, np.float32)
    inputs = [{"a": tensor.from_array(a[i]), "b": tensor.from_array(b[i])} for i in range(3)]
    out = replies_of(run_batch(model, *batch(*inputs), "w"))
    sums, prods = offline(path, {"a": a, "b": b})
    for i, r in enumerate(out):
        assert set(r["output"]) == {"sum", "prod"}
        assert np.array_equal(r["output"]["sum"], sums[i]) and np.array_equal(r["output"]["prod"], prods[i])


def test_a_request_the_model_refuses_fails_alone(tmp_path: Path) -> None:
    # The broker's signature check stops such a request first; the worker must not let it fail its batch.
    path = onnx_models.linear(tmp_path / "linear.onnx")
    model = load_model(ModelSpec.parse(f"onnx:{path}"), None, threads=1)
    good = np.ones(4, np.float32)
    inputs = [good, np.ones(4, np.float64), good]
    out = replies_of(run_batch(model, *batch(*map(tensor.from_array, inputs)), "w"))
    assert [r["ok"] for r in out] == [True, False, True]
    assert out[1]["error"]["code"] == "model_error" and "double" in out[1]["error"]["message"]
    assert out[0]["batch_size"] == 3 and np.array_equal(out[0]["output"], out[2]["output"])


def test_missing_named_inputs_are_refused_saying_which(tmp_path: Path) -> None:
    path = onnx_models.sum_and_product(tmp_path / "sp.onnx")
    model = load_model(ModelSpec.parse(f"onnx:{path}"), None, threads=1)
    out = replies_of(run_batch(model, *batch({"a": tensor.from_array(np.ones(2, np.float32))}), "w"))
    assert out[0]["error"]["code"] == "bad_request"
    assert "the model's inputs are ['a', 'b']; missing ['b']" in out[0]["error"]["message"]


def test_the_session_uses_the_threads_it_is_given(tmp_path: Path) -> None:
    path = onnx_models.linear(tmp_path / "linear.onnx")
    assert OnnxModel(str(path), None, 1).session.get_session_options().intra_op_num_threads == 1
    assert OnnxModel(str(path), None, 2).threads == 2


def test_cuda_is_asked_for_only_with_a_gpu_and_a_cuda_build(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = ["CPUExecutionProvider"]
    assert providers(cpu, 0) == cpu
    assert providers(["CUDAExecutionProvider", *cpu], None) == cpu
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert providers(["CUDAExecutionProvider", *cpu], 3) == [
        ("CUDAExecutionProvider", {"device_id": 0}),
        *cpu,
    ]
    assert device_index(1) == 1  # not among the visible ids: taken as CUDA's own index


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("onnx:/m/digits.onnx", "digits"),
        ("d=onnx:/m/x.onnx", "d"),
        ("a=sim", "a"),
        ("sim", "sim"),
        ("mine", "mine"),
    ],
)
def test_the_broker_configures_a_spec_under_the_name_its_worker_announces(text: str, name: str) -> None:
    from batcher.cli.commands import served_name

    assert served_name(text) == name


@pytest.mark.parametrize(("workers", "given"), [(1, None), (2, None), (8, None), (2, 3)])
def test_serve_divides_the_cores_among_its_workers_unless_told(workers: int, given: int | None) -> None:
    import os

    from workers.supervisor import PoolSettings, Supervisor

    pool = PoolSettings("tcp://127.0.0.1:1", ("sim",), workers, gpus=(), threads_per_worker=given)
    command = Supervisor(pool).command("sim", None)
    threads = int(command[command.index("--threads-per-worker") + 1])
    assert threads == (given if given is not None else max(1, (os.cpu_count() or 1) // workers))


def test_an_onnx_models_signature_is_read_from_its_session(tmp_path: Path) -> None:
    linear = OnnxModel(str(onnx_models.linear(tmp_path / "l.onnx")), None, 1)
    assert linear.signature is not None and linear.signature.wire() == {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 3]}],
    }
    sp = OnnxModel(str(onnx_models.sum_and_product(tmp_path / "sp.onnx")), None, 1)
    assert sp.signature is not None
    assert [s.name for s in sp.signature.inputs] == ["a", "b"]
    assert [s.name for s in sp.signature.outputs] == ["sum", "prod"]


def run_rows(model: Any, arrays: list[Any]) -> list[dict[str, Any]]:
    return replies_of(run_batch(model, *batch(*arrays), "w"))


def test_requests_whose_dynamic_axes_differ_are_run_apart_and_all_answered(tmp_path: Path) -> None:
    model = load_model(
        ModelSpec.parse(f"onnx:{onnx_models.unary(tmp_path / 'n.onnx', 'Neg', ['b', 'n'])}"), None, 1
    )
    arrays = [np.arange(3, dtype=np.float32), np.arange(5, dtype=np.float32), np.ones(3, np.float32)]
    out = run_rows(model, [tensor.from_array(a) for a in arrays])
    assert [r["ok"] for r in out] == [True] * 3
    assert all(np.array_equal(r["output"], -a) for r, a in zip(out, arrays, strict=True))


def test_a_tensor_alone_and_in_a_map_under_its_name_share_a_batch(tmp_path: Path) -> None:
    model = load_model(ModelSpec.parse(f"onnx:{onnx_models.linear(tmp_path / 'l.onnx')}"), None, 1)
    x = np.ones(4, np.float32)
    out = run_rows(model, [tensor.from_array(x), {"x": tensor.from_array(x)}])
    assert [r["ok"] for r in out] == [True, True]
    assert np.array_equal(out[0]["output"], out[1]["output"])


def test_a_model_with_its_batch_axis_fixed_at_1_runs_requests_one_by_one(tmp_path: Path) -> None:
    model = load_model(
        ModelSpec.parse(f"onnx:{onnx_models.unary(tmp_path / 'r.onnx', 'Relu', [1, 4])}"), None, 1
    )
    arrays = [np.full(4, v, np.float32) for v in (-1.0, 2.0, 3.0)]
    out = run_rows(model, [tensor.from_array(a) for a in arrays])
    assert [r["ok"] for r in out] == [True] * 3
    assert all(np.array_equal(r["output"], np.maximum(a, 0)) for r, a in zip(out, arrays, strict=True))


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        (
            lambda p: onnx_models.unary(p, "ReduceSum", ["b", 4], out_shape=[4]),
            "output 'y' (shape [4]) does not lead",
        ),
        (lambda p: onnx_models.unary(p, "Relu", [8, 4]), "its batch axis is fixed at [8]"),
        (lambda p: onnx_models.unary(p, "Relu", None), "has no batch axis"),
        (
            lambda p: onnx_models.unary(p, "Identity", ["b"], elem=onnx_models.TensorProto.STRING),
            "tensor(string)",
        ),
    ],
)
def test_a_model_the_worker_cannot_batch_is_refused_at_load_saying_why(
    tmp_path: Path, build: Any, reason: str
) -> None:
    path = build(tmp_path / "m.onnx")
    with pytest.raises(Exception, match=re.escape(reason)):
        load_model(ModelSpec.parse(f"onnx:{path}"), None, 1)


@pytest.mark.parametrize(
    ("text", "name", "target"),
    [("onnx:/tmp/a=b.onnx", "a=b", "onnx:/tmp/a=b.onnx"), ("onnx: /m/x.onnx", "x", "onnx:/m/x.onnx")],
)
def test_an_onnx_path_may_hold_an_equals_sign_and_is_stripped(text: str, name: str, target: str) -> None:
    spec = ModelSpec.parse(text)
    assert (spec.name, spec.target) == (name, target)


def test_a_request_gets_the_same_bits_alone_as_in_any_batch(tmp_path: Path) -> None:
    """onnxruntime rounds a batch of one otherwise than a larger batch (seen with the
    digits example's classifier): the worker runs a lone request as two equal rows, so a
    request's answer does not depend on whether it happened to run alone."""
    for module in ("sklearn", "skl2onnx"):
        pytest.importorskip(module, reason=f"{module} is not installed (the test extra has it)")
    import importlib.util

    spec = importlib.util.spec_from_file_location("digits", ROOT / "examples" / "digits" / "digits.py")
    assert spec is not None and spec.loader is not None
    digits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(digits)
    images, _ = digits.train_and_export(tmp_path / "digits.onnx")
    model = OnnxModel(str(tmp_path / "digits.onnx"), None, 1)
    together = model(list(images[:40]))
    for x, y in zip(images[:40], together, strict=True):
        alone = model([x])[0]
        assert alone["label"] == y["label"] and np.array_equal(alone["probabilities"], y["probabilities"])
