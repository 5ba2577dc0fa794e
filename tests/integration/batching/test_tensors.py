"""Tensors on the wire (batcher/wire/tensor.py): every datatype and shape makes the round trip
equal, malformed tensor maps are refused saying why, and the worker hands a model arrays
and answers a malformed tensor alone with `bad_request`.

The integration half: these tests start processes or measure time; the unit tests
are in tests/unit/wire/test_tensor.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from batcher.wire import protocol, tensor
from batcher.wire.tensor import TensorError
from tests.helpers import broker_stats, pack, recv_replies
from tests.unit.wire.test_tensor import _arrays, _random_tensor, _same, t


@pytest.mark.integration
def test_client_async_client_and_multiclient_send_and_receive_arrays(serve, client, zctx):
    import asyncio

    from batcher import AsyncClient
    from batcher.client.multi import MultiClient

    s = serve("--model", "echo", "--workers", "1", "--max-batch-size", "8", workers=1)
    sent = _arrays()
    got = client(s.frontend).request_many(sent)
    assert all(_same(g, x) for g, x in zip(got, sent, strict=True))
    named = client(s.frontend).request({"a": sent[0], "b": [sent[1], "text"]})
    assert _same(named["a"], sent[0]) and _same(named["b"][0], sent[1]) and named["b"][1] == "text"

    async def via_async() -> list[Any]:
        async with AsyncClient(s.frontend, timeout_s=10) as ac:
            return await ac.request_many(sent)

    assert all(_same(g, x) for g, x in zip(asyncio.run(via_async()), sent, strict=True))
    with MultiClient([s.frontend], timeout_s=10, context=zctx) as mc:
        assert all(_same(g, x) for g, x in zip(mc.request_many(sent), sent, strict=True))


@pytest.mark.integration
def test_a_malformed_tensor_gets_bad_request_with_its_id_and_the_rest_are_served(serve, connect, client):
    s = serve("--model", "echo", "--workers", "1", "--max-batch-size", "8", "--max-wait-ms", "50", workers=1)
    sock = connect(zmq.DEALER, s.frontend)
    good = tensor.from_array(np.arange(3, dtype=np.int16))
    for i, value in enumerate([good, t(shape=[-2]), good]):
        sock.send_multipart([b"", pack({"id": i, "model": "echo", "input": value})])
    replies = {r["id"]: r for r in recv_replies(sock, 3)}
    assert replies[1]["error"] == {
        "code": "bad_request",
        "message": "tensor shape must hold ints >= 0, got [-2]",
    }
    assert replies[0]["ok"] and replies[2]["ok"]
    assert tensor.to_array(replies[0]["output"]).tolist() == [0, 1, 2]
    # Counted as the client saw it: a bad request, not a model error.
    outcomes = client(s.frontend).control("stats")["models"]["echo"]["outcomes"]
    assert outcomes == {"ok": 2, "bad_request": 1}


@pytest.mark.integration
def test_batcher_send_takes_and_prints_json_tensors(serve, cli):
    s = serve("--model", "echo", "--workers", "1", workers=1)
    result = cli(
        "send", "--connect", s.frontend,
        '{"datatype": "FP16", "shape": [2, 2], "data": [1, 2.5, -3, 0]}',
        '{"datatype": "BOOL", "shape": [], "data": [true]}',
        timeout_s=30,
    )  # fmt: skip
    assert result.returncode == 0, result
    outputs = [json.loads(line)["output"] for line in result.stdout.splitlines()]
    assert outputs == [
        {"datatype": "FP16", "shape": [2, 2], "data": [1.0, 2.5, -3.0, 0.0]},
        {"datatype": "BOOL", "shape": [], "data": [True]},
    ]


@pytest.mark.integration
def test_batcher_send_refuses_a_malformed_json_tensor(cli):
    result = cli("send", "--connect", "tcp://127.0.0.1:9", '{"datatype": "INT8", "shape": [2], "data": [1]}')
    assert result.returncode == 2
    assert "tensor data has 1 values, but INT8 [2] needs 2" in result.stderr


@pytest.mark.integration
def test_the_broker_and_the_cli_never_import_numpy() -> None:
    import subprocess
    import sys

    code = (
        "import sys, batcher.broker.loop, batcher.cli.commands, batcher.serve.serving; "
        "print('numpy' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr


@pytest.mark.integration
def test_fuzzed_tensors_each_get_one_reply_and_nothing_goes_down(serve, connect, zctx):
    import random

    s = serve("--model", "echo", "--workers", "1", "--max-batch-size", "16", workers=1)
    workers = {
        w["worker"] for w in broker_stats(s.frontend, zctx, timeout_s=5)["models"]["echo"]["worker_list"]
    }
    sock = connect(zmq.DEALER, s.frontend)
    rng = random.Random(17)
    sent = {i: _random_tensor(rng) for i in range(600)}
    for i, value in sent.items():
        sock.send_multipart([b"", pack({"id": i, "model": "echo", "input": value})])
    replies = recv_replies(sock, len(sent), timeout_s=60)
    assert sorted(r["id"] for r in replies) == sorted(sent)  # exactly one each
    for r in replies:
        value = sent[r["id"]]
        try:
            tensor.check(value)
        except TensorError as exc:
            assert r["error"] == {"code": "bad_request", "message": str(exc)}, (value, r)
        else:
            assert r["ok"] and r["output"] == value, (value, r)
    stats = broker_stats(s.frontend, zctx, timeout_s=5)
    assert {w["worker"] for w in stats["models"]["echo"]["worker_list"]} == workers  # none restarted
    assert stats["workers_lost"] == 0


@pytest.mark.integration
def test_tensors_from_empty_to_the_message_size_limit_round_trip(serve, client):
    limit = 1 << 20
    s = serve("--model", "echo", "--workers", "1", "--max-message-bytes", str(limit), workers=1)
    c = client(s.frontend, timeout_s=30)
    overhead = len(protocol.pack({"id": 1, "input": np.zeros(0, np.uint8)}))
    # the client aligns the tensor's data: its keys' headers take up to 7 bytes more
    for size in (0, 1, 4096, 65536, limit - overhead - 8 - 7):
        sent = np.frombuffer(np.random.default_rng(size).bytes(size), dtype=np.uint8)
        assert len(protocol.pack_carrying({"id": 1, "input": sent}, sent)) <= limit
        got = c.request(sent)
        assert got.dtype == np.uint8 and np.array_equal(got, sent), size


@pytest.mark.integration
def test_a_tensor_over_the_limit_raises_too_large_and_the_client_goes_on(serve, client):
    from batcher.client.sync import TooLarge

    limit = 1 << 20
    s = serve("--model", "echo", "--workers", "1", "--max-message-bytes", str(limit), workers=1)
    c = client(s.frontend, timeout_s=30)
    with pytest.raises(TooLarge, match=f"more than {limit} bytes"):
        c.request(np.zeros(limit, np.uint8))
    assert c.request(np.arange(3, dtype=np.uint8)).tolist() == [0, 1, 2]


@pytest.mark.integration
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps (Linux)")
def test_a_worker_has_numpy_loaded_before_its_first_tensor_request(serve, zctx):
    """Issue 28 item 23: a model without a signature is not warmed up, so its first tensor
    request imported numpy (40-170 ms);
    the worker now loads it, and runs a tiny tensor batch, before READY."""
    s = serve("--model", "echo", "--workers", "1", workers=1)
    (entry,) = broker_stats(s.frontend, zctx, timeout_s=5)["models"]["echo"]["worker_list"]
    pid = int(entry["worker"].split("/pid")[1].split("/")[0])
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert "_multiarray_umath" in maps  # numpy's core extension, mapped before any request
