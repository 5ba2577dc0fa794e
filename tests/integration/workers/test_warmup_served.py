"""Warm-up and cost profiling (workers/warmup.py): the sizes run, the zero inputs, the fit,
the broker seeding its cost model from READY, and end to end through serve.

The integration half: these tests start processes or measure time; the unit tests
are in tests/unit/workers/test_warmup.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.workers.test_warmup import _reshape3


@pytest.mark.integration
@pytest.mark.parametrize("warm", [True, False])
def test_an_onnx_worker_announces_its_cost_before_the_first_request(
    serve, client, tmp_path: Path, warm: bool
):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    from tests import onnx_models

    path = onnx_models.linear(tmp_path / "m.onnx")
    s = serve("--model", f"onnx:{path}", "--workers", "1", *([] if warm else ["--no-warmup"]), workers=1)
    cost = client(s.frontend).control("stats")["models"]["m"]["batch_cost_ms"]
    if warm:
        assert cost is not None and cost[0] >= 0 and cost[1] >= 0  # known before any request
    else:
        assert cost is None


@pytest.mark.integration
def test_a_model_that_cannot_be_warmed_up_says_so_and_gets_no_cost_from_it(serve, client, tmp_path: Path):
    """Its error path was measured as its cost (and set a 1 s time limit for 2 s batches):
    now stats and the worker's log say the warm-up failed, no cost is known before the
    first batch (so the first-batch time limit holds), and the model is served; a model
    given a warmup_sample it accepts is measured."""
    np = pytest.importorskip("numpy")
    s = serve(
        "--model", "fails=tests.fixture_models:TripleWidth",
        "--model", "sampled=tests.fixture_models:SampledTripleWidth",
        "--workers", "1",
        workers=2,
    )  # fmt: skip
    c = client(s.frontend)
    models = c.control("stats")["models"]
    assert models["fails"]["warmup"].startswith(
        "failed: at batch size 1 the model failed its input: ValueError"
    )
    assert models["fails"]["batch_cost_ms"] is None
    assert models["sampled"]["warmup"] == "measured" and models["sampled"]["batch_cost_ms"] is not None
    for model in ("fails", "sampled"):
        assert c.request(np.ones(6, np.float32), model=model).tolist() == [6.0]
    log = (tmp_path / "serve-0.stderr").read_text()
    assert "warm-up failed, so no cost is announced" in log and "could not be warmed up" in log


@pytest.mark.integration
def test_an_onnx_model_is_warmed_up_on_the_sample_its_model_table_names(serve, client, tmp_path: Path):
    """An ONNX model has no Python attribute to hold a sample: a model table's
    warmup_sample names a JSON file of one request's input (as `batcher send` reads
    tensors), which serve passes to its workers as --warmup-sample. Without it the
    model's warm-up fails (its dynamic axis as 1), and says so."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    path = _reshape3(tmp_path / "r3.onnx")
    (tmp_path / "r3.json").write_text('{"datatype": "FP32", "shape": [6], "data": [0, 0, 0, 0, 0, 0]}')
    config = tmp_path / "batcher.toml"
    config.write_text('[models.sampled]\nwarmup_sample = "r3.json"\n')
    s = serve(
        "--model", f"sampled=onnx:{path}", "--model", f"plain=onnx:{path}", "--config", str(config),
        "--workers", "1", "--threads-per-worker", "1",
        workers=2,
    )  # fmt: skip
    models = client(s.frontend).control("stats")["models"]
    assert models["sampled"]["warmup"] == "measured" and models["sampled"]["batch_cost_ms"] is not None
    assert models["plain"]["warmup"].startswith("failed: at batch size 1 the model failed its input")
    assert models["plain"]["batch_cost_ms"] is None
