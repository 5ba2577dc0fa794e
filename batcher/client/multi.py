"""MultiClient: one request at a time to the first of several brokers that is up,
through a Client each, a broker that stops answering taken out of the rotation for a
back-off (batcher.core.link) and probed back in."""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from collections.abc import Iterable
from typing import Any

import zmq

from batcher.client.core import (
    BlockingRequests,
    StreamArgs,
    _Awaited,
    reply_wait_s,
    request_fields,
    takes,
    timeout_reply,
)
from batcher.client.sync import Client, PendingReply, Stream
from batcher.core.expiry import Attempts, Resend, check_retries, expire
from batcher.core.link import Backoff, Drop, PeerLink
from batcher.core.versions import parse_version
from batcher.errors import SettingsError
from batcher.wire.errors import (
    CLOSED,
    ClientClosed,
)
from batcher.wire.protocol import ErrorCode

log = logging.getLogger("batcher.client")


class _Frontend:
    """One broker frontend of a MultiClient: its Client and whether it is taken for down
    (until `down_until`, then probed); its back-off is a link's (batcher/core/link.py)."""

    def __init__(self, client: Client, down_s: float, max_down_s: float) -> None:
        self.client = client
        self.address = client.address
        self.link = PeerLink(Backoff(initial_s=down_s, cap_s=max_down_s))
        self.down_until: float | None = None  # None: up
        self.probe: PendingReply | None = None  # a `stats` request asking whether it is back
        self.sent = 0  # attempts sent here, for spreading and for tests
        self.timeouts = 0

    @property
    def up(self) -> bool:
        return self.down_until is None

    def mark_up(self, now: float) -> None:
        """It answered: up, and its back-off starts again from `down_s`."""
        self.down_until = None
        self.link.heard(now)

    def mark_down(self, now: float, why: str) -> float:
        """No answer (or `why`): down for the back-off's next wait, which it returns."""
        drop = self.link.refused(why, now)
        assert isinstance(drop, Drop)  # a frontend is never given up on
        self.down_until = now + drop.retry_in_s
        return drop.retry_in_s


class MultiPending(_Awaited):
    """A MultiClient request in flight; `result()` waits for it while serving the others."""

    def __init__(self, multi: MultiClient, fields: dict[str, Any], wait_s: float | None) -> None:
        self._multi = multi
        self.fields = fields
        self.wait_s = wait_s
        self.attempts = 0  # sends, on whichever frontend
        self.timeouts = 0
        self.tried: list[str] = []  # the frontend of each attempt, in order
        self.reply: dict[str, Any] | None = None
        self._frontend: _Frontend | None = None
        self._inner: PendingReply | None = None
        self._pinned = False  # a control request for one given frontend: never moved

    @property
    def address(self) -> str | None:
        """The frontend of the latest attempt."""
        return self.tried[-1] if self.tried else None

    def _wait(self) -> None:
        self._multi._wait_for(self)

    def cancel(self) -> None:
        """Ask the broker holding it to drop this request if it is still queued."""
        if self.reply is None and self._frontend is not None and self._inner is not None:
            self._frontend.client.send_cancel(self._inner.request_id)


class MultiClient(BlockingRequests):
    """Spreads requests round-robin over several broker frontends (one Client each,
    driven through its public methods: start, receive_ready, forget, send_cancel).

    A frontend whose request gets no reply within `timeout_s` is taken for down: new
    requests skip it for `down_s` seconds, after which it is asked for `stats` (a probe,
    never a user's request); an answer brings it back, silence doubles its back-off (up
    to `max_down_s`). The timed-out request is sent again on another frontend while
    `retries` last, so, as with Client, retries are only for idempotent models: the
    first attempt may still run, and whichever reply comes first is the answer.
    A `shutting_down` reply (a draining broker, which never queued the request) also
    takes its frontend down, and the request goes to another one whatever `retries` says.
    When every frontend is down, requests go to the one due back soonest. Not thread-safe.
    """

    def __init__(
        self,
        addresses: Iterable[str],
        timeout_s: float = 5.0,
        retries: int = 1,
        down_s: float = 1.0,
        max_down_s: float = 30.0,
        context: zmq.Context[Any] | None = None,
        curve_server_key: str | None = None,
        curve_secret_key: str | None = None,
    ) -> None:
        addresses = list(addresses)
        if not addresses:
            raise SettingsError("MultiClient needs at least one address")
        if len(set(addresses)) != len(addresses):
            raise SettingsError(f"duplicate addresses in {addresses}")
        if not timeout_s > 0:
            raise SettingsError(
                f"timeout_s must be > 0 (it is how a down frontend is found), got {timeout_s}"
            )
        check_retries(retries)
        if not 0 < down_s <= max_down_s:
            raise ValueError(f"need 0 < down_s <= max_down_s, got {down_s} and {max_down_s}")
        self.timeout_s = timeout_s
        self.retries = retries
        self.max_down_s = max_down_s
        self._ctx: zmq.Context[Any] = context or zmq.Context.instance()
        self._frontends: list[_Frontend] = []
        self._closed = False
        try:
            for a in addresses:
                c = Client(a, timeout_s, 0, self._ctx, curve_server_key, curve_secret_key)
                self._frontends.append(_Frontend(c, down_s, max_down_s))
        except BaseException:
            self.close()
            raise
        self._poller = zmq.Poller()
        self._by_socket: dict[zmq.Socket[Any], _Frontend] = {}
        for fe in self._frontends:
            self._poller.register(fe.client.socket, zmq.POLLIN)
            self._by_socket[fe.client.socket] = fe
        self._next = 0  # round-robin position
        self._deadlines: list[tuple[float, int, MultiPending, PendingReply]] = []
        self._seq = itertools.count()
        #: Requests sent again on another frontend after a timeout or `shutting_down`.
        self.resent = 0

    # --- lifecycle and state ----------------------------------------------------------------

    def __enter__(self) -> MultiClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every socket; a request still waiting for its reply raises ClientClosed,
        and so does any request made after."""
        self._closed = True
        error = {"code": CLOSED, "message": f"the client of {', '.join(self.addresses)} was closed"}
        for fe in self._frontends:
            fe.client.close()
        # Every attempt in flight has a deadline (a MultiClient always has a timeout).
        for _, _, waiting, inner in self._deadlines:
            if waiting.reply is None and waiting._inner is inner:
                waiting.reply = {"id": inner.request_id, "ok": False, "error": error}
        self._deadlines.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed(f"the client of {', '.join(self.addresses)} is closed")

    @property
    def addresses(self) -> list[str]:
        return [fe.address for fe in self._frontends]

    def down(self) -> list[str]:
        """The frontends currently taken for down."""
        return [fe.address for fe in self._frontends if not fe.up]

    def sent(self) -> dict[str, int]:
        """Attempts sent to each frontend so far (probes not counted)."""
        return {fe.address: fe.sent for fe in self._frontends}

    @property
    def duplicates_dropped(self) -> int:
        """Replies that matched no waiting request (late, or a resent request's second)."""
        return sum(fe.client.duplicates_dropped for fe in self._frontends)

    # --- requests ---------------------------------------------------------------------------

    @takes(request_fields)
    def submit(self, fields: dict[str, Any]) -> MultiPending:
        """Send a request to the next frontend that is up, without waiting."""
        return self._submit(fields)

    def _submit(self, fields: dict[str, Any]) -> MultiPending:
        self._check_open()
        wait_s = reply_wait_s(self.timeout_s, fields.get("timeout_ms"))
        assert wait_s is not None  # a MultiClient always has a timeout: it is how it finds a dead broker
        pending = MultiPending(self, fields, wait_s)
        self._send(pending, time.monotonic())
        return pending

    def control(self, op: str, address: str | None = None, **fields: Any) -> Any:
        """Send a control request (`stats`; `reload` with model=NAME), with `fields` as
        Client.control takes them, to the next frontend that is up, or to `address`
        only (no resend elsewhere), and return its output."""
        self._check_open()
        pending = MultiPending(self, {"op": op, **fields}, self.timeout_s)
        if address is None:
            self._send(pending, time.monotonic())
        else:
            matches = [fe for fe in self._frontends if fe.address == address]
            if not matches:
                raise SettingsError(f"{address} is not one of {self.addresses}")
            pending._pinned = True
            self._send_to(pending, matches[0])
        return pending.result()

    @takes(StreamArgs)
    def stream(self, args: StreamArgs) -> Stream:
        """Send a streamed request to the next frontend that is up and iterate over its
        chunks, as Client.stream does. A stream is never moved to another frontend: its
        chunks already given cannot be taken back."""
        self._check_open()
        if args.version is not None:
            parse_version(args.version)  # a bad one raises before a frontend is picked
        fe = self._pick(time.monotonic(), None)
        fe.sent += 1
        return fe.client.stream(*args)

    # --- machinery --------------------------------------------------------------------------

    def _pick(self, now: float, avoid: _Frontend | None) -> _Frontend:
        """The next frontend that is up, round-robin; else the one due back soonest."""
        n = len(self._frontends)
        for k in range(n):
            fe = self._frontends[(self._next + k) % n]
            if fe.up and fe is not avoid:
                self._next = (self._next + k + 1) % n
                return fe
        others = [fe for fe in self._frontends if fe is not avoid] or self._frontends
        return min(others, key=lambda fe: fe.down_until or now)

    def _send(self, pending: MultiPending, now: float, avoid: _Frontend | None = None) -> None:
        self._send_to(pending, self._pick(now, avoid))

    def _send_to(self, pending: MultiPending, fe: _Frontend) -> None:
        inner = fe.client.start(pending.fields, pending.wait_s)
        inner.owner = pending
        fe.sent += 1
        pending._frontend, pending._inner = fe, inner
        pending.attempts += 1
        pending.tried.append(fe.address)
        if inner.deadline is not None:  # always: a MultiClient's wait_s is never None
            heapq.heappush(self._deadlines, (inner.deadline, next(self._seq), pending, inner))

    def _mark_down(self, fe: _Frontend, now: float, why: str) -> None:
        if fe.up:
            down_s = fe.mark_down(now, why)
            log.warning("frontend %s taken for down for %.1fs: %s", fe.address, down_s, why)

    def _wait_for(self, target: MultiPending) -> None:
        while target.reply is None:
            now = time.monotonic()
            self._expire_due(now)
            self._probe(now)
            if target.reply is not None:
                return
            wakes = [self._deadlines[0][0]] if self._deadlines else []
            wakes += [fe.probe.deadline for fe in self._frontends if fe.probe and fe.probe.deadline]
            timeout_ms = -1
            if wakes:
                timeout_ms = max(0, math.ceil((min(wakes) - now) * 1000))
            for sock, _ in self._poller.poll(timeout_ms):
                self._receive(self._by_socket[sock])

    def _receive(self, fe: _Frontend) -> None:
        now = time.monotonic()
        for inner in fe.client.receive_ready():
            assert inner.reply is not None
            if not fe.up:
                log.info("frontend %s answers again", fe.address)
            fe.mark_up(now)  # any answer shows it is up
            if fe.probe is inner:
                fe.probe = None
                continue
            if isinstance(inner.owner, MultiPending):
                self._settle(inner.owner, fe, inner.reply)

    def _settle(self, pending: MultiPending, fe: _Frontend, reply: dict[str, Any]) -> None:
        error = reply.get("error") if not reply.get("ok") else None
        if (
            isinstance(error, dict)
            and error.get("code") == ErrorCode.SHUTTING_DOWN
            and not pending._pinned
            and len(set(pending.tried)) < len(self._frontends)
        ):
            now = time.monotonic()
            self._mark_down(fe, now, "it is shutting down")
            self.resent += 1
            self._send(pending, now, avoid=fe)
            return
        pending.reply = reply

    def _expire_due(self, now: float) -> None:
        """Requests past their deadline: take their frontend for down and send them again
        elsewhere while retries last, else answer them with a timeout."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, pending, inner = heapq.heappop(self._deadlines)
            if pending.reply is not None or pending._inner is not inner:
                continue  # answered, or already sent again
            fe = pending._frontend
            assert fe is not None
            fe.client.forget(inner.request_id)  # a reply that still comes is dropped there
            fe.timeouts += 1
            self._mark_down(fe, now, f"no reply within {pending.wait_s}s")
            pending.timeouts += 1
            retries = 0 if pending._pinned else self.retries
            if isinstance(expire(Attempts(pending.timeouts, pending.wait_s), now, retries), Resend):
                self.resent += 1
                self._send(pending, now, avoid=fe)
                continue
            message = f"no reply after {pending.attempts} attempt(s): {', '.join(pending.tried)}"
            pending.reply = timeout_reply(inner.request_id, message)

    def _probe(self, now: float) -> None:
        """Ask each down frontend whose back-off is over whether it is back; a probe
        that goes unanswered doubles the back-off."""
        for fe in self._frontends:
            if fe.probe is not None:
                if fe.probe.deadline is not None and now >= fe.probe.deadline:
                    fe.client.forget(fe.probe.request_id)
                    fe.probe = None
                    down_s = fe.mark_down(now, "the probe went unanswered")
                    log.info("frontend %s still down; next try in %.1fs", fe.address, down_s)
            elif fe.down_until is not None and now >= fe.down_until:
                fe.probe = fe.client.start({"op": "stats"}, self.timeout_s)
