"""ONNX models served as they are: `--model onnx:PATH` (or `NAME=onnx:PATH`).

One onnxruntime InferenceSession per worker, made once. A batch is one `session.run`
on the requests' inputs stacked along a new first axis, or one per group of requests
whose tensors have the same shapes (a model's dynamic axes may differ between
requests): a request's `input` is one tensor without the batch axis, for a model with
one input (or a map of its name to it), or a map of input name -> tensor; its reply's
`output` is its row of the one output, or a map of output name -> row when the model
has several. A model must lead every input and output with its batch axis, dynamic or
fixed at 1 (then requests run one by one); other models are refused at load.

The execution provider is CUDA on the worker's GPU when onnxruntime-gpu is installed and
the worker has a GPU, the CPU otherwise. onnxruntime and numpy come with
`pip install 'batcher[onnx]'`; this module imports them only when an ONNX model loads.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from batcher.errors import ModelLoadError
from batcher.wire.signature import Signature, TensorSpec
from workers import fastpath
from workers.placement import threads_per_worker
from workers.stacking import BadInput

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


#: The file is not a model onnxruntime can run here (or onnxruntime is missing): the older
#: name of batcher.errors.ModelLoadError, the one class for a model that will not load.
OnnxLoadError = ModelLoadError


class OnnxModel:
    """A session, and the list-in, list-out model the worker calls: the batch's inputs
    are grouped by shape (requests whose dynamic axes differ cannot share one array),
    each group stacked and run in one `session.run`, and each output split back per
    request. A model whose batch axis is fixed at 1 runs its requests one by one."""

    #: session.run computes without the GIL: the worker runs it on a thread of its own and
    #: decodes and encodes around it meanwhile (workers/overlap.py).
    releases_gil = True

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
        self.one_by_one = batch_axis(self.session, path)
        self.signature = onnx_signature(self.session)

    def __call__(self, inputs: list[Any]) -> list[Any]:
        import numpy as np

        out: list[Any] = [None] * len(inputs)
        stacked = fastpath.stacked_of(inputs)
        if stacked is not None and len(self.inputs) == 1 and not self.one_by_one:
            # Rows of one array already (workers/fastpath.py): run it as it is, not stacked again.
            name = self.inputs[0]
            self._run_group(range(len(inputs)), [{name: x} for x in inputs], out, np, stacked)
            return out
        groups: dict[tuple[Any, ...], list[int]] = {}
        feeds: list[dict[str, Any] | str] = []
        for i, x in enumerate(inputs):
            feed = self._feed(x)
            feeds.append(feed)
            if isinstance(feed, dict):
                key: tuple[Any, ...] = tuple((n, a.dtype.str, a.shape) for n, a in sorted(feed.items()))
                groups.setdefault((i,) if self.one_by_one else key, []).append(i)
            else:
                out[i] = BadInput(feed)
        for members in groups.values():
            self._run_group(members, [feeds[i] for i in members], out, np)
        return out

    def _run_group(
        self, members: Sequence[int], group: list[Any], out: list[Any], np: Any, stacked: Any = None
    ) -> None:
        """Run a group's feeds in one session.run, each row to its place in `out`; when the
        run fails, each feed alone, so a bad input fails only its own request."""
        try:
            rows = self._run(group, np, stacked)
        except Exception:  # onnxruntime's own types; a bad input fails the run: run each alone
            for i, feed in zip(members, group, strict=True):
                try:
                    (out[i],) = self._run([feed], np)
                except Exception as exc:  # onnxruntime raises its own unrelated types
                    out[i] = exc
            return
        for i, row in zip(members, rows, strict=True):
            out[i] = row

    def _run(self, feeds: list[Any], np: Any, stacked: Any = None) -> list[Any]:
        """One session.run on `feeds` stacked (or on `stacked`, the one input's feeds
        stacked already); each request's row of the outputs."""
        if stacked is not None:
            batch = {self.inputs[0]: stacked}
        else:
            batch = {n: np.stack([f[n] for f in feeds]) for n in self.inputs}
        alone = len(feeds) == 1 and not self.one_by_one
        if alone:
            # A batch of one runs as two equal rows: onnxruntime's matrix-vector kernels
            # round otherwise than its matrix kernels, so a request's answer would depend on
            # whether it happened to run alone (its bits, not its label; measured on the
            # digits example). From two rows on, a row's answer is the same in any batch.
            batch = {n: np.concatenate([a, a]) for n, a in batch.items()}
        results = self.session.run(None, batch)
        if alone:
            results = [r[:1] if getattr(r, "ndim", 0) and len(r) == 2 else r for r in results]
        if len(results) == 1 and len(results[0]) == len(feeds):
            return list(results[0])  # its rows, as views
        return [dict(zip(self.outputs, [r[k] for r in results], strict=True)) for k in range(len(feeds))]

    def _feed(self, x: Any) -> dict[str, Any] | str:
        """A request's input as {input name: array}, or why it cannot be one. A model of
        one input takes its tensor alone or in a map under its name."""
        if type(x).__name__ == "ndarray" and len(self.inputs) == 1:
            return {self.inputs[0]: x}
        if isinstance(x, dict) and all(type(v).__name__ == "ndarray" for v in x.values()):
            missing = [n for n in self.inputs if n not in x]
            unknown = [n for n in x if n not in self.inputs]
            if not missing and not unknown:
                return dict(x)
            return f"the model's inputs are {self.inputs}; missing {missing}, unknown {unknown}"
        if len(self.inputs) == 1:
            return f"the input must be a tensor (or a map of {self.inputs[0]!r} to one)"
        return f"the input must be a map of the tensors {self.inputs}"


def batch_axis(session: Any, path: str) -> bool:
    """Whether the model must run its requests one by one (its batch axis is fixed at 1);
    OnnxLoadError for a model whose inputs and outputs do not all lead with a batch axis
    the worker can stack along and split (dynamic, or all fixed at 1)."""
    firsts: list[tuple[str, Any]] = []
    for kind, args in (("input", session.get_inputs()), ("output", session.get_outputs())):
        for arg in args:
            where = f"cannot serve {path}: {kind} {arg.name!r}"
            if arg.type not in ONNX_DATATYPES:
                raise OnnxLoadError(f"{where} is {arg.type}, which has no tensor datatype here")
            if not arg.shape:
                raise OnnxLoadError(
                    f"{where} has no batch axis (its shape is unknown or []): "
                    "export the model with a dynamic first axis"
                )
            first = arg.shape[0]
            firsts.append(
                (f"{where} (shape {arg.shape})", first if isinstance(first, int) and first >= 0 else None)
            )
    inputs_fixed = {first for _, first in firsts[: len(session.get_inputs())] if first is not None}
    if inputs_fixed and inputs_fixed != {1}:
        raise OnnxLoadError(
            f"cannot serve {path}: its batch axis is fixed at {sorted(inputs_fixed)}: export the model "
            "with a dynamic first axis (or fixed at 1: then it runs one request at a time)"
        )
    allowed = {1} if inputs_fixed else set()
    for where, first in firsts:
        if first is not None and first not in allowed:
            raise OnnxLoadError(
                f"{where} does not lead with the batch axis: the worker could not split it per request"
            )
    return bool(inputs_fixed)


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


def load_onnx(path: str, gpu: int | None, threads: int | None) -> OnnxModel:
    """The worker's model for an ONNX file: its session, batches stacked by shape."""
    return OnnxModel(path, gpu, threads or threads_per_worker(1))
