"""A model repository served by `batcher serve --model-repository` (docs/models.md): each
version side by side with its own weights, the version policy, a broken version skipped,
versions copied in while it runs, canary splits, load and unload."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from tests import onnx_models
from tests.helpers import wait_until

ROW = np.arange(4, dtype=np.float32)


def version(root: Path, name: str, v: int, seed: int) -> Path:
    """DIR/NAME/V/model.onnx, a linear model whose weights come from `seed`; written in a
    directory beside and renamed in, as a deployment copies one in whole."""
    staging = root / f".{name}-{v}-staging"
    staging.mkdir(parents=True)
    onnx_models.linear(staging / "model.onnx", inputs=4, outputs=3, seed=seed)
    (root / name).mkdir(parents=True, exist_ok=True)
    target = root / name / str(v)
    staging.rename(target)
    return target / "model.onnx"


def expected(path: Path, row: np.ndarray = ROW) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": row[None]})[0][0]  # type: ignore[no-any-return]


def ask(c: Any, model: str, v: int | str | None = None, row: np.ndarray = ROW) -> dict[str, Any]:
    """The whole reply to one request for `model`, naming version `v` when given."""
    fields: dict[str, Any] = {"input": row, "model": model}
    if v is not None:
        fields["version"] = v
    try:
        return {"ok": True, "output": c.start(fields, c.timeout_s).result()}
    except Exception as exc:  # the typed reply error
        return {"ok": False, "code": getattr(exc, "code", None), "message": str(exc)}


def config(root: Path, name: str, text: str) -> None:
    (root / name).mkdir(parents=True, exist_ok=True)
    (root / name / "config.toml").write_text(text)


@pytest.mark.integration
def test_each_version_answers_with_its_own_weights_and_a_broken_one_is_skipped(
    serve, client, tmp_path: Path
) -> None:
    root = tmp_path / "models"
    v1 = version(root, "lin", 1, seed=1)
    v2 = version(root, "lin", 2, seed=2)
    config(root, "lin", 'version_policy = "all"\nworkers = 1\nmax_wait_ms = 2\n')
    other = version(root, "other", 1, seed=7)  # no config.toml: the defaults, latest:1
    (root / "broken").mkdir()
    (root / "broken" / "config.toml").write_text("max_batch_size = 0\n")  # refused: reported, skipped
    (root / "broken" / "1").mkdir()
    onnx_models.linear(root / "broken" / "1" / "model.onnx", seed=3)
    (root / "other" / "2").mkdir()  # a version that holds no model: skipped, version 1 served
    s = serve("--model-repository", str(root), "--workers", "1", workers=3)
    c = client(s.frontend)
    assert np.array_equal(ask(c, "lin", 1)["output"], expected(v1))
    assert np.array_equal(ask(c, "lin", "2")["output"], expected(v2))
    assert np.array_equal(ask(c, "lin")["output"], expected(v2))  # none named: the newest
    assert np.array_equal(ask(c, "lin/1")["output"], expected(v1))  # the internal key
    assert np.array_equal(ask(c, "other")["output"], expected(other))
    assert not np.array_equal(expected(v1), expected(v2))
    refused = ask(c, "lin", 3)
    assert refused["code"] == "unknown_model" and "served: 1, 2" in refused["message"]
    assert ask(c, "broken")["code"] == "unknown_model"
    stats = c.control("stats")
    assert {"lin/1", "lin/2", "other/1"} <= set(stats["models"])
    assert stats["models"]["lin/1"]["workers"] == 1 and stats["models"]["lin/2"]["workers"] == 1
    assert stats["versions"]["lin"]["served"] == [1, 2]
    meta = c.control("metadata", model="lin", version=1)
    assert meta["name"] == "lin" and meta["version"] == "1" and meta["versions"] == ["1", "2"]
    assert meta["inputs"][0]["name"] == "x"
    index = {(m["name"], m["version"]): m for m in c.control("repository_index")["models"]}
    assert index[("lin", "1")]["state"] == index[("lin", "2")]["state"] == "READY"
    assert index[("broken", "")]["state"] == "UNAVAILABLE"
    assert "max_batch_size" in index[("broken", "")]["reason"]
    assert index[("other", "2")]["state"] == "UNAVAILABLE" and "no model" in index[("other", "2")]["reason"]


@pytest.mark.integration
def test_latest_1_serves_only_the_newest_and_a_version_that_does_not_load_is_skipped(
    serve, client, tmp_path: Path
) -> None:
    root = tmp_path / "models"
    version(root, "lin", 1, seed=1)
    v2 = version(root, "lin", 2, seed=2)
    good = version(root, "good", 1, seed=5)
    (root / "bad" / "1").mkdir(parents=True)
    (root / "bad" / "1" / "model.onnx").write_bytes(b"not an onnx model")  # found only by its worker
    s = serve("--model-repository", str(root), "--workers", "1", workers=2)
    c = client(s.frontend)
    assert np.array_equal(ask(c, "lin")["output"], expected(v2))
    assert ask(c, "lin", 1)["code"] == "unknown_model"
    assert "lin/1" not in c.control("stats")["models"]
    wait_until(lambda: c.control("stats")["versions"]["bad"]["served"] == [], 20, "bad/1 reported")
    assert ask(c, "bad")["code"] == "unknown_model"
    assert np.array_equal(ask(c, "good")["output"], expected(good))  # undisturbed
    index = {(m["name"], m["version"]): m for m in c.control("repository_index")["models"]}
    assert index[("bad", "1")]["state"] == "UNAVAILABLE" and "loaded" in index[("bad", "1")]["reason"]
    assert s.process is not None and s.process.poll() is None  # serve goes on
