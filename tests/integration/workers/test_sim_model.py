"""A worker's batch handling (`run_batch`, no sockets) and the model loader.

The integration half: these tests start processes or measure time; the unit tests
are in tests/unit/workers/test_batch_runner.py."""

from __future__ import annotations

import time

import pytest

from tests.unit.workers.test_batch_runner import run
from workers.models import SimModel, SimSettings


@pytest.mark.integration  # measures the model's time
def test_sim_model_through_run_batch() -> None:
    model = SimModel(SimSettings(base_ms=20.0, per_item_ms=5.0))  # t(2) = 30 ms
    started = time.perf_counter()
    infer_ms, replies = run(model, [{"id": "x", "input": "hi"}, {"id": "y", "input": 2}])
    elapsed_ms = (time.perf_counter() - started) * 1000.0
    assert [r["output"] for r in replies] == [
        {"echo": "hi", "amortized_ms": 15.0, "batch_size": 2},
        {"echo": 2, "amortized_ms": 15.0, "batch_size": 2},
    ]
    # infer_ms is the model's time: at least the sim's cost, within the call that ran it
    assert 30.0 <= infer_ms <= elapsed_ms, (infer_ms, elapsed_ms)
    assert all(r["infer_ms"] == infer_ms for r in replies)


@pytest.mark.integration  # measures the model's time
def test_sim_model_outputs_and_cost() -> None:
    model = SimModel(SimSettings(base_ms=3.0, per_item_ms=1.0))
    t0 = time.perf_counter()
    outputs = model(["a", {"b": 1}])
    elapsed = time.perf_counter() - t0
    assert outputs == [
        {"echo": "a", "amortized_ms": 2.5, "batch_size": 2},
        {"echo": {"b": 1}, "amortized_ms": 2.5, "batch_size": 2},
    ]
    assert elapsed >= 0.004  # 5 ms simulated; a generous lower bound only
