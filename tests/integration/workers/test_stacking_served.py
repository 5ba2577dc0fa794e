"""Batched arrays for models (workers/stacking.py): stacking, padding and unpadding agree
with numpy, inputs that do not fit are answered alone, and a stacked model is served
end to end.

The integration half: these tests start processes or measure time; the unit tests
are in tests/unit/workers/test_stacking.py."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from batcher.wire import protocol, tensor
from tests.helpers import recv_replies


@pytest.mark.integration
def test_example_mean_pool_and_token_doubler_through_serve(serve, connect):
    s = serve(
        "--model", "pool=examples.python.mymodels:MeanPool",
        "--model", "tokens=examples.python.mymodels:TokenDoubler",
        "--workers", "1", "--max-batch-size", "8", "--max-wait-ms", "100", "--policy", "window",
        workers=2,
    )  # fmt: skip
    sock = connect(zmq.DEALER, s.frontend)
    rows = [np.arange(n * 2, dtype=np.float32).reshape(n, 2) for n in (1, 3, 2)]
    for i, r in enumerate(rows):
        sock.send_multipart([b"", protocol.pack({"id": i, "model": "pool", "input": r})])
    got = {r["id"]: r for r in recv_replies(sock, 3)}
    for i, r in enumerate(rows):
        assert got[i]["ok"], got[i]
        assert np.allclose(tensor.to_array(got[i]["output"]), r.mean(axis=0))
    assert {got[i]["batch_size"] for i in got} == {3}
    ids = [np.array([5, 6, 7], np.int64), np.array([1], np.int64)]
    for i, t in enumerate(ids):
        sock.send_multipart([b"", protocol.pack({"id": i, "model": "tokens", "input": t})])
    got = {r["id"]: r for r in recv_replies(sock, 2)}
    assert [tensor.to_array(got[i]["output"]).tolist() for i in range(2)] == [[10, 12, 14], [2]]


@pytest.mark.integration
def test_serve_bounds_padding_with_max_padded_elements(serve, connect):
    """Through serve (its --max-padded-elements reaches each worker): a request over the
    budget alone is bad_request; two that would pad past it together are both served, in
    one broker batch, by separate model calls."""
    s = serve(
        "--model", "tokens=examples.python.mymodels:TokenDoubler", "--workers", "1",
        "--max-batch-size", "4", "--max-wait-ms", "5000", "--policy", "window",
        "--max-padded-elements", "40",
        workers=1,
    )  # fmt: skip
    sock = connect(zmq.DEALER, s.frontend)
    lengths = {"over": 41, "a": 30, "b": 1, "c": 15}
    for rid, n in lengths.items():
        body = {"id": rid, "model": "tokens", "input": np.arange(n, dtype=np.int64)}
        sock.send_multipart([b"", protocol.pack(body)])
    got = {r["id"]: r for r in recv_replies(sock, 4)}
    assert got["over"]["error"]["code"] == "bad_request", got["over"]
    assert "more than the 40 a batch may (--max-padded-elements)" in got["over"]["error"]["message"]
    for rid in ("a", "b", "c"):
        assert got[rid]["ok"], got[rid]
        assert tensor.to_array(got[rid]["output"]).tolist() == [2 * i for i in range(lengths[rid])]
    assert {got[rid]["batch_size"] for rid in ("a", "b", "c")} == {4}
