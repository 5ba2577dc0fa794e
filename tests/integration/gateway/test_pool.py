"""The gateway's brokers (batcher/gateway/brokers.py) against scripted brokers: which broker
each row goes to as brokers drain, fall silent or lack the model, and the retry of a row
a draining broker refused, or not with `retry` false."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from batcher.gateway import oip
from batcher.gateway.brokers import HEARTBEAT_S, BrokerPool, Row
from batcher.gateway.settings import GatewaySettings
from tests.helpers import Answer, FakeBroker, fake_brokers

pytestmark = pytest.mark.integration  # broker threads and real sockets


@pytest.fixture
def make_broker() -> Iterator[Any]:
    with fake_brokers() as make:
        yield make


def broker(
    stopping: bool = False,
    models: tuple[str, ...] = ("m",),
    refuse: bool = False,
    needed: float | None = None,
) -> Answer:
    """A broker's answers: its stats (each model ready; `stopping`; `needed`: each model's
    scaling entry says so many workers needed), and every row echoed (or, `refuse`,
    refused `shutting_down` as a draining broker does)."""

    def answer(body: dict[str, Any]) -> dict[str, Any] | None:
        if body.get("op") == "stats":
            entry = {"ready": True, "configured": True, "scaling": {"workers_needed": needed}}
            stats = {"stopping": stopping, "models": {m: entry for m in models}}
            return {"id": body["id"], "ok": True, "output": stats}
        if body.get("op"):
            return {"id": body["id"], "ok": True, "output": {}}
        if refuse:
            return {"id": body["id"], "ok": False, "error": {"code": "shutting_down", "message": "draining"}}
        return {"id": body["id"], "ok": True, "output": body["input"]}

    return answer


async def heard(pool: BrokerPool, n: int) -> None:
    """Until `n` brokers have answered a heartbeat's stats."""
    deadline = asyncio.get_running_loop().time() + 5.0
    while sum(b.health.heard_at is not None for b in pool.brokers.values()) < n:
        assert asyncio.get_running_loop().time() < deadline, "no heartbeat answered"
        await asyncio.sleep(0.02)  # polling the heartbeat's answers


async def send_rows(pool: BrokerPool, n: int, retry: bool = True) -> tuple[Counter[str], list[Any]]:
    """`n` rows of model m; (which broker answered each, the answers or errors)."""
    rows = []
    for i in range(n):
        row = Row(pool, "m", {"model": "m", "input": i}, retry)
        row.start(pool.choose("m"), now=True)
        rows.append(row)
    results = await asyncio.gather(*(r.future for r in rows), return_exceptions=True)
    return Counter(r.broker.address for r in rows if r.broker is not None), results


def run(fbs: list[FakeBroker], test: Any) -> None:
    async def main() -> None:
        first, *more = (fb.address for fb in fbs)
        pool = BrokerPool(GatewaySettings(connect=first, extra_connect=tuple(more), http_port=1))
        pool.start()
        try:
            await heard(pool, len(fbs))
            await test(pool)
        finally:
            pool.close()

    asyncio.run(main())


def test_rows_go_only_to_brokers_ready_and_not_draining(make_broker: Any) -> None:
    ready, draining, other = (
        make_broker(broker()),
        make_broker(broker(stopping=True)),
        make_broker(broker(models=("n",))),
    )

    async def test(pool: BrokerPool) -> None:
        where, results = await send_rows(pool, 40)
        assert where == {ready.address: 40} and [r["output"] for r in results] == list(range(40))
        states = {s["broker"]: s for s in pool.states()}
        assert states[draining.address]["draining"] and not states[draining.address]["ready"]
        assert states[ready.address]["rows_total"] == 40 and 'rows_total{broker="' in pool.metrics_text()

    run([ready, draining, other], test)


def test_rows_spread_over_equal_brokers_by_outstanding_rows(make_broker: Any) -> None:
    """Brokers that hold every row (none answered yet): with two, the power of two choices
    always sees both and sends each row to the one holding fewer, so they split evenly."""
    stats_only = broker()

    def holding(body: dict[str, Any]) -> dict[str, Any] | None:
        return stats_only(body) if body.get("op") else None

    a, b = make_broker(holding), make_broker(holding)

    async def test(pool: BrokerPool) -> None:
        rows = []
        for i in range(200):
            row = Row(pool, "m", {"model": "m", "input": i}, True)
            row.start(pool.choose("m"), now=True)
            rows.append(row)
        where = Counter(r.broker.address for r in rows if r.broker is not None)
        assert abs(where[a.address] - where[b.address]) <= 2, where

    run([a, b], test)


def test_a_silent_broker_takes_no_row_from_a_heartbeat_on(make_broker: Any) -> None:
    answering = broker()
    mute = {"on": False}

    def sometimes(body: dict[str, Any]) -> dict[str, Any] | None:
        return None if mute["on"] else answering(body)

    a, b = make_broker(sometimes), make_broker(broker())

    async def test(pool: BrokerPool) -> None:
        mute["on"] = True
        pool.brokers[a.address].health.heard_at = None  # forget, and wait for the next question
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 3 * HEARTBEAT_S + 1.0
        while not pool.health(a.address).silent(loop.time(), HEARTBEAT_S):
            assert loop.time() < deadline, "the broker never became silent"
            await asyncio.sleep(0.02)  # polling the heartbeat
        where, _ = await send_rows(pool, 20)
        assert where == {b.address: 20}

    run([a, b], test)


def test_a_row_refused_by_a_draining_broker_goes_to_another_whatever_retry_says(make_broker: Any) -> None:
    """A `shutting_down` refusal was never queued: the row goes to the other broker, even
    with `retry` false (as MultiClient does), and the refusing broker takes no more rows."""
    refusing, good = make_broker(broker(refuse=True)), make_broker(broker())

    async def test(pool: BrokerPool) -> None:
        for retry, value in ((True, 7), (False, 8)):
            pool.brokers[refusing.address].health.draining = False
            row = Row(pool, "m", {"model": "m", "input": value}, retry=retry)
            row.start(pool.brokers[refusing.address], now=True)
            assert (await row.future)["output"] == value
            assert row.tried == [refusing.address, good.address]
            assert pool.brokers[refusing.address].health.draining  # no more rows for it
        assert pool.retried_total == 2

    run([refusing, good], test)


def test_a_refusal_with_no_other_broker_is_answered_as_it_came(make_broker: Any) -> None:
    refusing = make_broker(broker(refuse=True))

    async def test(pool: BrokerPool) -> None:
        row = Row(pool, "m", {"model": "m", "input": 1}, retry=True)
        row.start(pool.choose("m"), now=True)
        assert (await row.future)["error"]["code"] == "shutting_down" and pool.retried_total == 0

    run([refusing], test)


def test_no_broker_for_the_row_is_unavailable_at_once() -> None:
    async def main() -> None:
        pool = BrokerPool(
            GatewaySettings(connect="tcp://127.0.0.1:1", extra_connect=("tcp://127.0.0.1:2",), http_port=1)
        )
        try:
            with pytest.raises(oip.OipError) as info:
                pool.choose("m")
            assert info.value.code == "unavailable" and "tcp://127.0.0.1:2" in str(info.value)
        finally:
            pool.close()

    asyncio.run(main())


def test_the_gateway_exports_the_workers_its_brokers_need_summed_then_rounded_up(make_broker: Any) -> None:
    """Two cells needing 1.2 and 1.3 workers of model m: the deployment needs 2.5, so 3
    workers are desired (a sum of each cell's rounded-up 2 + 2 would never scale in); a
    model only one broker has counts that broker alone, and a broker without a figure
    (before its first tick) adds nothing."""
    fbs = [
        make_broker(broker(needed=1.2)),
        make_broker(broker(models=("m", "n"), needed=1.3)),
        make_broker(broker(needed=None)),
    ]

    async def check(pool: BrokerPool) -> None:
        text = pool.metrics_text()
        assert 'batcher_workers_needed{model="m"} 2.5' in text
        assert 'batcher_desired_workers{model="m"} 3' in text
        assert 'batcher_workers_needed{model="n"} 1.3' in text
        assert 'batcher_desired_workers{model="n"} 2' in text

    run(fbs, check)
