"""Multipart send and receive without pyzmq's Python-level wrappers.

pyzmq's `send_multipart` type-checks every frame and combines enum flags in Python
for each one; measured here, a 3-frame message cost 5.1 us that way and 0.6 us
through the Cython socket methods with precomputed int flags (receive: 2.6 us and
2.2 us). On the broker's hot path every request is received once and answered
once, so this is most of what a request costs. The functions are non-blocking:
they raise zmq.Again when there is nothing to receive or no room to send.

Large frames are never copied: past the frames every message starts with (routing ids,
protocol and command frames), a frame is received as a zmq.Frame, which shares libzmq's
buffer, and kept so when it holds ZERO_COPY_BYTES or more; sending a zmq.Frame passes
that buffer on by reference. A smaller frame is copied to bytes, which costs it less.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, cast

import zmq
from zmq.backend import Frame
from zmq.backend import Socket as _BaseSocket

from batcher.wire.protocol import ZERO_COPY_BYTES

_send = _BaseSocket.send
_recv = _BaseSocket.recv
_get = _BaseSocket.get

_MORE = int(zmq.SNDMORE) | int(zmq.NOBLOCK)
_LAST = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)

#: A frame as received: bytes, or a zmq.Frame when large (both are buffers).
Buffer = bytes | Frame


def readable(sock: zmq.Socket[Any]) -> bool:
    """Whether a message waits on `sock` (its ZMQ_EVENTS has POLLIN): half the cost of
    pyzmq's getsockopt with its enum flags.

    Not free: libzmq answers it by looking for commands in the socket's mailbox, two
    system calls (getpid, poll) whenever none waits, 2.3 us on this VM. So the drain loops
    ask it once, after a poll's first message, and read on until zmq.Again only if another
    waits: a lone message is never followed by a raised zmq.Again (15-50 us of a cold CPU
    on its path), a burst of N pays one zmq.Again (~5 us hot) instead of N queries. Asked
    after every message, the broker's event loop made 3x the system calls a batch at 64
    in flight (33 polls a batch against v1's 10; perf stat)."""
    return bool(cast(int, _get(sock, _EVENTS)) & _POLLIN)


def send_frames(sock: zmq.Socket[Any], frames: list[Any]) -> None:
    """Send `frames` as one multipart message, without blocking; a large frame is passed
    to libzmq by reference (pyzmq keeps the object alive until libzmq is done with it)."""
    last = len(frames) - 1
    for i in range(last):
        frame = frames[i]
        _send(sock, frame, _MORE, len(frame) < ZERO_COPY_BYTES)
    frame = frames[last]
    _send(sock, frame, _LAST, len(frame) < ZERO_COPY_BYTES)


def send_reply(sock: zmq.Socket[Any], envelope: list[bytes], body: Any) -> None:
    """Send `envelope` then `body` as one message: a reply, with no list built for it."""
    for frame in envelope:
        _send(sock, frame, _MORE)
    _send(sock, body, _LAST)


class Addressed(Protocol):
    """Anything with the envelope its reply goes back on (a queued request)."""

    envelope: list[bytes]


def send_replies(sock: zmq.Socket[Any], requests: Iterable[Addressed], bodies: Iterable[Any]) -> int:
    """Send each body to its request's envelope, back to back (a batch's replies: no call
    and no wrapper between two sends, so libzmq's I/O thread is woken less often); returns
    how many could not go (the client is gone, or not reading: see send_reply)."""
    failed = 0
    for req, body in zip(requests, bodies, strict=True):
        try:
            for frame in req.envelope:
                _send(sock, frame, _MORE)
            _send(sock, body, _LAST)
        except zmq.ZMQError:
            failed += 1
    return failed


def recv_frames(sock: zmq.Socket[Any], copied: int = 1 << 30) -> list[Any]:
    """Receive one whole multipart message, without blocking (zmq.Again when none): the
    first `copied` frames as bytes, the others as bytes or, when large, zmq.Frames.

    Each frame is received as a zmq.Frame, whose `more` pyzmq reads in C: asking the
    socket for ZMQ_RCVMORE instead goes through pyzmq's `Socket.get`, which looks the
    option up in a Python enum (2.0 us a frame on this VM, against 0.6 us for the Frame
    and its copy to bytes)."""
    frame = _recv(sock, _LAST, False)
    parts: list[Any] = [frame.bytes]
    while frame.more:
        frame = _recv(sock, _LAST, False)
        parts.append(frame.bytes if len(parts) < copied or len(frame) < ZERO_COPY_BYTES else frame)
    return parts


def recv_bounded(sock: zmq.Socket[Any], max_frames: int, max_bytes: int) -> tuple[list[Any], bool]:
    """Receive one whole message, keeping at most `max_frames` frames and stopping to
    copy once the frames after the first (the routing id a ROUTER adds) pass `max_bytes`
    in all; returns (frames kept, whether the message was within both limits). The rest
    of an oversized message is received without a copy and dropped at once. The routing
    id and the frame after it (the delimiter, for most clients) are bytes; the body may
    be a zmq.Frame, when large.

    libzmq's MAXMSGSIZE limits each frame only, and libzmq assembles a multipart message
    whole before it is delivered, so this is where a message's total is bounded.
    """
    frame = _recv(sock, _LAST, False)  # each frame a zmq.Frame: see recv_frames
    parts: list[Any] = [frame.bytes]
    total = 0
    while frame.more:
        if len(parts) >= max_frames or total > max_bytes:
            while frame.more:
                frame = _recv(sock, _LAST, False)  # freed right away: no copy made
            return parts, False
        frame = _recv(sock, _LAST, False)
        size = len(frame)
        parts.append(frame.bytes if len(parts) < 2 or size < ZERO_COPY_BYTES else frame)
        total += size
    return parts, total <= max_bytes


def recv_bounded_from(
    sock: zmq.Socket[Any], max_frames: int, max_bytes: int
) -> tuple[list[Any], bool, Frame]:
    """recv_bounded, keeping the message's first frame as a zmq.Frame as well: its
    metadata (`frame.get("User-Id")`, the CURVE key its sender was admitted with) says
    who sent the message. For a broker with --curve-admins only: the Frame costs about
    0.4 us a message more than recv_bounded (3.7 and 4.2 us measured over inproc), which
    `batcher bench` does not tell from noise."""
    first = frame = _recv(sock, _LAST, False)
    parts: list[Any] = [first.bytes]
    total = 0
    while frame.more:
        if len(parts) >= max_frames or total > max_bytes:
            while frame.more:
                frame = _recv(sock, _LAST, False)
            return parts, False, first
        frame = _recv(sock, _LAST, False)
        size = len(frame)
        parts.append(frame.bytes if len(parts) < 2 or size < ZERO_COPY_BYTES else frame)
        total += size
    return parts, total <= max_bytes, first
