"""The response cache's pure rule: bounded bytes, LRU order, per-model keys."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batcher.core.cache import ENTRY_OVERHEAD_BYTES, ResponseCache, input_key
from batcher.errors import SettingsError

ops = st.lists(
    st.tuples(st.sampled_from(["get", "put"]), st.integers(0, 20), st.integers(0, 300)), max_size=200
)


@given(st.integers(0, 2000), ops)
def test_never_exceeds_its_bytes(max_bytes: int, steps: list[tuple[str, int, int]]) -> None:
    cache = ResponseCache(max_bytes)
    for op, k, size in steps:
        key = ("m", bytes([k]))
        if op == "put":
            cache.put(key, b"x" * size)
        else:
            cache.get(key)
        assert cache.used_bytes <= max_bytes
        assert cache.used_bytes == sum(
            len(cache._entries[k]) + ENTRY_OVERHEAD_BYTES for k in cache.lru_order()
        )


@given(ops)
def test_lru_order_matches_a_model(steps: list[tuple[str, int, int]]) -> None:
    cache = ResponseCache(10**9)  # never full: the order alone
    model: list[int] = []
    for op, k, size in steps:
        key = ("m", bytes([k]))
        if op == "put":
            cache.put(key, b"x" * size)
            if k in model:
                model.remove(k)
            model.append(k)
        elif cache.get(key) is not None:
            model.remove(k)
            model.append(k)
    assert [key[1][0] for key in cache.lru_order()] == model


def test_evicts_the_least_recently_used() -> None:
    size = 100 + ENTRY_OVERHEAD_BYTES
    cache = ResponseCache(3 * size)
    for k in b"abc":
        cache.put(("m", bytes([k])), b"x" * 100)
    assert cache.get(("m", b"a")) is not None  # a is now the most recent
    cache.put(("m", b"d"), b"x" * 100)
    assert [k[1] for k in cache.lru_order()] == [b"c", b"a", b"d"]
    assert cache.evictions == 1


def test_models_and_versions_never_share_entries() -> None:
    cache = ResponseCache(10_000)
    cache.put(input_key("m", b"in"), b"one")
    assert cache.get(input_key("m/2", b"in")) is None
    assert cache.get(input_key("other", b"in")) is None
    assert cache.get(input_key("m", b"in")) == b"one"
    stats = cache.stats()["models"]
    assert stats == {
        "m/2": {"hits": 0, "misses": 1, "hit_ratio": 0.0},
        "other": {"hits": 0, "misses": 1, "hit_ratio": 0.0},
        "m": {"hits": 1, "misses": 0, "hit_ratio": 1.0},
    }


def test_an_entry_over_the_bound_is_never_kept() -> None:
    cache = ResponseCache(100)
    cache.put(("m", b"k"), b"x" * 100)
    assert len(cache) == 0 and cache.used_bytes == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_bad_bounds_are_refused(bad: object) -> None:
    with pytest.raises(SettingsError, match="cache_bytes must be an int >= 0"):
        ResponseCache(bad)  # type: ignore[arg-type]


def test_a_models_entries_are_dropped_together_and_their_bytes_freed() -> None:
    cache = ResponseCache(10_000)
    for i in range(3):
        cache.put(input_key("m", b"%d" % i), b"x" * 10)
    cache.put(input_key("m/2", b"0"), b"y" * 10)
    cache.put(input_key("other", b"0"), b"z" * 10)
    assert cache.drop_model("m") == 3
    assert cache.used_bytes == 2 * (10 + ENTRY_OVERHEAD_BYTES) and len(cache) == 2
    assert cache.get(input_key("m", b"0")) is None
    assert cache.get(input_key("m/2", b"0")) == b"y" * 10  # another version keeps its own
    assert cache.drop_model("m") == 0 and cache.drop_model("nothing") == 0


@given(ops, st.sampled_from([str(i) for i in range(5)]))
def test_dropping_a_model_leaves_exactly_the_others(steps: list[tuple[str, int, int]], dropped: str) -> None:
    cache = ResponseCache(2_000)
    for op, k, size in steps:
        key = input_key(str(k % 5), b"%d" % k)
        if op == "put":
            cache.put(key, b"v" * size)
        else:
            cache.get(key)
    kept = [key for key in cache.lru_order() if key[0] != dropped]
    cache.drop_model(dropped)
    assert cache.lru_order() == kept
    assert cache.used_bytes == sum(len(cache.get(k) or b"") + ENTRY_OVERHEAD_BYTES for k in kept)


def test_a_key_is_the_model_and_a_16_byte_digest_of_the_input() -> None:
    model, digest = input_key("m/2", b"input bytes")
    assert model == "m/2" and len(digest) == 16
    assert input_key("m/2", b"input bytes") == (model, digest)
    assert input_key("m/2", b"other bytes")[1] != digest


def test_an_entry_of_exactly_the_bound_is_kept() -> None:
    cache = ResponseCache(100 + ENTRY_OVERHEAD_BYTES)
    cache.put(("m", b"k"), b"x" * 100)
    assert len(cache) == 1 and cache.used_bytes == cache.max_bytes


def test_stats_count_every_hit_miss_and_eviction_per_model() -> None:
    size = 10 + ENTRY_OVERHEAD_BYTES
    cache = ResponseCache(2 * size)
    a, b, c = (input_key("m", x) for x in (b"a", b"b", b"c"))
    assert cache.get(a) is None  # a miss
    cache.put(a, b"x" * 10)
    assert cache.get(a) == b"x" * 10 and cache.get(a) == b"x" * 10  # two hits
    assert cache.get(input_key("n", b"a")) is None and cache.get(input_key("n", b"b")) is None
    cache.put(b, b"y" * 10)
    cache.put(c, b"z" * 10)  # evicts a
    cache.put(input_key("n", b"a"), b"w" * 10)  # evicts b
    assert cache.stats() == {
        "bytes": 2 * size,
        "max_bytes": 2 * size,
        "entries": 2,
        "evictions": 2,
        "models": {
            "m": {"hits": 2, "misses": 1, "hit_ratio": 0.6667},
            "n": {"hits": 0, "misses": 2, "hit_ratio": 0.0},
        },
    }
