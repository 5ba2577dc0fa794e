"""batcher.core.versions alone: version policies, the weighted chooser, which key a request
goes to (no processes)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batcher.core.versions import (
    VersionPolicy,
    VersionTable,
    WeightedChooser,
    parse_traffic,
    split_key,
    version_key,
)
from batcher.errors import SettingsError

weights = st.dictionaries(st.integers(1, 9), st.integers(0, 50), min_size=1).filter(lambda w: any(w.values()))


@given(weights, st.integers(1, 5))
def test_every_run_of_the_total_gives_each_version_exactly_its_weight(w: dict[int, int], runs: int) -> None:
    chooser = WeightedChooser(w)
    total = sum(w.values())
    picks = [chooser.pick() for _ in range(total * runs)]
    assert {v: picks.count(v) for v in w if w[v]} == {v: n * runs for v, n in w.items() if n}


@given(weights)
def test_a_version_is_never_picked_twice_as_often_as_its_weight_in_any_prefix(w: dict[int, int]) -> None:
    """Smooth: at every point, each version's picks stay within one of its exact share."""
    chooser = WeightedChooser(w)
    total = sum(w.values())
    counts = dict.fromkeys(w, 0)
    for i in range(1, 2 * total + 1):
        counts[chooser.pick()] += 1
        for v, n in w.items():
            assert abs(counts[v] - i * n / total) < len(w)


@given(st.lists(st.integers(1, 50), unique=True, min_size=1), st.integers(1, 5))
def test_latest_n_serves_the_newest_n(available: list[int], n: int) -> None:
    assert VersionPolicy.parse(f"latest:{n}").select(available) == tuple(sorted(available)[-n:])
    assert VersionPolicy.parse("all").select(available) == tuple(sorted(available))


@pytest.mark.parametrize(
    ("text", "available", "served"),
    [("specific:1,3", [1, 2, 3, 4], (1, 3)), ("specific:5", [1, 2], ()), ("latest", [1, 2], (2,))],
)
def test_policies(text: str, available: list[int], served: tuple[int, ...]) -> None:
    assert VersionPolicy.parse(text).select(available) == served


@pytest.mark.parametrize("text", ["latest:0", "newest:1", "specific:", "specific:a", "all:2", 3])
def test_a_bad_policy_is_refused_saying_what_it_takes(text: object) -> None:
    with pytest.raises(SettingsError, match="version_policy"):
        VersionPolicy.parse(text)


@pytest.mark.parametrize(
    ("traffic", "problem"),
    [
        ({}, "must map"),
        ({"2": -1}, "weight of version 2"),
        ({"x": 1}, "version must be"),
        ({"2": 0}, "all be 0"),
    ],
)
def test_a_bad_split_is_refused(traffic: object, problem: str) -> None:
    with pytest.raises(SettingsError, match=problem):
        parse_traffic(traffic)


def test_keys_round_trip_and_plain_names_are_not_keys() -> None:
    assert split_key(version_key("digits", 12)) == ("digits", 12)
    assert split_key("digits") is None and split_key("a/b") is None and split_key("/2") is None


def table() -> VersionTable:
    t = VersionTable()
    t.set_served("m", [1, 2])
    return t


def test_resolve_names_the_newest_or_the_asked_version_and_refuses_the_rest() -> None:
    t = table()
    assert t.resolve("m", None) == "m/2"
    assert t.resolve("m", "1") == "m/1" and t.resolve("m", 1) == "m/1" and t.resolve("m/1", None) == "m/1"
    assert t.resolve("m", 3) == ("unknown_model", "model 'm' does not serve version 3 (served: 1, 2)")
    assert t.resolve("m", "x")[0] == "bad_request"
    assert t.resolve("plain", None) == "plain" and t.resolve("plain", "1") == "plain"
    assert t.resolve("plain", 2)[0] == "unknown_model"
    t.set_served("m", [])
    assert t.resolve("m", None)[0] == "unknown_model"


def test_a_split_routes_by_weight_counts_shares_and_follows_what_is_served() -> None:
    t = table()
    t.set_traffic("m", {1: 3, 2: 1})
    picks = [t.resolve("m", None) for _ in range(8)]
    assert picks.count("m/1") == 6 and picks.count("m/2") == 2
    assert t.wire()["m"]["share"] == {"1": 0.75, "2": 0.25}
    assert t.resolve("m", None, count=False) == "m/2"  # a lookup moves nothing
    t.set_served("m", [2])  # version 1 retired: the split goes to what is left
    assert {t.resolve("m", None) for _ in range(5)} == {"m/2"}
    with pytest.raises(SettingsError, match="does not serve version 1"):
        t.set_traffic("m", {1: 1})


def test_the_request_header_carries_its_version_and_refuses_a_wrong_type() -> None:
    import msgpack

    from batcher.wire.protocol import ProtocolError, read_header

    assert read_header(msgpack.packb({"input": 1, "model": "m", "version": 2})).version == 2
    assert read_header(msgpack.packb({"input": 1, "version": "3"})).version == "3"
    assert read_header(msgpack.packb({"input": 1})).version is None
    for wrong in (True, 1.5, [2]):
        with pytest.raises(ProtocolError, match="version must be an int or a str"):
            read_header(msgpack.packb({"id": 7, "input": 1, "version": wrong}))
