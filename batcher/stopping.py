"""SIGINT/SIGTERM as an event that a zmq.Poller can wait on.

pyzmq retries an interrupted poll after running Python's signal handlers, so a flag
set by a handler would go unseen until the poll times out. A socketpair written by
the handler and registered in the poller wakes the loop at once instead.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
from types import FrameType

log = logging.getLogger("batcher")


class StopSignals:
    """Counts SIGINT/SIGTERM received; `fd` becomes readable on each one."""

    def __init__(self) -> None:
        self.count = 0
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)

    @property
    def fd(self) -> int:
        """Register this in a zmq.Poller for POLLIN; poll() reports it by this number."""
        return self._r.fileno()

    def install(self) -> StopSignals:
        """Route SIGINT and SIGTERM to this object (main thread only)."""
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)
        return self

    def trigger(self) -> None:
        """Act as if a signal arrived: used by the handler and by tests."""
        self.count += 1
        with contextlib.suppress(OSError):
            self._w.send(b"\0")

    def clear(self) -> None:
        """Empty the wake-up pipe after the poller reported it readable."""
        with contextlib.suppress(OSError):
            self._r.recv(4096)

    def close(self) -> None:
        self._r.close()
        self._w.close()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        log.info("received %s", signal.Signals(signum).name)
        self.trigger()
