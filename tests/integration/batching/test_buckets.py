"""Length buckets and padding waste end to end: `batcher serve --bucket-by length
--length-buckets ...` never batches requests of different buckets together, and `stats`
reports exactly the padding the worker added."""

from __future__ import annotations

import bisect
import random

import numpy as np
import pytest
import zmq

from batcher.wire import protocol, tensor
from tests.helpers import recv_replies
from tests.integration.operations.test_operations import free_port, sample, scrape

BOUNDS = [16, 32, 64, 128]

pytestmark = pytest.mark.integration


def bucket(length: int) -> int:
    return bisect.bisect_left(BOUNDS, length)


def test_requests_of_different_buckets_never_share_a_batch_and_padding_is_counted(serve, connect, client):
    port = free_port()
    s = serve(
        "--model", "span=tests.fixture_models:LengthSpan", "--workers", "1",
        "--max-batch-size", "8", "--max-wait-ms", "30", "--policy", "window",
        "--bucket-by", "length", "--length-buckets", ",".join(map(str, BOUNDS)), "--metrics-port", str(port),
        workers=1,
    )  # fmt: skip
    sock = connect(zmq.DEALER, s.frontend)
    rng = random.Random(7)
    lengths = [rng.randint(0, 200) for _ in range(120)]
    for i, n in enumerate(lengths):
        x = np.ones((n, 3), np.float32)
        sock.send_multipart([b"", protocol.pack({"id": i, "model": "span", "input": x})])
    replies = {r["id"]: r for r in recv_replies(sock, len(lengths), timeout_s=30)}
    assert sorted(replies) == list(range(len(lengths)))
    padded = real = 0
    batch_sizes = []
    for i, n in enumerate(lengths):
        r = replies[i]
        assert r["ok"], r
        shortest, longest = tensor.to_array(r["output"]).tolist()
        assert shortest <= n <= longest
        assert bucket(shortest) == bucket(longest) == bucket(n), (n, shortest, longest)
        padded += (longest - n) * 3
        real += n * 3
        batch_sizes.append(r["batch_size"])
    assert max(batch_sizes) > 1, "nothing was batched: the test proves nothing"
    stats = client(s.frontend).control("stats")["models"]["span"]
    assert (stats["padded_elements"], stats["real_elements"]) == (padded, real)
    assert stats["padding_waste"] == pytest.approx(padded / real)
    assert (stats["bucket_by"], stats["length_buckets"]) == ("length", BOUNDS)
    metrics = scrape(port)
    assert sample(metrics, "batcher_stacked_elements_total", model="span", kind="padded") == padded
    assert sample(metrics, "batcher_stacked_elements_total", model="span", kind="real") == real
    assert sample(metrics, "batcher_padding_waste_ratio", model="span") == pytest.approx(padded / real)


def test_a_bucketed_model_refuses_a_request_without_a_length_alone(serve, connect):
    s = serve(
        "--model", "span=tests.fixture_models:LengthSpan", "--workers", "1",
        "--bucket-by", "length", "--length-buckets", "8", workers=1,
    )  # fmt: skip
    sock = connect(zmq.DEALER, s.frontend)
    bad_inputs = [[1, 2, 3], np.float32(2.0), np.zeros((), np.float32), {"a": [1]}]
    for i, x in enumerate(bad_inputs):
        sock.send_multipart([b"", protocol.pack({"id": i, "model": "span", "input": x})])
    sock.send_multipart(
        [b"", protocol.pack({"id": "ok", "model": "span", "input": np.zeros((2, 1), np.int8)})]
    )
    replies = {r["id"]: r for r in recv_replies(sock, len(bad_inputs) + 1)}
    for i in range(len(bad_inputs)):
        assert replies[i]["error"]["code"] == "bad_request", replies[i]
        assert "groups requests by length (--bucket-by length)" in replies[i]["error"]["message"]
    assert replies["ok"]["ok"], replies["ok"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--length-buckets", "16,32"], "bucket_by and length_buckets go together"),
        (["--bucket-by", "length"], "bucket_by and length_buckets go together"),
        (["--bucket-by", "length", "--length-buckets", "32,16"], "length buckets must be increasing"),
        (["--bucket-by", "length", "--length-buckets", "0,16"], "length buckets must be increasing"),
        (["--bucket-by", "length", "--length-buckets", "a,b"], "expected lengths like 16,32,64,128"),
        (["--bucket-by", "shape", "--length-buckets", "16"], "'shape' is not 'length'"),
    ],
)
def test_bad_bucket_options_are_a_one_line_usage_error(cli, args, message):
    result = cli("broker", "--frontend", "tcp://127.0.0.1:1", "--backend", "tcp://127.0.0.1:2", *args)
    assert result.returncode == 2, result
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
