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
