"""Many models per worker (batcher.core.multiplex), and the scheduler's placement of a
multiplexed model's batches, on a fake clock."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batcher.core.limits import BatchSettings, Policy
from batcher.core.multiplex import LOAD_LIMIT_S, Catalog, Resident, Use
from batcher.core.scheduler import Scheduler
from batcher.errors import SettingsError
from tests.scheduler_builders import enqueue_many, rq

MODELS = ("a", "b", "c", "d", "e", "f")


def catalog(budget_mb: int = 200, mb: int = 100, models: tuple[str, ...] = MODELS) -> Catalog:
    return Catalog(budget_mb, {m: mb for m in models})


# --- the catalog ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("budget", "sizes", "message"),
    [
        (0, {"a": 1}, "multiplex budget_mb must be an int in [1, 1073741824], got 0"),
        (True, {"a": 1}, "multiplex budget_mb must be an int in [1, 1073741824], got True"),
        (10, {}, "a multiplexed worker serves 1 to 1024 models, got {}"),
        (10, {"a": 0}, "memory_mb of model 'a' must be an int in [1, 1073741824], got 0"),
        (10, {"a": 1.5}, "memory_mb of model 'a' must be an int in [1, 1073741824], got 1.5"),
        (10, {"": 1}, "a multiplexed model's name must be 1 to 256 characters, got ''"),
        (10, {"a": 11}, "model 'a' needs 11 MB, more than the multiplexed workers' budget of 10 MB"),
    ],
)
def test_a_catalog_refuses_what_cannot_be_served_saying_why(
    budget: object, sizes: object, message: str
) -> None:
    with pytest.raises(SettingsError) as raised:
        Catalog(budget, sizes)  # type: ignore[arg-type]
    assert str(raised.value).startswith(message)


def test_a_catalog_goes_over_the_wire_and_back() -> None:
    c = Catalog(300, {"a/1": 100, "b": 200})
    assert Catalog.from_wire(c.wire()) == c
    for bad in (
        {"budget_mb": 300},
        {"budget_mb": 1, "models": [1]},
        [300],
        {"budget_mb": 1, "models": {}, "x": 1},
    ):
        with pytest.raises(ValueError):
            Catalog.from_wire(bad)


# --- least recently used -------------------------------------------------------------------------


def test_a_worker_loads_on_first_use_and_unloads_the_least_recently_used() -> None:
    r = Resident(catalog())
    assert r.use("a") == Use(True, ())
    assert r.use("b") == Use(True, ())
    assert r.use("a") == Use(False, ())  # a is the most recent now
    assert r.use("c") == Use(True, ("b",))
    assert list(r) == ["a", "c"] and r.used_mb == 200
    assert r.use("d") == Use(True, ("a",))


def test_a_large_model_unloads_as_many_as_it_needs() -> None:
    r = Resident(Catalog(300, {"s1": 100, "s2": 100, "s3": 100, "big": 250}))
    for m in ("s1", "s2", "s3"):
        r.use(m)
    assert r.use("big") == Use(True, ("s1", "s2", "s3"))
    assert r.used_mb == 250 and not r.room_for("s1")
    assert r.use("s1") == Use(True, ("big",))
    assert r.room_for("s2") and r.room_for("s1")


def test_a_failed_load_frees_its_room() -> None:
    r = Resident(catalog())
    r.use("a")
    r.use("b")
    r.drop("b")
    r.drop("zzz")  # never held: nothing happens
    assert list(r) == ["a"] and r.used_mb == 100 and r.room_for("c")


@settings(max_examples=300, deadline=None)
@given(
    budget=st.integers(1, 6),
    sizes=st.lists(st.integers(1, 3), min_size=1, max_size=6),
    uses=st.lists(st.integers(0, 5), max_size=60),
)
def test_the_budget_always_holds_and_a_use_is_cold_exactly_when_not_held(
    budget: int, sizes: list[int], uses: list[int]
) -> None:
    names = [f"m{i}" for i in range(len(sizes))]
    fitting = {n: mb for n, mb in zip(names, sizes, strict=True) if mb <= budget}
    if not fitting:
        return
    r = Resident(Catalog(budget, fitting))
    keys = list(fitting)
    for u in uses:
        key = keys[u % len(keys)]
        held_before = key in r
        before = set(r)
        used = r.use(key)
        assert used.cold is not held_before
        assert set(used.unloaded) <= before and key not in used.unloaded
        assert set(r) == (before - set(used.unloaded)) | {key}
        assert r.used_mb == sum(fitting[k] for k in r) <= budget
        assert list(r)[-1] == key  # the most recently used


@settings(max_examples=200, deadline=None)
@given(others=st.lists(st.sampled_from(MODELS[1:]), max_size=80))
def test_a_model_used_between_every_other_is_never_unloaded(others: list[str]) -> None:
    r = Resident(catalog(budget_mb=200))  # two models fit
    for other in others:
        assert "a" not in r.use("a").unloaded
        assert "a" not in r.use(other).unloaded
        assert "a" in r


# --- the scheduler's placement -------------------------------------------------------------------


def pool(
    workers: int = 2, size: int = 4, slots: int = 1, budget_mb: int = 200, policy: Policy = Policy.WINDOW
) -> Scheduler:
    """A scheduler of models a-f, each of batch size `size` (window policy unless told),
    over `workers` multiplexed workers p0, p1, ... of `slots` batches each."""
    per_model = {m: BatchSettings(max_batch_size=size, max_wait_ms=10.0, policy=policy) for m in MODELS}
    s = Scheduler(per_model=per_model, worker_prefetch=slots)
    for i in range(workers):
        s.add_worker(f"p{i}".encode(), "multiplexed", slots, catalog=catalog(budget_mb))
    return s


def serve(s: Scheduler, model: str, n: int, t: float) -> list[bytes]:
    """Enqueue `n` requests of `model` at `t`, cut what is due and answer it at once:
    the workers its batches went to."""
    enqueue_many(s, model, n, t)
    out = []
    for batch in s.due_batches(t):
        out.append(batch.worker)
        assert batch.multiplexed and batch.model == model
        assert s.complete(batch.worker, batch.batch_id, 0.001, t) is batch
    return out


def test_a_multiplexed_worker_serves_every_model_of_its_catalog() -> None:
    s = pool()
    for m in MODELS:
        assert s.has_workers(m)
        assert [w.worker_id for w in s.views()[m].workers] == [b"p0", b"p1"]
    assert s.remove_worker(b"p0") == []
    assert all([w.worker_id for w in s.views()[m].workers] == [b"p1"] for m in MODELS)


def test_batches_go_where_their_model_is_held() -> None:
    s = pool()
    first = serve(s, "a", 4, 0.0)
    second = serve(s, "b", 4, 0.0)
    assert first != second  # b went to the worker with room: nothing unloaded
    for t in (1.0, 2.0, 3.0):
        assert serve(s, "a", 4, t) == first
        assert serve(s, "b", 4, t) == second
    views = s.views()
    assert [w.holds for w in views["a"].workers if w.worker_id == first[0]] == [True]
    assert [w.holds for w in views["a"].workers if w.worker_id != first[0]] == [False]


def test_a_batch_waits_for_the_worker_holding_its_model_rather_than_load_it_elsewhere() -> None:
    s = pool()
    enqueue_many(s, "a", 4, 0.0)
    (held,) = s.due_batches(0.0)  # p0 now holds a, and runs this batch
    enqueue_many(s, "a", 4, 0.0)  # one full batch more: p1 is idle, but would have to load a
    assert s.due_batches(0.0) == []
    assert s.next_wakeup() is None  # nothing is due until p0 answers: no busy wait
    s.complete(held.worker, held.batch_id, 0.001, 0.002)
    (again,) = s.due_batches(0.002)
    assert again.worker == held.worker and not again.cold


def test_a_length_buckets_batch_goes_to_the_worker_holding_its_model() -> None:
    """With --bucket-by length, a multiplexed model's bucket queues place their batches by
    the same rule as its own queue: on the worker that holds the model, not loaded again."""
    settings = BatchSettings(
        max_batch_size=4, max_wait_ms=10.0, policy="window", bucket_by="length", length_buckets=(16, 32)
    )
    s = Scheduler(per_model={m: settings for m in MODELS})
    for i in range(2):
        s.add_worker(f"p{i}".encode(), "multiplexed", catalog=catalog())
    (held,) = serve(s, "a", 4, 0.0)  # requests of no bucket: the model's own queue
    for _ in range(4):
        r = rq(1.0)
        r.bucket = settings.bucket(20)
        s.enqueue("a", r)
    assert s.models["a"].buckets[1].size == 4
    (batch,) = s.due_batches(1.0)
    assert batch.worker == held and not batch.cold


def test_a_model_spreads_to_another_worker_when_two_full_batches_wait() -> None:
    s = pool()
    enqueue_many(s, "a", 4, 0.0)
    (held,) = s.due_batches(0.0)
    enqueue_many(s, "a", 8, 0.0)  # two full batches wait behind the busy holder
    (spread,) = s.due_batches(0.0)
    assert spread.worker != held.worker and spread.cold
    assert all(w.holds for w in s.views()["a"].workers)


def test_a_model_no_worker_holds_goes_where_nothing_is_unloaded() -> None:
    s = pool(budget_mb=200)
    serve(s, "a", 4, 0.0)  # p0: a
    serve(s, "b", 4, 1.0)  # p1: b (room)
    serve(s, "c", 4, 2.0)  # p0 (least recently used): a, c
    (w,) = serve(s, "d", 4, 3.0)  # both full: the least recently used, p1, unloads nothing yet
    assert w == b"p1"
    holders = {m: [v.worker_id for v in s.views()[m].workers if v.holds] for m in "abcd"}
    assert holders == {"a": [b"p0"], "b": [b"p1"], "c": [b"p0"], "d": [b"p1"]}
    (w,) = serve(s, "e", 4, 4.0)  # p0 is least recent: it unloads a, its least recent
    assert w == b"p0"
    assert not any(v.holds for v in s.views()["a"].workers)


@pytest.mark.parametrize(("policy", "n"), [(Policy.WINDOW, 4), (Policy.ADAPTIVE, 1)])
def test_a_model_no_worker_holds_goes_to_one_with_room_before_a_less_recently_used_full_one(
    policy: Policy, n: int
) -> None:
    """Full batches (window), or a lone request the adaptive policy sends at once."""
    s = pool(budget_mb=200, policy=policy)
    assert serve(s, "a", n, 0.0) == [b"p0"]
    assert serve(s, "b", n, 1.0) == [b"p1"]
    assert serve(s, "c", n, 2.0) == [b"p0"]  # p0 holds a and c: full
    assert serve(s, "b", n, 3.0) == [b"p1"]  # p1, b only, is now the more recently used
    (w,) = serve(s, "d", n, 4.0)  # p0 would unload a for it: p1 has room
    assert w == b"p1"
    holders = {m: [v.worker_id for v in s.views()[m].workers if v.holds] for m in "abcd"}
    assert holders == {"a": [b"p0"], "b": [b"p1"], "c": [b"p0"], "d": [b"p1"]}


def test_a_cold_batch_gets_time_to_load_its_model() -> None:
    s = pool(workers=1)
    enqueue_many(s, "a", 4, 0.0)
    (cold,) = s.due_batches(0.0)
    assert cold.cold
    limit = s.default_limit_s(cold)
    assert s.hung_batches(limit + LOAD_LIMIT_S - 0.001, None) == []
    assert [b for b, _ in s.hung_batches(limit + LOAD_LIMIT_S + 0.001, None)] == [cold]
    assert [b for b, _ in s.hung_batches(LOAD_LIMIT_S + 1.001, 1.0)] == [cold]  # a fixed limit too
    s.complete(cold.worker, cold.batch_id, 0.001, 0.01)
    enqueue_many(s, "a", 4, 0.01)
    (warm,) = s.due_batches(0.01)
    assert not warm.cold
    assert [b for b, _ in s.hung_batches(0.01 + 1.001, 1.0)] == [warm]


def holding(s: Scheduler) -> list[str]:
    """The models the first worker holds, as the broker believes."""
    return [m for m in MODELS if s.views()[m].workers[0].holds]


def test_what_the_worker_says_it_holds_corrects_the_placement_with_its_later_batches_replayed() -> None:
    s = pool(workers=1, slots=2)
    enqueue_many(s, "a", 4, 0.0)
    enqueue_many(s, "b", 4, 0.0)
    first, second = s.due_batches(0.0)  # a (cold), then b (cold) behind it
    assert (first.model, second.model) == ("a", "b")
    assert (first.held_after, second.held_after) == (("a",), ("a", "b"))
    s.complete(first.worker, first.batch_id, 0.001, 0.01)
    s.held_by(first.worker, (), first)  # a's load failed: it holds nothing; b, still to run, will load
    assert holding(s) == ["b"] and second.held_after == ("b",)
    s.held_by(b"unknown", ("a",), first)  # a worker gone: nothing to correct


def test_a_held_list_is_taken_only_as_far_as_the_brokers_own_replay_allows() -> None:
    """A worker's word may say its load failed, nothing more: it cannot make the broker
    believe it holds models it never loaded (nor count them held: loads - unloads = held)."""
    s = pool(workers=1, slots=2)
    enqueue_many(s, "a", 4, 0.0)
    (first,) = s.due_batches(0.0)
    s.complete(first.worker, first.batch_id, 0.001, 0.01)
    s.held_by(first.worker, ("zzz", "c", "d", "a", "a"), first)  # never loaded, not of its catalog
    assert holding(s) == ["a"]
    enqueue_many(s, "b", 4, 0.02)
    (second,) = s.due_batches(0.02)
    s.complete(second.worker, second.batch_id, 0.001, 0.03)
    s.held_by(second.worker, ("b",), second)  # a lie: a was never unloaded
    assert holding(s) == ["a", "b"]
    s.held_by(second.worker, ("a",), second)  # b's load failed, whatever else it says
    assert holding(s) == ["a"]


def test_a_batch_behind_a_failed_load_of_its_model_is_cold_again_and_gets_the_load_time() -> None:
    s = pool(workers=1, slots=2)
    enqueue_many(s, "a", 8, 0.0)
    first, second = s.due_batches(0.0)
    assert first.cold and not second.cold  # a is to be held by then
    s.complete(first.worker, first.batch_id, 0.001, 0.01)
    s.held_by(first.worker, (), first)  # the load failed: the worker loads a for the second
    assert second.cold and second.held_after == ("a",)
    limit = s.default_limit_s(second)
    assert s.hung_batches(0.01 + limit + 1.0, None) == []  # LOAD_LIMIT_S more for its load


def test_a_reset_keeps_what_fits_in_the_catalog_in_order() -> None:
    r = Resident(Catalog(250, {"a": 100, "b": 100, "c": 100}))
    r.reset(["c", "x", "c", "a", "b"])
    assert list(r) == ["c", "a"] and r.used_mb == 200
    assert r.use("b") == Use(True, ("c",))


def test_a_worker_of_the_model_alone_counts_as_holding_it_beside_a_multiplexed_one() -> None:
    s = pool(workers=1)
    s.add_worker(b"own", "a", 1)  # a worker of model a alone, beside the pool
    enqueue_many(s, "a", 8, 0.0)
    (first,) = s.due_batches(0.0)
    assert first.worker == b"own" and not first.cold  # it holds a: no load
    assert s.due_batches(0.0) == []  # one full batch waits for it rather than load a
    enqueue_many(s, "a", 4, 0.0)
    (spread,) = s.due_batches(0.0)  # two full batches wait: the pool's worker loads a
    assert spread.worker == b"p0" and spread.cold
    enqueue_many(s, "b", 4, 0.0)
    assert s.due_batches(0.0) == []  # b's only worker is busy; "own" does not serve b


def test_the_catalogs_bounds_are_inclusive_and_its_refusals_are_cut_at_300_characters() -> None:
    from batcher.core.multiplex import MAX_KEY_CHARS, MAX_MB, MAX_MODELS

    Catalog(MAX_MB, {"k" * MAX_KEY_CHARS: MAX_MB})  # each bound itself is allowed
    Catalog(1, {f"m{i}": 1 for i in range(MAX_MODELS)})
    for budget, sizes in (
        (1, {f"m{i}": 1 for i in range(MAX_MODELS + 1)}),
        (1, {"k" * (MAX_KEY_CHARS + 1): 1}),
        (MAX_MB + 1, {"a": 1}),
        (MAX_MB, {"a": MAX_MB + 1}),
    ):
        with pytest.raises(SettingsError) as raised:
            Catalog(budget, sizes)
        assert len(str(raised.value)) <= 300
    with pytest.raises(SettingsError) as raised:
        Catalog(1, {f"m{i}": 1 for i in range(MAX_MODELS + 1)})
    assert len(str(raised.value)) <= 300 and str(raised.value).endswith("...")  # the map it quotes: cut
    with pytest.raises(SettingsError) as raised:
        Catalog(1, {"k" * 400: 1})
    assert len(str(raised.value)) <= 300 and str(raised.value).endswith("...")
    for bad in ({"budget_mb": "x" * 400}, {"budget_mb": 1, "models": ["x" * 400]}):
        with pytest.raises(SettingsError) as raised:
            Catalog.from_wire(bad)
        assert len(str(raised.value)) <= 300 and str(raised.value).endswith("...")
    with pytest.raises(SettingsError, match="multiplexed models must be a map of name to MB, got"):
        Catalog.from_wire({"budget_mb": 1, "models": [1]})


def test_dropping_one_model_keeps_the_room_of_the_others() -> None:
    r = Resident(Catalog(300, {"a": 100, "b": 50, "c": 100}))
    r.use("a")
    r.use("b")
    r.drop("a")
    assert r.used_mb == 50 and list(r) == ["b"]
