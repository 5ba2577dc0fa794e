"""CPU pinning: `serve --pin-cpus` puts each worker on cores of its own and the broker on
the rest; `worker --cpus` pins one worker (workers/placement.py)."""

from __future__ import annotations

import os
from typing import Any

import psutil
import pytest

from workers.placement import CpuPlan, parse_cpus, pinned_threads_per_worker, plan_cpus
from workers.supervisor import PoolSettings, Supervisor

LINUX = hasattr(os, "sched_setaffinity")
CORES = sorted(os.sched_getaffinity(0)) if LINUX else []


def test_cpu_lists_read_like_taskset() -> None:
    assert parse_cpus("3") == (3,)
    assert parse_cpus("0,2-3") == (0, 2, 3)
    assert parse_cpus(" 5 , 1-2,2 ") == (1, 2, 5)
    for bad, why in [("", "not an id"), ("a", "not an id"), ("1-", "not an id"), ("-1", "not an id"),
                     ("3-1", "runs backwards"), ("1,,2", "not an id"),
                     ("0-100000000", "go up to 8191"), ("8192", "go up to 8191"),
                     ("²", "not an id"), ("\uff11", "not an id")]:  # fmt: skip
        with pytest.raises(ValueError, match=why):
            parse_cpus(bad)


def test_each_worker_gets_cores_of_its_own_from_the_top_and_the_broker_the_rest() -> None:
    assert plan_cpus([0, 1], 1, 1) == CpuPlan(broker=(0,), workers=((1,),))
    assert plan_cpus(range(8), 3, 2) == CpuPlan(broker=(0, 1), workers=((6, 7), (4, 5), (2, 3)))
    plan = plan_cpus([4, 9, 2, 7], 1, 2)  # a cpuset's ids, in any order
    assert plan == CpuPlan(broker=(2, 4), workers=((7, 9),))
    cores = [c for own in plan_cpus(range(16), 5, 3).workers for c in own]
    assert len(cores) == len(set(cores)) == 15  # no core is given twice


def test_no_core_left_for_the_broker_is_refused_saying_what_to_lower() -> None:
    with pytest.raises(ValueError, match=r"needs a core left for the broker: 2 worker\(s\) x 1 thread"):
        plan_cpus([0, 1], 2, 1)
    with pytest.raises(ValueError, match="lower --workers or --threads-per-worker"):
        plan_cpus([0, 1, 2, 3], 1, 4)
    with pytest.raises(ValueError, match="needs Linux"):
        plan_cpus([], 1, 1)


def test_pinned_workers_share_the_cores_but_the_brokers() -> None:
    assert pinned_threads_per_worker([0, 1], 1) == 1
    assert pinned_threads_per_worker(range(8), 2) == 3
    assert pinned_threads_per_worker(range(8), 9) == 1  # then the plan refuses it


@pytest.mark.skipif(len(CORES) < 2, reason="needs Linux and 2 cores")
def test_serve_pin_cpus_passes_each_worker_its_cores_and_keeps_them_over_a_reload() -> None:
    pool = PoolSettings("tcp://127.0.0.1:1", ("sim",), 1, pin_cpus=True)
    assert pool.threads() == (len(CORES) - 1)
    sup = Supervisor(pool)
    assert sup.cpu_plan is not None and sup.cpu_plan.broker == (CORES[0],)
    command = sup.command("sim", None, sup.cpu_plan.workers[0])
    assert command[command.index("--cpus") + 1] == ",".join(map(str, CORES[1:]))
    assert command[command.index("--threads-per-worker") + 1] == str(len(CORES) - 1)
    assert "--cpus" not in Supervisor(PoolSettings("tcp://127.0.0.1:1", ("sim",), 1)).command("sim", None)
    with pytest.raises(ValueError, match="needs a core left for the broker"):
        PoolSettings("tcp://127.0.0.1:1", ("sim",), len(CORES), pin_cpus=True)


def test_the_workers_threads_follow_the_plan_made_before_serve_pinned_itself(monkeypatch: Any) -> None:
    import workers.supervisor as supervisor

    monkeypatch.setattr(supervisor, "usable_cpus", lambda: tuple(range(8)))
    pool = PoolSettings("tcp://127.0.0.1:1", ("sim",), 2, pin_cpus=True)
    plan = pool.cpu_plan()
    assert plan == CpuPlan(broker=(0, 1), workers=((5, 6, 7), (2, 3, 4)))
    monkeypatch.setattr(supervisor, "usable_cpus", lambda: (0, 1))  # serve, now pinned
    sup = Supervisor(pool, plan)
    command = sup.command("sim", None, plan.workers[1])
    assert command[command.index("--threads-per-worker") + 1] == "3"
    assert command[command.index("--cpus") + 1] == "2,3,4"


# --- real processes ---------------------------------------------------------------------------


def _affinities(pid: int) -> set[tuple[int, ...]]:
    """The CPU masks of every thread of `pid`."""
    return {tuple(sorted(os.sched_getaffinity(t.id))) for t in psutil.Process(pid).threads()}


@pytest.mark.skipif(len(CORES) < 2, reason="needs Linux and 2 cores")
def test_the_default_threads_count_the_cores_this_process_may_use_not_the_machines() -> None:
    from workers.placement import threads_per_worker

    assert threads_per_worker(1) == len(CORES)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {CORES[0]})  # as a container's cpuset or taskset would
    try:
        assert threads_per_worker(1) == 1
    finally:
        os.sched_setaffinity(0, before)
