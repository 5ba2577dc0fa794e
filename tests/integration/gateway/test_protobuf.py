"""The gateway installs beside Triton's and KServe's clients: its generated gRPC modules
load on every protobuf from the oldest that tritonclient[grpc] accepts to the newest, and
the gateway's extra says so (pyproject.toml, bin/gen-proto).

Both ends are run for real: protobuf of each end is installed into a scratch directory
(`pip install --target`, seconds: one wheel, from pip's cache after the first run), put
first on the gateway process's PYTHONPATH, and Triton's gRPC client talks to that
gateway. A throwaway venv per end would cost a minute each; the client side stays on the
test environment's own protobuf, as a client's process would."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
from packaging.requirements import Requirement
from packaging.version import Version

from batcher.gateway import inference_pb2, inference_pb2_grpc
from batcher.serve.launcher import free_tcp_address
from tests.helpers import wait_until
from tests.integration.gateway.test_gateway import free_port, http_status, wait_gateway

ROOT = Path(__file__).resolve().parents[3]


def extra(name: str) -> dict[str, Requirement]:
    """The requirements of one of pyproject.toml's extras, by project name."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {r.name: r for r in map(Requirement, project["optional-dependencies"][name])}


def lower_bound(req: Requirement) -> Version:
    bounds = [Version(s.version) for s in req.specifier if s.operator in (">=", "==")]
    assert len(bounds) == 1, f"{req} has no single lower bound"
    return bounds[0]


def tritonclient_protobuf() -> Requirement:
    """What the installed tritonclient[grpc] asks of protobuf."""
    for raw in importlib.metadata.requires("tritonclient") or []:
        req = Requirement(raw)
        if req.name == "protobuf" and req.marker is not None and req.marker.evaluate({"extra": "grpc"}):
            return req
    raise AssertionError("tritonclient[grpc] does not name protobuf")


def gencode_version() -> Version:
    source = Path(inference_pb2.__file__).read_text()
    found = re.search(r"ValidateProtobufRuntimeVersion\(\s*\S+,\s*(\d+),\s*(\d+),\s*(\d+),", source)
    assert found, "inference_pb2.py has no runtime version check"
    return Version(".".join(found.groups()))


def test_the_declared_range_is_the_generated_code_s_and_holds_the_clients_oldest() -> None:
    """The gateway's protobuf and grpcio lower bounds are what the committed modules need
    (bin/gen-proto's generator), no higher than the oldest protobuf today's
    tritonclient[grpc] accepts, and the test extra asks for the same range."""
    gateway = extra("gateway")
    assert lower_bound(gateway["protobuf"]) == gencode_version()
    assert lower_bound(gateway["grpcio"]) == Version(inference_pb2_grpc.GRPC_GENERATED_VERSION)
    assert lower_bound(gateway["protobuf"]) <= lower_bound(tritonclient_protobuf())
    assert extra("test")["protobuf"].specifier == gateway["protobuf"].specifier
    gen_proto = (ROOT / "bin" / "gen-proto").read_text()
    assert f"tools_version={inference_pb2_grpc.GRPC_GENERATED_VERSION}\n" in gen_proto


@pytest.fixture(scope="module")
def protobuf_at(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, str]]:
    """Factory: protobuf matching `spec` installed into a scratch directory; (the
    directory, the version installed). Skips where pip cannot fetch it."""
    made: dict[str, tuple[Path, str]] = {}

    def install(spec: str) -> tuple[Path, str]:
        if spec not in made:
            target = tmp_path_factory.mktemp("protobuf")
            run = subprocess.run(
                [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), spec],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if run.returncode != 0:
                pytest.skip(f"pip cannot install {spec}: {run.stderr.strip()[-300:]}")
            probe = subprocess.run(
                [sys.executable, "-c", "import google.protobuf as p; print(p.__version__)"],
                capture_output=True,
                text=True,
                env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
                timeout=60,
            )
            made[spec] = (target, probe.stdout.strip())
        return made[spec]

    return install


def range_ends() -> list[str]:
    return [f"protobuf=={lower_bound(tritonclient_protobuf())}", str(extra("gateway")["protobuf"])]


@pytest.mark.integration
@pytest.mark.timeout(180)
@pytest.mark.parametrize("spec", range_ends(), ids=["oldest", "newest"])
def test_grpc_gateway_on_each_end_of_the_protobuf_range(
    spec: str, protobuf_at: Callable[[str], tuple[Path, str]], spawn: Callable[..., object]
) -> None:
    """A gateway whose process runs on the oldest protobuf tritonclient[grpc] accepts,
    and one on the newest the gateway's range allows, serves Triton's gRPC client:
    health, metadata, inference, and Triton's configuration and statistics."""
    target, version = protobuf_at(spec)
    assert Version(version) in Requirement(spec).specifier, (spec, version)
    frontend, backend = free_tcp_address(), free_tcp_address()
    http_port, grpc_port = free_port(), free_port()
    spawn("broker", "--frontend", frontend, "--backend", backend, "--model", "echo")
    spawn("worker", "--connect", backend, "--model", "echo")
    gateway_env = {"PYTHONPATH": f"{target}:{ROOT}"}
    spawn(
        "gateway",
        "--connect",
        frontend,
        "--http-port",
        str(http_port),
        "--grpc-port",
        str(grpc_port),
        env=gateway_env,
    )
    wait_gateway(http_port)
    wait_until(lambda: http_status(http_port, "/v2/health/ready") == 200, 20, "ready")
    seen = subprocess.run(
        [sys.executable, "-c", "import google.protobuf as p; print(p.__version__)"],
        capture_output=True,
        text=True,
        env=gateway_env,
        timeout=60,
    )
    assert seen.stdout.strip() == version  # what the gateway's process imports
    client = tgrpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.get_model_metadata("echo").name == "echo"
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        inp = tgrpc.InferInput("x", [2, 3], "FP32")
        inp.set_data_from_numpy(x)
        result = client.infer("echo", [inp])
        np.testing.assert_array_equal(result.as_numpy(result.get_response().outputs[0].name), x)
        assert client.get_model_config("echo").config.max_batch_size == 8
        assert client.get_inference_statistics("echo").model_stats[0].inference_count == 2
    finally:
        client.close()
