"""The PyTorch and scikit-learn recipes of examples/python/recipes.py, through the worker's
batch path: each runs when its library is installed and skips, saying why, otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest

np = pytest.importorskip("numpy")

from batcher.wire import tensor  # noqa: E402
from tests.unit.wire.test_tensor import batch, replies_of  # noqa: E402
from workers.models import ModelSpec, load_model  # noqa: E402
from workers.worker import run_batch  # noqa: E402


def test_the_scikit_learn_recipe_serves_the_estimators_own_probabilities(tmp_path, monkeypatch) -> None:
    pytest.importorskip("sklearn", reason="scikit-learn is not installed (the test extra has it)")
    import joblib
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    estimator = LogisticRegression(max_iter=500).fit(x[:1000], digits.target[:1000])
    joblib.dump(estimator, tmp_path / "clf.joblib")
    monkeypatch.setenv("BATCHER_SKLEARN_MODEL", str(tmp_path / "clf.joblib"))
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3] / "examples" / "python"))
    model = load_model(ModelSpec.parse("clf=recipes:SklearnModel"), None)
    rows = x[1000:1008]
    out = replies_of(run_batch(model, *batch(*map(tensor.from_array, rows)), "w"))
    expected = estimator.predict_proba(rows)
    assert all(np.array_equal(r["output"], e) for r, e in zip(out, expected, strict=True))


def test_the_torchscript_recipe_serves_the_modules_own_outputs(tmp_path, monkeypatch) -> None:
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (it is not in the test extra)")
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()).eval()
    torch.jit.save(torch.jit.script(module), str(tmp_path / "net.pt"))
    monkeypatch.setenv("BATCHER_TORCH_MODEL", str(tmp_path / "net.pt"))
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3] / "examples" / "python"))
    model = load_model(ModelSpec.parse("net=recipes:TorchScriptModel"), None)
    rows = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    out = replies_of(run_batch(model, *batch(*map(tensor.from_array, rows)), "w"))
    with torch.inference_mode():
        expected = module(torch.from_numpy(rows)).numpy()
    assert all(np.array_equal(r["output"], e) for r, e in zip(out, expected, strict=True))
