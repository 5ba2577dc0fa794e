"""batcher.transport.zmqio: the non-blocking multipart calls the broker and the gateway use."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from batcher.transport.zmqio import readable, recv_bounded, recv_bounded_from, recv_frames, send_frames
from batcher.wire.protocol import ZERO_COPY_BYTES


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


@pytest.mark.parametrize(
    "frames",
    [
        [b"one"],
        [b"", b"body"],
        [b"", b"x" * 2000],  # over max_bytes
        [b"a"] * 40,  # over max_frames
        [b"", bytes(ZERO_COPY_BYTES + 10)],  # a zero-copy body, over max_bytes too
    ],
)
def test_recv_bounded_from_gives_what_recv_bounded_does_and_the_first_frame(
    pair: tuple[zmq.Socket[Any], zmq.Socket[Any]], frames: list[bytes]
) -> None:
    """The --curve-admins variant of recv_bounded: the same frames and verdict, and the
    message's first frame as a zmq.Frame (whose metadata names the sender)."""
    a, b = pair
    send_frames(a, frames)
    send_frames(a, frames)
    plain = recv_bounded(b, 32, 1024)
    parts, fits, first = recv_bounded_from(b, 32, 1024)
    assert (parts, fits) == plain
    assert [bytes(p) for p in parts] == [bytes(p) for p in plain[0]]
    assert isinstance(first, zmq.Frame) and first.bytes == frames[0] == parts[0]
    assert fits == (len(frames) < 32 and sum(map(len, frames[1:])) <= 1024)
    assert not readable(b)  # the rest of an oversized message went too
