"""ONNX models served as they are: `--model onnx:PATH` (or `NAME=onnx:PATH`).

One onnxruntime InferenceSession per worker, made once. A batch is one `session.run`
on the requests' inputs stacked along a new first axis (workers.stacking): a request's
`input` is one tensor without the batch axis, for a model with one input, or a map of
input name -> tensor; its reply's `output` is its row of the one output, or a map of
output name -> row when the model has several.

The execution provider is CUDA on the worker's GPU when onnxruntime-gpu is installed and
the worker has a GPU, the CPU otherwise. onnxruntime and numpy come with
`pip install 'batcher[onnx]'`; this module imports them only when an ONNX model loads.
"""

from __future__ import annotations

import os
from typing import Any

from batcher.signature import Signature, TensorSpec
from workers.stacking import Stack, Stacked

#: onnxruntime's element types -> the protocol's datatypes.
ONNX_DATATYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
}


class OnnxLoadError(RuntimeError):
    """The file is not a model onnxruntime can run (or onnxruntime is missing)."""


def default_threads(workers_on_host: int = 1) -> int:
    """Intra-op threads per worker so that workers x threads <= cores."""
    return max(1, (os.cpu_count() or 1) // max(1, workers_on_host))


class OnnxModel:
    """A session and its input and output names; called by the worker with the batch
    stacked (one array, or a map of name -> array)."""

    def __init__(self, path: str, gpu: int | None, threads: int) -> None:
        try:
            import onnxruntime as ort
        except ImportError:
            raise OnnxLoadError(
                f"cannot serve {path}: onnxruntime is not installed (pip install 'batcher[onnx]')"
            ) from None
        if not os.path.isfile(path):
            raise OnnxLoadError(f"cannot serve {path}: no such file")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.providers = providers(ort.get_available_providers(), gpu)
        try:
            self.session = ort.InferenceSession(path, sess_options=options, providers=self.providers)
        except Exception as exc:  # onnxruntime raises its own unrelated types
            raise OnnxLoadError(f"cannot serve {path}: {type(exc).__name__}: {exc}") from None
        self.path = path
        self.threads = threads
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.signature = onnx_signature(self.session)

    def __call__(self, batch: Any) -> Any:
        if isinstance(batch, dict):
            missing = [name for name in self.inputs if name not in batch]
            unknown = [name for name in batch if name not in self.inputs]
            if missing or unknown:
                raise ValueError(
                    f"the model's inputs are {self.inputs}; missing {missing}, unknown {unknown}"
                )
            feed = {name: batch[name] for name in self.inputs}
        elif len(self.inputs) == 1:
            feed = {self.inputs[0]: batch}
        else:
            raise ValueError(f"the model has {len(self.inputs)} inputs: send a map of {self.inputs}")
        results = self.session.run(None, feed)
        if len(results) == 1:
            return results[0]
        return dict(zip(self.outputs, results, strict=True))


def onnx_signature(session: Any) -> Signature | None:
    """The session's inputs and outputs as a signature (a dynamic or named axis is -1);
    None when a tensor has a type the protocol has not (strings, sequences, maps)."""

    def spec(arg: Any) -> TensorSpec | None:
        datatype = ONNX_DATATYPES.get(arg.type)
        shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in (arg.shape or [-1]))
        return None if datatype is None else TensorSpec(arg.name, datatype, shape)

    inputs = [spec(i) for i in session.get_inputs()]
    outputs = [spec(o) for o in session.get_outputs()]
    if any(s is None for s in (*inputs, *outputs)):
        return None
    return Signature(tuple(s for s in inputs if s), tuple(s for s in outputs if s))


def providers(available: list[str], gpu: int | None) -> list[Any]:
    """CUDA on `gpu` when onnxruntime has it and the worker has a GPU, then the CPU."""
    if gpu is not None and "CUDAExecutionProvider" in available:
        return [("CUDAExecutionProvider", {"device_id": device_index(gpu)}), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def device_index(gpu: int) -> int:
    """CUDA's index of GPU `gpu` in this process: its place in CUDA_VISIBLE_DEVICES when
    that lists it (serve sets it to the worker's GPU alone: index 0), else `gpu`."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible.index(str(gpu)) if str(gpu) in visible else gpu


def load_onnx(path: str, gpu: int | None, threads: int | None) -> Stacked:
    """The worker's model for an ONNX file: its session, stacked batches in and out."""
    return Stacked(OnnxModel(path, gpu, threads or default_threads()), Stack())
