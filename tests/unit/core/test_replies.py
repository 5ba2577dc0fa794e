"""The reply table (batcher.core.replies) on its own: the ids it hands out, a reply
matched to its waiter once, the nil-id rule, forgetting, and every waiter handed over
at once; whatever a waiter is (a future, a PendingReply, a bench's due time)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batcher.core.replies import ReplyTable, reply_key


def ok(req_id: Any) -> dict[str, Any]:
    return {"id": req_id, "ok": True, "output": 1}


def error(req_id: Any) -> dict[str, Any]:
    return {"id": req_id, "ok": False, "error": {"code": "bad_request", "message": "no"}}


def test_ids_count_from_one_and_each_table_has_its_own() -> None:
    a, b = ReplyTable[str](), ReplyTable[str]()
    assert [a.new_id(), a.open("w"), a.new_id()] == [1, 2, 3]
    assert b.open("w") == 1
    assert len(a) == 1 and 2 in a and 1 not in a and a.get(2) == "w"


def test_a_reply_takes_its_waiter_out_once_in_any_order() -> None:
    t = ReplyTable[str]()
    ids = [t.open(f"w{k}") for k in range(3)]
    assert t.match(ids[2]) == "w2"
    assert t.match(ids[0]) == "w0"
    assert len(t) == 1 and t.get(ids[1]) == "w1"
    assert t.unmatched == 0
    assert t.match(ids[0]) is None  # a second reply
    assert t.match(99) is None  # never sent
    assert t.unmatched == 2


def test_a_waiter_that_is_falsy_is_still_matched() -> None:
    t = ReplyTable[float]()
    rid = t.open(0.0)  # a bench request due at time 0.0
    assert t.get(rid) == 0.0 and t.match(rid) == 0.0 and t.unmatched == 0


def test_forget_hands_the_waiter_back_and_a_later_reply_is_unmatched() -> None:
    t = ReplyTable[str]()
    rid = t.open("w")
    assert t.forget(rid) == "w"
    assert t.forget(rid) is None  # twice is harmless
    assert t.unmatched == 0  # forgetting is no reply
    assert t.match(rid) is None and t.unmatched == 1


def test_release_forgets_only_the_waiter_given() -> None:
    t = ReplyTable[list[int]]()
    first, second = [1], [1]  # equal, not the same
    t.add(5, first)
    t.release(5, second)
    assert t.get(5) is first
    t.release(5, first)
    assert 5 not in t
    t.release(5, first)  # gone already: nothing happens


def test_take_all_hands_every_waiter_over_and_ids_go_on() -> None:
    t = ReplyTable[str]()
    ids = [t.open(w) for w in "abc"]
    t.forget(ids[1])
    assert t.take_all() == {ids[0]: "a", ids[2]: "c"}
    assert len(t) == 0 and t.take_all() == {}
    assert t.match(ids[0]) is None and t.unmatched == 1  # its reply came after all
    assert t.open("d") == 4  # an id is never handed out twice


def test_add_takes_an_id_from_elsewhere_and_returns_the_waiter() -> None:
    t = ReplyTable[str]()
    assert t.add("x-1", "w") == "w"
    assert t.match_reply(ok("x-1")) == "w"


def test_nil_id_error_answers_the_one_request_in_flight() -> None:
    t = ReplyTable[str]()
    t.open("w")
    assert t.match_reply(error(None)) == "w" and t.unmatched == 0


def test_nil_id_error_with_several_in_flight_or_nil_id_success_matches_none() -> None:
    t = ReplyTable[str]()
    a, b = t.open("a"), t.open("b")
    assert t.match_reply(error(None)) is None  # ambiguous
    assert t.match_reply(ok(None)) is None  # only an error may carry a nil id
    assert len(t) == 2 and t.unmatched == 2
    t.forget(a)
    assert t.match_reply(ok(None)) is None  # even with one in flight
    assert t.match_reply(error(None)) == "b" and b not in t


def test_plain_match_has_no_nil_id_rule() -> None:
    t = ReplyTable[str]()
    t.open("w")
    assert t.match(None) is None and len(t) == 1 and t.unmatched == 1


@pytest.mark.parametrize("not_a_reply", [{}, {"id": [1]}, {"id": {}}])
def test_what_is_no_reply_raises_and_is_not_counted(not_a_reply: Any) -> None:
    t = ReplyTable[str]()
    t.open("w")
    with pytest.raises((KeyError, TypeError)):
        t.match_reply(not_a_reply)
    with pytest.raises(TypeError):
        t.match([1])
    assert t.unmatched == 0 and len(t) == 1


def test_reply_key_reads_the_id_or_the_lone_request() -> None:
    assert reply_key(error(None), {41: "w"}) == 41
    assert reply_key(error(None), {41: "w", 42: "v"}) is None
    assert reply_key(ok(None), {41: "w"}) is None
    assert reply_key(error(42), {41: "w", 42: "v"}) == 42


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("open"), st.integers(0, 9)),
        st.tuples(st.sampled_from(["match", "forget", "get"]), st.integers(0, 12)),
        st.tuples(st.just("take_all"), st.just(0)),
    ),
    max_size=60,
)


@given(_OPS)
def test_it_behaves_as_a_map_of_ids_and_a_count(ops: list[tuple[str, int]]) -> None:
    """Against a plain model: a dict of the waiting ids, the next id, and the unmatched
    count; every operation gives what the model gives."""
    t = ReplyTable[int]()
    model: dict[int, int] = {}
    next_id, unmatched = 1, 0
    for op, arg in ops:
        if op == "open":
            assert t.open(arg) == next_id
            model[next_id] = arg
            next_id += 1
        elif op == "match":
            expected = model.pop(arg, None)
            unmatched += expected is None
            assert t.match(arg) == expected
        elif op == "forget":
            assert t.forget(arg) == model.pop(arg, None)
        elif op == "get":
            assert t.get(arg) == model.get(arg) and (arg in t) == (arg in model)
        else:
            assert t.take_all() == model
            model = {}
        assert len(t) == len(model) and t.unmatched == unmatched
