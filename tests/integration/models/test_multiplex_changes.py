"""Multiplexed models that join at run time (docs/models.md, "Many models per worker"):
a new version or model outside the pool's catalog joins through a replacement of the
pool's workers, with nothing in flight lost; one that cannot join is reported."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from batcher.client import AsyncClient, Client
from batcher.wire.errors import ModelError
from tests.helpers import wait_until
from tests.integration.models.test_multiplex import MODEL, by_model, pool, repository

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]


def pool_pids(frontend: str, model: str) -> set[int]:
    """The pids of the live pool workers that serve `model`."""
    workers = by_model(frontend)[model]["worker_list"]
    return {int(w["worker"].split("/pid")[1].split("/")[0]) for w in workers}


def add_version(root: Path, name: str, version: int, k: int) -> None:
    """Version `version` of `name`, answering x * 10 + k, written whole before it is seen."""
    tmp = root / name / f".v{version}"
    tmp.mkdir()
    (tmp / "model.py").write_text(MODEL.format(k=k))
    tmp.rename(root / name / str(version))


def test_a_new_version_joins_the_pool_under_load_with_nothing_lost(serve, tmp_path: Path) -> None:
    root = repository(tmp_path)
    s = serve(
        "--model-repository", str(root), "--multiplex-workers", "2", "--multiplex-memory-mb", "200",
        "--max-wait-ms", "2", "--repository-poll-s", "0.3", workers=12,
    )  # fmt: skip
    before = pool_pids(s.frontend, "m1")
    assert len(before) == 2
    answers: list[int] = []
    with Client(s.frontend, timeout_s=30) as c:
        assert c.request(1, model="m1") == 11
        add_version(root, "m1", 2, k=9)
        x = 0

        def switched() -> bool:
            nonlocal x
            xs = list(range(x, x + 8))
            x += 8
            futures = [c.submit(v, model="m1") for v in xs] + [c.submit(v, model="m0") for v in xs]
            got = [f.result() for f in futures]  # an error would raise here: none may be lost
            assert got[8:] == [v * 10 for v in xs]
            answers.extend(got[:8])
            assert all(a in (v * 10 + 1, v * 10 + 9) for a, v in zip(got[:8], xs, strict=True))
            return got[:8] == [v * 10 + 9 for v in xs] and not (pool_pids(s.frontend, "m1") & before)

        wait_until(switched, 90, "version 2 served by a new pool, the old pool gone")
        assert c.request(5, model="m1") == 59 and c.request(5, model="m4") == 54
        assert c.control("stats")["versions"]["m1"]["served"] == [2]  # latest 1: 1 retired
        index = c.control("repository_index")["models"]
    states = {(e["name"], e["version"]): e["state"] for e in index}
    assert states[("m1", "2")] == "READY" and states[("m1", "1")] == "UNAVAILABLE"
    assert len(pool_pids(s.frontend, "m2")) == 2  # as many pool workers as before
    assert answers[0] == 0 * 10 + 1  # version 1 served until the new pool had joined


def test_a_multiplexed_model_starts_the_pool_when_serve_had_none(serve, cli, tmp_path: Path) -> None:
    (tmp_path / "a" / "1").mkdir(parents=True)
    (tmp_path / "a" / "1" / "model.py").write_text(MODEL.format(k=3))
    (tmp_path / "a" / "config.toml").write_text('kind = "python"\n')
    s = serve(
        "--model-repository", str(tmp_path), "--workers", "1", "--multiplex-workers", "1",
        "--multiplex-memory-mb", "200", "--max-wait-ms", "2", workers=1,
    )  # fmt: skip
    for k, name in ((4, "p"), (5, "q")):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "1" / "model.py").write_text(MODEL.format(k=k))
        (tmp_path / name / "config.toml").write_text('kind = "python"\nmultiplexed = true\nmemory_mb = 100\n')
    result = cli("load", "p", "--connect", s.frontend, "--timeout-s", "60")
    assert result.returncode == 0, result.stderr
    with Client(s.frontend, timeout_s=20) as c:
        assert c.request(1, model="p") == 14 and c.request(1, model="a") == 13
        result = cli("load", "q", "--connect", s.frontend, "--timeout-s", "60")
        assert result.returncode == 0, result.stderr
        assert [c.request(2, model=m) for m in ("p", "q", "a")] == [24, 25, 23]
    stats = by_model(s.frontend)
    assert stats["p"]["multiplexed"] and stats["q"]["multiplexed"]
    assert stats["p"]["workers"] == stats["q"]["workers"] == 1


def test_a_version_too_big_for_the_budget_is_reported_and_the_rest_serve_on(
    serve, cli, tmp_path: Path
) -> None:
    root = repository(tmp_path)
    s = pool(serve, root)
    (root / "big" / "1").mkdir(parents=True)
    (root / "big" / "1" / "model.py").write_text(MODEL.format(k=7))
    (root / "big" / "config.toml").write_text('kind = "python"\nmultiplexed = true\nmemory_mb = 300\n')
    pids = pool_pids(s.frontend, "m0")
    result = cli("load", "big", "--connect", s.frontend, "--timeout-s", "30")
    assert result.returncode != 0
    assert "model 'big': versions [1] cannot be multiplexed" in result.stdout + result.stderr
    assert "needs 300 MB" in result.stdout + result.stderr
    with Client(s.frontend, timeout_s=20) as c:
        assert c.request(1, model="m0") == 10
        index: list[dict[str, Any]] = c.control("repository_index")["models"]
    big = next(e for e in index if e["name"] == "big")
    assert big["state"] == "UNAVAILABLE" and "needs 300 MB" in big["reason"], json.dumps(big)
    assert pool_pids(s.frontend, "m0") == pids  # the pool was not replaced


def test_multiplex_options_without_a_repository_are_a_usage_error(cli) -> None:
    result = cli("serve", "--multiplex-memory-mb", "100", "--frontend", "tcp://127.0.0.1:1")
    assert result.returncode != 0
    assert "--multiplex-workers and --multiplex-memory-mb go with --model-repository" in result.stderr


def test_a_version_whose_pool_does_not_start_is_reported_and_the_old_pool_serves_on(
    serve, tmp_path: Path
) -> None:
    root = repository(tmp_path)
    s = pool(serve, root)
    assert s.process is not None
    pids = pool_pids(s.frontend, "m2")
    (root / "m1" / "2").mkdir()  # slow to read: the new workers are killed before they join
    (root / "m1" / "2" / "model.py").write_text("import time\ntime.sleep(10)\n" + MODEL.format(k=9))
    load = subprocess.Popen(
        [sys.executable, "-m", "batcher", "load", "m1", "--connect", s.frontend, "--timeout-s", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:

        def new_workers() -> list[psutil.Process]:
            kids = psutil.Process(s.process.pid).children()
            return [k for k in kids if "--multiplex" in k.cmdline() and k.pid not in pids]

        for worker in wait_until(lambda: len(new_workers()) == 2 and new_workers(), 30, "the new pool"):
            worker.kill()
        out, err = load.communicate(timeout=60)
    finally:
        if load.poll() is None:
            os.killpg(load.pid, signal.SIGKILL)
            load.wait()
    assert load.returncode != 0
    said = out + err
    assert "model 'm1': versions [2] could not join the multiplexed workers" in said, said
    assert "before it joined" in said and "the versions served before serve on" in said
    with Client(s.frontend, timeout_s=20) as c:
        assert [c.request(4, model=m) for m in ("m1", "m5")] == [41, 45]  # version 1, the old pool
        index: list[dict[str, Any]] = c.control("repository_index")["models"]
        assert "m1/2" not in c.control("stats")["models"]  # no queue left for the version that failed
    states = {(e["name"], e["version"]): (e["state"], e["reason"]) for e in index}
    assert states[("m1", "1")] == ("READY", "")
    assert states[("m1", "2")][0] == "UNAVAILABLE" and "before it joined" in states[("m1", "2")][1]
    assert pool_pids(s.frontend, "m2") == pids


def test_a_model_whose_load_ends_its_process_fails_alone_at_start_and_at_a_join(
    serve, cli, tmp_path: Path
) -> None:
    root = repository(tmp_path)
    (root / "m3" / "1" / "model.py").write_text("import os\nos._exit(3)  # ends whoever loads it\n")
    s = pool(serve, root)  # the pool starts: m3 was read in a child process, which it ended
    (root / "m1" / "2").mkdir()
    (root / "m1" / "2" / "model.py").write_text("import os\nos._exit(4)\n")
    result = cli("load", "m1", "--connect", s.frontend, "--timeout-s", "60")
    assert result.returncode == 0, result.stderr  # it joins, and fails its own batches
    with Client(s.frontend, timeout_s=20) as c:
        for model, code in (("m3", 3), ("m1", 4)):
            with pytest.raises(ModelError, match=rf"ended the process that loaded it \(exit code {code}\)"):
                c.request(1, model=model)
        assert [c.request(2, model=m) for m in ("m0", "m2", "m4", "m5")] == [20, 22, 24, 25]
    assert by_model(s.frontend)["m3"]["workers"] == 2  # no pool worker was lost to it


def test_two_loads_at_once_replace_the_pool_one_after_the_other(serve, tmp_path: Path) -> None:
    root = repository(tmp_path)
    s = pool(serve, root)
    pids = pool_pids(s.frontend, "m2")
    add_version(root, "m1", 2, k=9)
    (root / "p" / "1").mkdir(parents=True)
    (root / "p" / "1" / "model.py").write_text(MODEL.format(k=8))
    (root / "p" / "config.toml").write_text('kind = "python"\nmultiplexed = true\nmemory_mb = 100\n')

    async def load_both() -> list[Any]:
        async with AsyncClient(s.frontend, timeout_s=60) as c:  # sent in this order, one socket
            loaded = await asyncio.gather(c.control("load", model="m1"), c.control("load", model="p"))
            assert [await c.request(6, model=m) for m in ("m1", "p", "m2")] == [69, 68, 62]
            return list(loaded)

    # p is not in the first replacement's catalog: it waits for it, then starts its own.
    assert asyncio.run(load_both()) == [{"model": "m1", "versions": [2]}, {"model": "p", "versions": [1]}]
    after = pool_pids(s.frontend, "m2")
    assert len(after) == 2 and not after & pids


def test_a_removed_model_leaves_the_catalog_at_the_next_replacement(serve, cli, tmp_path: Path) -> None:
    root = repository(tmp_path)
    s = pool(serve, root)
    shutil.rmtree(root / "m5")
    result = cli("unload", "m5", "--connect", s.frontend)
    assert result.returncode == 0, result.stderr  # no longer served, still in the catalog
    add_version(root, "m1", 2, k=9)
    result = cli("load", "m1", "--connect", s.frontend, "--timeout-s", "60")
    assert result.returncode == 0, result.stderr
    with Client(s.frontend, timeout_s=20) as c:
        models = c.control("stats")["models"]
        assert c.request(7, model="m1") == 79
    assert models["m5/1"]["workers"] == 0 and not models["m5/1"]["configured"]
    assert models["m1/2"]["workers"] == 2 and models["m1/2"]["configured"]
    ready = cli("ready", "--connect", s.frontend, "--timeout-s", "10")
    assert ready.returncode == 0, ready.stdout + ready.stderr  # waits for no model left behind


def test_a_model_that_becomes_multiplexed_joins_the_pool_with_nothing_refused_and_its_workers_stop(
    serve, cli, tmp_path: Path
) -> None:
    """Model p had a worker of its own; its config now says multiplexed and a version 2
    comes: version 1 serves until version 2 has joined the pool, then its worker drains
    and stops (no request refused, no worker left running unserved)."""
    root = repository(tmp_path)
    (root / "p" / "1").mkdir(parents=True)
    (root / "p" / "1" / "model.py").write_text(MODEL.format(k=8))
    (root / "p" / "config.toml").write_text('kind = "python"\n')
    s = serve(
        "--model-repository", str(root), "--multiplex-workers", "2", "--multiplex-memory-mb", "200",
        "--max-wait-ms", "2", "--workers", "1", workers=12,
    )  # fmt: skip

    def own_pids() -> set[int]:
        with Client(s.frontend, timeout_s=10) as c:
            workers = c.control("stats")["models"]["p/1"]["worker_list"]
        return {int(w["worker"].split("/pid")[1].split("/")[0]) for w in workers}

    wait_until(lambda: len(own_pids()) == 1, 20, "p's own worker joined")
    own = own_pids()
    (root / "p" / "config.toml").write_text('kind = "python"\nmultiplexed = true\nmemory_mb = 100\n')
    add_version(root, "p", 2, k=9)

    async def load_under_requests() -> tuple[Any, list[int]]:
        async with AsyncClient(s.frontend, timeout_s=60) as c:
            loading = asyncio.ensure_future(c.control("load", model="p"))
            answers: list[int] = []
            while not loading.done():  # an error (unknown_model) would raise here
                answers += await asyncio.gather(*(c.request(x, model="p") for x in range(4)))
            return await loading, answers

    loaded, answers = asyncio.run(load_under_requests())
    assert loaded == {"model": "p", "versions": [2]}
    assert answers and set(answers) <= {x * 10 + k for x in range(4) for k in (8, 9)}
    with Client(s.frontend, timeout_s=20) as c:
        assert c.request(1, model="p") == 19
    wait_until(lambda: not any(psutil.pid_exists(pid) for pid in own), 20, "p/1's own worker stopped")


def test_a_model_no_longer_multiplexed_gets_workers_of_its_own_and_the_pool_serves_on(
    serve, tmp_path: Path
) -> None:
    """m1's config stops saying multiplexed and a version 2 comes: version 2 starts on
    a worker of its own, version 1 serves (from the pool) until it has joined; the
    pool's workers are neither replaced nor drained (the other models serve on)."""
    root = repository(tmp_path)
    s = serve(
        "--model-repository", str(root), "--multiplex-workers", "2", "--multiplex-memory-mb", "200",
        "--max-wait-ms", "2", "--workers", "1", workers=12,
    )  # fmt: skip
    pids = pool_pids(s.frontend, "m0")
    (root / "m1" / "config.toml").write_text('kind = "python"\n')
    add_version(root, "m1", 2, k=9)

    async def load_under_requests() -> tuple[Any, list[int]]:
        async with AsyncClient(s.frontend, timeout_s=60) as c:
            loading = asyncio.ensure_future(c.control("load", model="m1"))
            answers: list[int] = []
            while not loading.done():  # an error would raise here
                answers += await asyncio.gather(
                    *(c.request(x, model=m) for x in range(3) for m in ("m1", "m0"))
                )
            return await loading, answers

    loaded, answers = asyncio.run(load_under_requests())
    assert loaded == {"model": "m1", "versions": [2]}
    assert answers and set(answers) <= {x * 10 + k for x in range(3) for k in (0, 1, 9)}
    with Client(s.frontend, timeout_s=20) as c:
        assert [c.request(2, model=m) for m in ("m1", "m0", "m5")] == [29, 20, 25]
        models = c.control("stats")["models"]
    assert not models["m1/2"]["multiplexed"] and models["m1/2"]["workers"] == 1
    assert pool_pids(s.frontend, "m0") == pids  # the same pool, never drained
