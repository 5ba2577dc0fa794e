"""A worker's dropped trace spans, said in its heartbeats (docs/protocol.md 6.6), counted
once per model by the broker's stats however often the same count is said again."""

from __future__ import annotations

from types import SimpleNamespace

from batcher.broker.stats import BrokerStats
from batcher.wire import protocol


def said(n: object) -> list[bytes]:
    return [protocol.pack({"trace_spans_dropped": n})]


def test_each_workers_growth_is_added_to_its_model_once_and_bad_frames_are_ignored() -> None:
    stats = BrokerStats()
    a, b = SimpleNamespace(model="m"), SimpleNamespace(model="m")
    stats.worker_said(a, b"a", said(3))
    stats.worker_said(a, b"a", said(3))  # said again: nothing new
    stats.worker_said(b, b"b", said(2))
    stats.worker_said(a, b"a", said(5))
    for bad in ([b"\xc1"], said(-1), said("7"), said(True), [protocol.pack([1])], []):
        stats.worker_said(a, b"a", bad)
    stats.worker_said(None, b"gone", said(9))  # a worker no longer known
    assert dict(stats.worker_spans_dropped) == {"m": 7}


def test_counts_summed_from_a_peers_numbers_stop_at_what_msgpack_encodes() -> None:
    """A worker may say up to 2**64 - 1 dropped spans and 2**63 - 1 padded elements each
    time: summed, they passed msgpack's int64, and every `stats` request failed after."""
    stats = BrokerStats()
    a = SimpleNamespace(model="m")
    for n in (2**64 - 1, 0, 2**64 - 1):  # each rise is added
        stats.worker_said(a, b"a", said(n))
    for _ in range(3):
        stats.batch_done("m", [0.0], 1.0, None, 1, padding=(2**63 - 1, 2**63 - 1))
    st = stats.model("m")
    assert dict(stats.worker_spans_dropped) == {"m": 2**63 - 1}  # (stats.MAX_COUNTED)
    assert (st.padded_elements, st.real_elements, st.padding_waste) == (2**63 - 1, 2**63 - 1, 1.0)
    protocol.pack([dict(stats.worker_spans_dropped), st.padded_elements, st.real_elements])
