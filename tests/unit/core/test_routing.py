"""The gateway's routing core (batcher/core/routing.py) and discovery's parsing: pure rules,
with a fake clock, a fake random source and hypothesis."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batcher.core.routing import (
    BrokerHealth,
    choose_round_robin,
    choose_two,
    eligible,
    gateway_ready,
    membership_change,
    workers_needed_total,
)
from batcher.errors import SettingsError
from batcher.gateway.discovery import (
    Discoverer,
    DnsSource,
    FileSource,
    parse_source,
    read_addresses,
    tcp_address,
)

names = st.sets(st.sampled_from([f"tcp://10.0.0.{i}:5555" for i in range(8)]))


@given(names, names)
def test_membership_change_turns_current_into_wanted(current: set[str], wanted: set[str]) -> None:
    add, remove = membership_change(current, wanted)
    assert (current | set(add)) - set(remove) == wanted
    assert not set(add) & current and set(remove) <= current
    assert add == sorted(add) and remove == sorted(remove)


def test_membership_change_of_equal_sets_is_nothing() -> None:
    assert membership_change(["a", "b"], ["b", "a"]) == ([], [])


@given(st.lists(st.integers(0, 50), min_size=1, max_size=10), st.randoms(use_true_random=False))
def test_choose_two_never_takes_the_busier_of_its_two(loads: list[int], rnd: random.Random) -> None:
    """Whatever two it draws, the one chosen has no more rows than the other: never the
    single most loaded broker when there are two or more (unless tied)."""
    drawn: list[int] = []

    def randbelow(n: int) -> int:
        value = rnd.randrange(n)
        drawn.append(value)
        return value

    candidates = list(range(len(loads)))
    chosen = choose_two(candidates, lambda i: loads[i], randbelow)
    if len(loads) == 1:
        assert chosen == 0 and drawn == []
        return
    i, j = drawn
    second = j + 1 if j >= i else j
    assert i != second
    assert chosen in (i, second) and loads[chosen] == min(loads[i], loads[second])
    if len(loads) >= 2 and loads.count(max(loads)) == 1:
        assert loads[chosen] < max(loads)


def test_choose_two_prefers_the_first_drawn_on_a_tie_and_refuses_none() -> None:
    assert choose_two(["a", "b"], lambda _: 3, lambda n: 0) == "a"
    assert choose_two(["a", "b"], lambda _: 3, lambda n: n - 1) == "b"
    with pytest.raises(ValueError, match=r"^no broker to choose from$"):
        choose_two([], lambda _: 0, lambda n: 0)


def test_choose_two_spreads_equal_loads_evenly() -> None:
    rnd = random.Random(7)
    counts = Counter(choose_two("abc", lambda _: 0, rnd.randrange) for _ in range(3000))
    assert all(900 < counts[c] < 1100 for c in "abc"), counts


def test_choose_two_sends_most_rows_to_the_idle_one() -> None:
    rnd = random.Random(1)
    loads = {"busy": 10, "idle": 0, "mid": 5}
    counts = Counter(choose_two(list(loads), loads.__getitem__, rnd.randrange) for _ in range(3000))
    assert counts["busy"] == 0 and counts["idle"] > counts["mid"]


def test_round_robin_refuses_no_candidates() -> None:
    with pytest.raises(ValueError, match=r"^no broker to choose from$"):
        choose_round_robin([], 3)


@given(st.lists(st.text(min_size=1), min_size=1, max_size=5), st.integers(0, 100))
def test_round_robin_takes_each_in_turn(candidates: list[str], turn: int) -> None:
    picks = [choose_round_robin(candidates, turn + k) for k in range(len(candidates))]
    assert sorted(picks) == sorted(candidates)


def ready_health(*models: str, now: float = 0.0) -> BrokerHealth:
    h = BrokerHealth(connected=True)
    h.heard({"models": {m: {"ready": True, "configured": True} for m in models}}, now)
    return h


def test_a_broker_takes_rows_of_its_ready_models_only_while_it_answers() -> None:
    h = ready_health("a", now=10.0)
    assert h.takes("a", 10.0, 0.5) and not h.takes("b", 10.0, 0.5)
    h.asked_at = 11.0  # asked, not answered
    assert h.takes("a", 11.5, 0.5)  # a heartbeat not yet gone
    assert not h.takes("a", 11.6, 0.5) and h.silent(11.6, 0.5) and not h.open(11.6, 0.5)
    h.heard({"models": {"a": {"ready": True}}}, 12.0)  # it answers again
    assert h.takes("a", 12.0, 0.5)
    h.heard({"stopping": True, "models": {"a": {"ready": True}}}, 12.5)
    assert not h.takes("a", 12.5, 0.5) and not h.open(12.5, 0.5)
    h.lost()
    assert not h.connected and not h.ready_models and not h.takes("a", 13.0, 0.5)


def test_heard_takes_any_answer_without_raising() -> None:
    h = BrokerHealth(connected=True)
    for junk in (None, 3, "x", {"models": 3}, {"models": {"a": 3, "b": {"ready": 1}}}):
        h.heard(junk, 1.0)
    assert h.ready_models == {"b"}


def test_eligible_falls_back_tier_by_tier() -> None:
    healths = {
        "ready": ready_health("m"),
        "other": ready_health("n"),
        "draining": ready_health("m"),
        "down": BrokerHealth(),
    }
    healths["draining"].draining = True
    order = list(healths)
    assert eligible(order, healths.__getitem__, "m", 0.0, 0.5) == ["ready"]
    assert eligible(order, healths.__getitem__, "m", 0.0, 0.5, exclude=["ready"]) == ["other"]
    assert eligible(order, healths.__getitem__, "m", 0.0, 0.5, exclude=["ready", "other"]) == ["draining"]
    assert eligible(["down"], healths.__getitem__, "m", 0.0, 0.5) == []


def test_gateway_ready_needs_every_configured_model_somewhere() -> None:
    assert gateway_ready([ready_health("a"), ready_health("b")], 0.0, 0.5)
    half = BrokerHealth(connected=True)
    half.heard({"models": {"a": {"ready": True, "configured": True}, "b": {"configured": True}}}, 0.0)
    assert not gateway_ready([half], 0.0, 0.5)
    assert gateway_ready([half, ready_health("b")], 0.0, 0.5)
    draining = ready_health("b")
    draining.draining = True
    assert not gateway_ready([half, draining], 0.0, 0.5)
    assert not gateway_ready([], 0.0, 0.5)


# --- discovery's parsing ---------------------------------------------------------------------


def test_sources_parse_or_say_what_is_wrong() -> None:
    assert parse_source("dns+tcp://cells.ns.svc:5555") == DnsSource("cells.ns.svc", 5555)
    assert parse_source("dns+tcp://[::1]:7") == DnsSource("::1", 7)
    assert parse_source("file:/tmp/x") == FileSource("/tmp/x")
    for bad in ("dns+tcp://name", "dns+tcp://name:0", "dns+tcp://:5", "file:", "http://x", "tcp://a:1"):
        with pytest.raises(SettingsError, match="--discover"):
            parse_source(bad)


def test_addresses_of_a_file_and_a_host() -> None:
    assert read_addresses("tcp://a:1\n\n  # c\ntcp://b:2 # d\n") == ["tcp://a:1", "tcp://b:2"]
    assert tcp_address("10.1.2.3", 5) == "tcp://10.1.2.3:5"
    assert tcp_address("fd00::1", 5) == "tcp://[fd00::1]:5"


def test_a_file_is_read_again_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "brokers"
    d = Discoverer(f"file:{path}")
    assert asyncio.run(d.resolve()) is None  # not there: cannot say (the last answer holds)
    path.write_text("tcp://b:1\ntcp://a:1\ntcp://a:1\n")
    assert asyncio.run(d.resolve()) == ["tcp://a:1", "tcp://b:1"]
    path.write_text("tcp://c:1\n")
    assert asyncio.run(d.resolve()) == ["tcp://c:1"]
    path.write_text("")  # truncated by a writer about to write: not "no broker"
    assert asyncio.run(d.resolve()) is None
    path.write_text("# every broker gone\n")  # said on purpose: none
    assert asyncio.run(d.resolve()) == []


def test_dns_resolves_a_name_without_blocking() -> None:
    d = Discoverer("dns+tcp://localhost:5555")
    found = asyncio.run(d.resolve())
    assert found is not None and "tcp://127.0.0.1:5555" in found
    assert asyncio.run(Discoverer("dns+tcp://no-such-host.invalid:1").resolve()) is None


def test_a_brokers_workers_needed_come_from_its_stats_and_go_with_its_connection() -> None:
    h = BrokerHealth(connected=True)
    scaling = {"workers_needed": 1.5}
    stats = {
        "models": {
            "a": {"ready": True, "scaling": scaling},
            "b": {"scaling": {"workers_needed": None}},  # before the first tick
            "c": {"scaling": {"workers_needed": True}},  # no number
            "d": {"scaling": {"workers_needed": float("inf")}},
            "e": {"scaling": "?"},
            "f": {"scaling": {"workers_needed": 0}},
        }
    }
    h.heard(stats, 1.0)
    assert h.workers_needed == {"a": 1.5, "f": 0.0}
    other = BrokerHealth(connected=True)
    other.heard({"models": {"a": {"scaling": {"workers_needed": 2.25}}}}, 1.0)
    gone = BrokerHealth(connected=False, workers_needed={"a": 100.0})
    assert workers_needed_total([h, other, gone]) == {"a": 3.75, "f": 0.0}
    h.lost()
    assert h.workers_needed == {} and workers_needed_total([h, other]) == {"a": 2.25}


def test_a_silent_broker_leaves_the_ready_and_open_tiers_and_readiness() -> None:
    """A broker asked and not answered within a heartbeat is passed over by the first two
    tiers (and by readiness) until it answers; one asked just now is not silent yet."""
    healths = {"silent": ready_health("m", now=0.0), "slow": ready_health("m", now=0.0)}
    healths["silent"].asked_at = 1.0
    healths["slow"].asked_at = 1.4
    order = list(healths)
    assert eligible(order, healths.__getitem__, "m", 1.6, 0.5) == ["slow"]
    assert eligible(order, healths.__getitem__, "n", 1.6, 0.5) == ["slow"]  # open: answering
    assert eligible(["silent"], healths.__getitem__, "m", 1.6, 0.5) == ["silent"]  # connected
    assert gateway_ready([healths["silent"]], 1.4, 0.5)
    assert not gateway_ready([healths["silent"]], 1.6, 0.5)


def test_readiness_counts_every_brokers_configured_models() -> None:
    """A model configured on one broker and ready on none keeps the gateway not ready,
    whichever broker comes last."""
    stuck = BrokerHealth(connected=True)
    stuck.heard({"models": {"c": {"configured": True}}}, 0.0)
    assert not gateway_ready([stuck, ready_health("a")], 0.0, 0.5)
    assert not gateway_ready([ready_health("a"), stuck], 0.0, 0.5)


def test_a_lost_broker_forgets_its_models_and_a_junk_answer_is_not_draining() -> None:
    h = ready_health("a")
    h.heard(None, 1.0)
    assert not h.draining and h.heard_at == 1.0
    h.lost()
    assert h.ready_models == frozenset() and h.configured_models == frozenset()
    assert gateway_ready([h, ready_health("b")], 2.0, 0.5)  # a lost broker's models are none
