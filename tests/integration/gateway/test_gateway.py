"""The Open Inference Protocol (KServe v2) gateway, end to end: `batcher serve
--http-port/--grpc-port` (or `batcher gateway`) in front of real workers, driven by
Triton's own clients (tritonclient) over HTTP and gRPC, and by curl as the README does."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.grpc.aio as tgrpc_aio
import tritonclient.http as thttp
import zmq
from tritonclient.utils import InferenceServerException

from batcher.serve.launcher import ServeProcess, free_tcp_address
from tests import onnx_models
from tests.helpers import model_stats, wait_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
PROBE = "probe=tests.fixture_models:oip_probe"


def stats(frontend: str, model: str) -> dict[str, Any]:
    """The model's broker stats ({} while the broker does not answer)."""
    return model_stats(frontend, zmq.Context.instance(), model)


def free_port() -> int:
    return int(free_tcp_address().rsplit(":", 1)[1])


def http_status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0  # not listening yet


def wait_gateway(port: int, timeout_s: float = 20.0) -> None:
    wait_until(lambda: http_status(port, "/v2/health/live") == 200, timeout_s, "the gateway's HTTP port")


class Gateway:
    """A serve with its gateway: the ports, and Triton's clients of both protocols."""

    def __init__(self, serve: ServeProcess, http_port: int, grpc_port: int) -> None:
        self.serve = serve
        self.http_port = http_port
        self.grpc_port = grpc_port
        self.http = thttp.InferenceServerClient(f"127.0.0.1:{http_port}", concurrency=16)
        self.grpc = tgrpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")

    def close(self) -> None:
        self.http.close()
        self.grpc.close()


@pytest.fixture
def gateway(serve: Callable[..., ServeProcess]) -> Iterator[Callable[..., Gateway]]:
    """Factory: `gateway(*serve_args, workers=N)` starts serve with a gateway on free ports."""
    made: list[Gateway] = []

    def start(*args: str, workers: int) -> Gateway:
        http_port, grpc_port = free_port(), free_port()
        sp = serve(*args, "--http-port", str(http_port), "--grpc-port", str(grpc_port), workers=workers)
        wait_gateway(http_port)
        gw = Gateway(sp, http_port, grpc_port)
        made.append(gw)
        return gw

    yield start
    for gw in made:
        gw.close()
    gc.collect()  # tritonclient's __del__ closes again: here, not in some later test's thread


def http_input(name: str, array: np.ndarray, datatype: str, binary: bool) -> thttp.InferInput:
    inp = thttp.InferInput(name, list(array.shape), datatype)
    inp.set_data_from_numpy(array, binary_data=binary)
    return inp


def grpc_input(name: str, array: np.ndarray, datatype: str) -> tgrpc.InferInput:
    inp = tgrpc.InferInput(name, list(array.shape), datatype)
    inp.set_data_from_numpy(array)
    return inp


def http_error(call: Callable[[], Any]) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value


# --- health and metadata ------------------------------------------------------------------------


def test_health_and_metadata_over_both_protocols(gateway: Callable[..., Gateway], tmp_path: Path) -> None:
    """Live, ready, server and model metadata from Triton's clients; the signature of an
    ONNX model is its v2 metadata, with the batch axis first."""
    sp = onnx_models.sum_and_product(tmp_path / "sp.onnx")
    gw = gateway("--model", "echo", "--model", f"sp=onnx:{sp}", "--workers", "1", workers=2)
    for client in (gw.http, gw.grpc):
        assert client.is_server_live()
        assert client.is_server_ready()
        assert client.is_model_ready("echo")
        assert client.is_model_ready("sp", "1")
        assert not client.is_model_ready("nope")
        assert not client.is_model_ready("sp", "2")
    assert gw.http.get_server_metadata() == {
        "name": "batcher",
        "version": "0.1.0",
        "extensions": ["binary_tensor_data", "model_configuration", "model_repository", "statistics"],
    }
    assert list(gw.grpc.get_server_metadata().extensions) == [
        "binary_tensor_data",
        "model_configuration",
        "model_repository",
        "statistics",
    ]
    meta = gw.http.get_model_metadata("sp")
    assert meta["name"] == "sp" and meta["versions"] == ["1"] and meta["platform"] == "batcher"
    assert meta["inputs"] == [
        {"name": "a", "datatype": "FP32", "shape": [-1, 2]},
        {"name": "b", "datatype": "FP32", "shape": [-1, 2]},
    ]
    assert [o["name"] for o in meta["outputs"]] == ["sum", "prod"]
    gmeta = gw.grpc.get_model_metadata("sp", as_json=True)
    assert [(t["name"], t["datatype"], t["shape"]) for t in gmeta["inputs"]] == [
        ("a", "FP32", ["-1", "2"]),
        ("b", "FP32", ["-1", "2"]),
    ]
    assert http_error(lambda: gw.http.get_model_metadata("nope")).status() == "404"
    assert http_error(lambda: gw.grpc.get_model_metadata("nope")).status() == "StatusCode.NOT_FOUND"
    # Several named inputs and outputs, several rows, through the ONNX worker.
    a = np.arange(6, dtype=np.float32).reshape(3, 2)
    b = np.full((3, 2), 2.0, dtype=np.float32)
    for result in (
        gw.http.infer("sp", [http_input("a", a, "FP32", True), http_input("b", b, "FP32", False)]),
        gw.grpc.infer("sp", [grpc_input("a", a, "FP32"), grpc_input("b", b, "FP32")]),
    ):
        np.testing.assert_array_equal(result.as_numpy("sum"), a + b)
        np.testing.assert_array_equal(result.as_numpy("prod"), a * b)


def test_ready_only_when_every_configured_model_has_a_worker(spawn: Callable[..., Any]) -> None:
    """A gateway in front of a broker whose model has no worker yet is live, not ready;
    once the worker joins it is ready, over both protocols."""
    frontend, backend = free_tcp_address(), free_tcp_address()
    http_port, grpc_port = free_port(), free_port()
    spawn("broker", "--frontend", frontend, "--backend", backend, "--model", "echo")
    spawn("gateway", "--connect", frontend, "--http-port", str(http_port), "--grpc-port", str(grpc_port))
    wait_gateway(http_port)
    grpc_client = tgrpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        assert http_status(http_port, "/v2/health/ready") == 503
        assert http_status(http_port, "/v2/models/echo/ready") == 503
        assert grpc_client.is_server_live() and not grpc_client.is_server_ready()
        spawn("worker", "--connect", backend, "--model", "echo")
        wait_until(lambda: http_status(http_port, "/v2/health/ready") == 200, 20, "ready")
        assert http_status(http_port, "/v2/models/echo/ready") == 200
        assert http_status(http_port, "/v2/models/echo/versions/1/ready") == 200
        assert grpc_client.is_server_ready() and grpc_client.is_model_ready("echo")
    finally:
        grpc_client.close()


# --- tensors, rows, in flight -------------------------------------------------------------------

ARRAYS = {
    "FP32": np.array([[1.5, -2.0, 3.25], [4.0, 5.0, -6.5]], dtype=np.float32),
    "INT64": np.array([[2**40, -7], [0, 9]], dtype=np.int64),
    "BYTES": np.array([[b"abc", b""], [b"\xff\x00 not text", b"z"]], dtype=np.object_),
}


@pytest.mark.parametrize("datatype", sorted(ARRAYS))
def test_every_datatype_both_protocols_with_and_without_binary(
    gateway: Callable[..., Gateway], datatype: str
) -> None:
    """FP32, INT64 and BYTES, JSON and binary over HTTP, raw over gRPC, 1 row and
    several: what comes back from echo equals what went in, row for row."""
    gw = gateway("--model", "echo", "--workers", "1", workers=1)
    full = ARRAYS[datatype]
    for array in (full[:1], full):  # one row, then several
        for binary in (False, True):
            if datatype == "BYTES" and not binary and array is full:
                array = np.array([[b"abc", b""], [b"text", b"z"]], dtype=np.object_)  # JSON: UTF-8
            result = gw.http.infer(
                "echo",
                [http_input("x", array, datatype, binary)],
                outputs=[thttp.InferRequestedOutput("output", binary_data=binary)],
                request_id="req-7",
            )
            got = result.as_numpy("output")
            assert got.shape == array.shape
            if datatype == "BYTES" and not binary:  # tritonclient gives JSON text as str
                got = np.array([[x.encode() for x in row] for row in got], dtype=np.object_)
            np.testing.assert_array_equal(got, array)
            assert result.get_response()["id"] == "req-7"
            assert result.get_output("output")["datatype"] == datatype
        result = gw.grpc.infer("echo", [grpc_input("x", array, datatype)], request_id="g-1")
        np.testing.assert_array_equal(result.as_numpy("output"), array)
        assert result.get_response().id == "g-1"


def test_large_tensors_pass_both_ways(gateway: Callable[..., Gateway]) -> None:
    """4 MiB in one row, and 3 rows of 256 KiB (each reply read in place by the
    gateway), come back equal over HTTP binary data and over gRPC raw contents."""
    gw = gateway("--model", "echo", "--workers", "1", workers=1)
    rng = np.random.default_rng(5)
    for array in (
        rng.standard_normal((1, 2**20), dtype=np.float32),
        rng.standard_normal((3, 2**16), dtype=np.float32),
    ):
        result = gw.http.infer(
            "echo",
            [http_input("x", array, "FP32", True)],
            outputs=[thttp.InferRequestedOutput("output", binary_data=True)],
        )
        np.testing.assert_array_equal(result.as_numpy("output"), array)
        np.testing.assert_array_equal(
            gw.grpc.infer("echo", [grpc_input("x", array, "FP32")]).as_numpy("output"), array
        )


def test_rows_share_batches_and_many_requests_in_flight(gateway: Callable[..., Gateway]) -> None:
    """64 async requests of 2 rows each over HTTP and over gRPC at once: every one
    answered with its own rows, and the broker batched rows of different requests."""
    gw = gateway(
        "--model",
        "echo",
        "--workers",
        "1",
        "--max-batch-size",
        "16",
        "--max-wait-ms",
        "20",
        "--policy",
        "window",
        workers=1,
    )
    arrays = [np.array([[i, -i], [i * 10, 7]], dtype=np.int64) for i in range(64)]
    pending = [
        gw.http.async_infer("echo", [http_input("x", a, "INT64", True)], request_id=str(i))
        for i, a in enumerate(arrays)
    ]
    for i, p in enumerate(pending):
        result = p.get_result(timeout=30)
        assert result.get_response()["id"] == str(i)
        np.testing.assert_array_equal(result.as_numpy("output"), arrays[i])

    async def over_grpc() -> list[Any]:
        client = tgrpc_aio.InferenceServerClient(f"127.0.0.1:{gw.grpc_port}")
        try:
            return await asyncio.gather(
                *(
                    client.infer("echo", [grpc_input("x", a, "INT64")], request_id=str(i))
                    for i, a in enumerate(arrays)
                )
            )
        finally:
            await client.close()

    for i, result in enumerate(asyncio.run(over_grpc())):
        assert result.get_response().id == str(i)
        np.testing.assert_array_equal(result.as_numpy("output"), arrays[i])
    echo = stats(gw.serve.frontend, "echo")
    assert echo["requests"] >= 2 * 2 * 64  # every row is a request of the broker's
    assert echo["mean_batch_size"] > 2.0  # rows of different requests shared batches


# --- errors -------------------------------------------------------------------------------------


def test_request_errors_and_their_status(gateway: Callable[..., Gateway]) -> None:
    """bad_request -> 400 / INVALID_ARGUMENT; unknown_model -> 404 / NOT_FOUND;
    model_error -> 500 / INTERNAL: each with the broker's or the gateway's message."""
    gw = gateway("--model", "echo", "--model", PROBE, "--workers", "1", workers=2)
    x = np.array([[1.0, 2.0]], dtype=np.float32)
    err = http_error(lambda: gw.http.infer("nope", [http_input("x", x, "FP32", True)]))
    assert (err.status(), "nope" in err.message()) == ("404", True)
    err = http_error(lambda: gw.grpc.infer("nope", [grpc_input("x", x, "FP32")]))
    assert err.status() == "StatusCode.NOT_FOUND"
    err = http_error(lambda: gw.http.infer("echo", [http_input("x", x, "FP32", True)], model_version="3"))
    assert err.status() == "404"
    boom = np.array([b"boom"], dtype=np.object_)
    err = http_error(lambda: gw.http.infer("probe", [http_input("x", boom, "BYTES", True)]))
    assert err.status() == "500" and "boom" in err.message()
    err = http_error(lambda: gw.grpc.infer("probe", [grpc_input("x", boom, "BYTES")]))
    assert err.status() == "StatusCode.INTERNAL" and "boom" in err.message()
    # bad_request from the gateway itself: rows that disagree, a scalar, a short buffer.
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [], "data": [1.0]}]}
    status, doc = post_json(gw.http_port, "/v2/models/echo/infer", body)
    assert status == 400 and "batch axis" in doc["error"]
    body = {
        "inputs": [
            {"name": "a", "datatype": "FP32", "shape": [2], "data": [1.0, 2.0]},
            {"name": "b", "datatype": "FP32", "shape": [3], "data": [1.0, 2.0, 3.0]},
        ]
    }
    status, doc = post_json(gw.http_port, "/v2/models/echo/infer", body)
    assert status == 400 and "disagree" in doc["error"]
    bad = grpc_input("x", np.zeros((1, 3), dtype=np.float32), "FP32")
    bad.set_shape([2, 2])  # 12 bytes of data for a shape that needs 16
    err = http_error(lambda: gw.grpc.infer("echo", [bad]))
    assert err.status() == "StatusCode.INVALID_ARGUMENT" and "needs 16" in err.message()


def test_worker_failed_is_internal(gateway: Callable[..., Gateway]) -> None:
    """A worker that dies in the batch: 500 / INTERNAL, and the gateway goes on serving."""
    gw = gateway("--model", PROBE, "--workers", "1", "--max-retries", "0", workers=1)
    crash = np.array([b"crash"], dtype=np.object_)
    err = http_error(lambda: gw.http.infer("probe", [http_input("x", crash, "BYTES", True)]))
    assert err.status() == "500"
    wait_until(lambda: gw.http.is_model_ready("probe"), 30, "the worker respawned")
    ok = np.array([b"fine"], dtype=np.object_)
    assert gw.grpc.infer("probe", [grpc_input("x", ok, "BYTES")]).as_numpy("output").tolist() == [b"fine"]


def test_overloaded_and_deadline_exceeded(gateway: Callable[..., Gateway]) -> None:
    """A full queue: 503 with Retry-After / UNAVAILABLE. A request whose `timeout`
    (microseconds, as Triton's clients send it) passes while it waits: 504 /
    DEADLINE_EXCEEDED; so does a gRPC deadline."""
    args = ["--model", PROBE, "--workers", "1", "--max-batch-size", "1", "--max-queue", "1"]
    gw = gateway(*args, "--worker-prefetch", "1", workers=1)
    slow = np.array([b"slow"], dtype=np.object_)
    busy = gw.http.async_infer("probe", [http_input("x", slow, "BYTES", True)])
    wait_until(lambda: stats(gw.serve.frontend, "probe").get("busy_workers") == 1, 10, "busy")
    queued = gw.http.async_infer("probe", [http_input("x", slow, "BYTES", True)])
    wait_until(lambda: stats(gw.serve.frontend, "probe").get("queued") == 1, 10, "queued")
    body = {"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": ["x"]}]}
    status, doc, headers = post_json_full(gw.http_port, "/v2/models/probe/infer", body)
    assert status == 503 and headers.get("Retry-After") == "1", (status, doc)
    one = np.array([b"x"], dtype=np.object_)
    err = http_error(lambda: gw.grpc.infer("probe", [grpc_input("x", one, "BYTES")]))
    assert err.status() == "StatusCode.UNAVAILABLE"
    busy.get_result(timeout=30)
    queued.get_result(timeout=30)
    # deadlines: the worker busy for 1.5 s, a request allowed 100 ms
    busy = gw.http.async_infer("probe", [http_input("x", slow, "BYTES", True)])
    wait_until(lambda: stats(gw.serve.frontend, "probe").get("busy_workers") == 1, 10, "busy")
    err = http_error(lambda: gw.http.infer("probe", [http_input("x", one, "BYTES", True)], timeout=100_000))
    assert err.status() == "504"
    err = http_error(lambda: gw.grpc.infer("probe", [grpc_input("x", one, "BYTES")], client_timeout=0.2))
    assert err.status() == "StatusCode.DEADLINE_EXCEEDED"
    busy.get_result(timeout=30)
    outcomes = stats(gw.serve.frontend, "probe")["outcomes"]
    assert outcomes.get("deadline_exceeded", 0) >= 1 and outcomes.get("overloaded", 0) == 2


def test_shutting_down_is_unavailable(spawn: Callable[..., Any]) -> None:
    """A broker draining after SIGTERM refuses new requests: 503 / UNAVAILABLE, while
    the request it is finishing still gets its answer through the gateway."""
    frontend, backend = free_tcp_address(), free_tcp_address()
    http_port, grpc_port = free_port(), free_port()
    broker = spawn("broker", "--frontend", frontend, "--backend", backend, "--model", "probe")
    spawn("worker", "--connect", backend, "--model", PROBE)
    spawn("gateway", "--connect", frontend, "--http-port", str(http_port), "--grpc-port", str(grpc_port))
    wait_gateway(http_port)
    wait_until(lambda: http_status(http_port, "/v2/health/ready") == 200, 20, "ready")
    slow = SlowRequest(http_port)
    try:
        wait_until(lambda: stats(frontend, "probe").get("busy_workers") == 1, 10, "busy")
        os.kill(broker.pid, signal.SIGTERM)
        body = {"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": ["x"]}]}
        status, doc = post_json(http_port, "/v2/models/probe/infer", body)
        assert status == 503 and "shutting down" in doc["error"]
        client = tgrpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        one = np.array([b"x"], dtype=np.object_)
        err = http_error(lambda: client.infer("probe", [grpc_input("x", one, "BYTES")]))
        client.close()
        assert err.status() == "StatusCode.UNAVAILABLE"
    finally:
        slow.thread.join(30)
    status, doc, _ = slow.result()
    assert status == 200 and doc["outputs"][0]["data"] == ["slow"], (status, doc)


def test_rows_answered_504_never_run_later(spawn: Callable[..., Any]) -> None:
    """A broker paused (SIGSTOP) past the gateway's --request-timeout-ms: every client
    gets 504 / DEADLINE_EXCEEDED in time, and once the broker resumes none of those
    rows runs (the gateway cancelled them, or never sent them; each carried its deadline
    too)."""
    frontend, backend = free_tcp_address(), free_tcp_address()
    http_port, grpc_port = free_port(), free_port()
    broker = spawn("broker", "--frontend", frontend, "--backend", backend, "--model", "probe")
    spawn("worker", "--connect", backend, "--model", PROBE)
    spawn(
        "gateway", "--connect", frontend, "--http-port", str(http_port), "--grpc-port", str(grpc_port),
        "--request-timeout-ms", "1000",
    )  # fmt: skip
    wait_gateway(http_port)
    wait_until(lambda: http_status(http_port, "/v2/health/ready") == 200, 20, "ready")
    os.kill(broker.pid, signal.SIGSTOP)
    try:
        results: list[Any] = []

        def call(i: int) -> None:
            body = {"inputs": [{"name": "x", "datatype": "BYTES", "shape": [2], "data": [f"a{i}", f"b{i}"]}]}
            results.append(post_json(http_port, "/v2/models/probe/infer", body))

        threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        client = tgrpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        one = np.array([b"g"], dtype=np.object_)
        err = http_error(lambda: client.infer("probe", [grpc_input("x", one, "BYTES")]))
        client.close()
        for t in threads:
            t.join(30)
    finally:
        os.kill(broker.pid, signal.SIGCONT)
    assert err.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert [status for status, _ in results] == [504, 504, 504]
    # A marker row through the same gateway, answered: the broker has read everything sent
    # before it on the gateway's connection (a resumed broker may answer a new connection's
    # `stats` before it has read the rows waiting on the gateway's). Rows that never left
    # the gateway (dropped there at their 504) cannot run, so the count read is at most 7.
    marker = {"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": ["marker"]}]}
    wait_until(lambda: post_json(http_port, "/v2/models/probe/infer", marker)[0] == 200, 20, "the marker")
    wait_until(lambda: stats(frontend, "probe").get("queued") == 0, 10, "the queue empty")
    outcomes = stats(frontend, "probe")["outcomes"]
    assert outcomes.get("ok", 0) == 1, outcomes  # the marker: not one of the 7 rows ran
    assert sum(outcomes.values()) - 1 <= 7, outcomes


def test_draining_serve_is_not_ready_and_finishes_what_it_holds(gateway: Callable[..., Gateway]) -> None:
    """SIGTERM to serve: readiness turns 503 at once (load balancers stop sending), new
    requests get 503, and the request in a batch is still answered 200."""
    gw = gateway("--model", PROBE, "--workers", "1", workers=1)
    slow = SlowRequest(gw.http_port)
    try:
        wait_until(lambda: stats(gw.serve.frontend, "probe").get("busy_workers") == 1, 10, "busy")
        assert gw.serve.process is not None
        os.kill(gw.serve.process.pid, signal.SIGTERM)
        wait_until(
            lambda: http_status(gw.http_port, "/v2/health/ready") == 503, 5, "not ready while draining"
        )
        assert slow.outcome is None  # still in its batch
    finally:
        slow.thread.join(30)
    status, doc, _ = slow.result()
    assert status == 200 and doc["outputs"][0]["data"] == ["slow"], (status, doc)


def test_a_signal_to_serves_whole_group_drains_with_the_gateway_up(gateway: Callable[..., Gateway]) -> None:
    """Ctrl-C or systemd signal the whole process group: the gateway ignores it (it is
    serve's to act on), so serve drains as with a signal to it alone: the request in a
    batch gets its result, and readiness says 503 meanwhile."""
    gw = gateway("--model", PROBE, "--workers", "1", workers=1)
    slow = SlowRequest(gw.http_port)
    try:
        wait_until(lambda: stats(gw.serve.frontend, "probe").get("busy_workers") == 1, 10, "busy")
        assert gw.serve.process is not None
        os.killpg(gw.serve.process.pid, signal.SIGTERM)
        wait_until(
            lambda: http_status(gw.http_port, "/v2/health/ready") == 503, 5, "not ready while draining"
        )
    finally:
        slow.thread.join(30)
    status, doc, _ = slow.result()
    assert status == 200 and doc["outputs"][0]["data"] == ["slow"], (status, doc)
    assert gw.serve.process.wait(15) == 0
    wait_until(
        lambda: http_status(gw.http_port, "/v2/health/live") == 0, 10, "the gateway stopped with serve"
    )


def test_the_gateway_stops_when_serve_dies(gateway: Callable[..., Gateway]) -> None:
    """serve killed outright: its gateway does not live on holding the port."""
    gw = gateway("--model", "echo", "--workers", "1", workers=1)
    assert gw.serve.process is not None
    group = gw.serve.process.pid
    os.kill(group, signal.SIGKILL)
    wait_until(lambda: http_status(gw.http_port, "/v2/health/live") == 0, 10, "the gateway gone")
    # nothing of serve's outlives it: its worker and its gateway both watch their pipe
    wait_until(lambda: not [p for p in psutil.process_iter(["pid"]) if _in_group(p, group)], 10, "all gone")


def _in_group(p: Any, group: int) -> bool:
    try:
        return os.getpgid(p.pid) == group and p.status() != psutil.STATUS_ZOMBIE
    except (ProcessLookupError, psutil.Error):
        return False


def test_rows_in_flight_when_the_broker_dies_get_503_at_once(spawn: Callable[..., Any]) -> None:
    """The broker holding a request dies: the client hears 503 within a second or two,
    not at the request's deadline (30 s here)."""
    frontend, backend = free_tcp_address(), free_tcp_address()
    http_port = free_port()
    broker = spawn("broker", "--frontend", frontend, "--backend", backend, "--model", "probe")
    spawn("worker", "--connect", backend, "--model", PROBE)
    spawn("gateway", "--connect", frontend, "--http-port", str(http_port))
    wait_gateway(http_port)
    wait_until(lambda: http_status(http_port, "/v2/health/ready") == 200, 20, "ready")
    slow = SlowRequest(http_port)
    try:
        wait_until(lambda: stats(frontend, "probe").get("busy_workers") == 1, 10, "busy")
        os.kill(broker.pid, signal.SIGKILL)
    finally:
        slow.thread.join(30)
    status, doc, took_s = slow.result()
    assert status == 503 and "lost" in doc["error"] and took_s < 5, (status, doc, took_s)


def test_http_errors_of_every_kind_are_v2_error_bodies(gateway: Callable[..., Gateway]) -> None:
    """No such route, a method not allowed, JSON over its limit: `{"error": ...}` with the
    right status, as tritonclient reads it; a gRPC request mixing raw and typed contents,
    or naming no model, is INVALID_ARGUMENT."""
    gw = gateway("--model", "echo", "--workers", "1", workers=1)
    for path, method, status in (("/v2/nothing", "GET", 404), ("/v2/models/echo/infer", "GET", 405)):
        request = urllib.request.Request(f"http://127.0.0.1:{gw.http_port}{path}", method=method)
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=10)
        assert info.value.code == status and "error" in json.loads(info.value.read())
    huge = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [0] * (9 * 2**20)}]}
    status, doc = post_json(gw.http_port, "/v2/models/echo/infer", huge)
    assert status == 413 and "binary data" in doc["error"]
    import grpc

    from batcher.gateway import inference_pb2 as pb
    from batcher.gateway import inference_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{gw.grpc_port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        tensor = pb.ModelInferRequest.InferInputTensor(
            name="x", datatype="FP32", shape=[1], contents=pb.InferTensorContents(fp32_contents=[1.0])
        )
        for request, words in (
            (
                pb.ModelInferRequest(model_name="echo", inputs=[tensor], raw_input_contents=[b"\0" * 4]),
                "one or",
            ),
            (pb.ModelInferRequest(model_name="", inputs=[tensor]), "model_name"),
        ):
            with pytest.raises(grpc.RpcError) as rpc:
                stub.ModelInfer(request, timeout=10)
            assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in rpc.value.details()
        reply = stub.ModelInfer(pb.ModelInferRequest(model_name="echo", inputs=[tensor]), timeout=10)
        assert reply.raw_output_contents == [np.float32(1.0).tobytes()]


# --- cancellation -------------------------------------------------------------------------------


def test_disconnect_and_cancel_drop_queued_rows(gateway: Callable[..., Gateway], tmp_path: Path) -> None:
    """An HTTP client that goes away, and a gRPC call that is cancelled, cancel their
    queued requests at the broker (Triton #4818, #3581): the model never runs them."""
    gw = gateway(
        "--model", PROBE, "--workers", "1", "--max-batch-size", "1", "--worker-prefetch", "1", workers=1
    )
    release = tmp_path / "release"  # the worker stays busy until the test creates it
    hold = np.array([f"hold:{release}".encode()], dtype=np.object_)
    busy = gw.http.async_infer("probe", [http_input("x", hold, "BYTES", True)])
    wait_until(lambda: stats(gw.serve.frontend, "probe").get("busy_workers") == 1, 10, "busy")
    slow = np.array([b"slow"], dtype=np.object_)

    async def give_up() -> None:
        import aiohttp

        body = {"inputs": [{"name": "x", "datatype": "BYTES", "shape": [3], "data": ["a", "b", "c"]}]}
        async with aiohttp.ClientSession() as session:
            post = session.post(f"http://127.0.0.1:{gw.http_port}/v2/models/probe/infer", json=body)
            task = asyncio.ensure_future(post)
            await asyncio.to_thread(
                wait_until,
                lambda: stats(gw.serve.frontend, "probe").get("queued") == 3,
                10,
                "3 rows queued",
            )
            task.cancel()  # the connection closes
            with pytest.raises(asyncio.CancelledError):
                await task
        # Until the 3 are cancelled: "2 queued" below must be the gRPC rows, not 2 of these
        # still being cancelled (the broker's ROUTER reads the test's stats between the
        # gateway's 3 cancels); the gRPC call was then cancelled before its rows had left.
        await asyncio.to_thread(
            wait_until,
            lambda: (
                (s := stats(gw.serve.frontend, "probe")).get("outcomes", {}).get("cancelled") == 3
                and s.get("queued") == 0
            ),
            10,
            "the 3 HTTP rows cancelled",
        )
        client = tgrpc_aio.InferenceServerClient(f"127.0.0.1:{gw.grpc_port}")
        try:
            call = asyncio.ensure_future(client.infer("probe", [grpc_input("x", slow[[0, 0]], "BYTES")]))
            await asyncio.to_thread(
                wait_until,
                lambda: stats(gw.serve.frontend, "probe").get("queued") == 2,
                10,
                "2 rows queued",
            )
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
        finally:
            await client.close()

    asyncio.run(give_up())
    seen: list[dict[str, Any]] = []  # the last stats, for the failure's message

    def cancelled_5() -> bool:
        seen[:] = [stats(gw.serve.frontend, "probe")]
        return seen[0].get("outcomes", {}).get("cancelled") == 5

    try:
        wait_until(cancelled_5, 10, "5 rows cancelled")
    except AssertionError as exc:  # once in 12 runs (docs/testing.md): say what was there
        raise AssertionError(f"{exc}; the broker's stats: {seen}") from None
    release.touch()
    busy.get_result(timeout=30)
    assert stats(gw.serve.frontend, "probe")["outcomes"]["ok"] == 1


def test_a_client_gone_with_a_request_pipelined_behind_still_cancels_its_rows(
    gateway: Callable[..., Gateway], tmp_path: Path
) -> None:
    """An infer with a second request pipelined behind it on the same connection: the
    connection closing cancels the infer's queued row (the running request is found,
    not the newest one parsed)."""
    import socket

    gw = gateway(
        "--model", PROBE, "--workers", "1", "--max-batch-size", "1", "--worker-prefetch", "1", workers=1
    )
    release = tmp_path / "release"  # the worker stays busy until the test creates it
    hold = np.array([f"hold:{release}".encode()], dtype=np.object_)
    busy = gw.http.async_infer("probe", [http_input("x", hold, "BYTES", True)])
    wait_until(lambda: stats(gw.serve.frontend, "probe").get("busy_workers") == 1, 10, "busy")
    body = json.dumps({"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": ["a"]}]}).encode()
    request = (
        f"POST /v2/models/probe/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.create_connection(("127.0.0.1", gw.http_port), timeout=10) as client:
        client.sendall(request + b"GET /v2 HTTP/1.1\r\nHost: x\r\n\r\n")
        wait_until(lambda: stats(gw.serve.frontend, "probe").get("queued") == 1, 10, "1 row queued")
    wait_until(
        lambda: stats(gw.serve.frontend, "probe").get("outcomes", {}).get("cancelled") == 1, 10, "cancelled"
    )
    release.touch()
    busy.get_result(timeout=30)
    assert stats(gw.serve.frontend, "probe")["outcomes"]["ok"] == 1


def test_compressed_requests_from_tritonclient(gateway: Callable[..., Gateway]) -> None:
    """tritonclient's request_compression_algorithm, gzip and deflate, JSON and binary."""
    gw = gateway("--model", "echo", "--workers", "1", workers=1)
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    for algorithm in ("gzip", "deflate"):
        for binary in (False, True):
            result = gw.http.infer(
                "echo",
                [http_input("x", array, "FP32", binary)],
                request_compression_algorithm=algorithm,
            )
            np.testing.assert_array_equal(result.as_numpy("output"), array)


# --- processes ----------------------------------------------------------------------------------


def test_several_gateways_front_one_broker(spawn: Callable[..., Any]) -> None:
    """Two gateway processes on one broker both serve, and their rows share batches."""
    frontend, backend = free_tcp_address(), free_tcp_address()
    spawn("broker", "--frontend", frontend, "--backend", backend, "--model", "echo", "--max-wait-ms", "50")
    spawn("worker", "--connect", backend, "--model", "echo")
    ports = [free_port(), free_port()]
    for port in ports:
        spawn("gateway", "--connect", frontend, "--http-port", str(port))
    for port in ports:
        wait_gateway(port)
        wait_until(lambda port=port: http_status(port, "/v2/health/ready") == 200, 20, "ready")
    replies: list[Any] = []

    def call(port: int, value: int) -> None:
        body = {"inputs": [{"name": "x", "datatype": "INT64", "shape": [1], "data": [value]}]}
        replies.append(post_json(port, "/v2/models/echo/infer", body))

    threads = [threading.Thread(target=call, args=(ports[i % 2], i)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(doc["outputs"][0]["data"][0] for status, doc in replies if status == 200) == list(range(8))


def test_a_standalone_gateway_stops_promptly_on_sigterm_and_says_so(spawn: Callable[..., Any]) -> None:
    """SIGTERM to `batcher gateway` after HTTP and gRPC traffic, its clients' connections
    still open: it logs that it is stopping and that it stopped, and exits 0 well inside
    its 5 s grace (nothing is in flight)."""
    frontend, backend = free_tcp_address(), free_tcp_address()
    spawn("broker", "--frontend", frontend, "--backend", backend, "--model", "echo")
    spawn("worker", "--connect", backend, "--model", "echo")
    http_port, grpc_port = free_port(), free_port()
    gw = spawn("gateway", "--connect", frontend, "--http-port", str(http_port), "--grpc-port", str(grpc_port))
    wait_gateway(http_port)
    wait_until(lambda: http_status(http_port, "/v2/health/ready") == 200, 20, "ready")
    hclient = thttp.InferenceServerClient(f"127.0.0.1:{http_port}")
    gclient = tgrpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for _ in range(5):
        assert (
            hclient.infer("echo", [http_input("x", x, "FP32", True)]).as_numpy("output").tolist()
            == x.tolist()
        )
        assert gclient.infer("echo", [grpc_input("x", x, "FP32")]).as_numpy("output").tolist() == x.tolist()
    started = time.monotonic()
    os.kill(gw.pid, signal.SIGTERM)
    assert gw.process.wait(10) == 0
    took_s = time.monotonic() - started
    log_text = gw.stderr_path.read_text()
    assert "gateway stopping" in log_text and "gateway stopped in" in log_text, log_text
    assert took_s < 2.0, f"the gateway took {took_s:.2f} s to exit on SIGTERM"
    gclient.close()
    hclient.close()


def test_serve_stops_when_its_gateway_cannot_listen(tmp_path: Path) -> None:
    """A busy --http-port: serve says so and exits non-zero instead of serving deaf."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        sp = ServeProcess(
            ["--model", "echo", "--workers", "1", "--http-port", str(port)], stderr=subprocess.PIPE
        )
        sp.start()
        assert sp.process is not None
        try:
            _, err = sp.process.communicate(timeout=30)
        finally:
            sp.stop()
    assert sp.process.returncode == 1
    assert b"cannot listen" in err and b"gateway process exited" in err


def test_gateway_says_why_it_cannot_start(spawn: Callable[..., Any], tmp_path: Path) -> None:
    """A gRPC port in use, or a --connect that is no address: one line, exit 1, no traceback."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for args, words in ((["--grpc-port", str(port)], "cannot listen for gRPC"),):
            result = subprocess.run(
                [sys.executable, "-m", "batcher", "gateway", *args],
                capture_output=True,
                text=True,
                timeout=30,
                cwd=ROOT,
            )
            assert result.returncode == 1 and words in result.stderr, result.stderr
            assert "Traceback" not in result.stderr
    # a --connect that is no address is a usage error (exit 2) naming the expected form
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "batcher",
            "gateway",
            "--connect",
            "nonsense",
            "--http-port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert result.returncode == 2 and "expected tcp://HOST:PORT or ipc://PATH" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_the_gateway_of_a_curve_broker_is_admitted_with_the_brokers_key(tmp_path: Path) -> None:
    """serve with CurveZMQ and a client allow-list that lists nobody: its own gateway
    connects with the broker's key pair, and HTTP clients are served."""
    from batcher.transport.security import generate_keys

    _, secret = generate_keys(str(tmp_path), "broker")
    allowed = tmp_path / "clients"
    allowed.mkdir()
    port = free_port()
    args = [
        "--model",
        "echo",
        "--workers",
        "1",
        "--curve-secret-key",
        secret,
        "--curve-clients",
        str(allowed),
    ]
    sp = ServeProcess([*args, "--http-port", str(port)])
    sp.start()
    try:
        wait_gateway(port)
        wait_until(lambda: http_status(port, "/v2/health/ready") == 200, 20, "ready through CURVE")
        body = {"inputs": [{"name": "x", "datatype": "INT64", "shape": [1, 2], "data": [3, 4]}]}
        status, doc = post_json(port, "/v2/models/echo/infer", body)
        assert status == 200 and doc["outputs"][0]["data"] == [3, 4]
    finally:
        sp.stop()


def test_gateway_refuses_to_serve_nothing() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "batcher", "gateway"], capture_output=True, text=True, timeout=30, cwd=ROOT
    )
    assert result.returncode == 2 and "--http-port or --grpc-port" in result.stderr


# --- the README's curl examples -----------------------------------------------------------------


def readme_curl_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- gateway-curl -->\n```sh\n(.*?)```\n<!-- /gateway-curl -->", text, re.S)
    assert block, "README.md has no <!-- gateway-curl --> block"
    return [line for line in block.group(1).splitlines() if line.startswith("curl ")]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_readme_curl_examples(gateway: Callable[..., Gateway]) -> None:
    """Every curl line of the README's gateway section, against serve --http-port 8000
    (here a free port): each succeeds and prints what the README says it prints."""
    gw = gateway("--model", "echo", "--workers", "1", workers=1)
    commands = readme_curl_commands()
    assert len(commands) >= 3
    outputs = []
    for command in commands:
        command = command.replace("localhost:8000", f"localhost:{gw.http_port}")
        result = subprocess.run(command, shell=True, capture_output=True, timeout=30, cwd=ROOT)
        assert result.returncode == 0, (command, result.stderr)
        outputs.append(result.stdout)
    infer = json.loads(outputs[-1])
    assert infer["outputs"][0]["shape"] == [2, 3]
    assert infer["outputs"][0]["data"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


class SlowRequest:
    """A `slow` row (the probe holds its batch 1.5 s) posted from a thread of its own, so
    the test can act while it is in its batch; `result()` joins it: (status, doc,
    seconds), or (the exception's repr, None, seconds) for the assertion to show."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.outcome: tuple[Any, Any, float] | None = None
        self.thread = threading.Thread(target=self._post)
        self.thread.start()

    def _post(self) -> None:
        body = {"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": ["slow"]}]}
        started = time.monotonic()
        try:
            status, doc = post_json(self.port, "/v2/models/probe/infer", body)
        except Exception as exc:  # shown by the test's assertion
            status, doc = repr(exc), None
        self.outcome = (status, doc, time.monotonic() - started)

    def result(self) -> tuple[Any, Any, float]:
        self.thread.join(30)
        assert self.outcome is not None, "the slow request did not finish within 30 s"
        return self.outcome


# --- helpers ------------------------------------------------------------------------------------


def post_json_full(port: int, path: str, body: Any) -> tuple[int, Any, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return int(r.status), json.loads(r.read()), r.headers
    except urllib.error.HTTPError as exc:
        return int(exc.code), json.loads(exc.read()), exc.headers


def post_json(port: int, path: str, body: Any) -> tuple[int, Any]:
    status, doc, _ = post_json_full(port, path, body)
    return status, doc
