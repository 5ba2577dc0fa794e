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
from batcher.wire.codes import ErrorCode

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


def test_the_stats_entry_of_a_versioned_model_is_exact() -> None:
    t = table()
    assert t.wire() == {"m": {"served": [1, 2], "newest": 2, "traffic": None, "routed": {}, "share": {}}}
    t.resolve("m", None)
    t.resolve("m", 1)  # a named version is not part of the split's share
    assert t.wire()["m"]["routed"] == {"2": 1} and t.wire()["m"]["share"] == {"2": 1.0}
    t.set_traffic("m", {1: 1, 2: 0})
    assert t.wire()["m"]["traffic"] == {"1": 1, "2": 0} and t.wire()["m"]["routed"] == {}  # counts anew
    assert [t.resolve("m", None) for _ in range(3)] == ["m/1"] * 3  # a 0 weight gets nothing
    t.set_traffic("m", None)
    assert t.wire()["m"]["traffic"] is None and t.resolve("m", None) == "m/2"
    t.set_served("m", [])
    assert t.wire()["m"]["newest"] is None and t.wire()["m"]["served"] == []
    t.remove("m")
    assert not t and t.wire() == {}


def test_refusals_say_what_is_wrong() -> None:
    t = table()
    with pytest.raises(SettingsError, match="no versioned model 'x'"):
        t.set_traffic("x", {1: 1})
    assert t.resolve("m", "0") == (ErrorCode.BAD_REQUEST, "version must be an integer >= 1, got 0")
    assert t.resolve("plain", 3) == (
        ErrorCode.UNKNOWN_MODEL,
        "model 'plain' has one version, 1 (it is not in a repository)",
    )
    assert t.resolve("m/3", None) == (
        ErrorCode.UNKNOWN_MODEL,
        "model 'm' does not serve version 3 (served: 1, 2)",
    )
    t.set_served("m", [])
    assert t.resolve("m", None) == (ErrorCode.UNKNOWN_MODEL, "model 'm' serves no version now")
    with pytest.raises(SettingsError, match="above 0"):
        WeightedChooser({1: 0})
    with pytest.raises(SettingsError, match="latest:N needs N >= 1, got 0"):
        VersionPolicy("latest", 0)
    with pytest.raises(SettingsError, match="names no version"):
        VersionPolicy("specific")
    with pytest.raises(SettingsError, match="got 'newest'"):
        VersionPolicy("newest")
    assert VersionPolicy("all").select([3, 1]) == (1, 3)


@pytest.mark.parametrize(("value", "version"), [(1, 1), ("7", 7), (" 12 ", 12)])
def test_versions_parse(value: object, version: int) -> None:
    from batcher.core.versions import parse_version

    assert parse_version(value) == version


@pytest.mark.parametrize("value", [0, -1, True, "x", 1.0, None])
def test_a_version_that_is_no_integer_above_0_is_refused(value: object) -> None:
    from batcher.core.versions import parse_version

    with pytest.raises(SettingsError, match="version must be an integer >= 1"):
        parse_version(value)


def test_traffic_parses_versions_and_bounds_weights() -> None:
    assert parse_traffic({"2": 90, 3: 10}) == {2: 90, 3: 10}
    assert parse_traffic({"2": 1_000_000}) == {2: 1_000_000}
    for weight in (1_000_001, True, 1.5):
        with pytest.raises(SettingsError, match=r"must be an integer in \[0, 1000000\]"):
            parse_traffic({"2": weight})
    with pytest.raises(SettingsError, match="must map versions"):
        parse_traffic([("2", 1)])


# --- the survivors of mutation testing -------------------------------------------------------


def test_a_key_of_a_name_holding_the_separator_splits_at_the_last() -> None:
    assert split_key("org/model/2") == ("org/model", 2)


def test_the_newest_of_three_served_versions_takes_unnamed_requests() -> None:
    t = VersionTable()
    assert not t
    t.set_served("m", [1, 2, 3])
    assert t
    assert t.resolve("m", None) == "m/3" and t.resolve("m", None, count=False) == "m/3"
    assert t.wire()["m"]["newest"] == 3


def test_removing_an_unknown_model_is_nothing() -> None:
    t = table()
    t.remove("nothing")
    t.remove("m")
    assert not t


def test_a_zero_weight_version_gets_no_request() -> None:
    t = table()
    t.set_traffic("m", {1: 0, 2: 5})
    assert {t.resolve("m", None) for _ in range(20)} == {"m/2"}


def test_refusals_of_splits_and_policies_say_why() -> None:
    with pytest.raises(SettingsError, match=r"^traffic weights must not all be 0$"):
        parse_traffic({"1": 0})
    with pytest.raises(SettingsError, match=r"^version_policy specific: names no version$"):
        VersionPolicy("specific")
    with pytest.raises(SettingsError, match=r"^a split needs a version with a weight above 0$"):
        WeightedChooser({1: 0})
    t = table()
    with pytest.raises(SettingsError, match=r"^model 'm' does not serve version 3 \(served: 1, 2\)$"):
        t.set_traffic("m", {3: 1})
    t.set_served("m", [])
    with pytest.raises(SettingsError, match=r"\(served: none\)$"):
        t.set_traffic("m", {3: 1})
