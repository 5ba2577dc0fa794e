"""CPU pinning: `serve --pin-cpus` puts each worker on cores of its own and the broker on
the rest; `worker --cpus` pins one worker (workers/placement.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import psutil
import pytest

from batcher.serve.launcher import free_tcp_address
from workers.exit_codes import EXIT_BAD_ADDRESS
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


@pytest.mark.integration
@pytest.mark.skipif(len(CORES) < 2, reason="needs Linux and 2 cores")
def test_serve_pins_its_worker_and_every_thread_of_it_and_the_broker_elsewhere(
    serve: Any, tmp_path: Path
) -> None:
    sp = serve("--model", "echo", "--workers", "1", "--pin-cpus", workers=1)
    children = [c for c in psutil.Process(sp.process.pid).children() if "worker" in c.cmdline()]
    assert len(children) == 1
    assert _affinities(children[0].pid) == {tuple(CORES[1:])}
    assert _affinities(sp.process.pid) == {(CORES[0],)}  # the broker, its zmq and other threads
    from batcher.client.sync import Client

    with Client(sp.frontend, timeout_s=10) as client:
        assert client.request("pinned", model="echo") == "pinned"


@pytest.mark.integration
@pytest.mark.skipif(not LINUX, reason="pinning needs Linux")
def test_a_worker_given_cpus_it_cannot_use_fails_at_once_with_one_line(cli: Any) -> None:
    absent = str((os.cpu_count() or 1) + 64)
    result = cli("worker", "--connect", free_tcp_address(), "--model", "echo", "--cpus", absent, timeout_s=15)
    assert result.returncode == EXIT_BAD_ADDRESS, result
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"--cpus {absent}: cannot run on CPUs {absent}" in lines[0], result.stderr
    assert "loaded" not in result.stderr  # refused before the model loads


@pytest.mark.integration
def test_an_empty_cpu_list_is_refused_not_taken_as_none(cli: Any) -> None:
    # (an empty BATCHER_CPUS is unset, as every empty BATCHER_* variable is for click)
    result = cli("worker", "--connect", free_tcp_address(), "--cpus", "", timeout_s=15)
    assert result.returncode == 2 and "is not an id" in result.stderr, result


@pytest.mark.integration
@pytest.mark.skipif(len(CORES) < 2, reason="needs Linux and 2 cores")
def test_batcher_cpus_of_serves_environment_does_not_pin_its_workers(serve: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("BATCHER_CPUS", str(CORES[0]))  # meant for a lone worker, if anything
    sp = serve("--model", "echo", "--workers", "1", workers=1)
    children = [c for c in psutil.Process(sp.process.pid).children() if "worker" in c.cmdline()]
    assert len(children) == 1 and _affinities(children[0].pid) == {tuple(CORES)}


@pytest.mark.integration
@pytest.mark.skipif(len(CORES) < 2, reason="needs Linux and 2 cores")
def test_serve_refuses_pin_cpus_with_no_core_left_for_the_broker(cli: Any) -> None:
    result = cli("serve", "--model", "echo", "--workers", str(len(CORES)), "--pin-cpus", timeout_s=15)
    assert result.returncode == 2, result
    assert "needs a core left for the broker" in result.stderr


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
