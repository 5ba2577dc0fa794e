"""Triton's model configuration and statistics extensions on the gateway, end to end, as
Triton's own clients and its load tester (perf_analyzer) read them: `batcher serve` with
its gateway on free ports, real workers, Triton's tritonclient over HTTP and gRPC."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
from tritonclient.utils import InferenceServerException

from tests import onnx_models
from tests.integration.gateway.test_gateway import PROBE, Gateway, gateway, grpc_input, http_error, http_input

__all__ = ["gateway"]  # the fixture, shared with tests/integration/gateway/test_gateway.py

pytestmark = pytest.mark.integration

#: Where bin/install-perf-analyzer puts it; $PERF_ANALYZER names another.
PERF_ANALYZER_HOME = Path(
    os.environ.get("PERF_ANALYZER_HOME", Path.home() / ".cache" / "batcher" / "perf-analyzer")
)


def test_model_config_over_both_protocols(gateway: Callable[..., Gateway], tmp_path: Path) -> None:
    """The configuration Triton's clients read: the batch axis's limit, the tensors as
    TYPE_* without the batch axis, the dynamic batcher's preferred sizes and queue delay,
    and one instance group holding the live workers; 404 / NOT_FOUND for a model not
    served."""
    lin = onnx_models.linear(tmp_path / "lin.onnx", inputs=4, outputs=3)
    gw = gateway(
        "--model",
        f"lin=onnx:{lin}",
        "--model",
        "echo",
        "--workers",
        "2",
        "--max-batch-size",
        "16",
        "--batch-sizes",
        "1,4,16",
        "--max-wait-ms",
        "3",
        workers=4,
    )
    config = gw.http.get_model_config("lin")
    assert config == {
        "name": "lin",
        "platform": "batcher",
        "backend": "batcher",
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": 16,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}],
        "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [3]}],
        "dynamic_batching": {"preferred_batch_size": [1, 4, 16], "max_queue_delay_microseconds": 3000},
        "instance_group": [{"name": "lin_0", "count": 2, "kind": "KIND_CPU"}],
    }
    assert gw.http.get_model_config("lin", "1") == config
    g = gw.grpc.get_model_config("lin").config
    assert (g.name, g.platform, g.max_batch_size) == ("lin", "batcher", 16)
    assert [(t.name, tgrpc.model_config_pb2.DataType.Name(t.data_type), list(t.dims)) for t in g.input] == [
        ("x", "TYPE_FP32", [4])
    ]
    assert [(t.name, list(t.dims)) for t in g.output] == [("y", [3])]
    assert list(g.dynamic_batching.preferred_batch_size) == [1, 4, 16]
    assert g.dynamic_batching.max_queue_delay_microseconds == 3000
    assert [(i.name, i.count, i.kind) for i in g.instance_group] == [("lin_0", 2, 2)]  # 2: KIND_CPU
    # A model with no signature: its batching, no tensors.
    echo = gw.http.get_model_config("echo")
    assert echo["input"] == echo["output"] == [] and echo["max_batch_size"] == 16
    assert http_error(lambda: gw.http.get_model_config("nope")).status() == "404"
    assert http_error(lambda: gw.http.get_model_config("lin", "2")).status() == "404"
    assert http_error(lambda: gw.grpc.get_model_config("nope")).status() == "StatusCode.NOT_FOUND"


def test_statistics_count_what_the_broker_ran(gateway: Callable[..., Gateway]) -> None:
    """After 12 requests over both protocols (and one that fails) every count agrees with
    what was sent, the model's time is the simulated GPU's, and a request's parts add up
    to its whole time; the all-models form lists every model."""
    gw = gateway(
        "--model",
        "sim",
        "--model",
        PROBE,
        "--sim-base-ms",
        "20",
        "--sim-per-item-ms",
        "0",
        "--workers",
        "1",
        workers=2,
    )
    x = np.ones((1, 2), dtype=np.float32)

    # Six at once each way (tritonclient's HTTP client is gevent's: its own concurrency).
    pending = [gw.http.async_infer("sim", [http_input("x", x, "FP32", True)]) for _ in range(6)]
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda _: gw.grpc.infer("sim", [grpc_input("x", x, "FP32")]), range(6)))
    for handle in pending:
        handle.get_result()
    boom = np.array([b"boom"], dtype=np.object_)
    with pytest.raises(InferenceServerException):
        gw.grpc.infer("probe", [grpc_input("x", boom, "BYTES")])

    stats = gw.http.get_inference_statistics("sim")["model_stats"]
    assert [s["name"] for s in stats] == ["sim"]
    s = stats[0]
    inference = s["inference_stats"]
    assert s["inference_count"] == inference["success"]["count"] == 12
    assert inference["fail"] == {"count": 0, "ns": 0}
    for part in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert inference[part]["count"] == 12, part
    per_size = s["batch_stats"]
    assert sum(b["batch_size"] * b["compute_infer"]["count"] for b in per_size) == 12
    assert s["execution_count"] == sum(b["compute_infer"]["count"] for b in per_size)
    for b in per_size:  # every batch ran the simulated GPU's 20 ms
        assert b["compute_infer"]["ns"] >= 20e6 * b["compute_infer"]["count"]
    parts = sum(inference[p]["ns"] for p in ("queue", "compute_input", "compute_infer", "compute_output"))
    assert abs(parts - inference["success"]["ns"]) <= 12 * 1000  # rounding: under 1 us a request
    assert s["last_inference"] > 0

    probe = gw.grpc.get_inference_statistics("probe", as_json=True)["model_stats"][0]
    fail = probe["inference_stats"]["fail"]
    assert int(fail["count"]) == 1 and int(fail["ns"]) > 0
    every = gw.http.get_inference_statistics()["model_stats"]
    assert [m["name"] for m in every] == ["probe", "sim"]
    assert gw.grpc.get_inference_statistics().model_stats[1].inference_count == 12
    assert http_error(lambda: gw.http.get_inference_statistics("nope")).status() == "404"
    assert http_error(lambda: gw.grpc.get_inference_statistics("nope")).status() == "StatusCode.NOT_FOUND"


def test_server_metadata_names_the_extensions(gateway: Callable[..., Gateway]) -> None:
    gw = gateway("--model", "echo", "--workers", "1", workers=1)
    assert gw.http.get_server_metadata()["extensions"] == [
        "binary_tensor_data",
        "model_configuration",
        "model_repository",
        "statistics",
    ]


# --- perf_analyzer ------------------------------------------------------------------------------


def perf_analyzer() -> str:
    """The perf_analyzer to run: $PERF_ANALYZER, else bin/install-perf-analyzer's; skip,
    saying how to install it, when there is none that runs."""
    path = os.environ.get("PERF_ANALYZER") or str(PERF_ANALYZER_HOME / "perf_analyzer")
    if not (shutil.which(path) or os.access(path, os.X_OK)):
        pytest.skip(f"perf_analyzer not installed at {path} (bin/install-perf-analyzer installs it)")
    probe = subprocess.run([path], capture_output=True, text=True, timeout=30)
    if "SYNOPSIS" not in probe.stdout + probe.stderr:
        pytest.skip(f"{path} does not run here: {(probe.stdout + probe.stderr).strip()[-300:]}")
    return path


@pytest.mark.timeout(180)
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_runs_against_the_gateway(
    gateway: Callable[..., Gateway], tmp_path: Path, protocol: str
) -> None:
    """Triton's load tester, unchanged, over each protocol: it reads the configuration,
    loads the model, and prints the server's side (the statistics extension) with counts
    that match its own."""
    binary = perf_analyzer()
    lin = onnx_models.linear(tmp_path / "lin.onnx", inputs=4, outputs=3)
    gw = gateway("--model", f"lin=onnx:{lin}", "--workers", "1", workers=1)
    port = gw.http_port if protocol == "http" else gw.grpc_port
    cmd = [
        binary,
        "-m",
        "lin",
        "-u",
        f"127.0.0.1:{port}",
        "-i",
        protocol,
        "--concurrency-range",
        "4",
        # Windows of a fixed count of requests, taken as stable at once: a loaded 2-core
        # machine makes time windows vary past perf_analyzer's default 10 %.
        "--measurement-mode",
        "count_windows",
        "--measurement-request-count",
        "300",
        "--stability-percentage",
        "1000",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert re.search(r"Throughput: [\d.]+ infer/sec", out), out
    client_count = int(re.search(r"Client:\s+Request count: (\d+)", out).group(1))  # type: ignore[union-attr]
    server = re.search(r"Server:\s+Inference count: (\d+)\s+Execution count: (\d+)", out)
    assert server is not None, out
    server_count = int(server.group(1))  # over the same windows, give or take what is in flight
    assert client_count > 0 and abs(server_count - client_count) <= 8 + client_count // 10, out
    assert 0 < int(server.group(2)) <= int(server.group(1))
    breakdown = re.search(
        r"Avg request latency: \d+ usec \(overhead \d+ usec \+ queue \d+ usec \+ compute input \d+ usec"
        r" \+ compute infer (\d+) usec \+ compute output \d+ usec\)",
        out,
    )
    assert breakdown is not None, out
