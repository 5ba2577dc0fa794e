"""Which version answers, end to end (issue 33, docs/models.md): the Python clients'
`version=`, the reply's `version` (through ZeroMQ, a cache hit, the gateway's HTTP and
gRPC `model_version`), the gateway's input names per version, and the repository calls
of a gateway over two brokers."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
thttp = pytest.importorskip("tritonclient.http")
tgrpc = pytest.importorskip("tritonclient.grpc")

from tritonclient.utils import InferenceServerException  # noqa: E402

from batcher.client import AsyncClient, Client, MultiClient  # noqa: E402
from tests import onnx_models  # noqa: E402
from tests.helpers import wait_until  # noqa: E402
from tests.integration.gateway.test_gateway import free_port, http_status, wait_gateway  # noqa: E402
from tests.integration.models.test_repository import PY_MODEL, ROW, config  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def two_versions(root: Path) -> tuple[Path, Path]:
    """lin/1 (input `x`) and lin/2 (input `z`), of different weights, both served."""
    paths = []
    for v, name in ((1, "x"), (2, "z")):
        (root / "lin" / str(v)).mkdir(parents=True)
        paths.append(onnx_models.linear(root / "lin" / str(v) / "model.onnx", seed=v, input_name=name))
    config(root, "lin", 'version_policy = "all"\nworkers = 1\nmax_wait_ms = 1\n')
    return paths[0], paths[1]


def expected(path: Path) -> np.ndarray:
    """What the ONNX file at `path` answers to ROW (onnxruntime in the test)."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return session.run(None, {name: ROW[None]})[0][0]  # type: ignore[no-any-return]


def http_infer(tc: Any, name: str, version: str = "") -> tuple[np.ndarray, str]:
    x = thttp.InferInput(name, [1, 4], "FP32")
    x.set_data_from_numpy(ROW[None])
    result = tc.infer("lin", [x], model_version=version)
    return result.as_numpy("y")[0], result.get_response()["model_version"]


def grpc_infer(gc: Any, name: str, version: str = "") -> tuple[np.ndarray, str]:
    x = tgrpc.InferInput(name, [1, 4], "FP32")
    x.set_data_from_numpy(ROW[None])
    result = gc.infer("lin", [x], model_version=version)
    return result.as_numpy("y")[0], result.get_response().model_version


def test_the_version_named_is_the_one_that_answers_and_says_so(serve, tmp_path: Path) -> None:
    v1, v2 = two_versions(tmp_path / "models")
    http_port, grpc_port = free_port(), free_port()
    s = serve(
        "--model-repository", str(tmp_path / "models"),
        "--http-port", str(http_port), "--grpc-port", str(grpc_port),
        "--cache-bytes", "100000", "--cache-model", "lin/1",
        workers=2,
    )  # fmt: skip
    one, two = expected(v1), expected(v2)
    with Client(s.frontend, timeout_s=10) as c:
        assert np.array_equal(c.request(ROW, "lin", version=1), one)
        reply = c.request_reply(ROW, "lin", version="2")
        assert np.array_equal(reply["output"], two) and reply["version"] == "2"
        newest = c.request_reply(ROW, "lin")  # none named: the newest served
        assert np.array_equal(newest["output"], two) and newest["version"] == "2"
        assert all(np.array_equal(o, one) for o in c.request_many([ROW] * 3, "lin", version=1))
        assert np.array_equal(c.submit(ROW, "lin", version=1).result(), one)
        (chunk,) = list(c.stream(ROW, "lin", version=1))  # a batch model's stream: one chunk
        assert np.array_equal(chunk, one)
        hit = c.request_reply(ROW, "lin", version=1)  # lin/1 is cached: the hit keeps its version
        assert hit.get("cached") is True and hit["version"] == "1"
        with pytest.raises(Exception, match="does not serve version 3"):
            c.request(ROW, "lin", version=3)
        c.control("split", model="lin", traffic={"1": 1, "2": 1})  # none named: split 1:1
        split = sorted(c.request_reply(ROW * 2, "lin")["version"] for _ in range(4))
        assert split == ["1", "1", "2", "2"]

    async def via_async() -> dict[str, Any]:
        async with AsyncClient(s.frontend, timeout_s=10) as ac:
            return await ac.request_reply(ROW * 3, "lin", version=2)

    assert asyncio.run(via_async())["version"] == "2"
    with MultiClient([s.frontend], timeout_s=10) as mc:
        assert mc.request_reply(ROW * 3, "lin", version=1)["version"] == "1"

    wait_until(lambda: http_status(http_port, "/v2/health/ready") == 200, 20, "the gateway ready")
    tc = thttp.InferenceServerClient(f"127.0.0.1:{http_port}")
    gc = tgrpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    for infer, client in ((http_infer, tc), (grpc_infer, gc)):
        out, answered = infer(client, "x", "1")
        assert np.allclose(out, one) and answered == "1"
        out, answered = infer(client, "z", "2")
        assert np.allclose(out, two) and answered == "2"
        # Input names per version: v1's is x, v2's z; each refuses the other's.
        with pytest.raises(InferenceServerException, match="unexpected inference input 'z'"):
            infer(client, "z", "1")
        with pytest.raises(InferenceServerException, match="unexpected inference input 'x'"):
            infer(client, "x", "2")
    with Client(s.frontend, timeout_s=10) as c:
        c.control("split", model="lin", traffic=None)  # none named: the newest again
    out, answered = http_infer(tc, "z")
    assert np.allclose(out, two) and answered == "2"
    assert grpc_infer(gc, "z")[1] == "2"
    with Client(s.frontend, timeout_s=10) as c:
        c.control("split", model="lin", traffic={"1": 1, "2": 1})
    answered_many = sorted(http_infer(tc, "z")[1] for _ in range(4))
    assert answered_many == ["1", "1", "2", "2"]  # the split's pick, each named


def py_repository(root: Path, *names: str) -> None:
    for name in names:
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(PY_MODEL.format(factor=10))
        config(root, name, 'kind = "python"\nworkers = 1\n')


def served_versions(frontend: str, model: str) -> list[int]:
    with Client(frontend, timeout_s=10) as c:
        versions = c.control("stats").get("versions", {})
    return list(versions.get(model, {}).get("served", []))


def test_a_gateway_of_two_brokers_indexes_loads_and_unloads_on_each(serve, spawn, tmp_path: Path) -> None:
    py_repository(tmp_path / "a", "shared", "only_a")
    py_repository(tmp_path / "b", "shared", "only_b")
    a = serve("--model-repository", str(tmp_path / "a"), workers=2)
    b = serve("--model-repository", str(tmp_path / "b"), workers=2)
    port = free_port()
    spawn("gateway", "--connect", a.frontend, "--connect", b.frontend, "--http-port", str(port))
    wait_gateway(port)
    tc = thttp.InferenceServerClient(f"127.0.0.1:{port}")
    wait_until(lambda: len(tc.get_model_repository_index()) == 3, 20, "both brokers in the index")
    index = {(m["name"], m["version"]): m["state"] for m in tc.get_model_repository_index()}
    assert index == {("only_a", "1"): "READY", ("only_b", "1"): "READY", ("shared", "1"): "READY"}

    tc.unload_model("shared")  # on both brokers, answered once both have
    assert served_versions(a.frontend, "shared") == served_versions(b.frontend, "shared") == []
    assert {m["name"]: m["state"] for m in tc.get_model_repository_index()}["shared"] == "UNAVAILABLE"
    tc.load_model("shared")
    assert served_versions(a.frontend, "shared") == served_versions(b.frontend, "shared") == [1]
    tc.unload_model("only_b")  # held by b alone: a's "no such model" is not an error
    assert served_versions(b.frontend, "only_b") == [] and served_versions(a.frontend, "only_a") == [1]
    tc.load_model("only_b")
    assert served_versions(b.frontend, "only_b") == [1]
    with pytest.raises(InferenceServerException, match="missing"):
        tc.load_model("missing")  # on neither: unknown_model
    ready = {m["name"] for m in tc.get_model_repository_index() if m["state"] == "READY"}
    assert ready == {"shared", "only_a", "only_b"}
