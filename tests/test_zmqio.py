"""batcher.zmqio: the non-blocking multipart calls the broker and the gateway use."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from batcher.protocol import ZERO_COPY_BYTES
from batcher.zmqio import readable, recv_frames, send_frames


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    ctx: zmq.Context[Any] = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    for sock in (a, b):
        sock.setsockopt(zmq.LINGER, 0)
    a.bind("inproc://zmqio")
    b.connect("inproc://zmqio")
    try:
        yield a, b
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


def test_readable_says_whether_a_message_waits(pair: tuple[zmq.Socket[Any], zmq.Socket[Any]]) -> None:
    a, b = pair
    assert not readable(b)
    send_frames(a, [b"one", b"two"])
    assert readable(b)
    assert recv_frames(b) == [b"one", b"two"]
    assert not readable(b)
    with pytest.raises(zmq.Again):
        recv_frames(b)


def test_large_frames_come_back_whole(pair: tuple[zmq.Socket[Any], zmq.Socket[Any]]) -> None:
    """A frame past ZERO_COPY_BYTES is sent by reference and received without a copy
    (a zmq.Frame), with the same bytes; the frames before `copied` are always bytes."""
    a, b = pair
    big = bytes(range(256)) * (ZERO_COPY_BYTES // 256 + 1)
    send_frames(a, [b"head", big, big])
    head, first, second = recv_frames(b, copied=2)
    assert head == b"head" and first == big
    assert isinstance(second, zmq.Frame) and second.bytes == big
