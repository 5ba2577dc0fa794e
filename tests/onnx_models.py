"""Small ONNX models for the tests, built with onnx.helper (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def linear(path: Path, inputs: int = 4, outputs: int = 3, seed: int = 0) -> Path:
    """y = x @ W + b: one input x (batch, inputs), one output y (batch, outputs)."""
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array(rng.standard_normal((inputs, outputs)).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.standard_normal(outputs).astype(np.float32), "B")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "B"], ["y"])],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", inputs])],
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


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # readable by every onnxruntime the onnx extra allows
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path
