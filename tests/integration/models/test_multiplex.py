"""Many models per worker, end to end (issue 33 item 5, docs/models.md): a repository's
models marked `multiplexed = true` served by a pool of two workers that each hold two
of them at most, loading on first use and unloading the least recently used."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from batcher.broker.loop import Broker, BrokerSettings
from batcher.client import Client
from batcher.core.limits import BatchSettings
from batcher.core.multiplex import POOL_NAME
from batcher.serve.launcher import free_tcp_address
from batcher.wire import protocol
from batcher.wire.errors import ModelError, ReplyError, UnknownModel
from tests.helpers import broker_stats, start_broker, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

#: Model k answers each input x with x * 10 + k: a reply says which model ran it.
MODEL = """
def model(inputs):
    return [x * 10 + {k} for x in inputs]
"""
MODELS = [f"m{k}" for k in range(6)]


def repository(
    root: Path, broken: str | None = None, failure: str = "raise RuntimeError('no weights here')"
) -> Path:
    """Six multiplexed Python models of 100 MB each (`broken`: one whose import fails,
    by `failure`)."""
    for k, name in enumerate(MODELS):
        (root / name / "1").mkdir(parents=True)
        code = failure + "\n" if name == broken else MODEL.format(k=k)
        (root / name / "1" / "model.py").write_text(code)
        (root / name / "config.toml").write_text('kind = "python"\nmultiplexed = true\nmemory_mb = 100\n')
    return root


def pool(serve: Any, root: Path) -> Any:
    """serve over the repository with 2 multiplexed workers of 200 MB (two models each);
    each worker counts once per model in stats, so 12 worker entries mean both joined."""
    return serve(
        "--model-repository", str(root), "--multiplex-workers", "2", "--multiplex-memory-mb", "200",
        "--max-wait-ms", "2", workers=12,
    )  # fmt: skip


def by_model(frontend: str) -> dict[str, dict[str, Any]]:
    with Client(frontend, timeout_s=10) as c:
        models: dict[str, dict[str, Any]] = c.control("stats")["models"]
    return {name.partition("/")[0]: m for name, m in models.items()}


def test_six_models_over_two_workers_of_two_each_answer_correctly(serve, cli, tmp_path: Path) -> None:
    s = pool(serve, repository(tmp_path))
    rng = random.Random(7)
    with Client(s.frontend, timeout_s=20) as c:
        for round_ in range(150):
            other = rng.randrange(1, 6)  # m0 is used all the time; the others in turn
            xs = [round_ * 4 + i for i in range(4)]
            hot = [c.submit(x, model="m0") for x in xs]
            cold = [c.submit(x, model=f"m{other}") for x in xs]
            assert [f.result() for f in hot] == [x * 10 for x in xs]
            assert [f.result() for f in cold] == [x * 10 + other for x in xs]
    stats = by_model(s.frontend)
    table = cli("stats", "--connect", s.frontend)
    assert "m0/1: multiplexed: held by 1 of 2 workers; cold loads 1 (" in table.stdout, table.stdout
    assert all(stats[m]["multiplexed"] and stats[m]["workers"] == 2 for m in MODELS)
    assert stats["m0"]["outcomes"] == {"ok": 600}
    assert stats["m0"]["cold_loads"] == 1 and stats["m0"]["unloads"] == 0  # never unloaded
    assert stats["m0"]["held_by"] == 1
    loads = sum(stats[m]["cold_loads"] for m in MODELS)
    unloads = sum(stats[m]["unloads"] for m in MODELS)
    held = sum(stats[m]["held_by"] for m in MODELS)
    assert all(stats[m]["cold_loads"] >= 1 for m in MODELS)
    assert unloads >= 20  # five models take turns on the other worker's two places
    assert loads - unloads == held <= 4  # what is held is what was loaded and not unloaded
    assert all(stats[m]["cold_load_ms_total"] > 0 for m in MODELS)
    assert all(stats[m]["cold_load_ms_max"] <= stats[m]["cold_load_ms_total"] for m in MODELS)


@pytest.mark.parametrize("failure", ["raise RuntimeError('no weights here')", "import sys; sys.exit(1)"])
def test_a_model_that_will_not_load_fails_its_requests_only(serve, tmp_path: Path, failure: str) -> None:
    """A model whose import raises, or calls sys.exit() (read at each pool worker's start
    for its signature, then at its batches): its requests fail, the other models serve."""
    s = pool(serve, repository(tmp_path, broken="m3", failure=failure))
    why = "RuntimeError: no weights here" if "Runtime" in failure else "SystemExit: 1"
    with Client(s.frontend, timeout_s=20) as c:
        for _ in range(2):  # tried again at each batch: a fixed file would serve
            with pytest.raises(ModelError, match=f"model 'm3/1' could not be loaded: {why}"):
                c.request(1, model="m3")
            assert c.request_many([1, 2], model="m2") == [12, 22]
            assert c.request(5, model="m4") == 54
    stats = by_model(s.frontend)
    assert stats["m3"]["outcomes"] == {"model_error": 2} and stats["m3"]["held_by"] == 0
    assert stats["m2"]["outcomes"] == {"ok": 4}


def test_a_multiplexed_model_unloads_and_loads_again_and_a_new_version_joins(
    serve, cli, tmp_path: Path
) -> None:
    root = repository(tmp_path)
    s = pool(serve, root)
    with Client(s.frontend, timeout_s=20) as c:
        assert c.request(1, model="m1") == 11
        result = cli("unload", "m1", "--connect", s.frontend)
        assert result.returncode == 0, result.stderr
        assert '"versions": []' in result.stdout
        with pytest.raises(ReplyError, match="m1"):
            c.request(1, model="m1")
        assert c.request(1, model="m2") == 12  # the others serve on
        result = cli("load", "m1", "--connect", s.frontend)
        assert result.returncode == 0, result.stderr
        assert c.request(2, model="m1") == 21
        (root / "m1" / "2").mkdir()
        (root / "m1" / "2" / "model.py").write_text(MODEL.format(k=9))
        result = cli("load", "m1", "--connect", s.frontend, "--timeout-s", "60")
        assert result.returncode == 0, result.stderr  # the pool replaced by one that holds it
        assert json.loads(result.stdout) == {"model": "m1", "versions": [2]}
        assert c.request(3, model="m1") == 39  # latest 1: version 2 alone
        assert c.request(3, model="m2") == 32


@pytest.mark.parametrize(
    ("extra", "config", "message"),
    [
        ((), "multiplexed = true\n", "are multiplexed: give --multiplex-memory-mb"),
        (("--multiplex-memory-mb", "50"), "multiplexed = true\nmemory_mb = 100\n", "needs 100 MB, more than"),
        (("--multiplex-memory-mb", "500"), "multiplexed = true\nworkers = 2\n", "has no workers of its own"),
        (("--multiplex-memory-mb", "500"), "multiplexed = 1\n", "multiplexed must be true or false, got 1"),
        (
            ("--multiplex-memory-mb", "500"),
            "multiplexed = true\nmemory_mb = 0\n",
            "memory_mb must be an int in",
        ),
    ],
)
def test_serve_says_what_is_wrong_with_a_multiplexed_setup(
    cli, tmp_path: Path, extra: tuple[str, ...], config: str, message: str
) -> None:
    (tmp_path / "a" / "1").mkdir(parents=True)
    (tmp_path / "a" / "1" / "model.py").write_text(MODEL.format(k=1))
    (tmp_path / "a" / "config.toml").write_text(config)
    result = cli("serve", "--model-repository", str(tmp_path), "--frontend", "tcp://127.0.0.1:1", *extra)
    assert result.returncode != 0
    assert message in result.stderr


def test_a_pool_worker_killed_is_respawned_and_its_requests_answered(serve, tmp_path: Path) -> None:
    s = pool(serve, repository(tmp_path))
    with Client(s.frontend, timeout_s=20) as c:
        assert c.request(1, model="m1") == 11
        worker = next(w for w in by_model(s.frontend)["m1"]["worker_list"] if w.get("holds_model"))
        pid = int(worker["worker"].split("/pid")[1].split("/")[0])
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: by_model(s.frontend)["m1"]["workers"] == 1, 10, "the killed worker is gone")
        assert c.request(2, model="m1") == 21  # the other worker loads it
        wait_until(lambda: by_model(s.frontend)["m1"]["workers"] == 2, 20, "the pool worker respawned")
        assert [c.request(x, model=m) for x, m in ((3, "m1"), (4, "m5"))] == [31, 45]


def test_multiplexed_onnx_models_answer_over_http_with_their_signatures(serve, tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    thttp = pytest.importorskip("tritonclient.http")
    import numpy as np
    from tritonclient.utils import InferenceServerException

    from tests import onnx_models
    from tests.integration.gateway.test_gateway import free_port, wait_gateway
    from tests.integration.models.test_versions import expected

    files = []
    for k in range(3):  # three of 1 MB each (their file's size, rounded up) in a budget of 2
        (tmp_path / f"lin{k}" / "1").mkdir(parents=True)
        files.append(
            onnx_models.linear(tmp_path / f"lin{k}" / "1" / "model.onnx", inputs=4, outputs=3, seed=k)
        )
        (tmp_path / f"lin{k}" / "config.toml").write_text("multiplexed = true\n")
    port = free_port()
    s = serve(
        "--model-repository", str(tmp_path), "--multiplex-workers", "1", "--multiplex-memory-mb", "2",
        "--http-port", str(port), workers=3,
    )  # fmt: skip
    wait_gateway(port)
    tc = thttp.InferenceServerClient(f"127.0.0.1:{port}")
    meta = tc.get_model_metadata("lin1")
    assert [(i["name"], i["datatype"], i["shape"]) for i in meta["inputs"]] == [("x", "FP32", [-1, 4])]
    row = np.arange(4, dtype=np.float32)
    for k in (0, 1, 2, 0, 2):  # a third model unloads the least recent of the first two
        x = thttp.InferInput("x", [1, 4], "FP32")
        x.set_data_from_numpy(row[None])
        result = tc.infer(f"lin{k}", [x])
        assert np.allclose(result.as_numpy("y")[0], expected(files[k]))
    bad = thttp.InferInput("x", [1, 5], "FP32")  # refused before any worker, by its signature
    bad.set_data_from_numpy(np.zeros((1, 5), dtype=np.float32))
    with pytest.raises(InferenceServerException, match="shape"):
        tc.infer("lin1", [bad])
    stats = by_model(s.frontend)
    assert [(stats[f"lin{k}"]["cold_loads"], stats[f"lin{k}"]["unloads"]) for k in range(3)] == [
        (2, 1),
        (1, 1),
        (1, 0),
    ]
    assert [stats[f"lin{k}"]["held_by"] for k in range(3)] == [1, 0, 1]


def announce_and_leave(zctx: zmq.Context[Any], backend: str, frontend: str, names: list[str]) -> None:
    """A fake multiplexed worker (a raw DEALER speaking docs/protocol.md 6) joins with a
    catalog of `names`, is seen in `stats` to serve them, and leaves (DISCONNECT)."""
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    try:
        sock.connect(backend)
        info = {
            "model": POOL_NAME,
            "pid": 0,
            "multiplexed": {"budget_mb": 10, "models": dict.fromkeys(names, 1)},
        }
        sock.send_multipart([protocol.WORKER_PROTOCOL, protocol.CMD_READY, protocol.pack(info)])
        wait_until(
            lambda: broker_stats(frontend, zctx).get("models", {}).get(names[-1], {}).get("workers") == 1,
            10,
            "the catalog was taken",
        )
        sock.send_multipart([protocol.WORKER_PROTOCOL, protocol.CMD_DISCONNECT])
    finally:
        sock.close()


def models_listed(frontend: str, zctx: zmq.Context[Any]) -> set[str]:
    return set(broker_stats(frontend, zctx, timeout_s=5).get("models", {}))


def test_models_only_a_worker_announced_are_forgotten_once_it_left(spawn, zctx: zmq.Context[Any]) -> None:
    """A worker announcing ever new names (a catalog of them at each READY) must not grow the
    broker without bound: once no worker serves them, nothing of them is queued and the
    --no-worker-timeout-ms has passed, they are forgotten; a configured model stays."""
    frontend, backend = start_broker(spawn, zctx, "--model", "conf", "--no-worker-timeout-ms", "300")
    for i in range(20):
        announce_and_leave(zctx, backend, frontend, [f"m{i}-{k}" for k in range(50)])
    wait_until(lambda: models_listed(frontend, zctx) == {"conf"}, 10, "the announced models forgotten")
    with Client(frontend, timeout_s=5, context=zctx) as c:
        with pytest.raises(UnknownModel):
            c.request(1, model="m0-0")
        assert c.control("stats")["models"]["conf"]["configured"] is True


def test_without_a_no_worker_timeout_at_most_1024_models_no_worker_serves_are_kept(
    spawn, zctx: zmq.Context[Any]
) -> None:
    frontend, backend = start_broker(spawn, zctx, "--model", "conf", "--no-worker-timeout-ms", "0")
    for i in range(30):  # 1500 names
        announce_and_leave(zctx, backend, frontend, [f"m{i}-{k}" for k in range(50)])
    wait_until(lambda: len(models_listed(frontend, zctx)) == 1 + 1024, 10, "the oldest forgotten")
    listed = models_listed(frontend, zctx)
    assert "conf" in listed and "m29-49" in listed and "m0-0" not in listed


def next_batch_model(sock: zmq.Socket[Any], timeout_ms: int) -> str | None:
    """The model the next BATCH to a fake multiplexed worker names (heartbeats and EXIT
    skipped), or None when none comes within `timeout_ms`."""
    while sock.poll(timeout_ms):
        frames = sock.recv_multipart()
        if frames[1] == protocol.CMD_BATCH:
            return str(protocol.unpack(frames[2])[4])
    return None


def test_a_batch_whose_load_hung_is_answered_at_once_and_sent_to_no_other_worker(
    zctx: zmq.Context[Any],
) -> None:
    """The broker in this process over real sockets, its clock passed in: a batch that
    loads its model is taken for hung only after LOAD_LIMIT_S (60 s) more, too long to
    wait in a test. Its client is answered worker_failed at the first kill, saying the load
    hung; the batch of another model behind it goes to the next worker, and it alone."""
    settings = BrokerSettings(
        frontend=free_tcp_address(), backend=free_tcp_address(), models=("a", "b"),
        batch=BatchSettings(max_batch_size=1), worker_prefetch=2,
    )  # fmt: skip
    broker = Broker(settings, context=zctx)
    client, hangs, next_worker = (zctx.socket(zmq.DEALER) for _ in range(3))
    catalog = {"model": POOL_NAME, "pid": 0, "multiplexed": {"budget_mb": 2, "models": {"a": 1, "b": 1}}}
    try:
        for sock, address in (
            (client, settings.frontend),
            (hangs, settings.backend),
            (next_worker, settings.backend),
        ):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)

        def joined(sock: zmq.Socket[Any], n: int) -> None:
            sock.send_multipart([protocol.WORKER_PROTOCOL, protocol.CMD_READY, protocol.pack(catalog)])
            wait_until(
                lambda: broker.workers.drain(time.monotonic()) and len(broker.pool.ids()) == n, 10, "joined"
            )

        joined(hangs, 1)
        for rid, model in ((1, "a"), (2, "b")):
            client.send_multipart([b"", protocol.pack({"id": rid, "model": model, "input": rid})])

        def queued() -> bool:
            broker.clients.drain(time.monotonic())
            return sum(map(broker.scheduler.queued, "ab")) == 2

        wait_until(queued, 10, "the requests queued")
        broker._dispatch()
        assert [next_batch_model(hangs, 5000), next_batch_model(hangs, 5000)] == ["a", "b"]  # a loads first
        joined(next_worker, 2)
        broker.workers.check_time_limits(time.monotonic() + 3600.0, None)  # an hour later: a's load hung
        assert client.poll(5000), "the client of the hung load got no answer"
        reply = protocol.unpack(client.recv_multipart()[-1])
        assert reply["id"] == 1 and reply["error"]["code"] == "worker_failed"
        assert reply["error"]["message"].startswith("model 'a' hung while loading: its batch ran past")
        broker._dispatch()
        assert next_batch_model(next_worker, 5000) == "b"
        assert next_batch_model(next_worker, 300) is None  # a's batch is sent to no other worker
        assert broker.scheduler.queued("a") == 0
    finally:
        for sock in (client, hangs, next_worker):
            sock.close(linger=0)
        broker.close()


#: A model holding 60 MB of real pages (its weights), answering as MODEL does.
HEAVY = """
WEIGHTS = b"\\x01" * (60 * 2**20)


def model(inputs):
    return [x * 10 + {k} for x in inputs]
"""


def test_a_worker_holds_the_memory_of_its_budget_not_of_every_model_it_loaded(serve, tmp_path: Path) -> None:
    """Four Python models of 60 MB each over one worker whose budget holds one: each
    unloaded model's memory goes back (its module is not kept), so the worker's RSS stays
    near one model's, however many it has loaded, and read for their signatures."""
    psutil = pytest.importorskip("psutil")
    for k in range(4):
        (tmp_path / f"h{k}" / "1").mkdir(parents=True)
        (tmp_path / f"h{k}" / "1" / "model.py").write_text(HEAVY.format(k=k))
        config = 'kind = "python"\nmultiplexed = true\nmemory_mb = 100\n'
        (tmp_path / f"h{k}" / "config.toml").write_text(config)
    s = serve(
        "--model-repository", str(tmp_path), "--multiplex-workers", "1", "--multiplex-memory-mb", "100",
        workers=4,
    )  # fmt: skip
    with Client(s.frontend, timeout_s=30) as c:
        for round_ in range(2):
            assert [c.request(round_, model=f"h{k}") for k in range(4)] == [round_ * 10 + k for k in range(4)]
    stats = by_model(s.frontend)
    assert sum(stats[f"h{k}"]["unloads"] for k in range(4)) == 7
    pid = int(stats["h0"]["worker_list"][0]["worker"].split("/pid")[1].split("/")[0])
    rss_mb = psutil.Process(pid).memory_info().rss / 2**20
    assert rss_mb < 60 * 3, f"the worker holds {rss_mb:.0f} MB for a budget of one 60 MB model"
