"""A multiplexed worker's loads and unloads as the broker counts them (BrokerStats.model_loaded):
a REPLY's `load` is the worker's word, so only what its catalog allows counts."""

from __future__ import annotations

from types import SimpleNamespace

from batcher.broker.stats import BrokerStats
from batcher.core.multiplex import Catalog


def test_a_reply_naming_a_model_many_times_unloads_it_once() -> None:
    stats = BrokerStats()
    info = SimpleNamespace(model="multiplexed", catalog=Catalog(2, {"a": 1, "b": 1, "c": 1}))
    stats.model_loaded("a", 5.0, ("b",) * 1000 + ("a", "zzz", "c"), info)
    assert (stats.model("a").cold_loads, stats.model("a").unloads) == (1, 0)
    assert (stats.model("b").unloads, stats.model("c").unloads) == (1, 1)
    assert "zzz" not in stats.models


def test_a_load_from_a_worker_without_that_model_in_its_catalog_counts_nothing() -> None:
    stats = BrokerStats()
    plain = SimpleNamespace(model="m", catalog=None)  # a worker of one model sent a `load`
    stats.model_loaded("m", 5.0, ("m",), plain)
    other = SimpleNamespace(model="multiplexed", catalog=Catalog(2, {"a": 1}))
    stats.model_loaded("m", 5.0, ("a",), other)
    stats.model_loaded("m", 5.0, (), None)  # the worker is gone
    assert stats.model("m").cold_loads == 0 and stats.model("a").unloads == 0


def test_a_reply_counts_the_loads_and_unloads_of_the_brokers_replay_whatever_it_says() -> None:
    """A worker lying in its REPLY's `load` (unloads it did not make, models it never
    loaded) cannot make loads - unloads differ from what the broker takes it to hold."""
    import zmq

    from batcher.broker.backend import Backend
    from batcher.core.limits import BatchSettings, Policy
    from batcher.core.multiplex import POOL_NAME
    from batcher.core.pool import WorkerPool
    from batcher.core.scheduler import QueuedRequest, Scheduler
    from batcher.wire import protocol
    from batcher.wire.protocol import Heartbeat

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)  # bound nowhere: what the backend sends goes nowhere
    try:
        scheduler = Scheduler(BatchSettings(max_batch_size=1, max_wait_ms=0.0, policy=Policy.WINDOW))
        pool = WorkerPool(scheduler, Heartbeat(), 1, now=0.0)
        stats = BrokerStats()
        none: object = lambda *args: None  # noqa: E731
        backend = Backend(sock, scheduler, pool, stats, none, none, none, none)  # type: ignore[arg-type]
        catalog = {"budget_mb": 2, "models": {"a": 1, "b": 1, "c": 1}}
        backend._on_ready(b"w", protocol.pack({"model": POOL_NAME, "pid": 1, "multiplexed": catalog}), 0.0)
        said = (
            ("a", ["b", "c", "b"], ["b", "c", "a"]),  # nothing was held to unload; b and c never loaded
            ("b", [], ["a", "b"]),  # the truth
            ("c", [], ["a", "b", "c"]),  # a was unloaded for c; it says none was
        )
        for t, (model, unloaded, held) in enumerate(said):
            scheduler.enqueue(model, QueuedRequest([b"c", b""], b"\x80", t, float(t)))
            (batch,) = scheduler.due_batches(float(t))
            header = [batch.batch_id, 1.0, [1], 0, 0.0, None, {"ms": 5.0, "unloaded": unloaded, "held": held}]
            backend._on_reply(b"w", protocol.pack(header), [b"\xc0"], float(t) + 0.5)
        loads = {m: stats.model(m).cold_loads for m in "abc"}
        unloads = {m: stats.model(m).unloads for m in "abc"}
        held_now = {m for m, view in scheduler.views().items() if view.workers[0].holds}
        assert loads == {"a": 1, "b": 1, "c": 1} and unloads == {"a": 1, "b": 0, "c": 0}
        assert held_now == {"b", "c"}
        assert sum(loads.values()) - sum(unloads.values()) == len(held_now)
    finally:
        sock.close(linger=0)
        ctx.term()
