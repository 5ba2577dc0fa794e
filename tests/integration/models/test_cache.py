"""The response cache against real processes (issue 33, item 6)."""

from __future__ import annotations

from typing import Any

import pytest

from batcher.client import Client, ModelError
from batcher.serve.launcher import ServeProcess
from tests.helpers import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

ECHO = "echo=tests.fixture_models:flaky"
OTHER = "other=tests.fixture_models:flaky"
COUNTING = "counting=tests.fixture_models:counting"
CACHE_BYTES = 20_000


def batches(stats: dict[str, Any], model: str) -> int:
    return int(stats["models"][model]["batches"])


@pytest.fixture
def served() -> Any:
    args = [
        "--model",
        ECHO,
        "--model",
        OTHER,
        "--model",
        COUNTING,
        "--cache-bytes",
        str(CACHE_BYTES),
        "--workers",
        "1",
    ]
    for name in ("echo", "counting"):
        args += ["--cache-model", name]
    with ServeProcess(args) as serve:
        serve.wait_ready(3)
        yield serve


def test_a_repeated_input_is_answered_from_the_cache_without_a_batch(served: ServeProcess) -> None:
    with Client(served.frontend, timeout_s=10) as client:
        first = client.request_reply([1, 2, 3], model="echo")
        assert first["ok"] and "cached" not in first
        before = client.control("stats")
        again = client.request_reply([1, 2, 3], model="echo")
        after = client.control("stats")
    assert again["ok"] and again["cached"] is True
    assert again["output"] == first["output"] == [1, 2, 3]
    assert batches(after, "echo") == batches(before, "echo")
    assert after["cache"]["models"]["echo"]["hits"] >= 1


def test_the_cache_never_exceeds_its_bytes(served: ServeProcess) -> None:
    with Client(served.frontend, timeout_s=10) as client:
        outputs = client.request_many([f"input {i} " + "x" * 200 for i in range(400)], model="echo")
        stats = client.control("stats")
    assert outputs[7] == "input 7 " + "x" * 200
    cache = stats["cache"]
    assert 0 < cache["bytes"] <= CACHE_BYTES
    assert cache["evictions"] > 0


def test_a_model_that_is_not_deterministic_is_never_cached(served: ServeProcess) -> None:
    with Client(served.frontend, timeout_s=10) as client:
        replies = [client.request_reply("same", model="counting") for _ in range(3)]
    assert all("cached" not in r for r in replies)
    assert len({r["output"] for r in replies}) == 3


def test_an_error_reply_is_never_cached(served: ServeProcess) -> None:
    with Client(served.frontend, timeout_s=10) as client:
        for _ in range(2):
            with pytest.raises(ModelError):
                client.request("boom", model="echo")
        reply = client.request_reply("boom", model="echo")
    assert not reply["ok"] and "cached" not in reply


def test_different_models_never_share_entries(served: ServeProcess) -> None:
    with Client(served.frontend, timeout_s=10) as client:
        client.request("shared", model="echo")
        assert client.request_reply("shared", model="echo")["cached"] is True
        other = [client.request_reply("shared", model="other") for _ in range(2)]
    assert all(r["ok"] and "cached" not in r for r in other)  # other has no cache = true


def test_the_config_files_cache_key_turns_it_on(tmp_path: Any) -> None:
    config = tmp_path / "batcher.toml"
    config.write_text("cache-bytes = 100000\n[models.echo]\ncache = true\n")
    args = ["--config", str(config), "--model", ECHO, "--workers", "1"]
    with ServeProcess(args) as serve:
        serve.wait_ready(1)
        with Client(serve.frontend, timeout_s=10) as client:
            client.request("again", model="echo")
            reply = client.request_reply("again", model="echo")
    assert reply["cached"] is True and reply["output"] == "again"


def test_the_cache_metrics() -> None:
    import urllib.request

    from batcher.serve.launcher import free_tcp_address

    port = free_tcp_address().rsplit(":", 1)[1]
    args = ["--model", ECHO, "--workers", "1", "--cache-bytes", "100000", "--cache-model", "echo"]
    with ServeProcess([*args, "--metrics-port", port]) as serve:
        serve.wait_ready(1)
        with Client(serve.frontend, timeout_s=10) as client:
            for _ in range(3):
                client.request("m", model="echo")
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'batcher_cache_hits_total{model="echo"} 2.0' in text
    assert 'batcher_cache_misses_total{model="echo"} 1.0' in text
    assert "batcher_cache_bytes " in text and "batcher_cache_bytes 0.0" not in text


def test_a_reload_drops_the_models_entries(served: ServeProcess) -> None:
    """New workers may run new weights: once a reload has replaced the model's workers, a
    repeated input is answered by them (a miss), then from the cache again."""
    with Client(served.frontend, timeout_s=30) as client:
        client.request("before", model="echo")
        assert client.request_reply("before", model="echo").get("cached") is True
        old = {w["worker"] for w in client.control("stats")["models"]["echo"]["worker_list"]}
        assert client.control("reload", model="echo")["replaced"] == 1
        wait_until(
            lambda: not old & {w["worker"] for w in client.control("stats")["models"]["echo"]["worker_list"]},
            20,
            "the old worker gone",
        )
        first = client.request_reply("before", model="echo")
        again = client.request_reply("before", model="echo")
    assert first["ok"] and "cached" not in first, first
    assert again["cached"] is True


def test_a_stream_is_never_cached() -> None:
    """Identical streamed requests each run, to a step-level model (simlm) and to a batch
    model whose same input is in the cache; a plain repeat still hits, so the cache is on."""
    args = ["--model", ECHO, "--model", "simlm", "--workers", "1", "--cache-bytes", "100000"]
    args += ["--cache-model", "echo", "--cache-model", "simlm"]
    args += ["--simlm-step-base-ms", "1", "--simlm-step-per-seq-ms", "0"]
    with ServeProcess(args) as serve:
        serve.wait_ready(2)
        with Client(serve.frontend, timeout_s=10) as client:
            client.request("same", model="echo")
            assert client.request_reply("same", model="echo")["cached"] is True  # the cache is on
            before = client.control("stats")
            echoed = [list(client.stream("same", model="echo").replies()) for _ in range(3)]
            tokens = [list(client.stream({"tokens": 3}, model="simlm").replies()) for _ in range(3)]
            after = client.control("stats")
    assert all([r["output"] for r in s] == ["same"] for s in echoed)
    assert all([r["output"] for r in s] == [0, 1, 2] for s in tokens)  # every chunk generated
    assert not any("cached" in r for s in echoed + tokens for r in s)
    assert batches(after, "echo") == batches(before, "echo") + 3  # each stream ran a batch
    sequences = after["models"]["simlm"]["sequences"] - before["models"]["simlm"]["sequences"]
    chunks = after["models"]["simlm"]["chunks"] - before["models"]["simlm"]["chunks"]
    assert (sequences, chunks) == (3, 9)  # each stream generated by the worker
    hits = {m: c["hits"] for m, c in after["cache"]["models"].items()}
    assert hits.get("echo") == 1 and hits.get("simlm", 0) == 0  # the one plain repeat alone
