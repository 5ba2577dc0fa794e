"""The response cache as workers come and go (batcher.broker.response_cache): a worker's
READY or loss drops the cached replies of each model it serves, a multiplexed worker's
being every model of its catalog, not the pool's name (POOL_NAME) that no request names."""

from __future__ import annotations

from typing import Any

import zmq

from batcher.broker.backend import Backend
from batcher.broker.response_cache import BrokerCache
from batcher.broker.stats import BrokerStats
from batcher.core.multiplex import POOL_NAME, Catalog
from batcher.core.pool import WorkerInfo, WorkerPool
from batcher.core.scheduler import Scheduler
from batcher.wire import protocol
from batcher.wire.protocol import Heartbeat

CATALOG = Catalog(200, {"a/1": 100, "b/1": 100})


def ready(deterministic: bool = True) -> bytes:
    info: dict[str, Any] = {"model": POOL_NAME, "slots": 1, "multiplexed": CATALOG.wire(), "pid": 7}
    if not deterministic:
        info["deterministic"] = False
    return protocol.pack(info)


def fill(cache: BrokerCache) -> None:
    for model in ("a/1", "b/1", "c"):
        cache.lru.put((model, b"k"), b"reply of " + model.encode())


def cached_models(cache: BrokerCache) -> set[str]:
    return {model for model, _ in cache.lru.lru_order()}


def test_a_multiplexed_worker_serves_its_catalogs_models_and_a_plain_one_its_own() -> None:
    assert WorkerInfo(POOL_NAME, 0, 1, catalog=CATALOG).models == ("a/1", "b/1")
    assert WorkerInfo("m", 0, 1).models == ("m",)


def test_a_pool_workers_restart_and_loss_drop_the_cached_replies_of_each_model_of_its_catalog() -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)  # bound nowhere: what the backend sends goes nowhere
    try:
        scheduler = Scheduler()
        pool = WorkerPool(scheduler, Heartbeat(), 1, now=0.0)
        none: Any = lambda *args: None  # noqa: E731
        backend = Backend(sock, scheduler, pool, BrokerStats(), none, none, none, none)
        cache = backend.cache = BrokerCache(10_000, frozenset({"a/1", "b/1", "c"}))
        backend._on_ready(b"w", ready(), 0.0)
        fill(cache)
        backend._on_ready(b"w", ready(), 1.0)  # the same worker again: lost, then joined
        assert cached_models(cache) == {"c"}  # c is no model of its: kept
        fill(cache)
        backend.lost(b"w", "worker disconnected")
        assert cached_models(cache) == {"c"}
        assert cache.caches("a/1")
        backend._on_ready(b"v", ready(deterministic=False), 2.0)
        assert not cache.caches("a/1") and not cache.caches("b/1") and cache.caches("c")
        assert POOL_NAME not in cache.nondeterministic
    finally:
        sock.close(linger=0)
        ctx.term()


def test_a_worker_naming_models_that_do_not_cache_grows_no_table() -> None:
    cache = BrokerCache(10_000, frozenset({"a"}))
    for i in range(100):
        cache.worker_said([f"x{i}"], {"deterministic": False})
    assert cache.nondeterministic == set() and cache.caches("a")
