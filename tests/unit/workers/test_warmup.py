"""Warm-up and cost profiling (workers/warmup.py): the sizes run, the zero inputs, the fit,
the broker seeding its cost model from READY, and end to end through serve."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from batcher.core.pool import worker_info
from batcher.core.scheduler import BatchSettings, Scheduler
from batcher.wire.signature import Signature, TensorSpec
from workers import warmup

SIG = Signature(
    (TensorSpec("x", "FP32", (-1, -1, 3)), TensorSpec("m", "BOOL", (-1, 2))),
    (TensorSpec("y", "FP32", (-1, 3)),),
)


@pytest.mark.parametrize(
    ("max_size", "allowed", "sizes"),
    [(8, None, (1, 2, 4, 8)), (1, None, (1,)), (12, None, (1, 2, 4, 8, 12)), (32, (1, 4, 16), (1, 4, 16))],
)
def test_the_warm_up_runs_the_allowed_sizes_or_powers_of_two(max_size: int, allowed: Any, sizes: Any) -> None:
    assert warmup.warmup_sizes(max_size, allowed) == sizes


def test_zero_inputs_follow_the_signature_a_dynamic_axis_as_1() -> None:
    np = pytest.importorskip("numpy")
    x = warmup.zero_input(SIG)
    assert set(x) == {"x", "m"}
    assert (x["x"].shape, x["x"].dtype, x["m"].shape, x["m"].dtype) == ((1, 3), np.float32, (2,), np.bool_)
    assert not x["x"].any()


def test_the_profile_fits_the_fastest_time_of_each_size() -> None:
    pytest.importorskip("numpy")
    now = [0.0]
    calls: list[int] = []

    def model(inputs: list[Any]) -> list[Any]:
        n = len(inputs)
        calls.append(n)
        now[0] += (0.004 + 0.001 * n) * (3 if calls.count(n) == 1 else 1)  # the first run is slow
        return inputs

    a, b = warmup.profile(model, warmup.zero_input(SIG), (1, 2, 4, 8), clock=lambda: now[0])
    assert (a, b) == (pytest.approx(4.0), pytest.approx(1.0))
    assert calls == [1] * 3 + [2] * 3 + [4] * 3 + [8] * 3


def test_the_fit_is_never_negative_and_one_size_has_no_slope() -> None:
    assert warmup.fit([(4, 10.0)]) == (10.0, 0.0)
    assert warmup.fit([(1, 5.0), (2, 4.0)]) == (4.5, 0.0)


def test_the_broker_takes_a_warm_up_cost_only_before_batches_teach_one() -> None:
    s = Scheduler(per_model={"m": BatchSettings(max_batch_size=8)})
    s.seed_cost("m", 0.004, 0.001)
    a, b = s.cost("m") or (0.0, 0.0)
    assert (a, b) == (pytest.approx(0.004), pytest.approx(0.001))
    s.seed_cost("m", 1.0, 1.0)  # a second worker's: the cost already known stays
    assert s.cost("m") == (pytest.approx(0.004), pytest.approx(0.001))
    s.seed_cost("nobody", 1.0, 1.0)  # an unknown model: nothing to do


@pytest.mark.parametrize("bad", [[1.0], [1.0, -1.0], ["1", 2], [1.0, float("nan")], [True, 1], 5])
def test_a_ready_with_a_malformed_cost_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="bad READY cost_ms"):
        worker_info({"model": "m", "pid": 1, "cost_ms": bad})
    assert worker_info({"model": "m", "pid": 1, "cost_ms": [2, 0.5]}).cost_ms == (2.0, 0.5)


# --- issue 28 item 6: a failed warm-up is never measured ---------------------------------------------


def test_a_run_that_fails_is_never_measured_and_the_warm_up_says_why() -> None:
    np = pytest.importorskip("numpy")
    from tests.fixture_models import TripleWidth

    calls: list[int] = []

    def fails_alone(inputs: list[Any]) -> list[Any]:  # as the ONNX model answers a failed run
        calls.append(len(inputs))
        return [ValueError("cannot reshape") for _ in inputs]

    with pytest.raises(
        warmup.WarmupFailed, match="at batch size 1 the model failed its input: ValueError: cannot"
    ):
        warmup.profile(fails_alone, np.zeros(1, np.float32), (1, 2, 4))
    assert calls == [1]  # it stopped at the first failed run
    with pytest.raises(
        warmup.WarmupFailed, match="at batch size 2 the model returned 1 outputs for a batch of 2"
    ):
        warmup.profile(lambda xs: xs[:1], 0, (1, 2))
    with pytest.raises(warmup.WarmupFailed, match="at batch size 1 the model raised KeyError"):
        warmup.profile(lambda xs: {}[0], 0, (1,))
    model = TripleWidth()
    with pytest.raises(warmup.WarmupFailed, match="width 1 is not a multiple of 3"):
        warmup.profile(model, warmup.sample_of(model, Signature.from_wire(model.signature)), (1,))


def test_the_warm_up_input_is_the_models_sample_else_zeros_of_its_signature_else_none() -> None:
    np = pytest.importorskip("numpy")
    from tests.fixture_models import SampledTripleWidth

    assert warmup.sample_of(SampledTripleWidth(), SIG).tolist() == [1, 1, 1]
    assert set(warmup.sample_of(object(), SIG)) == {"x", "m"}
    assert warmup.sample_of(object(), None) is None
    a, b = warmup.profile(SampledTripleWidth(), warmup.sample_of(SampledTripleWidth(), None), (1, 2))
    assert a >= 0 and b >= 0
    assert np is not None


def test_a_ready_says_why_its_warm_up_failed_and_the_pool_tells_it() -> None:
    info = worker_info({"model": "m", "pid": 1, "warmup_error": "x" * 900})
    assert info.warmup == "failed: " + "x" * 500 and info.cost_ms is None
    assert worker_info({"model": "m", "pid": 1, "cost_ms": [1, 2]}).warmup == "measured"
    assert worker_info({"model": "m", "pid": 1}).warmup is None
    with pytest.raises(ValueError, match="bad READY warmup_error: must be a str, got 3"):
        worker_info({"model": "m", "pid": 1, "warmup_error": 3})


def _reshape3(path: Path) -> Path:
    """x FP32 [N, L] -> y = sum over the last axis of reshape(x, [N, -1, 3]): fails unless 3 | L."""
    from onnx import TensorProto, helper

    from tests import onnx_models

    shape = helper.make_tensor("shape", TensorProto.INT64, [3], [0, -1, 3])
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [2])
    graph = helper.make_graph(
        [
            helper.make_node("Reshape", ["x", "shape"], ["r"]),
            helper.make_node("ReduceSum", ["r", "axes"], ["y"], keepdims=0),
        ],
        "reshape3",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "L"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "M"])],
        [shape, axes],
    )
    return onnx_models._save(graph, path)


def test_a_model_tables_warmup_sample_is_a_path_from_the_config_files_directory(tmp_path: Path) -> None:
    from batcher.cli.config_file import ConfigError, load_config

    (tmp_path / "c.toml").write_text('[models.a]\nwarmup_sample = "s/a.json"\n[models.b]\nworkers = 1\n')
    assert load_config(str(tmp_path / "c.toml")).model_warmup_samples() == {
        "a": str(tmp_path / "s" / "a.json")
    }
    (tmp_path / "bad.toml").write_text("[models.a]\nwarmup_sample = 3\n")
    with pytest.raises(ConfigError, match="warmup_sample"):
        load_config(str(tmp_path / "bad.toml"))
