"""The broker's response cache (issue 33, item 6): the I/O side of batcher.core.cache.

A request for a model with `cache = true` is keyed by its model's internal key (the queue's
name, so `NAME/2` and `NAME` never share entries) and a digest of its `input` bytes, read as
they are (msgspec.Raw: never decoded). A hit is answered at once, the stored reply re-encoded
with the request's id and `"cached": true`, its output's bytes copied, not decoded. A miss
is forwarded untouched, as every request is; its ok reply is kept when the batch's reply
header counts no error. Never cached: a stream, a model whose worker said
`deterministic: false` in READY, an error reply."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from batcher.core.cache import ResponseCache, input_key


class _Input(msgspec.Struct):
    """A request's `input`, its bytes as they came."""

    input: msgspec.Raw = msgspec.Raw(b"")


_read_input = msgspec.msgpack.Decoder(_Input).decode
_read_reply = msgspec.msgpack.Decoder(dict[str, msgspec.Raw]).decode
_encode = msgspec.msgpack.Encoder().encode
_TRUE = msgspec.Raw(b"\xc3")


class BrokerCache:
    """Which models cache, which said they are not deterministic, and the LRU itself."""

    def __init__(self, max_bytes: int, models: frozenset[str]) -> None:
        self.lru = ResponseCache(max_bytes)
        self.models = models
        self.nondeterministic: set[str] = set()

    def caches(self, model: str) -> bool:
        """Whether `model`'s replies may be cached (a bounded cache, asked for, deterministic)."""
        return model in self.models and model not in self.nondeterministic and self.lru.max_bytes > 0

    def lookup(self, model: str, body: Any, req_id: object) -> tuple[bytes | None, Any]:
        """(the reply of a hit, None) or (None, the key to store the reply under)."""
        try:
            raw = _read_input(body).input
        except msgspec.DecodeError:
            return None, None  # the worker refuses it: nothing to cache
        key = input_key(model, bytes(raw))
        stored = self.lru.get(key)
        if stored is None:
            return None, key
        reply = _read_reply(stored)
        reply["id"] = msgspec.Raw(_encode(req_id))
        reply["cached"] = _TRUE
        return _encode(reply), None

    def store(self, requests: list[Any], replies: list[Any]) -> None:
        """Keep each reply whose request has a key (the batch had no error)."""
        for req, reply in zip(requests, replies, strict=True):
            if req.cache_key is not None:
                self.lru.put(req.cache_key, bytes(reply))

    def worker_said(self, models: Iterable[str], info: Any) -> None:
        """A worker of `models` joined (one, or a multiplexed worker's catalog): their
        entries go (it may run other weights, as in a reload), and a READY's
        `deterministic: false` takes them out for good. Only the models that cache count:
        a worker naming others changes nothing (and grows no table)."""
        cached = [model for model in models if model in self.models]
        for model in cached:
            self.lru.drop_model(model)
        if isinstance(info, dict) and info.get("deterministic") is False:
            self.nondeterministic.update(cached)

    def worker_left(self, models: Iterable[str]) -> None:
        """A worker of `models` left or died: their entries go, so that once a reload's old
        workers are gone no reply of their weights is served again."""
        for model in models:
            if model in self.models:
                self.lru.drop_model(model)


class CacheCollector:
    """The cache's Prometheus metrics, read at scrape time (from prometheus_client's thread:
    a table the loop changed under it is read again): batcher_cache_hits_total{model},
    batcher_cache_misses_total{model}, batcher_cache_bytes."""

    def __init__(self, cache: BrokerCache) -> None:
        self.cache = cache

    def collect(self) -> Any:
        """The three families."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for _ in range(5):
            try:
                counts = [(name, c.hits, c.misses) for name, c in list(self.cache.lru.counts.items())]
                break
            except RuntimeError:
                continue
        else:
            counts = []
        hits = CounterMetricFamily(
            "batcher_cache_hits", "Requests answered from the response cache", labels=["model"]
        )
        misses = CounterMetricFamily(
            "batcher_cache_misses", "Requests of a cached model not found in the cache", labels=["model"]
        )
        for name, hit, miss in counts:
            hits.add_metric([name], hit)
            misses.add_metric([name], miss)
        yield hits
        yield misses
        yield GaugeMetricFamily(
            "batcher_cache_bytes", "Bytes the response cache holds", value=self.cache.lru.used_bytes
        )
