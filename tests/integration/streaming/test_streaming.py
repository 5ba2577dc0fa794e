"""Streamed replies and step-level (continuous) batching, end to end: real `batcher serve`
(or broker and `batcher worker`) processes with the built-in step-level model `simlm`,
driven over raw DEALER sockets, Client.stream, AsyncClient.stream and the CLI.

The rules checked: a request with `"stream": true` gets one reply per chunk, in order,
each with the request's id, every one but the last saying `"more": true` and the last
`"more": false`, whether it ends well or with an error (the worker's or the broker's);
a sequence the broker ends early (cancel, deadline, client gone) is stopped at its
worker too; a sequence whose worker dies starts over elsewhere only if none of its
chunks was sent; a request-level worker admits nothing new until its batch has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import signal
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlparse

import pytest
import zmq
import zmq.asyncio

from batcher import AsyncClient
from batcher.client.sync import BadRequest, Client, UnknownModel
from batcher.serve.launcher import ServeProcess, free_tcp_address
from tests.helpers import (
    HEARTBEAT,
    broker_stats,
    model_stats,
    pack,
    recv_reply,
    sample,
    scrape,
    start_broker,
    unpack,
    wait_until,
)

pytestmark = pytest.mark.integration

#: simlm at 2 ms a step (plus 0.05 ms per sequence): streams are quick.
FAST_LM = ("--simlm-step-base-ms", "2", "--simlm-step-per-seq-ms", "0.05")
#: Tokens of a stream that, at any step cost here, outlives every test (it is ended early).
ENDLESS = 100_000
FLAKY = "flaky=tests.fixture_models:flaky"

_tags = itertools.count()

Serve = Callable[..., ServeProcess]
Connect = Callable[[int, str], zmq.Socket[Any]]
MakeClient = Callable[..., Client]
Cli = Callable[..., Any]
Spawn = Callable[..., Any]


# --- a raw DEALER that keeps every reply ------------------------------------------------------


class Dealer:
    """A raw DEALER to a broker's frontend (what a client in any language sees): requests
    go out as [b"", body], and every reply read is kept, in order of arrival."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self.sock = sock
        self.log: list[dict[str, Any]] = []
        self._by_id: dict[Any, list[dict[str, Any]]] = {}  # the log by id: no rescans of it
        self._ended: set[Any] = set()

    def send(self, body: dict[str, Any]) -> None:
        self.sock.send_multipart([b"", pack(body)])

    def stream(self, req_id: object, tokens: int, model: str = "simlm", **extra: Any) -> None:
        """A streamed simlm request of `tokens` chunks."""
        self.send({"id": req_id, "model": model, "input": {"tokens": tokens}, "stream": True, **extra})

    def cancel(self, req_id: object) -> None:
        self.send({"id": req_id, "op": "cancel"})

    def of(self, req_id: object) -> list[dict[str, Any]]:
        """The replies to `req_id` so far, in order."""
        return list(self._by_id.get(req_id, []))

    def ended(self, req_id: object) -> bool:
        return req_id in self._ended

    def read_until(self, predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
        """Read replies until `predicate()` holds, or fail after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            left_ms = int((deadline - time.monotonic()) * 1000)
            assert left_ms > 0 and self.sock.poll(left_ms, zmq.POLLIN), (
                f"{what}: not within {timeout_s}s; last replies: {self.log[-5:]}"
            )
            frames = self.sock.recv_multipart()
            assert len(frames) == 2 and frames[0] == b"", frames
            self.add(unpack(frames[1]))

    def add(self, reply: dict[str, Any]) -> None:
        """Keep a reply read from the socket."""
        self.log.append(reply)
        key = reply.get("id")
        self._by_id.setdefault(key, []).append(reply)
        if reply.get("more") is not True:
            self._ended.add(key)

    def chunks(self, req_id: object, n: int, timeout_s: float = 10.0) -> None:
        """Read until `req_id` has at least `n` replies."""
        self.read_until(lambda: len(self.of(req_id)) >= n, f"{n} replies to {req_id!r}", timeout_s)

    def finish(self, *req_ids: object, timeout_s: float = 10.0) -> None:
        """Read until each of `req_ids` has had its final reply."""
        self.read_until(lambda: all(self.ended(i) for i in req_ids), f"the ends of {req_ids!r}", timeout_s)

    def barrier(self) -> dict[str, Any]:
        """Ask the broker's `stats` on this socket and return them; its reply must be the
        very next message (nothing else was on its way to us)."""
        tag = f"barrier-{next(_tags)}"
        self.send({"id": tag, "op": "stats"})
        reply = recv_reply(self.sock)
        assert reply.get("id") == tag, f"an unexpected reply arrived: {reply}"
        assert reply["ok"], reply
        output: dict[str, Any] = reply["output"]
        return output

    def quiet(self, model: str = "simlm", timeout_s: float = 10.0) -> dict[str, Any]:
        """Barriers until every worker of `model` has said (in its last CHUNK) that it holds
        nothing: once the broker has read that, every chunk those workers sent before was
        handled, so a stray reply to us would have come before the last barrier's."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats: dict[str, Any] = self.barrier()["models"][model]
            if idle(stats):
                return stats
            assert time.monotonic() < deadline, f"{model}'s workers still hold sequences: {stats}"
            time.sleep(0.02)  # between probes of the condition


def idle(stats: dict[str, Any]) -> bool:
    """Whether no worker of a model holds a sequence, by the broker and by the workers' own
    last counters."""
    return stats["active_sequences"] == 0 and all(
        w.get("active_sequences", 0) == 0
        and w.get("counters", {}).get("active", 0) == 0
        and w.get("counters", {}).get("waiting", 0) == 0
        for w in stats["worker_list"]
    )


def assert_complete(replies: list[dict[str, Any]], k: int, req_id: object) -> None:
    """A stream's replies: exactly k chunks, outputs 0..k-1 in order, all ok, each with
    the request's id, only the last with more false."""
    assert [r.get("ok") for r in replies] == [True] * k, replies
    assert [r["output"] for r in replies] == list(range(k)), replies
    assert [r.get("more") for r in replies] == [True] * (k - 1) + [False], replies
    assert all(r["id"] == req_id for r in replies)


def assert_one_final_error(replies: list[dict[str, Any]], code: str) -> dict[str, Any]:
    """A stream ended by an error: chunks 0..n-1 in order, then one error reply, more false."""
    *chunks, final = replies
    assert [r["output"] for r in chunks] == list(range(len(chunks))), replies
    assert all(r.get("ok") is True and r.get("more") is True for r in chunks), replies
    assert final.get("ok") is False and final.get("more") is False, final
    assert final["error"]["code"] == code, final
    return final


def worker_pid(entry: dict[str, Any]) -> int:
    """The pid in a worker_list name, `model/gpuN/pidP/idHEX`."""
    found = re.search(r"/pid(\d+)/", entry["worker"])
    assert found, entry
    return int(found.group(1))


def lm_stats(sp: ServeProcess | str, ctx: zmq.Context[Any]) -> dict[str, Any]:
    return model_stats(sp if isinstance(sp, str) else sp.frontend, ctx, "simlm")


def only_worker(stats: dict[str, Any]) -> dict[str, Any]:
    (entry,) = stats["worker_list"]
    return dict(entry)


def serve_lm(serve: Callable[..., ServeProcess], *args: str, workers: int = 1) -> ServeProcess:
    """`batcher serve` of `workers` fast simlm workers."""
    return serve("--workers", str(workers), "--model", "simlm", *FAST_LM, *HEARTBEAT, *args, workers=workers)


@pytest.fixture
def actx() -> Iterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


# --- 1. order and exactly one final reply -------------------------------------------------------


def test_a_stream_of_k_tokens_is_k_replies_in_order_and_one_final(
    serve: Serve, connect: Connect, zctx: zmq.Context[Any]
) -> None:
    sp = serve(
        "--workers", "1", "--model", "simlm", "--model", "echo", "--model", FLAKY, *FAST_LM, workers=3
    )  # fmt: skip
    d = Dealer(connect(zmq.DEALER, sp.frontend))
    d.stream(1, 6)
    d.finish(1)
    replies = d.of(1)
    assert_complete(replies, 6, 1)
    assert replies[-1]["chunks"] == 6 and "worker" in replies[-1], replies[-1]

    # Without "stream": one reply holding every chunk, and no "more".
    d.send({"id": 2, "model": "simlm", "input": {"tokens": 6}})
    d.read_until(lambda: bool(d.of(2)), "the non-streamed reply")
    (plain,) = d.of(2)
    assert plain["ok"] and plain["output"] == list(range(6)) and "more" not in plain, plain

    # A bare int is a token count too, and "prompt" only adds a prefill.
    d.send({"id": 3, "model": "simlm", "input": 3, "stream": True})
    d.send({"id": 4, "model": "simlm", "input": {"tokens": 2, "prompt": 5}, "stream": True})
    d.finish(3, 4)
    assert_complete(d.of(3), 3, 3)
    assert_complete(d.of(4), 2, 4)

    # A request-level model asked for a stream answers once: its last chunk, more false.
    d.send({"id": 5, "model": "echo", "input": "x", "stream": True})
    d.read_until(lambda: bool(d.of(5)), "echo's streamed reply")
    (echoed,) = d.of(5)
    assert echoed["ok"] and echoed["output"] == "x" and echoed.get("more") is False, echoed

    # ...and so does its error: one reply, more false.
    d.send({"id": 6, "model": "flaky", "input": "boom", "stream": True})
    d.read_until(lambda: bool(d.of(6)), "flaky's streamed error")
    assert_one_final_error(d.of(6), "model_error")

    stats = d.quiet()
    assert len(d.log) == 6 + 1 + 3 + 2 + 1 + 1  # nothing more came, nothing twice
    assert stats["chunks"] == 6 + 1 + 3 + 2 and stats["sequences"] == 4, stats
    assert stats["outcomes"] == {"ok": 4}, stats
    assert stats["chunks_per_s"] > 0 and stats["first_chunk_ms_p50"] is not None, stats
    assert only_worker(stats)["counters"]["chunks"] == 6 + 6 + 3 + 2


def test_client_stream_and_async_stream_give_every_chunk(
    serve: Serve, client: MakeClient, actx: zmq.asyncio.Context
) -> None:
    sp = serve_lm(serve)
    c = client(sp.frontend)
    assert list(c.stream({"tokens": 5}, model="simlm")) == [0, 1, 2, 3, 4]

    st = c.stream({"tokens": 4}, model="simlm")
    replies = list(st.replies())
    assert_complete(replies, 4, st.request_id)
    assert st.final is replies[-1]
    assert st.next_reply() is None  # nothing after the last

    with pytest.raises(BadRequest):
        list(c.stream({"tokens": 0}, model="simlm"))
    with pytest.raises(UnknownModel):
        list(c.stream({"tokens": 2}, model="nope"))
    assert c.request({"tokens": 3}, model="simlm") == [0, 1, 2]  # the client is still in step

    async def main() -> tuple[list[Any], list[list[Any]]]:
        async with AsyncClient(sp.frontend, timeout_s=10, context=actx) as ac:
            one = [x async for x in ac.stream({"tokens": 7}, model="simlm")]

            async def collect(k: int) -> list[Any]:
                return [x async for x in ac.stream({"tokens": k}, model="simlm")]

            many = await asyncio.gather(*(collect(k) for k in range(1, 9)))
            return one, list(many)

    one, many = asyncio.run(main())
    assert one == list(range(7))
    assert many == [list(range(k)) for k in range(1, 9)]


# --- 2. many streams over one socket ------------------------------------------------------------


def test_64_concurrent_streams_over_one_dealer_each_complete_in_order(serve: Serve, connect: Connect) -> None:
    sp = serve_lm(serve, "--max-active", "16", workers=2)
    d = Dealer(connect(zmq.DEALER, sp.frontend))
    lengths = {i: 1 + (i * 7) % 20 for i in range(64)}
    for i, k in lengths.items():
        d.stream(i, k)
    d.finish(*lengths, timeout_s=20)
    for i, k in lengths.items():
        assert_complete(d.of(i), k, i)
    stats = d.quiet()  # and no reply arrives after the last final
    assert len(d.log) == sum(lengths.values())
    assert stats["sequences"] == 64 and stats["outcomes"] == {"ok": 64}, stats
    assert stats["chunks"] == sum(lengths.values()), stats
    assert sum(w["counters"]["chunks"] for w in stats["worker_list"]) == sum(lengths.values())
    # 64 sequences over 2 x 16 slots: both workers took some, neither ever more than 16
    assert all(w["max_active"] == 16 and w["counters"]["chunks"] > 0 for w in stats["worker_list"]), stats


# --- 3. cancel mid-stream -----------------------------------------------------------------------


def wait_stopped(sp: ServeProcess, ctx: zmq.Context[Any], reason: str, what: str) -> dict[str, Any]:
    """The model's stats once the broker counted one sequence ended for `reason` and the
    (only) worker acknowledged it: one cancelled by its counters, none active."""
    stats: dict[str, Any] = wait_until(
        lambda: (
            (s := lm_stats(sp, ctx))
            and s["sequences_cancelled"] == {reason: 1}
            and only_worker(s).get("counters", {}).get("cancelled") == 1
            and only_worker(s)["counters"]["active"] == 0
            and s["active_sequences"] == 0
            and s
        ),
        10,
        what,
    )
    return stats


def assert_stopped_by_cancel(d: Dealer, ctx: zmq.Context[Any], sp: ServeProcess) -> None:
    """After one stream was cancelled: the broker counted it, the worker stopped it (it
    acknowledged, and generates nothing more for it: its chunk count grows by exactly the
    next stream's chunks), and the next stream works."""
    stats = wait_stopped(sp, ctx, "cancel", "the worker acknowledged the cancel")
    assert stats["outcomes"].get("cancelled") == 1, stats
    at_ack = only_worker(stats)["counters"]["chunks"]
    d.stream("after", 4)
    d.finish("after")
    assert_complete(d.of("after"), 4, "after")
    stats = d.quiet()
    assert only_worker(stats)["counters"]["chunks"] == at_ack + 4, (at_ack, stats)
    assert only_worker(stats)["counters"]["cancelled"] == 1
    assert stats["sequences_cancelled"] == {"cancel": 1}, stats


def test_cancel_op_ends_a_stream_with_one_cancelled_reply_and_stops_the_worker(
    serve: Serve, connect: Connect, zctx: zmq.Context[Any]
) -> None:
    sp = serve_lm(serve)
    d = Dealer(connect(zmq.DEALER, sp.frontend))
    d.stream("long", ENDLESS)
    d.chunks("long", 3)
    # A cancel from another socket with the same id is not this client's: nothing happens.
    other = Dealer(connect(zmq.DEALER, sp.frontend))
    other.cancel("long")
    other.barrier()  # the broker has read the cancel
    seen = len(d.of("long"))
    d.chunks("long", seen + 3)
    assert not d.ended("long")
    d.cancel("long")
    d.finish("long")
    assert_one_final_error(d.of("long"), "cancelled")
    d.cancel("long")  # again, for a stream already ended: matches nothing, never answered
    d.barrier()
    assert_stopped_by_cancel(d, zctx, sp)
    # Whatever the worker had made before it heard of the cancel was dropped by the broker.
    assert d.log[-1]["id"] == "after" and [r for r in d.log if r["id"] == "long"][-1]["more"] is False
    assert len(d.of("long")) < ENDLESS
    assert all(r.get("more") is True for r in d.of("long")[:-1])


def test_closing_a_client_stream_cancels_it(
    serve: Serve, client: MakeClient, connect: Connect, zctx: zmq.Context[Any]
) -> None:
    sp = serve_lm(serve)
    c = client(sp.frontend)
    with c.stream({"tokens": ENDLESS}, model="simlm") as st:
        assert [next(st) for _ in range(3)] == [0, 1, 2]
    assert st.closed
    d = Dealer(connect(zmq.DEALER, sp.frontend))
    assert_stopped_by_cancel(d, zctx, sp)
    # The same client goes on: the cancelled reply was not taken for another's.
    assert c.request({"tokens": 2}, model="simlm") == [0, 1]
    assert list(c.stream({"tokens": 3}, model="simlm")) == [0, 1, 2]


def test_leaving_an_async_stream_early_cancels_it(
    serve: Serve, connect: Connect, zctx: zmq.Context[Any], actx: zmq.asyncio.Context
) -> None:
    sp = serve_lm(serve)

    async def main() -> list[Any]:
        got: list[Any] = []
        async with AsyncClient(sp.frontend, timeout_s=10, context=actx) as ac:
            chunks = cast(AsyncGenerator[Any, None], ac.stream({"tokens": ENDLESS}, model="simlm"))
            async with contextlib.aclosing(chunks):
                async for x in chunks:
                    got.append(x)
                    if len(got) == 3:
                        break
            # the cancel goes out from the client's loop: wait for the broker to count it
            deadline = time.monotonic() + 10
            while (await ac.control("stats"))["models"]["simlm"]["sequences_cancelled"] != {"cancel": 1}:
                assert time.monotonic() < deadline, "the cancel never reached the broker"
                await asyncio.sleep(0.02)  # between probes of the condition
            assert [x async for x in ac.stream({"tokens": 2}, model="simlm")] == [0, 1]
        return got

    assert asyncio.run(main()) == [0, 1, 2]
    d = Dealer(connect(zmq.DEALER, sp.frontend))
    assert_stopped_by_cancel(d, zctx, sp)


# --- 4. a deadline mid-stream -------------------------------------------------------------------


def test_a_deadline_mid_stream_ends_it_with_one_deadline_exceeded_reply(
    serve: Serve, connect: Connect
) -> None:
    sp = serve_lm(serve, "--simlm-step-base-ms", "5")
    d = Dealer(connect(zmq.DEALER, sp.frontend))
    started = time.monotonic()
    d.stream("late", ENDLESS, timeout_ms=600)
    d.finish("late")
    elapsed = time.monotonic() - started
    assert_one_final_error(d.of("late"), "deadline_exceeded")
    assert len(d.of("late")) > 1, "no chunk came before the deadline"
    assert 0.55 <= elapsed < 5, elapsed
    stats = d.quiet()
    counters = only_worker(stats)["counters"]
    # Ended by the broker (the worker told to stop, or it expired the sequence itself
    # before it heard) or by the worker's own deadline: one final reply either way.
    assert stats["sequences_cancelled"] in ({}, {"deadline": 1}), stats
    assert counters["expired"] + counters["cancelled"] == 1, counters
    if not stats["sequences_cancelled"]:
        assert counters["expired"] == 1, counters
    assert stats["outcomes"] == {"deadline_exceeded": 1}, stats
    assert counters["active"] == 0 and stats["active_sequences"] == 0


# --- 5. a worker that dies mid-stream -----------------------------------------------------------


def test_a_dead_workers_streams_fail_once_chunked_and_restart_elsewhere_if_not(
    serve: Serve, connect: Connect, zctx: zmq.Context[Any]
) -> None:
    # Request-level workers with 2 slots: a sequence sent to a worker that is generating
    # waits there, chunkless, until the batch at hand ends.
    sp = serve_lm(serve, "--max-active", "2", "--batching-level", "request", workers=2)
    d = Dealer(connect(zmq.DEALER, sp.frontend))
    d.stream("a", ENDLESS)
    d.chunks("a", 3)
    (holds_a,) = [w["worker"] for w in lm_stats(sp, zctx)["worker_list"] if w["active_sequences"] == 1]
    d.stream("c", ENDLESS)  # to the other, emptier, worker
    d.chunks("c", 3)
    workers = lm_stats(sp, zctx)["worker_list"]
    assert [w["active_sequences"] for w in workers] == [1, 1], workers
    d.stream("b", 3)
    # b went to one of them, where it waits behind the stream at hand: it has no chunk.
    victim = wait_until(
        lambda: [
            w
            for w in lm_stats(sp, zctx)["worker_list"]
            if w["active_sequences"] == 2 and w.get("counters", {}).get("waiting") == 1
        ],
        10,
        "b waiting at a worker",
    )[0]
    doomed, spared = ("a", "c") if victim["worker"] == holds_a else ("c", "a")
    # The other worker's stream is cancelled first, so that b can run wherever it goes next.
    d.cancel(spared)
    d.finish(spared)
    assert_one_final_error(d.of(spared), "cancelled")
    assert d.of("b") == []

    os.kill(worker_pid(victim), signal.SIGKILL)
    d.finish(doomed, "b")
    final = assert_one_final_error(d.of(doomed), "worker_failed")
    assert final["id"] == doomed
    assert_complete(d.of("b"), 3, "b")  # started over elsewhere, from its first token

    # serve respawned the worker, and new streams run.
    stats = wait_until(
        lambda: (
            (s := lm_stats(sp, zctx))
            and s["workers"] == 2
            and worker_pid(victim) not in [worker_pid(w) for w in s["worker_list"]]
            and s
        ),
        15,
        "the dead worker respawned",
    )
    assert stats["outcomes"].get("worker_failed") == 1, stats
    d.stream("new", 5)
    d.finish("new")
    assert_complete(d.of("new"), 5, "new")
    d.quiet()
    for req_id in (doomed, spared, "b", "new"):
        assert sum(r.get("more") is not True for r in d.of(req_id)) == 1, d.of(req_id)


def test_a_sequence_waiting_at_a_request_level_worker_can_be_cancelled_or_expire(
    serve: Serve, connect: Connect, zctx: zmq.Context[Any]
) -> None:
    # One request-level worker with 2 slots, generating an endless stream: whatever it is
    # sent next waits there, chunkless, for the batch at hand to end.
    sp = serve_lm(serve, "--max-active", "2", "--batching-level", "request")
    d = Dealer(connect(zmq.DEALER, sp.frontend))
    d.stream("running", ENDLESS)
    d.chunks("running", 2)

    def waiting_at_worker(n: int) -> Callable[[], bool]:
        def check() -> bool:
            s = lm_stats(sp, zctx)
            return bool(s) and only_worker(s).get("counters", {}).get("waiting") == n

        return check

    d.stream("waits", 3)
    wait_until(waiting_at_worker(1), 10, "the second stream waiting at the worker")
    d.cancel("waits")
    d.finish("waits")
    (cancelled,) = d.of("waits")
    assert_one_final_error([cancelled], "cancelled")
    wait_until(waiting_at_worker(0), 10, "the worker dropped the waiting sequence")

    d.stream("expires", 3, timeout_ms=300)
    d.finish("expires")
    (expired,) = d.of("expires")
    assert_one_final_error([expired], "deadline_exceeded")
    wait_until(waiting_at_worker(0), 10, "the worker dropped the expired sequence")

    assert not d.ended("running")
    d.cancel("running")
    d.finish("running")
    assert_one_final_error(d.of("running"), "cancelled")
    stats = d.quiet()
    counters = only_worker(stats)["counters"]
    # "running" and "waits" acknowledged as cancelled; "expires" ended by the broker (the
    # worker acknowledging its cancel) or by the worker's own deadline
    assert counters["cancelled"] + counters["expired"] == 3, counters
    assert counters["chunks"] >= len(d.of("running")) - 1, counters  # only "running" made any
    assert stats["sequences_cancelled"].get("cancel") == 2, stats
    assert stats["outcomes"] == {"cancelled": 2, "deadline_exceeded": 1}, stats


# --- 6. a client that vanishes mid-stream -------------------------------------------------------


def test_a_client_gone_mid_stream_is_noticed_and_its_sequence_stopped(
    serve: Serve, connect: Connect, zctx: zmq.Context[Any]
) -> None:
    sp = serve_lm(serve)
    gone = connect(zmq.DEALER, sp.frontend)
    gone.send_multipart(
        [b"", pack({"id": 1, "model": "simlm", "input": {"tokens": ENDLESS}, "stream": True})]
    )
    for i in range(3):
        assert recv_reply(gone)["output"] == i
    gone.close(linger=0)
    stats = wait_stopped(
        sp, zctx, "client_gone", "the broker noticed the client had gone and stopped its sequence"
    )
    assert stats["outcomes"] == {}, stats  # nobody was answered
    # The worker is free again for others.
    d = Dealer(connect(zmq.DEALER, sp.frontend))
    d.stream("next", 3)
    d.finish("next")
    assert_complete(d.of("next"), 3, "next")


# --- 7. batcher send --stream -------------------------------------------------------------------


def test_send_stream_prints_one_json_line_per_chunk(serve: Serve, cli: Cli) -> None:
    sp = serve_lm(serve)
    result = cli(
        "send", "--connect", sp.frontend, "--model", "simlm", "--stream", '{"tokens": 3}', '{"tokens": 2}'
    )
    assert result.returncode == 0, result
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(lines) == 5, result.stdout
    first, second = lines[:3], lines[3:]
    assert_complete(first, 3, first[0]["id"])
    assert_complete(second, 2, second[0]["id"])
    assert first[0]["id"] != second[0]["id"]

    bad = cli("send", "--connect", sp.frontend, "--model", "simlm", "--stream", '{"tokens": 0}')
    assert bad.returncode == 1, bad
    (line,) = [json.loads(x) for x in bad.stdout.splitlines()]
    assert line["ok"] is False and line["more"] is False and line["error"]["code"] == "bad_request", line


# --- 8. batcher bench --stream ------------------------------------------------------------------


def test_bench_stream_measures_chunks(tmp_path: Path, cli: Cli) -> None:
    out = tmp_path / "stream.json"
    result = cli(
        "bench", "--spawn", "--stream", "--duration", "2", "--concurrency", "8", "--workers", "1",
        "--simlm-step-base-ms", "2", "--input", '{"tokens": 16}', "--json", str(out), timeout_s=40,
    )  # fmt: skip
    assert result.returncode == 0, result
    data = json.loads(out.read_text())
    assert data["errors"] == {} and data["ok"] > 0, data
    assert data["chunks_per_s"] > 0, data
    # 8 streams at once on one worker stepping every ~2.4 ms: far fewer chunks than a
    # token per ms each could give, and many more than one per stream
    assert data["chunks_per_s"] >= 16 * data["throughput_rps"] * 0.9, data
    for key in ("first_chunk_ms", "inter_chunk_ms"):
        assert set(data[key]) >= {"p50", "p99", "max"}, data[key]
        assert 0 < data[key]["p50"] <= data[key]["p99"] <= data[key]["max"], data[key]
    assert "chunks:" in result.stdout


# --- 9. Prometheus --------------------------------------------------------------------------------


def test_metrics_count_chunks_first_chunks_cancels_and_active_sequences(
    serve: Serve, connect: Connect, zctx: zmq.Context[Any]
) -> None:
    port = urlparse(free_tcp_address()).port
    assert port is not None
    sp = serve_lm(serve, "--metrics-port", str(port))
    d = Dealer(connect(zmq.DEALER, sp.frontend))
    for i, k in enumerate((3, 4, 5)):
        d.stream(i, k)
    d.finish(0, 1, 2)
    d.quiet()
    m = scrape(port)
    assert sample(m, "batcher_chunks_total", model="simlm") == 12
    assert sample(m, "batcher_time_to_first_chunk_seconds_count", model="simlm") == 3
    assert sample(m, "batcher_requests_total", model="simlm", outcome="ok") == 3
    assert sample(m, "batcher_active_sequences", model="simlm") == 0

    d.stream("long", ENDLESS)
    d.chunks("long", 2)
    assert sample(scrape(port), "batcher_active_sequences", model="simlm") == 1
    d.cancel("long")
    d.finish("long")
    stats = d.quiet()
    m = scrape(port)
    assert sample(m, "batcher_sequences_cancelled_total", model="simlm", reason="cancel") == 1
    assert sample(m, "batcher_requests_total", model="simlm", outcome="cancelled") == 1
    assert sample(m, "batcher_active_sequences", model="simlm") == 0
    assert sample(m, "batcher_time_to_first_chunk_seconds_count", model="simlm") == 4
    # every chunk the broker delivered, and the same count as its stats
    assert sample(m, "batcher_chunks_total", model="simlm") == 12 + len(d.of("long")) - 1 == stats["chunks"]


# --- 10. the broker's own stream errors -------------------------------------------------------


def test_broker_refusals_of_a_stream_say_more_false(
    serve: Serve, connect: Connect, zctx: zmq.Context[Any]
) -> None:
    sp = serve_lm(serve, "--max-active", "1", "--max-queue", "1")
    d = Dealer(connect(zmq.DEALER, sp.frontend))
    d.stream("nope", 3, model="nope")
    d.finish("nope")
    assert_one_final_error(d.of("nope"), "unknown_model")

    d.stream("running", ENDLESS)
    d.chunks("running", 1)
    d.stream("queued", 3)  # the one slot is taken: it waits in the broker's queue...
    wait_until(lambda: lm_stats(sp, zctx).get("queued") == 1, 10, "one stream queued")
    d.stream("over", 3)  # ...which is full
    d.finish("over")
    assert_one_final_error(d.of("over"), "overloaded")

    d.cancel("queued")
    d.finish("queued")
    (cancelled,) = d.of("queued")
    assert_one_final_error([cancelled], "cancelled")

    d.stream("expires", 3, timeout_ms=100)  # never leaves the queue before its deadline
    d.finish("expires")
    (expired,) = d.of("expires")
    assert_one_final_error([expired], "deadline_exceeded")

    d.cancel("running")
    d.finish("running")
    assert_one_final_error(d.of("running"), "cancelled")
    stats = d.quiet()
    assert stats["sequences_cancelled"] == {"cancel": 1}, stats  # only one had started
    assert stats["sequences"] == 1, stats


def test_a_stream_refused_for_a_bad_header_says_more_false(serve: Serve, connect: Connect) -> None:
    sp = serve_lm(serve)
    d = Dealer(connect(zmq.DEALER, sp.frontend))
    d.stream("bad", 3, timeout_ms=-1)
    d.finish("bad")
    (reply,) = d.of("bad")
    assert reply["ok"] is False and reply["error"]["code"] == "bad_request", reply
    assert reply.get("more") is False, reply


def test_sigterm_drains_a_running_stream_and_refuses_new_ones(
    serve: Serve, connect: Connect, zctx: zmq.Context[Any]
) -> None:
    # One slot; 100 steps of ~10 ms, then 5 more for the stream queued behind: well within
    # the broker's 10 s drain
    sp = serve_lm(serve, "--simlm-step-base-ms", "10", "--max-active", "1")
    d = Dealer(connect(zmq.DEALER, sp.frontend))
    d.stream("draining", 100)
    d.chunks("draining", 3)
    d.stream("queued", 5)
    wait_until(lambda: lm_stats(sp, zctx).get("queued") == 1, 10, "one stream queued")
    assert sp.process is not None
    os.kill(sp.process.pid, signal.SIGTERM)
    wait_until(lambda: broker_stats(sp.frontend, zctx).get("stopping") is True, 10, "serve draining")
    d.stream("refused", 3)
    d.finish("refused", "draining", "queued")
    assert_one_final_error(d.of("refused"), "shutting_down")
    # Within the grace, what was accepted is finished, the queued one too; past it, it
    # would end shutting_down: one final reply either way.
    for req_id, k in (("draining", 100), ("queued", 5)):
        replies = d.of(req_id)
        if replies[-1]["ok"]:
            assert_complete(replies, k, req_id)
        else:
            assert_one_final_error(replies, "shutting_down")
    assert sp.process.wait(10) == 0
    # serve has exited: every reply it sent is in, and none came after a final
    while d.sock.poll(0, zmq.POLLIN):
        d.add(unpack(d.sock.recv_multipart()[-1]))
    assert len(d.log) == len(d.of("draining")) + len(d.of("queued")) + 1, d.log[-3:]


# --- 11. request-level batching, the baseline ---------------------------------------------------


def queue_then_start_worker(
    spawn: Spawn, zctx: zmq.Context[Any], connect: Connect, level: str, lengths: list[int], fifth: int
) -> tuple[Dealer, str]:
    """A broker holding 5 streams in its queue before its one worker (4 slots) joins, so
    the worker gets the first 4 in one START and the 5th when a slot frees."""
    frontend, backend = start_broker(spawn, zctx, "--model", "simlm", *HEARTBEAT)
    d = Dealer(connect(zmq.DEALER, frontend))
    for i, k in enumerate(lengths):
        d.stream(i, k)
    d.stream("fifth", fifth)
    wait_until(lambda: lm_stats(frontend, zctx).get("queued") == 5, 10, "5 streams queued")
    spawn(
        "worker", "--connect", backend, "--model", "simlm", *FAST_LM, *HEARTBEAT,
        "--max-active", "4", "--batching-level", level,
    )  # fmt: skip
    return d, frontend


def test_request_level_admits_nothing_new_until_the_batch_has_ended(
    spawn: Spawn, zctx: zmq.Context[Any], connect: Connect
) -> None:
    lengths = [5, 10, 15, 20]
    d, _ = queue_then_start_worker(spawn, zctx, connect, "request", lengths, 3)
    try:
        d.finish(0, 1, 2, 3, "fifth")
        for i, k in enumerate(lengths):
            assert_complete(d.of(i), k, i)
        assert_complete(d.of("fifth"), 3, "fifth")
        first_of_fifth = next(n for n, r in enumerate(d.log) if r["id"] == "fifth")
        last_final = max(n for n, r in enumerate(d.log) if r["id"] in range(4) and r["more"] is False)
        assert first_of_fifth > last_final, [(r["id"], r["output"]) for r in d.log]
        stats = d.quiet()
        assert only_worker(stats)["max_active"] == 4
    finally:
        d.sock.close(0)


def test_step_level_admits_a_new_sequence_between_steps(
    spawn: Spawn, zctx: zmq.Context[Any], connect: Connect
) -> None:
    # The contrast: at step level the 5th runs as soon as a slot frees, while the others go on.
    lengths = [5, ENDLESS, ENDLESS, ENDLESS]
    d, _ = queue_then_start_worker(spawn, zctx, connect, "step", lengths, 3)
    try:
        d.finish(0, "fifth")
        assert_complete(d.of(0), 5, 0)
        assert_complete(d.of("fifth"), 3, "fifth")
        assert not any(d.ended(i) for i in (1, 2, 3))
        for i in (1, 2, 3):
            d.cancel(i)
        d.finish(1, 2, 3)
        for i in (1, 2, 3):
            assert_one_final_error(d.of(i), "cancelled")
        stats = d.quiet()
        assert stats["sequences_cancelled"] == {"cancel": 3}, stats
    finally:
        d.sock.close(0)


# --- what is not a hung step-level worker ------------------------------------------------------


def test_a_long_request_without_stream_is_not_taken_for_a_hung_step(
    serve: Serve, client: MakeClient, zctx: zmq.Context[Any]
) -> None:
    """A request without "stream" sends no chunk until its last step; its worker still
    says, every 100 ms, that it makes progress, so a time limit far shorter than the
    request does not take it for hung."""
    sp = serve_lm(serve, "--batch-timeout-ms", "300")  # raised to 1 s for step-level workers
    c = client(sp.frontend, timeout_s=30)
    pid = worker_pid(only_worker(lm_stats(sp, zctx)))
    assert list(c.stream({"tokens": 5}, model="simlm")) == list(range(5))  # the worker has stepped
    started = time.monotonic()
    assert c.request({"tokens": 1200}, model="simlm") == list(range(1200))
    assert time.monotonic() - started > 2.0  # 1,200 steps of 2 ms and more: twice the limit
    assert broker_stats(sp.frontend, zctx)["batches_timed_out"] == 0
    assert worker_pid(only_worker(lm_stats(sp, zctx))) == pid


def test_a_paused_broker_does_not_take_its_step_workers_for_hung(
    spawn: Spawn, zctx: zmq.Context[Any], connect: Connect
) -> None:
    """CHUNKs that wait unread while the broker is stopped (SIGSTOP) past the step time
    limit are no silence of the workers: every stream ends well once it resumes."""
    frontend, backend = free_tcp_address(), free_tcp_address()
    broker = spawn(
        "broker", "--frontend", frontend, "--backend", backend, "--model", "simlm",
        "--batch-timeout-ms", "500", "--heartbeat-ms", "2000",
    )  # fmt: skip
    spawn("worker", "--connect", backend, "--model", "simlm", "--heartbeat-ms", "2000")
    wait_until(lambda: lm_stats(frontend, zctx).get("workers") == 1, 10, "the worker joined")
    d = Dealer(connect(zmq.DEALER, frontend))
    for i in range(32):
        d.stream(i, 60)
    d.chunks(31, 2)  # every stream runs
    os.kill(broker.pid, signal.SIGSTOP)
    try:
        time.sleep(1.2)  # the fault itself: a broker paused for more than twice the limit
    finally:
        os.kill(broker.pid, signal.SIGCONT)
    d.finish(*range(32), timeout_s=30)
    for i in range(32):
        assert_complete(d.of(i), 60, i)
    assert broker_stats(frontend, zctx)["batches_timed_out"] == 0


def test_a_broker_that_reads_slowly_slows_its_worker_and_loses_no_chunk(
    spawn: Spawn, zctx: zmq.Context[Any], connect: Connect
) -> None:
    """A fast worker fills its socket's queue while the broker is stopped: it waits for
    room instead of dropping CHUNKs, so every stream has every token, in order."""
    frontend, backend = free_tcp_address(), free_tcp_address()
    broker = spawn(
        "broker", "--frontend", frontend, "--backend", backend, "--model", "simlm", "--heartbeat-ms", "5000"
    )
    spawn(
        "worker", "--connect", backend, "--model", "simlm", "--heartbeat-ms", "5000",
        "--simlm-step-base-ms", "0", "--simlm-step-per-seq-ms", "0.01",
    )  # fmt: skip
    wait_until(lambda: lm_stats(frontend, zctx).get("workers") == 1, 10, "the worker joined")
    d = Dealer(connect(zmq.DEALER, frontend))
    for i in range(32):
        d.stream(i, 8000)
    d.chunks(31, 2)
    os.kill(broker.pid, signal.SIGSTOP)
    try:
        time.sleep(3.5)  # the fault itself: more CHUNKs pile up than queues and buffers hold
    finally:
        os.kill(broker.pid, signal.SIGCONT)
    d.finish(*range(32), timeout_s=45)
    for i in range(32):
        assert_complete(d.of(i), 8000, i)


def test_a_burst_of_slow_cancels_does_not_silence_the_worker(
    spawn: Spawn, zctx: zmq.Context[Any], connect: Connect
) -> None:
    """12 cancels of a model whose stop takes 100 ms keep the worker busy 1.2 s, past the
    0.75 s heartbeat expiry: its heartbeats go on meanwhile, and its other streams end well."""
    frontend, backend = start_broker(spawn, zctx, "--model", "simlm", *HEARTBEAT)
    spawn(
        "worker", "--connect", backend, "--model", "simlm=tests.fixture_models:SlowStopLM", *HEARTBEAT,
        "--max-active", "16",
    )  # fmt: skip
    wait_until(lambda: lm_stats(frontend, zctx).get("workers") == 1, 10, "the worker joined")
    d = Dealer(connect(zmq.DEALER, frontend))
    for i in range(12):
        d.stream(i, ENDLESS)
    for i in range(12, 16):
        d.stream(i, 1000)
    d.chunks(15, 2)
    for i in range(12):
        d.cancel(i)
    d.finish(*range(16), timeout_s=30)
    for i in range(12):
        assert_one_final_error(d.of(i), "cancelled")
    for i in range(12, 16):
        assert_complete(d.of(i), 1000, i)
    assert broker_stats(frontend, zctx)["workers_lost"] == 0
