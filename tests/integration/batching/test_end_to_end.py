"""Integration tests: real `batcher` processes on free loopback ports, over ZeroMQ + msgpack.

Raw-socket tests use nothing of the project but the launcher that starts `serve`: a
client in any language sees exactly what they see.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest
import zmq

from batcher.client.sync import BadRequest, BatcherError, Client, DeadlineExceeded, ModelError, UnknownModel
from batcher.serve.launcher import free_tcp_address
from tests.helpers import FAST_SIM, HEARTBEAT, pack, recv_frames, recv_reply, unpack, wait_until

pytestmark = pytest.mark.integration

FLAKY = "flaky=tests.fixture_models:flaky"
SHORT = "short=tests.fixture_models:wrong_length"
CUDA = "cuda=tests.fixture_models:cuda_devices"


def gather(socks: list[zmq.Socket[Any]], timeout_s: float = 20.0) -> list[list[bytes]]:
    """One reply (its frames) from each socket, in socket order; a second reply fails."""
    poller = zmq.Poller()
    index = {}
    for i, s in enumerate(socks):
        poller.register(s, zmq.POLLIN)
        index[s] = i
    got: dict[int, list[bytes]] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < len(socks):
        left = deadline - time.monotonic()
        missing = sorted(set(range(len(socks))) - set(got))
        assert left > 0, f"sockets {missing} got no reply within {timeout_s}s"
        for s, _ in poller.poll(max(1, int(left * 1000))):
            i = index[s]
            frames = s.recv_multipart()
            assert i not in got, f"socket {i} got a second reply: {frames!r} after {got[i]!r}"
            got[i] = frames
    return [got[i] for i in range(len(socks))]


def wait_for_stats(
    address: str,
    ctx: zmq.Context[Any],
    predicate: Callable[[dict[str, Any]], bool],
    timeout_s: float = 30.0,
    processes: tuple[subprocess.Popen[bytes], ...] = (),
) -> dict[str, Any]:
    """Ask the broker's `stats` until `predicate(stats)` holds, or fail after `timeout_s`
    (or as soon as one of `processes` has exited)."""
    deadline = time.monotonic() + timeout_s
    last: dict[str, Any] | None = None
    with Client(address, timeout_s=0.5, context=ctx) as c:
        while time.monotonic() < deadline:
            for p in processes:
                assert p.poll() is None, f"{p.args} exited with code {p.returncode}"
            try:
                last = c.control("stats")
            except BatcherError:
                continue  # no answer within 0.5 s: not listening yet
            if predicate(last):
                return last
            time.sleep(0.02)  # between probes of the condition
    raise AssertionError(f"broker at {address} never met the condition within {timeout_s}s: {last}")


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# --- many clients at once -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["DEALER", "REQ"])
def test_64_concurrent_sockets_each_get_their_own_reply(serve, connect, client, kind):
    sp = serve(
        "--workers", "4", "--model", "sim", *FAST_SIM, "--max-wait-ms", "20", "--max-batch-size", "8",
        workers=4,
    )  # fmt: skip
    socks = [connect(getattr(zmq, kind), sp.frontend) for _ in range(64)]
    for i, s in enumerate(socks):
        # Sockets 2k and 2k+1 use the same id: replies are routed by socket, not by id.
        body = pack({"id": i // 2, "input": f"{kind}-{i}"})
        if kind == "DEALER":
            s.send_multipart([b"", body])
        else:
            s.send(body)

    sizes = []
    for i, frames in enumerate(gather(socks)):
        if kind == "DEALER":
            assert len(frames) == 2 and frames[0] == b"", frames
        else:
            assert len(frames) == 1, frames
        reply = unpack(frames[-1])
        assert reply["ok"], reply
        assert reply["id"] == i // 2
        assert reply["output"]["echo"] == f"{kind}-{i}"
        assert reply["batch_size"] == reply["output"]["batch_size"]
        sizes.append(reply["batch_size"])
    assert max(sizes) > 1, f"no batching at all: {sizes}"
    assert max(sizes) <= 8, f"a batch larger than --max-batch-size 8: {sizes}"
    stats = client(sp.frontend).control("stats")["models"]["sim"]
    assert stats["requests"] == 64 and stats["batches"] < 64, stats


def test_dealer_without_delimiter_gets_replies_without_delimiter(serve, connect):
    sp = serve("--workers", "1", "--model", "echo", "--max-wait-ms", "1", workers=1)
    sock = connect(zmq.DEALER, sp.frontend)
    for i in range(8):
        sock.send(pack({"id": f"r{i}", "input": [i, "x"]}))
    replies = {}
    for _ in range(8):
        frames = recv_frames(sock)
        assert len(frames) == 1, f"expected the body alone, got {frames!r}"
        reply = unpack(frames[0])
        replies[reply["id"]] = reply
    assert sorted(replies) == [f"r{i}" for i in range(8)], replies
    for i in range(8):
        assert replies[f"r{i}"]["ok"] and replies[f"r{i}"]["output"] == [i, "x"], replies[f"r{i}"]


# --- the Python client --------------------------------------------------------------------------


def test_python_client_request_request_many_and_typed_errors(serve, client):
    sp = serve(
        "--workers", "2", "--model", "sim", "--model", FLAKY, *FAST_SIM,
        "--max-wait-ms", "20", "--max-batch-size", "8",
        workers=4,
    )  # fmt: skip
    c = client(sp.frontend)
    assert c.request({"text": "hi"})["echo"] == {"text": "hi"}

    outputs = c.request_many(range(64))  # 64 in flight over one DEALER
    assert [o["echo"] for o in outputs] == list(range(64))
    sizes = [o["batch_size"] for o in outputs]
    assert 1 < max(sizes) <= 8, sizes

    with pytest.raises(UnknownModel) as unknown:
        c.request("x", model="nope")
    assert unknown.value.code == "unknown_model" and "nope" in unknown.value.message

    with pytest.raises(ModelError) as failed:
        c.request("boom", model="flaky")
    assert isinstance(failed.value, BatcherError)
    assert failed.value.code == "model_error" and "boom" in failed.value.message

    mixed = c.request_many(["a", "b"], model="nope", return_exceptions=True)
    assert all(isinstance(e, UnknownModel) for e in mixed), mixed
    assert c.request_many([1, 2], model="flaky") == [1, 2]  # the client is still usable


def test_python_client_raises_bad_request(serve, client):
    sp = serve("--workers", "1", "--model", "echo", workers=1)
    c = client(sp.frontend, timeout_s=2.0)
    started = time.monotonic()
    try:
        c.request("x", timeout_ms=-1)  # a negative deadline is a bad request
    except BadRequest as exc:
        assert exc.code == "bad_request" and "timeout_ms" in exc.message
    except BatcherError as exc:
        waited = time.monotonic() - started
        raise AssertionError(f"expected BadRequest, got {exc!r} after {waited:.1f}s") from None
    else:
        raise AssertionError("expected BadRequest, got an output")


def test_request_past_its_deadline_gets_deadline_exceeded(serve, client, zctx):
    sp = serve(
        "--workers", "1", "--model", "sim", "--sim-base-ms", "600", "--sim-per-item-ms", "0",
        "--policy", "window", "--max-batch-size", "1", "--max-wait-ms", "0", "--worker-prefetch", "1",
        workers=1,
    )  # fmt: skip
    c = client(sp.frontend)
    busy = c.submit("busy")  # holds the only worker for 600 ms; "late" has to queue
    wait_for_stats(sp.frontend, zctx, lambda st: st["models"]["sim"]["batches_in_flight"] == 1)
    late_request = c.submit("late", timeout_ms=50)
    with pytest.raises(DeadlineExceeded) as late:
        late_request.result()
    assert late.value.code == "deadline_exceeded" and late.value.reply["id"] == late_request.request_id
    assert busy.result()["echo"] == "busy"
    assert c.request("after", timeout_ms=5000)["echo"] == "after"


# --- model failures -----------------------------------------------------------------------------


def test_model_error_fails_its_whole_batch_and_the_worker_goes_on(serve, client):
    sp = serve(
        "--model", FLAKY, "--model", SHORT, "--workers", "1",
        "--policy", "window", "--max-batch-size", "4", "--max-wait-ms", "150",
        workers=2,
    )  # fmt: skip
    c = client(sp.frontend)
    first = c.submit("warm", model="flaky").wait()
    assert first["ok"] and first["output"] == "warm", first

    pendings = [c.submit(x, model="flaky") for x in ("a", "boom", "b", "c")]  # one full batch
    replies = [p.wait() for p in pendings]
    assert [r["id"] for r in replies] == [p.request_id for p in pendings]
    for reply in replies:
        assert not reply["ok"], f"a request of the failing batch was answered ok: {replies}"
        assert reply["error"]["code"] == "model_error"
        assert "ValueError: boom in a batch of 4" in reply["error"]["message"], reply

    after = c.submit("after", model="flaky").wait()
    assert after["ok"] and after["output"] == "after", after
    assert after["worker"] == first["worker"], "the flaky model's only worker changed"

    short = c.request_many(["x", "y"], model="short", return_exceptions=True)
    for err in short:
        assert isinstance(err, ModelError), short
        assert "outputs for a batch of" in err.message
    stats = c.control("stats")["models"]
    assert stats["flaky"]["workers"] == 1 and stats["short"]["workers"] == 1, stats


def test_worker_crash_mid_batch_is_answered_and_serve_goes_on(serve, client):
    sp = serve(
        "--workers", "1", "--model", "crash=tests.fixture_models:crash", "--max-wait-ms", "0",
        *HEARTBEAT,  # a dead worker is found within a second
        workers=1,
    )  # fmt: skip
    c = client(sp.frontend, timeout_s=15.0)
    first = c.submit("before").wait()
    assert first["ok"], first
    reply = c.submit("crash").wait()  # kills every worker that runs it
    assert not reply["ok"] and reply["error"]["code"] == "worker_failed", reply
    after = c.submit("after").wait()  # served by a respawned worker
    assert after["ok"] and after["output"] == "after", after
    assert after["worker"] != first["worker"], "the crashed worker answered again"


# --- bad requests -------------------------------------------------------------------------------


def test_unknown_model_is_refused_and_the_broker_keeps_serving(serve, connect):
    sp = serve("--workers", "1", "--model", "echo", "--max-wait-ms", "1", workers=1)
    sock = connect(zmq.REQ, sp.frontend)
    sock.send(pack({"id": 1, "input": "x", "model": "nope"}))
    reply = recv_reply(sock)
    assert reply["id"] == 1 and not reply["ok"], reply
    assert reply["error"]["code"] == "unknown_model" and "nope" in reply["error"]["message"]

    sock.send(pack({"id": 2, "input": "y"}))
    reply = recv_reply(sock)
    assert reply["id"] == 2 and reply["ok"] and reply["output"] == "y", reply


GARBAGE: dict[str, list[bytes]] = {
    "random bytes": [random.Random(7).randbytes(64)],
    "a msgpack list": [pack([1, 2, 3])],
    "a map with no input": [pack({"id": 5, "model": "echo"})],
    "two body frames": [pack({"id": 6, "input": 1}), pack({"id": 7, "input": 2})],
    "an empty message": [b""],
}


@pytest.mark.parametrize("kind", ["REQ", "DEALER", "DEALER without delimiter"])
def test_garbage_gets_bad_request_and_the_broker_keeps_serving(serve, connect, kind):
    sp = serve("--workers", "1", "--model", "echo", "--max-wait-ms", "1", workers=1)
    sock = connect(zmq.REQ if kind == "REQ" else zmq.DEALER, sp.frontend)
    prefix = [b""] if kind == "DEALER" else []
    for i, (name, frames) in enumerate(GARBAGE.items()):
        sock.send_multipart([*prefix, *frames])
        reply = recv_reply(sock)
        assert not reply["ok"], f"{name}: {reply}"
        assert reply["error"]["code"] == "bad_request", f"{name}: {reply}"

        sock.send_multipart([*prefix, pack({"id": 100 + i, "input": name})])
        reply = recv_reply(sock)
        assert reply["ok"] and reply["id"] == 100 + i and reply["output"] == name, f"after {name}: {reply}"


# --- several models -----------------------------------------------------------------------------


def test_two_models_on_one_broker(serve, client):
    sp = serve(
        "--model",
        "sim",
        "--model",
        "echo",
        "--gpus",
        "0,1",
        "--workers",
        "1",
        *FAST_SIM,
        "--max-wait-ms",
        "1",
        workers=2,
    )
    c = client(sp.frontend)
    echo = c.submit({"k": [1, 2]}, model="echo").wait()
    assert echo["ok"] and echo["output"] == {"k": [1, 2]}, echo
    default = c.submit("d").wait()
    assert default["ok"] and default["output"]["echo"] == "d", default
    named = c.submit("s", model="sim").wait()
    assert named["ok"] and named["output"]["echo"] == "s", named
    assert "/gpu1/" in echo["worker"] and "/gpu0/" in default["worker"], (echo, default)
    models = c.control("stats")["models"]
    assert models["sim"]["requests"] == 2 and models["echo"]["requests"] == 1, models


# --- the command line ---------------------------------------------------------------------------


def test_send_prints_one_json_line_per_input(serve, cli):
    sp = serve("--workers", "2", "--model", "sim", *FAST_SIM, "--max-wait-ms", "5", workers=2)
    result = cli("send", "--connect", sp.frontend, '{"text": "hello"}', "42", '"x"', timeout_s=20)
    assert result.returncode == 0, result
    lines = result.stdout.splitlines()
    replies = [json.loads(line) for line in lines]
    assert [r["ok"] for r in replies] == [True] * 3, result.stdout
    assert [r["output"]["echo"] for r in replies] == [{"text": "hello"}, 42, "x"]

    piped = cli("send", "--connect", sp.frontend, stdin='1\n\n"two"\n', timeout_s=20)
    assert piped.returncode == 0, piped
    assert [json.loads(line)["output"]["echo"] for line in piped.stdout.splitlines()] == [1, "two"]


def test_send_exits_1_when_a_reply_is_an_error(serve, cli):
    sp = serve("--workers", "1", "--model", "echo", "--max-wait-ms", "1", workers=1)
    result = cli("send", "--connect", sp.frontend, "--model", "nope", "1", timeout_s=20)
    assert result.returncode == 1, result
    [reply] = [json.loads(line) for line in result.stdout.splitlines()]
    assert not reply["ok"] and reply["error"]["code"] == "unknown_model", reply


def test_demo_passes(cli):
    result = cli("demo", timeout_s=40)
    assert result.returncode == 0, result
    assert "demo passed" in result.stdout, result.stdout


# --- shutdown -----------------------------------------------------------------------------------


SLOW_WINDOW = (
    "--model", "sim", "--sim-base-ms", "300", "--sim-per-item-ms", "0",
    "--policy", "window", "--max-batch-size", "4", "--max-wait-ms", "5000",
)  # fmt: skip


def queue_requests(sp, connect, zctx, n: int) -> list[zmq.Socket[Any]]:
    """n requests from n sockets (REQ and DEALER in turn), each with id and input i;
    returns once the broker holds them all, queued or in a batch of 4 (SLOW_WINDOW)."""
    assert n % 4 == 0
    socks = [connect(zmq.DEALER if i % 2 else zmq.REQ, sp.frontend) for i in range(n)]
    for i, s in enumerate(socks):
        body = pack({"id": i, "input": i})
        s.send_multipart([b"", body] if i % 2 else [body])
    wait_for_stats(
        sp.frontend,
        zctx,
        lambda st: (m := st["models"]["sim"])["queued"] + 4 * m["batches_in_flight"] + m["requests"] == n,
    )
    return socks


def test_sigterm_answers_every_queued_and_running_request_then_exits(serve, connect, zctx):
    sp = serve("--workers", "2", *SLOW_WINDOW, workers=2)
    assert sp.process is not None
    worker_pids = [p.pid for p in psutil.Process(sp.process.pid).children(recursive=True)]
    assert len(worker_pids) == 2
    late = connect(zmq.DEALER, sp.frontend)

    def stats_on_late() -> dict[str, Any]:
        late.send_multipart([b"", pack({"id": "stats", "op": "stats"})])
        return recv_reply(late)["output"]

    stats_on_late()  # `late` is connected
    socks = queue_requests(sp, connect, zctx, 24)
    os.kill(sp.process.pid, signal.SIGTERM)
    wait_until(lambda: stats_on_late()["stopping"], 20, "the broker started draining")
    late.send_multipart([b"", pack({"id": "late", "input": "late"})])

    for i, frames in enumerate(gather(socks)):
        reply = unpack(frames[-1])
        assert reply["id"] == i, reply
        if reply["ok"]:
            assert reply["output"]["echo"] == i
        else:
            assert reply["error"]["code"] == "shutting_down", reply
    refused = recv_reply(late)
    assert refused["id"] == "late" and refused["error"]["code"] == "shutting_down", refused

    assert sp.process.wait(timeout=30) == 0
    still_up = [pid for pid in worker_pids if running(pid)]
    assert not still_up, f"workers still running after serve exited: {still_up}"


def test_sigterm_to_the_process_group_still_finishes_queued_requests(serve, connect, zctx):
    sp = serve("--workers", "1", *SLOW_WINDOW, workers=1)
    assert sp.process is not None
    socks = queue_requests(sp, connect, zctx, 8)  # one batch running, one queued
    os.killpg(sp.process.pid, signal.SIGTERM)
    # As systemd stops a service: every process of the group gets SIGTERM, workers included.
    for i, frames in enumerate(gather(socks)):
        reply = unpack(frames[-1])
        assert reply["ok"] and reply["output"]["echo"] == i, reply


# --- standalone broker and workers, GPUs --------------------------------------------------------


def test_broker_with_separately_started_workers(spawn, client, zctx):
    frontend, backend = free_tcp_address(), free_tcp_address()
    broker = spawn("broker", "--frontend", frontend, "--backend", backend, "--model", "sim", "--model", CUDA,
                   "--max-wait-ms", "2")  # fmt: skip
    wait_for_stats(frontend, zctx, lambda st: True, processes=(broker.process,))
    sim = spawn("worker", "--connect", backend, "--model", "sim", "--gpu", "3", *FAST_SIM)
    cuda = spawn("worker", "--connect", backend, "--model", CUDA, "--gpu", "3",
                 env={"CUDA_VISIBLE_DEVICES": None})  # fmt: skip
    wait_for_stats(
        frontend,
        zctx,
        lambda st: all(m["workers"] == 1 for m in st["models"].values()),
        processes=(broker.process, sim.process, cuda.process),
    )

    c = client(frontend)
    replies = [p.wait() for p in [c.submit(i) for i in range(8)]]
    for i, reply in enumerate(replies):
        assert reply["ok"] and reply["output"]["echo"] == i, reply
        assert reply["worker"].endswith(f"/gpu3/{sim.pid}"), reply["worker"]
    seen = c.submit(None, model="cuda").wait()
    assert seen["ok"] and seen["worker"].endswith(f"/gpu3/{cuda.pid}"), seen
    assert seen["output"] == "3", "--gpu 3 did not set CUDA_VISIBLE_DEVICES=3"


def test_worker_gpu_overrides_inherited_cuda_visible_devices(spawn, client, zctx):
    frontend, backend = free_tcp_address(), free_tcp_address()
    broker = spawn("broker", "--frontend", frontend, "--backend", backend, "--model", CUDA)
    worker = spawn(
        "worker", "--connect", backend, "--model", CUDA, "--gpu", "3", env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    )
    wait_for_stats(
        frontend,
        zctx,
        lambda st: st["models"]["cuda"]["workers"] == 1,
        processes=(broker.process, worker.process),
    )
    seen = client(frontend).request(None)
    assert seen == "3", f"the model of `worker --gpu 3` sees CUDA_VISIBLE_DEVICES={seen!r}"


def test_serve_gives_each_worker_its_gpu(serve, client):
    sp = serve("--gpus", "0,1", "--model", CUDA, "--max-batch-size", "1", "--max-wait-ms", "0", workers=2)
    c = client(sp.frontend)
    seen: dict[str, str] = {}
    deadline = time.monotonic() + 30
    while len(seen) < 2:
        assert time.monotonic() < deadline, f"only saw {seen}"
        for p in [c.submit(i) for i in range(4)]:
            reply = p.wait()
            assert reply["ok"], reply
            seen[reply["worker"].split("/")[1]] = reply["output"]
    assert seen == {"gpu0": "0", "gpu1": "1"}, seen


# --- configuration errors -----------------------------------------------------------------------


@pytest.fixture
def bound_address() -> Iterator[str]:
    """A loopback address another socket is listening on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["serve", "--max-batch-size", "0"], "--max-batch-size"),
        (["serve", "--model", "nonsense"], "unknown model 'nonsense'"),
        (["serve", "--frontend", "{bound}"], "cannot bind {bound}"),
        (["serve", "--backend", "{bound}"], "cannot bind {bound}"),
        (["broker", "--frontend", "{bound}"], "cannot bind {bound}"),
        (["broker", "--max-wait-ms", "-1"], "--max-wait-ms"),
        (["worker", "--model", "nonsense"], "unknown model 'nonsense'"),
        (["send", "not json"], "not JSON"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_config_error_is_a_clear_message_not_a_traceback(cli, bound_address, args, expected):
    args = [a.format(bound=bound_address) for a in args]
    expected = expected.format(bound=bound_address)
    if args[0] in ("serve", "broker"):  # never the default ports, should it start after all
        for opt in ("--frontend", "--backend"):
            if opt not in args:
                args += [opt, free_tcp_address()]
    if args[0] == "serve":
        args += ["--workers", "1"]
    if args[0] == "worker":
        args += ["--connect", free_tcp_address()]
    result = cli(*args, timeout_s=30)
    assert result.returncode != 0, result
    assert "Error" in result.stderr and expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_unloadable_model_makes_serve_fail(spawn):
    proc = spawn(
        "serve", "--frontend", free_tcp_address(), "--backend", free_tcp_address(),
        "--workers", "1", "--model", "tests.fixture_models:no_such_model",
    )  # fmt: skip
    # Two interpreter start-ups (serve, then its worker) on a busy machine: a generous deadline.
    try:
        returncode: int | None = proc.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        returncode = None
    stderr = proc.stderr_path.read_text(errors="replace")
    assert returncode is not None, "serve still running 60 s after its only worker failed to load"
    assert returncode != 0, stderr
    assert "no_such_model" in stderr and "Traceback" not in stderr, stderr
