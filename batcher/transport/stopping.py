"""SIGINT/SIGTERM as an event that a zmq.Poller can wait on.

pyzmq retries an interrupted poll after running Python's signal handlers, so a flag
set by a handler would go unseen until the poll times out. A socketpair registered in
the poller, written by the C-level handler (`signal.set_wakeup_fd`, whichever thread
the signal reached) and by ours, wakes the loop at once instead.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
from collections.abc import Iterator
from types import FrameType

log = logging.getLogger("batcher")

#: The signals that ask a batcher process to stop (drain first, then exit).
STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block SIGINT/SIGTERM in this thread for the duration (none is lost: a pending one is
    delivered on leaving). A child started meanwhile inherits the block through exec, so
    a signal sent to the whole process group while it starts waits for it to decide what
    to do with it instead of killing it (see `workers.worker.run_worker`)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def ignore_stop_signals() -> None:
    """SIGINT and SIGTERM ignored, then unblocked (a pending one is discarded): for a
    process whose parent decides when it stops."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


class StopSignals:
    """Counts SIGINT/SIGTERM received (and SIGHUP, apart, once `install_hangup` is
    called); `fd` becomes readable on each one."""

    def __init__(self) -> None:
        self.count = 0
        self.hangups = 0  # SIGHUPs: "reload", never "stop"
        self._installed = False
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)

    @property
    def fd(self) -> int:
        """Register this in a zmq.Poller for POLLIN; poll() reports it by this number."""
        return self._r.fileno()

    def install(self) -> StopSignals:
        """Route SIGINT and SIGTERM to this object (main thread only), and unblock them in
        case they were inherited blocked (see `stop_signals_blocked`)."""
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)
        # Python runs a handler in the main thread only once that thread runs Python code
        # again; a signal the kernel gave to another thread (a heartbeat or metrics thread)
        # leaves the main thread asleep in its poll. The wake-up fd is written by the C
        # handler in whatever thread took the signal, so the poll wakes at once.
        signal.set_wakeup_fd(self._w.fileno(), warn_on_full_buffer=False)
        self._installed = True
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        return self

    def install_hangup(self) -> StopSignals:
        """Count SIGHUP in `hangups` (main thread only): `serve` reloads on it."""
        signal.signal(signal.SIGHUP, self._hangup)
        return self

    def _hangup(self, signum: int, frame: FrameType | None) -> None:
        log.info("received SIGHUP")
        self.hangups += 1
        with contextlib.suppress(OSError):
            self._w.send(b"\0")

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
        if self._installed:
            with contextlib.suppress(ValueError):  # not the main thread: nothing to undo there
                previous = signal.set_wakeup_fd(-1)
                if previous != self._w.fileno():
                    signal.set_wakeup_fd(previous)  # another's since: it stays
        self._r.close()
        self._w.close()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        log.info("received %s", signal.Signals(signum).name)
        self.trigger()
