"""What a socket monitor says about one connecting socket (clients and workers alike):
whether it ever reached its broker, and why its handshake failed. A refused CURVE key,
or plaintext against CURVE, otherwise looks just like a broker that is down."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from batcher.transport.security import load_public_key
from batcher.transport.zmqio import recv_frames

#: The socket monitor events that tell why a broker does not answer (ConnectionWatch).
WATCHED_EVENTS = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
#: A client's: also the refused connection attempts, which say that nothing listens.
CLIENT_EVENTS = WATCHED_EVENTS | zmq.EVENT_CONNECT_RETRIED
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
)
#: Handshake failures after which libzmq drops the connection for good (no reconnect):
#: the socket can then never send again, so it must be replaced.
FATAL_HANDSHAKE_FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)


class ConnectionWatch:
    """What a socket monitor says about one connecting socket: whether it ever reached
    the broker, and how its last handshake ended. A refused CURVE key, or plaintext
    against CURVE, otherwise looks just like a broker that is down.

    Events are read only when asked (`poll`): when a timeout's message is written, or
    when a worker's poller says some are waiting, so this costs nothing per request.
    `allow_list` is the broker option that would admit our key (--curve-clients for a
    client, --curve-workers for a worker); `secret_key_file` is our key pair, if any.
    """

    def __init__(
        self,
        sock: zmq.Socket[Any],
        address: str,
        allow_list: str,
        secret_key_file: str | None = None,
        events: int | None = None,
    ) -> None:
        self.address = address
        self.allow_list = allow_list
        self.curve = sock.getsockopt(zmq.MECHANISM) == zmq.CURVE
        # libzmq does not give a socket's public key back: it is read from our key file.
        self.public_key = load_public_key(secret_key_file).decode() if secret_key_file else None
        self._sock = sock
        self.monitor: zmq.Socket[Any] = sock.get_monitor_socket(WATCHED_EVENTS if events is None else events)
        self.monitor.setsockopt(zmq.LINGER, 0)
        self.connected_ever = False
        self.connected = False  # a TCP connection is up now
        self.connected_at = 0.0  # when it came up (time.monotonic)
        self.handshake_ok = False  # ...and its handshake succeeded
        self.handshake_ever = False  # some connection's handshake succeeded
        self.refused = False  # an attempt to connect failed (EVENT_CONNECT_RETRIED, if watched)
        #: A connection closed before its handshake said anything: the peer is no ZeroMQ one.
        self.closed_in_handshake = False
        self._handshake_heard = False  # the current connection's handshake ended, either way
        self.failure: tuple[int, int] | None = None  # (event, value) of the last failed handshake

    def poll(self) -> list[tuple[int, int]]:
        """Read the events waiting, without blocking; returns them as (event, value)."""
        events: list[tuple[int, int]] = []
        while True:
            try:
                frames = recv_frames(self.monitor)
            except zmq.Again:
                return events
            except zmq.ZMQError:  # closed under us: nothing more to learn
                return events
            try:
                message = parse_monitor_message(frames)
            except Exception:  # not a monitor message: nothing to learn from it
                continue
            event, value = int(message["event"]), int(message["value"])
            events.append((event, value))
            if event == zmq.EVENT_CONNECTED:
                self.connected_ever = self.connected = True
                self.connected_at, self._handshake_heard = time.monotonic(), False
            elif event == zmq.EVENT_DISCONNECTED:
                if self.connected and not self._handshake_heard:
                    self.closed_in_handshake = True
                self.connected = self.handshake_ok = False
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.handshake_ok, self.failure = True, None
                self.handshake_ever = self._handshake_heard = True
            elif event in HANDSHAKE_FAILED:
                self.handshake_ok, self.failure = False, (event, value)
                self._handshake_heard = True
            elif event == zmq.EVENT_CONNECT_RETRIED:
                self.refused = True

    @property
    def dead(self) -> bool:
        """Whether libzmq gave up on the connection (refused key, mechanism mismatch)."""
        return self.failure is not None and self.failure[0] in FATAL_HANDSHAKE_FAILURES

    def refusal(self) -> str | None:
        """Why the last handshake failed, with what to check; None if it did not."""
        if self.failure is None:
            return None
        event, value = self.failure
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            if self.public_key is None:
                return (
                    f"the broker refused our throwaway CURVE key (ZAP status {value}): it has a "
                    f"{self.allow_list} list, so give a key pair of ours (--curve-secret-key) listed there"
                )
            return (
                f"the broker refused our CURVE key {self.public_key} (ZAP status {value}): is our "
                f"public key in its {self.allow_list} directory? (it reads that at start and on SIGHUP)"
            )
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                if self.curve:
                    return (
                        "CURVE vs plaintext mismatch: we use CURVE (--curve-server-key) but the "
                        "broker does not (it needs --curve-secret-key)"
                    )
                return "plaintext vs CURVE mismatch: does the broker use CURVE (--curve-server-key)?"
            name = _protocol_error_name(value)
            return f"handshake protocol error {name}: is {self.address} a batcher broker?"
        # No detail: the broker dropped the connection mid-handshake. A plaintext broker
        # takes any plaintext peer, so for us that means CURVE on one side only, or a
        # CURVE server key that is not the broker's.
        if self.curve:
            return (
                f"the CURVE handshake failed ({_strerror(value)}): is --curve-server-key the "
                "broker's public key, and does the broker use CURVE?"
            )
        return (
            f"the handshake failed ({_strerror(value)}): plaintext vs CURVE mismatch? "
            "does the broker use CURVE (--curve-server-key)?"
        )

    def unreachable(self, since: float, now: float, wait_s: float) -> str | None:
        """Why no broker can be reached at the address, once that has held for `wait_s`
        since `since` (a request's send): nothing listens there (every connection refused),
        or the peer is no ZeroMQ one (it closed the connection in the handshake, or never
        answered the handshake). None while that is not known, and for good once a
        handshake succeeded (a broker was there: a restart is waited for as ever)."""
        self.poll()
        if self.handshake_ever or self.failure is not None:
            return None  # a broker, or a CURVE refusal, which `refusal` explains
        if self.closed_in_handshake:
            return (
                f"{self.address} is not a batcher broker: it took the connection and closed it in "
                "ZeroMQ's handshake (is it an HTTP or gRPC port, the gateway's say?)"
            )
        if self.connected:
            if now - max(since, self.connected_at) < wait_s:
                return None
            return (
                f"{self.address} is not a batcher broker (an HTTP server?): it took the connection "
                f"but did not answer ZeroMQ's handshake in {wait_s:g} s (or the broker is frozen)"
            )
        if self.refused and not self.connected_ever and now - since >= wait_s:
            return (
                f"nothing listening at {self.address}: every connection was refused for {wait_s:g} s "
                "(is the broker running, at this address?)"
            )
        return None

    def next_verdict_at(self, since: float, wait_s: float) -> float | None:
        """When `unreachable` may next change its mind with no new event (its `wait_s`
        running out), None if only an event can."""
        if self.handshake_ever or self.failure is not None:
            return None
        return max(since, self.connected_at if self.connected else since) + wait_s

    def hint(self) -> str:
        """Why a request may have got no reply, judged from the events read so far."""
        self.poll()
        why = self.refusal()
        if why is not None:
            return why
        if not self.connected_ever:
            if self.refused:
                return f"nothing listening at {self.address} (every connection was refused)"
            return f"no connection was ever made: is a broker running at {self.address}?"
        if not self.handshake_ever:
            return (
                f"connected, but {self.address} never completed ZeroMQ's handshake: is it a batcher "
                "broker (not an HTTP server)?"
            )
        if not self.connected:
            return f"the connection was lost: is the broker at {self.address} still running?"
        return "connected, but no reply came in time: the broker or its workers may be busy, slow or gone"

    def close(self) -> None:
        """Stop monitoring; call before closing the socket."""
        with contextlib.suppress(zmq.ZMQError):  # the socket is already closed
            self._sock.disable_monitor()
        self.monitor.close(linger=0)


def _protocol_error_name(value: int) -> str:
    for name in dir(zmq):
        if name.startswith("PROTOCOL_ERROR_") and getattr(zmq, name) == value:
            return name.removeprefix("PROTOCOL_ERROR_")
    return hex(value)


def _strerror(value: int) -> str:
    try:
        return zmq.strerror(value)
    except Exception:  # not an errno
        return str(value)
