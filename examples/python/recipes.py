"""Recipes: PyTorch and scikit-learn models served by the reference worker.

Each is a class model (docs/protocol.md 10.2): the worker builds it once with its GPU id,
having set CUDA_VISIBLE_DEVICES to that GPU first, so the one GPU the process sees is
cuda:0; without a GPU id, the CPU. Each declares `stack = True`: it is called with the
batch as one array of shape (n, ...) and returns one of the same first axis, which the
worker splits back per request. The file to load comes from an environment variable, so
that one recipe serves any such model:

    BATCHER_TORCH_MODEL=model.pt batcher serve --model net=recipes:TorchScriptModel
    BATCHER_SKLEARN_MODEL=model.joblib batcher serve --model clf=recipes:SklearnModel

(run from examples/python, or with it on PYTHONPATH). Copy and adapt them: the input
dtype, the output (probabilities or labels), the device.
"""

from __future__ import annotations

import os
from typing import Any


class TorchScriptModel:
    """A TorchScript module (torch.jit.save) on the worker's GPU, or the CPU: float32
    batches in, the module's output as a numpy array out."""

    stack = True

    def __init__(self, gpu_id: int | None) -> None:
        import torch

        self.torch = torch
        self.device = torch.device("cuda:0" if gpu_id is not None and torch.cuda.is_available() else "cpu")
        self.module = torch.jit.load(os.environ["BATCHER_TORCH_MODEL"], map_location=self.device).eval()

    def __call__(self, batch: Any) -> Any:
        torch = self.torch
        with torch.inference_mode():
            x = torch.from_numpy(batch.astype("float32", copy=False)).to(self.device)
            return self.module(x).cpu().numpy()


class SklearnModel:
    """A fitted scikit-learn estimator (joblib.dump): a batch of feature rows in, the
    predicted probabilities out (the predicted labels for an estimator without them).
    scikit-learn runs on the CPU; the GPU id is not used."""

    stack = True

    def __init__(self, gpu_id: int | None) -> None:
        import joblib

        self.estimator = joblib.load(os.environ["BATCHER_SKLEARN_MODEL"])

    def __call__(self, batch: Any) -> Any:
        if hasattr(self.estimator, "predict_proba"):
            return self.estimator.predict_proba(batch)
        return self.estimator.predict(batch)
