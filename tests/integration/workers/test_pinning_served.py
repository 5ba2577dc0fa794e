"""CPU pinning: `serve --pin-cpus` puts each worker on cores of its own and the broker on
the rest; `worker --cpus` pins one worker (workers/placement.py).

The integration half: these tests start processes or measure time; the unit tests
are in tests/unit/workers/test_pinning.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import psutil
import pytest

from batcher.serve.launcher import free_tcp_address
from tests.unit.workers.test_pinning import CORES, LINUX, _affinities
from workers.exit_codes import EXIT_BAD_ADDRESS


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
