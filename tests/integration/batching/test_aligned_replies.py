"""Aligned tensors (batcher/wire/aligned.py, docs/protocol.md 3.1 "Alignment"): every tensor
batcher writes (worker replies, client requests) has its data at a multiple of 8 bytes
from the body's first byte, whatever precedes it, and decodes to exactly the map of
three keys it was; a real worker's replies, as a client receives them, are aligned
(issue 28 item 22).

The integration half: these tests start processes or measure time; the unit tests
are in tests/unit/wire/test_aligned.py."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import zmq

from batcher.wire import protocol
from tests.unit.wire.test_aligned import DTYPES, _array, _arrays_in, assert_aligned


@pytest.mark.integration
def test_a_real_workers_replies_reach_the_client_aligned(serve, connect):
    """Every datatype, small (joined in one REPLY frame) and large (64 KiB and more, a frame
    of its own), alone and as named outputs, with ids of every length: as the client's
    socket receives each reply body, each tensor's data sits at a multiple of 8."""
    s = serve("--model", "echo", "--workers", "1", "--max-batch-size", "16", "--max-wait-ms", "20", workers=1)
    sock = connect(zmq.DEALER, s.frontend)
    sent: dict[Any, list[Any]] = {}
    k = 0
    for dtype in DTYPES:
        for shape in ((5, 7), (3,), (70_000,)):
            for req_id in (k, "r" * (k % 40), 2**40 + k):
                a = _array(dtype, shape, k)
                b = _array(dtype, shape, k + 10_000)
                payload = a if k % 2 else {"first": a, "second": [b]}
                sent[req_id] = _arrays_in(payload)
                sock.send_multipart([b"", protocol.pack({"id": req_id, "input": payload})])  # unaligned in
                k += 1
    bodies = {}
    for _ in range(len(sent)):
        assert sock.poll(30_000), f"{len(bodies)} of {len(sent)} replies"
        frames = sock.recv_multipart()
        reply = msgpack.unpackb(frames[-1], raw=False)
        assert reply["ok"], reply
        bodies[reply["id"]] = frames[-1]
    assert bodies.keys() == sent.keys()
    for req_id, arrays_in_it in sent.items():
        assert_aligned(bodies[req_id], arrays_in_it)
