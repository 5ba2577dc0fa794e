"""Models that only workers announced are forgotten once none serves them
(batcher.core.policy.forget_unserved): a worker announcing ever new names, one at a time
or a multiplexed catalog of them at each READY, must not grow the broker without bound;
a configured model, or one whose worker restarts within --no-worker-timeout-ms, keeps
its queue."""

from __future__ import annotations

import pytest

from batcher.core.multiplex import POOL_NAME, Catalog
from batcher.core.policy import MAX_UNSERVED_MODELS
from batcher.core.scheduler import BatchSettings, NoSuchModel, Scheduler
from tests.scheduler_builders import rq


def turn(s: Scheduler, now: float) -> list[str]:
    """What the broker's loop does each turn: refuse for no worker, then forget."""
    s.unavailable(now)
    return s.forget_unserved(now)


def test_catalog_after_catalog_of_new_names_leaves_only_the_configured_models() -> None:
    s = Scheduler(models=["conf"], no_worker_timeout_s=10.0)
    for i in range(50):
        catalog = Catalog(100, {f"m{i}-{k}": 1 for k in range(20)})
        s.add_worker(b"w", POOL_NAME, catalog=catalog)
        assert s.knows_model(f"m{i}-0") and not s.knows_model(POOL_NAME)
        s.remove_worker(b"w")
        turn(s, float(i))
    assert len(s.models) == 1 + 10 * 20  # the last 10 s's catalogs wait out the timeout
    assert sorted(turn(s, 50.0)) == sorted(f"m40-{k}" for k in range(20))
    assert sorted(turn(s, 59.0)) == sorted(f"m{i}-{k}" for i in range(41, 50) for k in range(20))
    assert list(s.models) == ["conf"] and list(s.views()) == ["conf"]
    with pytest.raises(NoSuchModel):
        s.enqueue("m0-0", rq(60.0))


def test_past_the_cap_the_oldest_go_at_once_even_without_a_no_worker_timeout() -> None:
    s = Scheduler(models=["conf"], no_worker_timeout_s=0.0)  # 0: a model without worker waits forever
    n = MAX_UNSERVED_MODELS + 500
    for i in range(n):
        s.add_worker(b"w%d" % i, f"m{i}")
        s.remove_worker(b"w%d" % i)
        turn(s, float(i))
    assert len(s.models) == 1 + MAX_UNSERVED_MODELS
    assert not s.knows_model("m499") and s.knows_model("m500") and s.knows_model(f"m{n - 1}")
    assert s.knows_model("conf")


def test_an_unserved_model_with_requests_queued_stays_until_they_are_answered_unavailable() -> None:
    s = Scheduler(no_worker_timeout_s=1.0)
    s.add_worker(b"w", "m")
    s.enqueue("m", rq(0.0))
    s.remove_worker(b"w")
    assert turn(s, 0.0) == [] and turn(s, 0.5) == []
    assert [name for name, _, _ in s.unavailable(1.0)] == ["m"]  # the rule for no worker
    assert s.forget_unserved(1.0) == ["m"]


def test_a_worker_that_restarts_within_the_timeout_finds_its_queue_and_settings() -> None:
    s = Scheduler(no_worker_timeout_s=1.0)
    s.add_worker(b"w", "m")
    before = s.models["m"]
    s.remove_worker(b"w")
    assert turn(s, 0.0) == []
    s.enqueue("m", rq(0.1))  # waits for a worker, as for any known model
    s.add_worker(b"v", "m")  # back: no more a candidate
    assert turn(s, 5.0) == [] and s.models["m"] is before
    s.remove_worker(b"v")
    assert s.models["m"].total() == 1 and turn(s, 5.5) == []  # its clock starts again
    s.cancel(lambda r: True)
    assert turn(s, 6.0) == [] and turn(s, 6.5) == ["m"]


def test_a_configured_model_is_never_forgotten_nor_one_configured_after_a_worker_announced_it() -> None:
    s = Scheduler(models=["a"], per_model={"b": BatchSettings(max_batch_size=2)}, no_worker_timeout_s=1.0)
    s.add_worker(b"w", "c")
    s.set_settings("c", BatchSettings(max_batch_size=3))  # a repository version, say
    s.add_worker(b"x", POOL_NAME, catalog=Catalog(10, {"a": 1, "b": 1, "c": 1, "d": 1}))
    s.remove_worker(b"w")
    s.remove_worker(b"x")
    assert turn(s, 0.0) == [] and turn(s, 10.0) == ["d"]
    assert sorted(s.models) == ["a", "b", "c"]


def test_a_model_one_of_two_workers_still_serves_is_kept() -> None:
    s = Scheduler(no_worker_timeout_s=1.0)
    s.add_worker(b"w", "m")
    s.add_worker(b"v", POOL_NAME, catalog=Catalog(10, {"m": 1, "n": 1}))
    s.remove_worker(b"v")
    assert turn(s, 0.0) == [] and turn(s, 2.0) == ["n"] and s.knows_model("m")
