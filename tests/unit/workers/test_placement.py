"""GPU placement of serve's workers (workers/placement.py), a pure function."""

from __future__ import annotations

from collections import Counter

import pytest

from workers.placement import place_workers, visible_gpus
from workers.supervisor import PoolSettings


def test_visible_gpus_from_cuda_visible_devices_driver_or_none(tmp_path) -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,5"}, str(tmp_path)) == (2, 5)
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, str(tmp_path)) == ()
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"}, str(tmp_path)) == (0, 1)
    for i in range(3):
        (tmp_path / f"0000:0{i}:00.0").mkdir()
    assert visible_gpus({}, str(tmp_path)) == (0, 1, 2)
    assert visible_gpus({}, str(tmp_path / "absent")) == ()


def test_without_devices_every_model_gets_its_workers_and_no_gpu() -> None:
    assert place_workers(["sim", "echo"], ()) == [("sim", None)] * 2 + [("echo", None)] * 2
    assert place_workers(["sim"], (), workers_per_model=3) == [("sim", None)] * 3


def test_by_default_each_model_gets_one_worker_per_device_and_models_share_devices() -> None:
    plan = place_workers(["a", "b"], (0, 1))
    assert sorted(plan, key=str) == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]


def test_workers_go_to_the_least_loaded_allowed_device() -> None:
    plan = place_workers(["a", "b"], (0, 1, 2), workers_per_model=1)
    assert plan == [("a", 0), ("b", 1)]  # b avoids the device a already took


def test_several_workers_per_gpu() -> None:
    plan = place_workers(["a"], (0, 1), workers_per_gpu=3)
    assert Counter(gpu for _, gpu in plan) == {0: 3, 1: 3}
    assert place_workers(["a"], (0, 1), workers_per_model=3, workers_per_gpu=2) == [
        ("a", 0),
        ("a", 1),
        ("a", 0),
    ]


def test_a_pinned_model_stays_on_its_gpus_and_never_gets_an_id_that_does_not_exist() -> None:
    plan = place_workers(["big", "small"], (0, 1), model_gpus={"big": [1]}, model_workers={"small": 2})
    assert [gpu for m, gpu in plan if m == "big"] == [1]
    assert sorted(gpu for m, gpu in plan if m == "small") == [0, 1]
    with pytest.raises(
        ValueError, match=r"^model 'big' is pinned to GPU 3, which is not a device here \(0, 1\)$"
    ):
        place_workers(["big"], (0, 1), model_gpus={"big": [3]})
    with pytest.raises(ValueError, match="pinned to GPU 0, which is not a device here \\(none\\)"):
        place_workers(["big"], (), model_gpus={"big": [0]})


def test_too_many_workers_for_the_devices_is_refused_naming_the_model() -> None:
    with pytest.raises(
        ValueError, match=r"^model 'a' needs 3 workers but its GPUs \[0\] take 2 \(--workers-per-gpu 2\)$"
    ):
        place_workers(["a"], (0,), workers_per_model=3, workers_per_gpu=2)


def test_placement_names_only_served_models() -> None:
    with pytest.raises(ValueError, match="not served: ghost"):
        place_workers(["a"], (0,), model_gpus={"ghost": [0]})


def test_pool_settings_place_by_model_spec_and_refuse_what_does_not_fit() -> None:
    pool = PoolSettings(
        "tcp://127.0.0.1:1", ("net=pkg.mod:Net", "sim"), gpus=(4, 7), model_gpus={"net": (7,)}
    )
    assert pool.placement() == [("net=pkg.mod:Net", 7), ("sim", 4), ("sim", 7)]
    with pytest.raises(ValueError, match="needs 5 workers"):
        PoolSettings("tcp://127.0.0.1:1", ("sim",), workers_per_model=5, gpus=(0, 1))
