"""Several hosts' worth of processes on one machine: a broker alone with `batcher worker`
processes joining and leaving under load, and MultiClient over two brokers.

Plus MultiClient's rules against scripted brokers (tests/helpers.py): round-robin,
timeouts sent elsewhere, back-off and probes, `shutting_down` sent elsewhere.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import defaultdict
from typing import Any

import pytest
import zmq

from batcher.client.multi import MultiClient
from batcher.client.sync import ClientTimeout
from batcher.serve.launcher import free_tcp_address
from tests.helpers import FAST_SIM, HEARTBEAT, broker_stats, echo, pack, silent, unpack, wait_until


def sim_workers(address: str, ctx: zmq.Context[Any]) -> int | None:
    st = broker_stats(address, ctx)
    return st["models"]["sim"]["workers"] if st else None


class SteadyLoad:
    """A thread keeping `window` requests in flight over a raw DEALER until stopped, and
    recording every reply it gets by id, so a lost or a duplicated reply shows."""

    def __init__(self, address: str, ctx: zmq.Context[Any], window: int = 16) -> None:
        self.address, self.ctx, self.window = address, ctx, window
        self.replies: dict[Any, list[dict[str, Any]]] = defaultdict(list)  # id -> replies
        self.sent = 0
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="steady load", daemon=True)

    def start(self) -> SteadyLoad:
        self._thread.start()
        return self

    def answered(self) -> int:
        return len(self.replies)

    def served_by(self) -> set[int]:
        """The pids of the workers that answered so far."""
        return {
            int(r["worker"].rsplit("/", 1)[1]) for rs in list(self.replies.values()) for r in rs if r["ok"]
        }

    def _run(self) -> None:
        sock: zmq.Socket[Any] = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        try:
            while not self._stop.is_set():
                while self.sent - len(self.replies) < self.window:
                    sock.send_multipart([b"", pack({"id": self.sent, "input": self.sent})])
                    self.sent += 1
                if sock.poll(100, zmq.POLLIN):
                    self._receive(sock)
            # Stopped: wait for what is still in flight, then for a fence (a stats reply,
            # sent after all of them) so that a duplicate on its way would show too.
            deadline = time.monotonic() + 15
            while len(self.replies) < self.sent and time.monotonic() < deadline:
                if sock.poll(100, zmq.POLLIN):
                    self._receive(sock)
            sock.send_multipart([b"", pack({"id": "fence", "op": "stats"})])
            while "fence" not in self.replies and time.monotonic() < deadline:
                if sock.poll(100, zmq.POLLIN):
                    self._receive(sock)
        except BaseException as exc:
            self.failure = exc
        finally:
            sock.close(0)

    def _receive(self, sock: zmq.Socket[Any]) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = unpack(frames[-1])
            self.replies[reply["id"]].append(reply)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(20)
        assert not self._thread.is_alive(), "the load thread did not finish"
        if self.failure is not None:
            raise self.failure


# --- workers joining and leaving a running broker -----------------------------------------------


@pytest.mark.integration
def test_workers_join_and_leave_under_steady_load_and_nothing_is_lost(spawn, zctx):
    frontend, backend = free_tcp_address(), free_tcp_address()
    broker = spawn("broker", "--frontend", frontend, "--backend", backend, "--model", "sim",
                   "--max-wait-ms", "2", "--max-batch-size", "8", *HEARTBEAT)  # fmt: skip

    def worker(gpu: int) -> Any:
        return spawn(
            "worker", "--connect", backend, "--model", "sim", "--gpu", str(gpu), *FAST_SIM, *HEARTBEAT
        )

    first = worker(0)
    wait_until(lambda: sim_workers(frontend, zctx) == 1, 15, "the first worker joined")
    load = SteadyLoad(frontend, zctx).start()
    try:
        wait_until(lambda: load.answered() >= 50, 15, "load flowing through the first worker")

        # Join: two more workers, no broker restart; both take a share of the load.
        second, third = worker(1), worker(2)
        wait_until(lambda: sim_workers(frontend, zctx) == 3, 15, "two more workers joined")
        wait_until(lambda: {second.pid, third.pid} <= load.served_by(), 15, "the new workers served")

        # Leave cleanly: SIGTERM finishes the batch at hand and says DISCONNECT.
        os.kill(first.pid, signal.SIGTERM)
        assert first.process.wait(timeout=10) == 0
        wait_until(lambda: sim_workers(frontend, zctx) == 2, 10, "the broker let the first worker go")

        # Die: SIGKILL; the broker finds out by heartbeat and re-queues what it held.
        os.kill(second.pid, signal.SIGKILL)
        second.process.wait(timeout=5)
        wait_until(lambda: sim_workers(frontend, zctx) == 1, 10, "the broker took the killed worker for dead")
        # Requests sent from now on can only go to the third worker (+1: the one the load
        # thread may be sending at this moment may have been sent before). Wait for 100 of
        # them answered: not for 100 answers counted from before the kill, which the third
        # worker may already have given while the loss was being detected.
        only_third_from = load.sent + 1

        def answered_after_loss() -> int:
            return sum(1 for i in range(only_third_from, load.sent) if i in load.replies)

        wait_until(lambda: answered_after_loss() >= 100, 15, "load flowing through the last worker")
    finally:
        load.stop()

    assert broker.process.poll() is None, "the broker exited"
    fence = load.replies.pop("fence")
    assert len(fence) == 1 and fence[0]["ok"], fence
    assert load.sent > only_third_from, "no request was sent after the second worker was lost"
    missing = [i for i in range(load.sent) if i not in load.replies]
    assert not missing, f"{len(missing)} requests never answered: {missing[:10]}"
    duplicated = {i: rs for i, rs in load.replies.items() if len(rs) != 1}
    assert not duplicated, f"requests answered more than once: {duplicated}"
    failed = {i: rs[0] for i, rs in load.replies.items() if not rs[0]["ok"]}
    assert not failed, f"requests answered with errors: {list(failed.values())[:5]}"
    assert all(rs[0]["output"]["echo"] == i for i, rs in load.replies.items())
    assert load.served_by() == {first.pid, second.pid, third.pid}
    late_workers = {load.replies[i][0]["worker"] for i in range(only_third_from, load.sent)}
    assert {int(w.rsplit("/", 1)[1]) for w in late_workers} == {third.pid}, late_workers

    final = fence[0]["output"]
    sim = final["models"]["sim"]
    assert sim["outcomes"] == {"ok": load.sent}, sim["outcomes"]
    assert final["workers_lost"] == 1, final  # the SIGKILLed one; the SIGTERMed one left
    assert final["batches_retried"] >= 1, final  # batches held by the leavers went back to the queue
    assert sim["workers"] == 1 and sim["queued"] == 0


# --- MultiClient over real brokers --------------------------------------------------------------


@pytest.mark.integration
def test_multiclient_goes_on_when_one_of_two_brokers_is_killed(serve, spawn, zctx):
    args = ("--workers", "1", "--model", "sim", "--sim-base-ms", "30", "--sim-per-item-ms", "0.5",
            "--max-wait-ms", "2")  # fmt: skip
    a, b = serve(*args, workers=1), serve(*args, workers=1)
    assert a.process is not None
    # timeout_s is how a dead broker is found; 2 s is long enough that the live one,
    # on a busy machine, is never taken for dead too.
    with MultiClient([a.frontend, b.frontend], timeout_s=2, retries=2, down_s=0.2, context=zctx) as mc:
        assert [o["echo"] for o in mc.request_many(range(10))] == list(range(10))
        assert mc.sent() == {a.frontend: 5, b.frontend: 5}, "not spread round-robin"

        # Mid-run: 40 requests in flight on both (30 ms batches), then broker A dies.
        pendings = [mc.submit(i) for i in range(40)]
        os.killpg(a.process.pid, signal.SIGKILL)
        a.process.wait(timeout=5)
        replies = [p.wait() for p in pendings]
        assert all(r["ok"] for r in replies), [r for r in replies if not r["ok"]][:3]
        assert [r["output"]["echo"] for r in replies] == list(range(40))
        assert mc.down() == [a.frontend]
        # Each request lost with A timed out once and went to B; none waited for A twice,
        # and those on B were answered at the first attempt.
        lost_on_a = [p for p in pendings if p.tried[0] == a.frontend and len(p.tried) > 1]
        assert lost_on_a, "no request was in flight on A when it was killed"
        assert all(p.tried == [a.frontend, b.frontend] and p.timeouts == 1 for p in lost_on_a), [
            (p.tried, p.timeouts) for p in lost_on_a
        ]
        assert all(p.tried == [b.frontend] for p in pendings if p.tried[0] == b.frontend)
        assert mc.resent == len(lost_on_a)

        # While A is down nothing more goes to it, and nobody waits for its timeout: each
        # request is answered by B at its first attempt.
        sent_to_a = mc.sent()[a.frontend]
        for i in range(10):
            p = mc.submit(i)
            assert p.result()["echo"] == i
            assert p.tried == [b.frontend] and p.timeouts == 0, (p.tried, p.timeouts)
        assert mc.sent()[a.frontend] == sent_to_a

        # A comes back at the same address: a probe finds it and it gets requests again.
        spawn("serve", "--frontend", a.frontend, "--backend", free_tcp_address(), *args)
        wait_until(lambda: mc.request("probe") and not mc.down(), 60, "the restarted broker taken back")
        before = mc.sent()
        assert [o["echo"] for o in mc.request_many(range(10))] == list(range(10))
        after = mc.sent()
        assert after[a.frontend] - before[a.frontend] == 5, (before, after)
        # B answered every attempt sent to it, once (probes are `stats`, not counted).
        outcomes = broker_stats(b.frontend, zctx, timeout_s=5)["models"]["sim"]["outcomes"]
        assert outcomes == {"ok": after[b.frontend]}, (outcomes, after)


# --- MultiClient's rules, against scripted brokers ----------------------------------------------


@pytest.mark.integration
def test_multiclient_spreads_round_robin(fake_broker, zctx):
    fbs = [fake_broker(echo) for _ in range(3)]
    with MultiClient([fb.address for fb in fbs], timeout_s=2, context=zctx) as mc:
        assert mc.request_many(range(9)) == list(range(9))
        assert mc.request("x") == "x"
        assert list(mc.sent().values()) == [4, 3, 3]
    for fb in fbs:
        assert all(b.get("op") is None for b in fb.received)  # no probes: nobody was down


@pytest.mark.integration
def test_multiclient_resends_a_timed_out_request_and_probes_before_using_it_again(fake_broker, zctx):
    # B holds the three requests resent from A (even inputs) until it has all of them: they
    # are answered only if A's three timeouts ran concurrently. One after another, the first
    # resend would wait for the others past its own timeout and fail.
    held: list[dict[str, Any]] = []

    def hold_resends(body: dict[str, Any]) -> dict[str, Any] | None:
        if len(held) == 3 or body.get("input", 1) % 2:
            return echo(body)
        held.append(body)
        if len(held) == 3:
            for h in held:
                b.reply_later({"id": h["id"], "ok": True, "output": h["input"]})
        return None

    a, b = fake_broker(silent), fake_broker(hold_resends)
    # timeout_s: long enough for B to answer in time on a busy machine.
    with MultiClient([a.address, b.address], timeout_s=1, retries=1, down_s=0.3, context=zctx) as mc:
        started = time.monotonic()
        assert mc.request_many(range(6)) == list(range(6))
        assert time.monotonic() - started >= 1, "a request was sent again before its timeout"
        assert mc.down() == [a.address] and mc.resent == 3
        assert mc.sent() == {a.address: 3, b.address: 6}
        a.wait_received(lambda got: len(got) == 3)
        assert [r["input"] for r in a.received] == [0, 2, 4]
        assert [r["input"] for r in b.received] == [1, 3, 5, 0, 2, 4]

        # Down: requests skip A, answered by B at the first attempt (no timeout).
        pendings = [mc.submit(i) for i in range(4)]
        assert [p.result() for p in pendings] == list(range(4))
        assert all(p.tried == [b.address] for p in pendings), [p.tried for p in pendings]
        assert mc.sent()[a.address] == 3

        # After the back-off A is asked for stats, never sent a user's request; silence
        # doubles the back-off; once it answers, it is used again.
        wait_until(
            lambda: mc.request(0) == 0 and any(r.get("op") == "stats" for r in a.received), 15, "a probe"
        )
        assert mc.sent()[a.address] == 3 and mc.down() == [a.address]
        a.answer = echo
        wait_until(lambda: mc.request(0) == 0 and not mc.down(), 15, "A taken back")
        assert all("input" not in r for r in a.received[3:]), "A got a user's request while down"
        before = mc.sent()[a.address]
        assert mc.request_many(range(4)) == list(range(4))
        assert mc.sent()[a.address] == before + 2


@pytest.mark.integration
def test_multiclient_gives_up_with_a_timeout_naming_every_frontend_tried(fake_broker, zctx):
    a, b = fake_broker(silent), fake_broker(silent)
    with MultiClient([a.address, b.address], timeout_s=0.15, retries=1, context=zctx) as mc:
        started = time.monotonic()
        with pytest.raises(ClientTimeout) as timed_out:
            mc.request("x")
        assert time.monotonic() - started >= 0.3, "gave up before two timeouts of 0.15 s"
        assert a.address in timed_out.value.message and b.address in timed_out.value.message
        # Both down: a request still goes out, to the frontend due back soonest.
        pending = mc.submit("y")
        assert pending.address == a.address
        # One attempt on each, then "y" on A: nothing more.
        a.wait_received(lambda got: len(got) == 2)
        b.wait_received(lambda got: len(got) == 1)
        assert [r.get("input") for r in a.received] == ["x", "y"]
        assert [r.get("input") for r in b.received] == ["x"]


@pytest.mark.integration
def test_multiclient_sends_a_refused_request_elsewhere_when_a_broker_drains(fake_broker, zctx):
    def draining(body: dict[str, Any]) -> dict[str, Any]:
        return {"id": body["id"], "ok": False, "error": {"code": "shutting_down", "message": "draining"}}

    a, b = fake_broker(draining), fake_broker(echo)
    # retries=0: a `shutting_down` request was never queued, so sending it on is always safe.
    with MultiClient([a.address, b.address], timeout_s=2, retries=0, context=zctx) as mc:
        assert mc.request_many(range(6)) == list(range(6))
        assert mc.down() == [a.address]
        assert len(a.received) == 3 and len(b.received) == 6
