"""The protocol's shared words (batcher/wire/codes.py): the values docs/protocol.md gives,
and how a value or an exception is worded in a log line or an error message."""

from __future__ import annotations

from batcher.wire import codes


def test_a_short_value_is_its_repr_and_a_long_one_is_cut_at_the_limit() -> None:
    assert codes.clip("abc") == "'abc'"
    assert codes.clip("x" * 78) == "'" + "x" * 78 + "'"  # 80 characters: kept whole
    assert codes.clip("x" * 79) == "'" + "x" * 79 + "..."  # 81: cut to 80
    assert codes.clip(b"\x00" * 10, limit=5) == "b'\\x0..."
    assert codes.clip(12345, limit=5) == "12345"


def test_an_exception_is_named_and_never_ends_in_an_empty_colon() -> None:
    assert codes.describe(ValueError("bad value")) == "ValueError: bad value"
    assert codes.describe(KeyError()) == "KeyError"
    assert codes.describe(RuntimeError("")) == "RuntimeError"


def test_the_documented_words_are_the_codes_values() -> None:
    # docs/protocol.md, section 5 (error codes) and section 4 (the backend's frames).
    assert [c.value for c in codes.ErrorCode] == [
        "bad_request", "unknown_model", "model_error", "deadline_exceeded", "overloaded",
        "cancelled", "worker_failed", "shutting_down", "unavailable", "too_large", "forbidden",
        "internal_error",
    ]  # fmt: skip
    assert codes.WORKER_PROTOCOL == b"BATCHER-W2"
    assert [codes.CMD_READY, codes.CMD_BATCH, codes.CMD_REPLY, codes.CMD_HEARTBEAT] == [
        b"\x01", b"\x02", b"\x03", b"\x04",
    ]  # fmt: skip


def test_clipping_a_flat_list_of_a_million_costs_its_repr_and_no_more() -> None:
    """A peer's value may be a list of millions (a 64 MB frame holds 60 million msgpack
    ints): telling how deep it nests keeps none of its elements, so clipping it costs
    what its repr costs (7 MB here), not a tuple per element (64 MB more)."""
    import tracemalloc

    flat = list(range(1_000_000))
    tracemalloc.start()
    try:
        shown = codes.clip(flat)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert shown == repr(flat)[:80] + "..."
    assert peak < len(repr(flat)) * 2
