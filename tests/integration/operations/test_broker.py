"""The broker's side of operating it for real, through real processes: readiness per
model, `unavailable` for a model without workers, unknown models named, queue time that
includes the wait in a worker's prefetch, refused handshakes logged, rolling reloads."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import pytest
import zmq

from batcher.client.sync import Client
from batcher.serve.launcher import free_tcp_address
from batcher.wire import protocol
from batcher.wire.protocol import pack, unpack
from tests.fixture_models import BROKEN_ENV
from tests.helpers import FLAT_SIM, broker_stats, curve_broker_stats, recv_replies, start_broker, wait_until
from tests.reliability_models import DealerLoad

pytestmark = pytest.mark.integration

# --- readiness, and models without workers -------------------------------------------------------


def test_model_without_worker_is_answered_unavailable_then_served_once_a_worker_joins(spawn, zctx, connect):
    frontend, backend = start_broker(spawn, zctx, "--model", "double", "--no-worker-timeout-ms", "300")
    st = broker_stats(frontend, zctx)["models"]["double"]
    assert st["configured"] is True and st["ready"] is False and st["workers"] == 0
    client = connect(zmq.DEALER, frontend)
    started = time.monotonic()
    client.send_multipart([b"", pack({"id": 1, "input": 2, "model": "double"})])
    (reply,) = recv_replies(client, 1)
    waited = time.monotonic() - started
    assert reply["id"] == 1 and reply["error"]["code"] == "unavailable", reply
    # The 300 ms count from when the broker first found the model without a worker (at its
    # start, maybe well before this request), so the wait itself is no measure of it: the
    # message says how long the model has had none.
    without_s = float(re.search(r"has had no worker for ([0-9.]+)s", reply["error"]["message"])[1])
    assert without_s >= 0.3, reply
    assert waited < 5.0, waited  # and not never
    # Past the timeout, a new request is answered at once.
    client.send_multipart([b"", pack({"id": 2, "input": 2, "model": "double"})])
    assert recv_replies(client, 1, timeout_s=2)[0]["error"]["code"] == "unavailable"
    # A worker joins: requests are queued for it again, and it serves them.
    worker = connect(zmq.DEALER, backend)
    worker.send_multipart([protocol.WORKER_PROTOCOL, protocol.CMD_READY, pack({"model": "double", "pid": 7})])
    wait_until(lambda: broker_stats(frontend, zctx)["models"]["double"]["ready"], 10, "ready once it joins")
    client.send_multipart([b"", pack({"id": 3, "input": 2, "model": "double"})])
    deadline = time.monotonic() + 10
    while True:
        assert worker.poll(int((deadline - time.monotonic()) * 1000)), "no batch"
        frames = worker.recv_multipart()
        if frames[1] == protocol.CMD_BATCH:
            break
    batch_id = unpack(frames[2])[0]
    body = protocol.ok_reply(3, 4)
    worker.send_multipart(
        [protocol.WORKER_PROTOCOL, protocol.CMD_REPLY, pack([batch_id, 1.0, [len(body)], 0]), body]
    )
    assert recv_replies(client, 1)[0] == {"id": 3, "ok": True, "output": 4}


def test_no_worker_timeout_0_waits_for_a_worker(spawn, zctx, connect):
    frontend, _ = start_broker(spawn, zctx, "--model", "double", "--no-worker-timeout-ms", "0")
    client = connect(zmq.DEALER, frontend)
    client.send_multipart([b"", pack({"id": 1, "input": 2, "model": "double"})])
    wait_until(lambda: broker_stats(frontend, zctx)["models"]["double"]["queued"] == 1, 10, "queued")
    assert not client.poll(1000), "answered although 0 means wait forever"
    assert broker_stats(frontend, zctx)["models"]["double"]["queued"] == 1


def test_unknown_model_lists_the_models_served(spawn, zctx):
    frontend, _ = start_broker(spawn, zctx, "--model", "sim", "--model", "echo")
    with Client(frontend, timeout_s=10, context=zctx) as c:
        reply = c.submit(1, model="nope").wait()
    assert reply["error"] == {
        "code": "unknown_model",
        "message": "no worker serves model 'nope' (models: echo, sim)",
    }


def test_stats_show_each_workers_gpu_and_readiness(serve, zctx):
    s = serve("--model", "sim", "--workers", "2", "--gpus", "3,5", *FLAT_SIM, workers=2)
    st = broker_stats(s.frontend, zctx)["models"]["sim"]
    assert st["ready"] is True and st["configured"] is True and st["no_worker_s"] is None
    assert sorted(w["gpu"] for w in st["worker_list"]) == [3, 5]


# --- queue time includes the wait in the worker's prefetch ---------------------------------------


def test_queue_time_includes_the_wait_in_the_workers_prefetch(serve, zctx):
    args = ["--model", "sim", "--workers", "1", "--max-batch-size", "1", "--worker-prefetch", "2"]
    s = serve(*args, "--sim-base-ms", "40", "--sim-per-item-ms", "0", workers=1)
    with Client(s.frontend, timeout_s=20, context=zctx) as c:
        got = [p.wait() for p in [c.submit(i) for i in range(8)]]
    assert all(r["ok"] for r in got), got
    for r in got:  # the reply's queue time counts the worker's wait (as it saw it) too
        assert r["queue_ms"] >= r["worker_wait_ms"] >= 0
    st = broker_stats(s.frontend, zctx)["models"]["sim"]
    assert st["worker_wait_ms_p99"] >= 30, st  # a prefetched batch waited about one 40 ms batch
    assert st["queue_ms_p99"] >= st["worker_wait_ms_p99"], st


# --- CURVE: refused handshakes are counted and logged ---------------------------------------------


def test_plaintext_peer_on_a_curve_socket_is_counted_and_logged(spawn, zctx, connect, cli, tmp_path):
    assert cli("keygen", str(tmp_path / "keys"), "--name", "broker").returncode == 0
    secret = str(tmp_path / "keys" / "broker.key_secret")
    frontend, backend = free_tcp_address(), free_tcp_address()
    proc = spawn(
        "broker", "--frontend", frontend, "--backend", backend, "--curve-secret-key", secret,
        "--log-level", "debug",
    )  # fmt: skip
    plain = connect(zmq.DEALER, backend)
    plain.send_multipart([protocol.WORKER_PROTOCOL, protocol.CMD_READY, pack({"model": "x"})])

    def refused() -> bool:
        stats = curve_broker_stats(frontend, zctx, curve_server_key=secret, timeout_s=1)
        return bool(stats.get("handshakes_refused", {}).get("backend"))

    wait_until(refused, 20, "the plaintext handshake counted")
    # Which line depends on a race (docs/deployment.md): the broker read the plaintext
    # greeting (a WARNING), or the peer hung up before sending it (DEBUG); one of them, always.
    lines = ("refused a handshake on the backend (protocol error", "a handshake on the backend ended early")
    wait_until(lambda: any(line in proc.stderr_path.read_text() for line in lines), 10, "logged")
    models = curve_broker_stats(frontend, zctx, curve_server_key=secret, timeout_s=5)["models"]
    assert "x" not in models and models["sim"]["workers"] == 0  # the plaintext peer never joined


# --- rolling reload ----------------------------------------------------------------------------


def test_reload_replaces_every_worker_under_load_and_loses_nothing(serve, zctx, cli):
    s = serve("--model", "sim", "--workers", "2", *FLAT_SIM, "--max-batch-size", "4", workers=2)
    before = {w["worker"] for w in broker_stats(s.frontend, zctx)["models"]["sim"]["worker_list"]}
    load = DealerLoad(zctx, s.frontend, clients=3, depth=4)
    done: list[Any] = []
    thread = threading.Thread(target=lambda: done.append(cli("reload", "sim", "--connect", s.frontend)))
    thread.start()
    load.run_until(lambda: not thread.is_alive(), 60, "the reload finished")
    thread.join()
    load.run_for(0.3)  # a little more load, on the new workers only
    assert load.drain(20), f"never answered: {sorted(load.outstanding())[:5]}"
    (result,) = done
    assert result.returncode == 0, result.stdout + result.stderr
    assert '"replaced": 2' in result.stdout
    after = {w["worker"] for w in broker_stats(s.frontend, zctx)["models"]["sim"]["worker_list"]}
    assert len(after) == 2 and not after & before, (before, after)
    summary = load.summary()
    assert summary["sent"] > 100, summary
    assert summary["ok"] == summary["sent"], summary  # none refused, lost or wrong
    assert summary["duplicated"] == summary["foreign"] == summary["lost"] == 0, summary


def test_a_reload_to_a_version_that_does_not_load_fails_alone_and_the_old_workers_serve_on(
    serve, zctx, cli, tmp_path, monkeypatch
):
    """Issue 28 item 5: the new workers' model raises in its constructor (exit 78, which
    at serve's start is a configuration error). `reload` exits 1 with the model's error,
    serve lives on, the old workers keep serving, nothing is refused or lost."""
    flag = tmp_path / "broken"
    monkeypatch.setenv(BROKEN_ENV, str(flag))
    s = serve(
        "--model", "flaky=tests.fixture_models:LoadsUnlessBroken", "--workers", "2", "--max-batch-size", "4",
        workers=2,
    )  # fmt: skip
    before = {w["worker"] for w in broker_stats(s.frontend, zctx)["models"]["flaky"]["worker_list"]}
    flag.touch()  # the next version is broken
    load = DealerLoad(zctx, s.frontend, clients=2, depth=4)
    done: list[Any] = []
    reload = ("reload", "flaky", "--connect", s.frontend, "--timeout-s", "60")
    thread = threading.Thread(target=lambda: done.append(cli(*reload, timeout_s=90)))
    thread.start()
    load.run_until(lambda: not thread.is_alive(), 90, "the reload answered")
    thread.join()
    load.run_for(0.5)  # serve and its old workers still serve after it
    assert load.drain(20), f"never answered: {sorted(load.outstanding())[:5]}"
    (result,) = done
    assert result.returncode == 1, result.stdout + result.stderr
    assert "could not load the model (exit code 78)" in result.stderr, result.stderr
    assert "FileNotFoundError: weights missing" in result.stderr  # the model's own error
    assert "the old workers serve on" in result.stderr
    assert s.process is not None and s.process.poll() is None, "serve stopped"
    after = {w["worker"] for w in broker_stats(s.frontend, zctx)["models"]["flaky"]["worker_list"]}
    assert after == before
    summary = load.summary()
    assert summary["sent"] > 20 and summary["ok"] == summary["sent"], summary
    assert summary["duplicated"] == summary["foreign"] == summary["lost"] == 0, summary
    flag.unlink()  # fixed: the next reload goes through
    again = cli(*reload, timeout_s=90)
    assert again.returncode == 0 and '"replaced": 2' in again.stdout, again.stdout + again.stderr


def test_reload_under_a_plain_broker_says_it_needs_serve(spawn, zctx, cli):
    frontend, _ = start_broker(spawn, zctx, "--model", "sim")
    result = cli("reload", "sim", "--connect", frontend, "--timeout-s", "10")
    assert result.returncode == 1
    assert "reload needs `batcher serve`" in result.stdout + result.stderr
