"""ONNX models served as they are (`--model onnx:PATH`, workers/onnx_model.py): the served
outputs are exactly what onnxruntime gives offline, with one input or several named
inputs and outputs; a file that does not load stops `serve` with its reason.

The integration half: these tests start processes or measure time; the unit tests
are in tests/unit/workers/test_onnx_model.py."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from batcher.serve.launcher import free_tcp_address
from tests import onnx_models
from tests.unit.workers.test_onnx_model import np, offline


@pytest.mark.integration
def test_served_outputs_equal_the_offline_ones(serve, client, tmp_path: Path) -> None:
    path = onnx_models.linear(tmp_path / "linear.onnx", inputs=8, outputs=5, seed=3)
    s = serve("--model", f"onnx:{path}", "--workers", "1", "--max-wait-ms", "20", workers=1)
    rows = np.random.default_rng(4).standard_normal((40, 8)).astype(np.float32)
    c = client(s.frontend)
    outputs = c.request_many(list(rows), model="linear")
    (expected,) = offline(path, {"x": rows})
    assert all(np.array_equal(o, e) for o, e in zip(outputs, expected, strict=True))
    assert c.control("stats")["models"]["linear"]["mean_batch_size"] > 1  # batched, and still exact


@pytest.mark.integration
def test_an_onnx_path_is_served_listed_defaulted_and_ready_under_its_files_stem(
    serve, client, cli, tmp_path: Path
) -> None:
    """The README's `--model onnx:PATH`: the broker configures the name the worker
    announces (the file's stem), so it is listed once, a request without `model` gets
    it, `batcher ready` passes, and so does the gateway's readiness."""
    import urllib.request

    path = onnx_models.linear(tmp_path / "digits.onnx", inputs=4, outputs=3, seed=1)
    http_port = int(free_tcp_address().rsplit(":", 1)[1])
    s = serve("--model", f"onnx:{path}", "--workers", "1", "--http-port", str(http_port), workers=1)
    c = client(s.frontend, timeout_s=10)
    models = c.control("stats")["models"]
    assert list(models) == ["digits"], models
    assert models["digits"]["configured"] and models["digits"]["workers"] == 1
    row = np.arange(4, dtype=np.float32)
    (expected,) = offline(path, {"x": row[None]})
    assert np.array_equal(c.request(row), expected[0])  # no `model`: the default is the file's stem
    result = cli("ready", "--connect", s.frontend, "--timeout-s", "5")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ready: digits (1 worker)"
    deadline = time.monotonic() + 20
    while True:  # the gateway process starts beside the broker: wait for its port
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=5) as r:
                assert r.status == 200
                break
        except OSError:
            if time.monotonic() > deadline:
                raise


@pytest.mark.integration
def test_serve_stops_with_the_reason_when_the_file_does_not_load(cli, tmp_path: Path) -> None:
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not an onnx model")
    for model, reason in ((broken, f"cannot serve {broken}: "), (tmp_path / "none.onnx", "no such file")):
        addresses = ["--frontend", free_tcp_address(), "--backend", free_tcp_address()]
        result = cli("serve", "--model", f"onnx:{model}", "--workers", "1", *addresses, timeout_s=60)
        assert result.returncode != 0
        assert reason in result.stderr, result.stderr


@pytest.mark.integration
def test_the_signature_checks_each_request_alone_and_metadata_returns_it(
    serve, connect, client, cli, tmp_path
) -> None:
    import zmq

    from batcher.wire.protocol import pack
    from tests.helpers import recv_replies

    path = onnx_models.sum_and_product(tmp_path / "sp.onnx")
    s = serve(
        "--model", f"sp=onnx:{path}", "--workers", "1", "--max-wait-ms", "50", "--policy", "window", workers=1
    )
    c = client(s.frontend)
    meta = c.control("metadata", model="sp")

    def spec(name: str) -> dict[str, Any]:
        return {"name": name, "datatype": "FP32", "shape": [-1, 2]}

    assert meta == {
        "name": "sp",
        "ready": True,
        "inputs": [spec("a"), spec("b")],
        "outputs": [spec("sum"), spec("prod")],
    }
    assert c.control("stats")["models"]["sp"]["signature"] == {k: meta[k] for k in ("inputs", "outputs")}
    table = cli("stats", "--connect", s.frontend).stdout
    assert "sp: inputs a FP32 [-1, 2], b FP32 [-1, 2]; outputs sum FP32 [-1, 2], prod FP32 [-1, 2]" in table
    one = np.ones(2, np.float32)
    inputs = [
        {"a": one, "b": one},
        {"a": one},  # missing b
        {"a": one, "b": np.ones(2, np.float64)},  # wrong datatype
        {"a": one, "b": np.ones(3, np.float32)},  # wrong size
        {"a": 2 * one, "b": one},
    ]
    sock = connect(zmq.DEALER, s.frontend)
    for i, x in enumerate(inputs):
        sock.send_multipart([b"", pack({"id": i, "model": "sp", "input": x})])
    replies = {r["id"]: r for r in recv_replies(sock, len(inputs))}
    assert [replies[i]["ok"] for i in range(5)] == [True, False, False, False, True]
    assert replies[1]["error"]["message"].endswith("missing ['b'], unknown []")
    assert replies[2]["error"]["message"] == "input 'b' must be FP32, got 'FP64'"
    assert "input 'b' must have shape [2]" in replies[3]["error"]["message"]
    assert {replies[i]["error"]["code"] for i in (1, 2, 3)} == {"bad_request"}
    assert replies[0]["batch_size"] == replies[4]["batch_size"] == 2  # the good ones batched together
    with pytest.raises(Exception, match="no model 'nope'"):
        c.control("metadata", model="nope")
