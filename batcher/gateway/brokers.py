"""The gateway's brokers: one BrokerLink each, a heartbeat that asks each its `stats`, the
discovery that adds and removes them, and the rows routed over them.

Every HEARTBEAT_S each broker is asked its `stats`: which models it has ready, whether it
drains. A broker lost (its connection closed) or refusing (its handshake failed) takes no
row from that moment; one draining, or silent (asked and not answered within a
heartbeat: a paused process, a partition), from the next heartbeat. Each row goes to one
of the brokers ready for its model (core.routing.eligible), by the power of two choices
on outstanding rows (core.routing.choose_two). A row whose broker is lost while it is in
flight is sent once more to another broker, unless its request said `"retry": false`;
one a draining broker refused (never queued) goes to another whatever it said
(docs/gateway.md, "Many brokers").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Coroutine
from typing import Any

from batcher.core.routing import (
    BrokerHealth,
    choose_round_robin,
    choose_two,
    eligible,
    membership_change,
    workers_needed_total,
)
from batcher.core.scaling import round_up_workers
from batcher.gateway import oip
from batcher.gateway.core import BrokerLink
from batcher.gateway.discovery import Discoverer
from batcher.gateway.settings import GatewaySettings
from batcher.wire.protocol import ErrorCode

log = logging.getLogger("batcher.gateway")

#: How often each broker is asked its `stats`, and how long it may take to answer before
#: it is taken as silent (no new rows).
HEARTBEAT_S = 0.5
#: The error codes after which a row is sent to another broker: its link was lost with it
#: in flight, or it never left (`unavailable`), or a draining broker refused it.
RETRIED_CODES = (ErrorCode.UNAVAILABLE, ErrorCode.SHUTTING_DOWN)


class Broker:
    """One broker: its link, what the gateway knows of it, and the rows it was given."""

    def __init__(self, link: BrokerLink, discovered: bool) -> None:
        self.link = link
        self.health = BrokerHealth()
        self.generation = -1  # the link's generation `health` is about
        self.discovered = discovered
        self.rows_total = 0
        self.retiring = False  # removed by discovery: closed once its rows are answered
        self.asking = False  # a `stats` question in flight

    @property
    def address(self) -> str:
        return self.link.address


class Row:
    """One row of a request, in flight on one broker: `future` is answered once, by the
    broker that answers it last, whatever happens to the ones before."""

    def __init__(self, pool: BrokerPool, model: str, body_fields: dict[str, Any], retry: bool) -> None:
        self.pool, self.model, self.fields = pool, model, body_fields
        self.future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.retries_left = 1 if retry else 0
        self.tried: list[str] = []
        self.broker: Broker | None = None
        self.req_id = 0
        self.cancelled = False  # cancelled at its broker past its deadline
        self.sent_at: float | None = None  # when it first left

    def start(self, broker: Broker, now: bool) -> None:
        """Send it to `broker` (OipError, as BrokerLink.pack and send_packed raise)."""
        self.send_packed(broker, *broker.link.pack(self.fields), now=now)

    def send_packed(self, broker: Broker, req_id: int, body: bytes, now: bool) -> None:
        """Send it to `broker` as packed by its link (OipError as BrokerLink.send_packed)."""
        _, inner = broker.link.send_packed(req_id, body, now=now)
        if self.sent_at is None:
            self.sent_at = asyncio.get_running_loop().time()
        self.broker, self.req_id = broker, req_id
        self.tried.append(broker.address)
        broker.rows_total += 1
        inner.add_done_callback(self._on_answer)

    def _on_answer(self, inner: asyncio.Future[dict[str, Any]]) -> None:
        if self.future.done() or inner.cancelled():
            return
        exc = inner.exception()
        code = exc.code if isinstance(exc, oip.OipError) else None
        if exc is None:
            reply = inner.result()
            if not reply.get("ok"):
                code = (reply.get("error") or {}).get("code")
        # A refusal (shutting_down) was never queued: sent on whatever `retry` says, as
        # MultiClient does, to each broker at most once; a lost row once, if allowed.
        refused = code == ErrorCode.SHUTTING_DOWN
        if (refused or (code in RETRIED_CODES and self.retries_left > 0)) and self._retry(code):
            return
        if exc is not None:
            self.future.set_exception(exc)
        else:
            self.future.set_result(inner.result())

    def _retry(self, code: object) -> bool:
        """Send it to another broker; False when there is none (or it cannot leave)."""
        if code == ErrorCode.SHUTTING_DOWN and self.broker is not None:
            self.broker.health.draining = True  # no more rows until it says otherwise
        timeout_ms = self.fields.get("timeout_ms")
        if isinstance(timeout_ms, int | float) and self.sent_at is not None:  # the same deadline
            spent_ms = (asyncio.get_running_loop().time() - self.sent_at) * 1000.0
            self.fields = {**self.fields, "timeout_ms": max(1.0, timeout_ms - spent_ms)}
            self.sent_at = asyncio.get_running_loop().time()
        for name in self.pool.candidates(self.model, exclude=self.tried):
            broker = self.pool.brokers[name]
            try:
                self.start(broker, now=True)
            except oip.OipError:
                self.tried.append(name)
                continue
            if code != ErrorCode.SHUTTING_DOWN:
                self.retries_left -= 1
            self.pool.retried_total += 1
            return True
        return False

    def forget(self, cancel: bool) -> None:
        """Stop waiting for it; with `cancel`, ask its broker to drop it if queued."""
        if self.broker is not None:
            self.broker.link.forget(self.req_id, cancel)

    def cancel_at_broker(self) -> None:
        """Ask its broker to drop it if still queued (past its deadline)."""
        self.cancelled = True
        if self.broker is not None:
            self.broker.link.cancel(self.req_id)


class BrokerPool:
    """Every broker of the gateway (create inside the event loop; `start` the heartbeat)."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.brokers: dict[str, Broker] = {}
        self.retried_total = 0
        self._turn = 0
        self._random = random.Random()
        self._loop = asyncio.get_running_loop()
        self._discoverers = [Discoverer(spec) for spec in settings.discover]
        self._tasks: set[asyncio.Task[None]] = set()  # held: the loop keeps only weak ones
        for address in settings.addresses():
            self._add(address, discovered=False)  # raises: a key file that does not load

    def start(self) -> None:
        """Start the heartbeat and the discovery (once the loop runs)."""
        self._spawn(self._heartbeat())
        if self._discoverers:
            self._spawn(self._discover())

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = self._loop.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for broker in self.brokers.values():
            broker.link.close()

    def _add(self, address: str, discovered: bool) -> None:
        self.brokers[address] = Broker(BrokerLink(self.settings, address), discovered)
        log.info("broker %s added%s", address, " (discovered)" if discovered else "")

    # --- which broker ------------------------------------------------------------------------

    def health(self, name: str) -> BrokerHealth:
        """The broker's health, its connection state taken from its link now."""
        broker = self.brokers[name]
        link, health = broker.link, broker.health
        if link.generation != broker.generation or not link.up:
            if health.connected or health.heard_at is not None:
                health.lost()
            broker.generation = link.generation
        health.connected = link.up and not broker.retiring
        return health

    def candidates(self, model: str, exclude: list[str] | tuple[str, ...] = ()) -> list[str]:
        """The brokers a new row of `model` may go to, the chosen one first."""
        names = [n for n, b in self.brokers.items() if not b.retiring]
        tier = eligible(names, self.health, model, self._loop.time(), HEARTBEAT_S, exclude)
        if len(tier) <= 1:
            return tier
        if self.settings.routing == "round-robin":
            self._turn += 1
            first = choose_round_robin(tier, self._turn)
        else:
            first = choose_two(tier, lambda n: self.brokers[n].link.outstanding, self._random.randrange)
        return [first] + [n for n in tier if n != first]

    def choose(self, model: str) -> Broker:
        """The broker for a new row of `model`; OipError `unavailable` when none is connected."""
        names = self.candidates(model)
        if not names:  # a handshake may be done with its event not yet read
            for broker in self.brokers.values():
                broker.link.poll_monitor()
            names = self.candidates(model)
        if names:
            return self.brokers[names[0]]
        if len(self.brokers) == 1:  # as one broker's gateway has always said
            (broker,) = self.brokers.values()
            raise oip.OipError(ErrorCode.UNAVAILABLE, broker.link.why_unavailable())
        why = "; ".join(b.link.why_unavailable() for b in self.brokers.values()) or "no broker is known yet"
        raise oip.OipError(ErrorCode.UNAVAILABLE, f"no broker takes rows of model '{model}': {why}")

    def any_link(self) -> BrokerLink:
        """A link for a question about the brokers (metadata, stats): an open one if any."""
        names = self.candidates("")
        if names:
            return self.brokers[names[0]].link
        if not self.brokers:
            raise oip.OipError(ErrorCode.UNAVAILABLE, "no broker is known yet (discovery found none)")
        return next(iter(self.brokers.values())).link

    # --- the heartbeat and discovery ---------------------------------------------------------

    async def _heartbeat(self) -> None:
        while True:
            for name in list(self.brokers):
                broker = self.brokers.get(name)
                if broker is None:
                    continue
                if broker.retiring and (broker.link.outstanding == 0 or not broker.link.up):
                    broker.link.close()
                    del self.brokers[name]
                    log.info("broker %s removed", name)
                    continue
                if self.health(name).connected and not broker.asking:
                    broker.asking = True
                    self._spawn(self._ask(broker))
            await asyncio.sleep(HEARTBEAT_S)

    async def _ask(self, broker: Broker) -> None:
        """One `stats` question; its answer is the broker's health. Unanswered, the broker
        is silent from a heartbeat after the first question it left unanswered."""
        health, link, generation = broker.health, broker.link, broker.link.generation
        if health.asked_at is None:
            health.asked_at = self._loop.time()
        wait_s = self.settings.probe_timeout_ms / 1000.0
        try:
            if link.max_message_bytes is None:
                await link.learn_limits(wait_s)
            reply = await link.call({"op": "stats"}, wait_s)
        except oip.OipError:
            return
        finally:
            broker.asking = False
        if link.generation == generation and reply.get("ok"):
            health.heard(reply.get("output"), self._loop.time())

    async def _discover(self) -> None:
        while True:
            await self.discover_once()
            await asyncio.sleep(self.settings.discover_interval_s)

    async def discover_once(self) -> None:
        """Ask every source; add the brokers they name, retire those none names any more."""
        answers = await asyncio.gather(*(d.resolve() for d in self._discoverers))
        if any(a is None for a in answers):
            for d, a in zip(self._discoverers, answers, strict=True):
                if a is None:
                    log.warning("discovery: %s cannot say now; its brokers are kept", d.spec)
            return
        static = set(self.settings.addresses())
        wanted = {address for answer in answers for address in answer or []} - static
        current = {n for n, b in self.brokers.items() if b.discovered and not b.retiring}
        add, remove = membership_change(current, wanted)
        for address in add:
            old = self.brokers.get(address)
            if old is not None:  # retiring still: it stays
                old.retiring = False
                continue
            try:
                self._add(address, discovered=True)
            except Exception as exc:  # a bad address in the file: the others still serve
                log.error("discovery: cannot connect to %r: %s", address, exc)
        for address in remove:
            self.brokers[address].retiring = True
            log.info("broker %s retiring: no longer discovered", address)

    # --- what the gateway says of its brokers ------------------------------------------------

    def states(self) -> list[dict[str, Any]]:
        """Each broker's state and share of rows, for /metrics."""
        now = self._loop.time()
        out = []
        for name, broker in self.brokers.items():
            h = self.health(name)
            out.append(
                {
                    "broker": name,
                    "up": h.connected,
                    "ready": h.open(now, HEARTBEAT_S) and h.heard_at is not None and bool(h.ready_models),
                    "draining": h.draining,
                    "silent": h.silent(now, HEARTBEAT_S),
                    "outstanding": broker.link.outstanding,
                    "rows_total": broker.rows_total,
                }
            )
        return out

    def metrics_text(self) -> str:
        """The gateway's own Prometheus metrics (`GET /metrics`): each broker's state and
        rows, and the rows retried on another broker."""
        states = self.states()
        families = [
            ("batcher_gateway_broker_up", "gauge", "1 while the gateway is connected to the broker.", "up"),
            ("batcher_gateway_broker_ready", "gauge", "1 while the broker takes new rows.", "ready"),
            ("batcher_gateway_broker_draining", "gauge", "1 while the broker drains.", "draining"),
            ("batcher_gateway_broker_outstanding_rows", "gauge", "Requests in flight.", "outstanding"),
            ("batcher_gateway_broker_rows_total", "counter", "Rows sent to the broker.", "rows_total"),
        ]
        lines = []
        for name, kind, text, key in families:
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            for st in states:
                lines.append(f'{name}{{broker="{_label(st["broker"])}"}} {int(st[key])}')
        needed = workers_needed_total(self.health(n) for n in self.brokers)
        lines += [
            "# HELP batcher_workers_needed Workers the load offered to all the gateway's brokers "
            "needs at their target utilization, summed before rounding up (batcher.core.scaling).",
            "# TYPE batcher_workers_needed gauge",
            *(f'batcher_workers_needed{{model="{_label(m)}"}} {n}' for m, n in sorted(needed.items())),
            "# HELP batcher_desired_workers The workers all the gateway's brokers need: "
            "batcher_workers_needed rounded up, the autoscaler's signal for the whole deployment.",
            "# TYPE batcher_desired_workers gauge",
            *(
                f'batcher_desired_workers{{model="{_label(m)}"}} {round_up_workers(n)}'
                for m, n in sorted(needed.items())
            ),
            "# HELP batcher_gateway_retried_rows_total Rows sent again to another broker.",
            "# TYPE batcher_gateway_retried_rows_total counter",
            f"batcher_gateway_retried_rows_total {self.retried_total}",
        ]
        return "\n".join(lines) + "\n"

    async def all_stats(self) -> list[tuple[Broker, Any]]:
        """Every connected broker's `stats` now (those that answer in the probe timeout;
        a draining one says which models it has configured), a silent one aside."""
        wait_s = self.settings.probe_timeout_ms / 1000.0

        async def one(broker: Broker) -> tuple[Broker, Any]:
            with contextlib.suppress(oip.OipError):
                reply = await broker.link.call({"op": "stats"}, wait_s)
                if reply.get("ok"):
                    broker.health.heard(reply.get("output"), self._loop.time())
                    return broker, reply.get("output")
            return broker, None

        now = self._loop.time()  # a silent broker is not waited for: it would hold the probe
        healths = {n: self.health(n) for n in self.brokers}
        live = [
            b
            for n, b in self.brokers.items()
            if healths[n].connected and not healths[n].silent(now, HEARTBEAT_S)
        ]
        return list(await asyncio.gather(*(one(b) for b in live)))


def _label(value: str) -> str:
    """A Prometheus label value, escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
