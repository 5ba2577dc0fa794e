# ruff: noqa: F811 (the gateway fixture, imported)
"""Issue 28's gateway items: a row over the broker's --max-message-bytes is refused by
the gateway (413) without taking the shared link down; an unknown input name and ragged
nested JSON are 400 / INVALID_ARGUMENT; the health endpoints answer v2's JSON bodies."""

from __future__ import annotations

import json
import struct
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from batcher.gateway import inference_pb2 as pb
from batcher.gateway import inference_pb2_grpc as pb_grpc
from batcher.gateway import oip
from batcher.wire.protocol import ErrorCode
from tests import onnx_models
from tests.integration.gateway.test_gateway import PROBE, Gateway, gateway  # noqa: F401 (the fixture)


def post(port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", body, headers or {}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return int(r.status), json.loads(r.read() or b"null")
    except urllib.error.HTTPError as exc:
        return int(exc.code), json.loads(exc.read() or b"null")


def get(port: int, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return int(r.status), json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), json.loads(exc.read())


def json_infer(name: str, shape: list[int], data: Any, datatype: str = "FP32") -> bytes:
    return json.dumps(
        {"inputs": [{"name": name, "datatype": datatype, "shape": shape, "data": data}]}
    ).encode()


def test_ragged_nested_data_is_refused_and_data_that_follows_the_shape_is_taken() -> None:
    with pytest.raises(oip.OipError, match=r"data\[0\] holds 3 values, but shape \[2, 2\] needs 2") as info:
        oip.json_input("x", "FP32", [2, 2], [[1, 2, 3], [4]])
    assert info.value.code == ErrorCode.BAD_REQUEST
    for ragged in ([[1, 2], 3, 4], [[[1, 2]], [[3, 4]]], [[1, 2], [3, 4], []]):
        with pytest.raises(oip.OipError):
            oip.json_input("x", "FP32", [2, 2], ragged)
    want = struct.pack("<8f", *range(8))
    for good in (list(range(8)), [[0, 1, 2, 3], [4, 5, 6, 7]], [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]):
        assert bytes(oip.json_input("x", "FP32", [2, 2, 2], good).data) == want


@pytest.mark.integration
def test_a_row_over_the_brokers_limit_is_413_and_other_clients_are_served(
    gateway: Callable[..., Gateway],
) -> None:
    """A row over 4x --max-message-bytes made libzmq drop the gateway's one connection:
    every request in flight got 503. The gateway knows the broker's limit and refuses it."""
    limit = 64 * 1024
    gw = gateway("--model", PROBE, "--workers", "1", "--max-message-bytes", str(limit), workers=1)
    slow: dict[str, Any] = {}
    body = json_infer("x", [1], ["slow"], "BYTES")
    t = threading.Thread(target=lambda: slow.update(r=post(gw.http_port, "/v2/models/probe/infer", body)))
    t.start()
    try:
        size = 5 * limit  # over the hard limit (4x)
        head = json.dumps(
            {
                "inputs": [
                    {
                        "name": "x",
                        "datatype": "UINT8",
                        "shape": [1, size],
                        "parameters": {"binary_data_size": size},
                    }
                ]
            }
        ).encode()
        status, answer = post(
            gw.http_port,
            "/v2/models/probe/infer",
            head + bytes(size),
            {"Inference-Header-Content-Length": str(len(head))},
        )
        assert status == 413, answer
        assert f"--max-message-bytes ({limit})" in answer["error"]
        between = json_infer("x", [1, 2 * limit], [0] * (2 * limit), "UINT8")  # between the limits
        assert post(gw.http_port, "/v2/models/probe/infer", between)[0] == 413
    finally:
        t.join(30)
    assert slow["r"][0] == 200, slow  # in flight meanwhile: not failed


@pytest.mark.integration
def test_an_unknown_input_name_is_refused_over_http_and_grpc(
    gateway: Callable[..., Gateway], tmp_path: Path
) -> None:
    model = onnx_models.linear(tmp_path / "id.onnx")  # one input, x: FP32 [-1, 4]
    gw = gateway("--model", f"id=onnx:{model}", "--workers", "1", workers=1)
    status, answer = post(gw.http_port, "/v2/models/id/infer", json_infer("zz", [1, 4], [1, 2, 3, 4]))
    assert status == 400 and "unexpected inference input 'zz'" in answer["error"], answer
    stub = pb_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(f"127.0.0.1:{gw.grpc_port}"))  # type: ignore[no-untyped-call]
    tensor = pb.ModelInferRequest.InferInputTensor(name="zz", datatype="FP32", shape=[1, 4])
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(
            pb.ModelInferRequest(model_name="id", inputs=[tensor], raw_input_contents=[bytes(16)]), timeout=10
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.integration
def test_health_endpoints_answer_v2_json_bodies(gateway: Callable[..., Gateway]) -> None:
    gw = gateway("--model", "echo", "--workers", "1", workers=1)
    assert get(gw.http_port, "/v2/health/live") == (200, {"live": True})
    assert get(gw.http_port, "/v2/health/ready") == (200, {"ready": True})
    assert get(gw.http_port, "/v2/models/echo/ready") == (200, {"name": "echo", "ready": True})
    assert get(gw.http_port, "/v2/models/nope/ready") == (503, {"name": "nope", "ready": False})
