"""Small ONNX models for the tests, built with onnx.helper (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def linear(path: Path, inputs: int = 4, outputs: int = 3, seed: int = 0, input_name: str = "x") -> Path:
    """y = x @ W + b: one input x (batch, inputs), one output y (batch, outputs); the
    input named `input_name`."""
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array(rng.standard_normal((inputs, outputs)).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.standard_normal(outputs).astype(np.float32), "B")
    graph = helper.make_graph(
        [helper.make_node("MatMul", [input_name, "W"], ["xw"]), helper.make_node("Add", ["xw", "B"], ["y"])],
        "linear",
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["batch", inputs])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", outputs])],
        initializer=[w, b],
    )
    return _save(graph, path)


def sum_and_product(path: Path) -> Path:
    """Two named inputs a and b (batch, 2) and two named outputs: sum and prod."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["sum"]), helper.make_node("Mul", ["a", "b"], ["prod"])],
        "sum_and_product",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 2]) for n in ("a", "b")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 2]) for n in ("sum", "prod")],
    )
    return _save(graph, path)


def _save(graph: onnx.GraphProto, path: Path, check: bool = True) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # readable by every onnxruntime the onnx extra allows
    if check:  # the checker wants every shape known; onnxruntime does not
        onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def unary(
    path: Path, op: str, shape: list[Any] | None, elem: int = TensorProto.FLOAT, out_shape: Any = "same"
) -> Path:
    """y = op(x) for an input x of `shape` (None: unknown rank); `out_shape` the output's
    declared shape ("same": as x)."""
    y_shape = shape if out_shape == "same" else out_shape
    nodes = [helper.make_node(op, ["x"], ["y"], **({"keepdims": 0} if op == "ReduceSum" else {}))]
    initializer = []
    if op == "ReduceSum":  # over the batch axis: an output without one
        initializer = [numpy_helper.from_array(np.array([0], np.int64), "axes")]
        nodes = [helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)]
    graph = helper.make_graph(
        nodes,
        op.lower(),
        [helper.make_tensor_value_info("x", elem, shape)],
        [helper.make_tensor_value_info("y", elem, y_shape)],
        initializer=initializer,
    )
    return _save(graph, path, check=shape is not None)
