"""A real model on real data, end to end: train a classifier on the digits bundled with
scikit-learn (nothing is downloaded), export it to ONNX, serve it with
`batcher serve --model digits=onnx:...`, send the held-out images as float32 tensors, and
check that every served prediction equals the offline prediction of the same ONNX model.

    pip install -e '.[onnx]' scikit-learn skl2onnx
    python examples/digits/digits.py            # prints accuracy, throughput, and checks

Exits 1 if any served prediction differs from the offline one.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def train_and_export(path: Path, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Fit a logistic regression on 80% of the digits, write it to `path` as ONNX (a
    float32 (batch, 64) input; `label` and `probabilities` outputs), and return the
    held-out images and labels."""
    from skl2onnx import to_onnx
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = digits.data.astype(np.float32) / 16.0
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.2, random_state=seed)
    model = LogisticRegression(max_iter=2000).fit(x_train, y_train)
    onnx_model = to_onnx(model, x_train[:1], options={id(model): {"zipmap": False}}, target_opset=17)
    path.write_bytes(onnx_model.SerializeToString())
    return x_test, y_test


def offline(path: Path, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same ONNX model's labels and probabilities, in this process."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    labels, probabilities = session.run(["label", "probabilities"], {session.get_inputs()[0].name: images})
    return labels, probabilities


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=1)
    args = p.parse_args(argv)
    from batcher.client import Client
    from batcher.serve.launcher import ServeProcess

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "digits.onnx"
        images, labels = train_and_export(path)
        expected, expected_probabilities = offline(path, images)
        serve = ServeProcess(["--model", f"digits=onnx:{path}", "--workers", str(args.workers),
                              "--max-batch-size", "32", "--max-wait-ms", "2"])  # fmt: skip
        try:
            serve.start()
            serve.wait_ready(args.workers, timeout_s=60)
            with Client(serve.frontend, timeout_s=30) as client:
                t0 = time.perf_counter()
                outputs = client.request_many(list(images), model="digits")
                elapsed = time.perf_counter() - t0
        finally:
            serve.stop()
    served = np.array([o["label"] for o in outputs])
    accuracy = float((served == labels).mean())
    same = sum(
        o["label"] == e and np.array_equal(o["probabilities"], p)
        for o, e, p in zip(outputs, expected, expected_probabilities, strict=True)
    )
    print(
        f"{len(images)} held-out digits: accuracy {accuracy:.3f}; "
        f"{len(images) / elapsed:.0f} requests/s served"
    )
    print(f"served predictions (labels and probabilities) equal to offline: {same} of {len(images)}")
    return 0 if same == len(images) else 1


if __name__ == "__main__":
    sys.exit(main())
