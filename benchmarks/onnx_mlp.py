"""A generated ONNX MLP for the real-model benchmarks: x FP32 (batch, 1024) -> 2048 ->
2048 -> 2048 -> 10, ReLU between, random weights (seeded): a batch of 32 takes about 5 ms
on one thread of this machine. Imported by the scripts; needs onnx (the test extra has it)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

SIZES = (1024, 2048, 2048, 2048, 10)


def write_mlp(path: Path, sizes: tuple[int, ...] = SIZES, seed: int = 0) -> Path:
    """Write the MLP to `path` and return it."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, weights, last = [], [], "x"
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        w = (rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(np.float32)
        weights.append(numpy_helper.from_array(w, f"W{i}"))
        out = "y" if i == len(sizes) - 2 else f"h{i}"
        nodes.append(helper.make_node("MatMul", [last, f"W{i}"], [out if i == len(sizes) - 2 else f"m{i}"]))
        if i < len(sizes) - 2:
            nodes.append(helper.make_node("Relu", [f"m{i}"], [out]))
        last = out
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", sizes[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", sizes[-1]])],
        initializer=weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path
