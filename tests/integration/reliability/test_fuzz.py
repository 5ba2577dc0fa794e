"""Fuzzing a real broker: 20,000 malformed messages on the frontend and 20,000 on the
backend (seeded random content from tests/reliability_models.py, so a failure replays),
then checks that it still serves correctly, in bounded memory.

Frontend rule: every malformed message that arrives with an envelope is answered with
bad_request. Backend rule: malformed messages are dropped (and counted), and a peer that
is not a registered worker is told DISCONNECT for anything in the worker protocol.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from batcher.client.sync import Client
from batcher.wire import protocol
from tests.helpers import broker_stats, pack, recv_reply, unpack, wait_until
from tests.reliability_models import (
    DISCONNECT,
    HEARTBEAT,
    WORKER_PROTOCOL,
    LoggedServe,
    malformed_backend_known,
    malformed_backend_unknown,
    malformed_frontend,
    rare_frontend,
)

pytestmark = pytest.mark.integration

LIMIT = 1 << 20  # --max-message-bytes of the fuzzed broker
FRONTEND_MESSAGES = 20_000
BACKEND_UNKNOWN_MESSAGES = 14_000
BACKEND_KNOWN_MESSAGES = 6_000
WINDOW = 250  # messages in flight per socket
RSS_GROWTH_LIMIT = 50 * 1024 * 1024
#: No reply for this long, with requests outstanding, means the broker stopped answering
#: (a deadline on progress, not on the whole run, which a busy machine may slow down).
STALL_S = 30


@pytest.fixture
def echo_broker(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[LoggedServe]:
    """`serve` with one echo worker and a 1 MiB message limit; its log is printed on failure."""
    s = LoggedServe(
        ["--workers", "1", "--model", "echo", "--max-wait-ms", "1", "--max-message-bytes", str(LIMIT)],
        tmp_path / "serve.log",
    )
    try:
        yield s.start(workers=1)
    finally:
        s.stop()
        if getattr(getattr(request.node, "rep_call", None), "failed", False):
            print(s.log()[-20_000:])


def rss(s: LoggedServe) -> int:
    return int(psutil.Process(s.pid).memory_info().rss)


def assert_serves_correctly(s: LoggedServe, ctx: zmq.Context[Any]) -> None:
    """The broker process is alive and answers valid requests with the right outputs."""
    assert s.process.poll() is None, "the broker exited"
    inputs = [1, {"k": [1, "v"]}, None, b"\x00bin", "text"]
    with Client(s.frontend, timeout_s=10, context=ctx) as c:
        assert c.request_many(inputs * 4) == inputs * 4
    log = s.log()
    assert "unexpected error" not in log, "the broker hit an unexpected error (see its log)"


def warm_up(s: LoggedServe, ctx: zmq.Context[Any]) -> int:
    """Serve some requests so allocator pools exist before the RSS baseline is taken."""
    with Client(s.frontend, timeout_s=10, context=ctx) as c:
        c.request_many(range(200))
    return rss(s)


def dealer(ctx: zmq.Context[Any], address: str | None) -> zmq.Socket[Any]:
    """A DEALER with unbounded queues, connected to `address` unless it is None."""
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if address is not None:
        sock.connect(address)
    return sock


def test_frontend_answers_20000_malformed_messages_with_bad_request(echo_broker, zctx):
    s = echo_broker
    baseline = warm_up(s, zctx)
    rng = random.Random(20261129)
    stream = malformed_frontend(rng)
    messages = [next(stream) for _ in range(FRONTEND_MESSAGES)]
    messages += [m for m in rare_frontend() for _ in range(3)]
    rng.shuffle(messages)
    categories = Counter(category for category, _ in messages)
    assert len(categories) >= 20, categories

    senders = [dealer(zctx, s.frontend) for _ in range(2)]
    sent = [0, 0]
    answered = [0, 0]
    codes: Counter[str] = Counter()

    def receive(i: int) -> None:
        """The replies waiting on socket i, after one more within STALL_S."""
        sock = senders[i]
        stalled = f"no reply for {STALL_S}s: answered {answered} of {sent}"
        assert sock.poll(STALL_S * 1000, zmq.POLLIN), stalled
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = unpack(frames[-1])
            answered[i] += 1
            codes[reply["error"]["code"] if not reply.get("ok") else "ok"] += 1

    for n, (_, frames) in enumerate(messages):
        i = n % 2
        while sent[i] - answered[i] >= WINDOW:
            receive(i)
        senders[i].send_multipart(frames)
        sent[i] += 1
    for i in (0, 1):
        while answered[i] < sent[i]:
            receive(i)
    assert codes == {"bad_request": len(messages)}, codes

    assert_serves_correctly(s, zctx)
    growth = rss(s) - baseline
    assert growth < RSS_GROWTH_LIMIT, f"broker RSS grew {growth / 2**20:.1f} MiB"


def test_backend_survives_20000_malformed_messages(echo_broker, zctx):
    s = echo_broker
    baseline = warm_up(s, zctx)
    backend = s.sp.backend
    rng = random.Random(1129)

    # Peers that never announce themselves.
    unknown = [dealer(zctx, backend) for _ in range(2)]
    stream = malformed_backend_unknown(rng)
    must_disconnect = [0, 0]
    may_disconnect = [0, 0]  # a refused READY: answering it DISCONNECT would be fine too
    disconnects = [0, 0]
    categories: Counter[str] = Counter()

    def drain_unknown(i: int) -> list[list[bytes]]:
        other = []
        while True:
            try:
                frames = unknown[i].recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return other
            if frames == [WORKER_PROTOCOL, DISCONNECT]:
                disconnects[i] += 1
            else:
                other.append(frames)

    for n in range(BACKEND_UNKNOWN_MESSAGES):
        i = n % 2
        category, frames, answered = next(stream)
        categories[category] += 1
        must_disconnect[i] += answered
        may_disconnect[i] += category == "fake READY with bad info"
        unknown[i].send_multipart(frames)
        if n % WINDOW == 0:
            assert drain_unknown(i) == []

    # A peer that did announce itself, then misbehaves (heartbeating so it stays alive).
    known = dealer(zctx, backend)
    known.send_multipart([WORKER_PROTOCOL, b"\x01", pack({"model": "fuzz-peer", "gpu": None, "pid": 0})])
    wait_until(
        lambda: broker_stats(s.frontend, zctx, 5).get("models", {}).get("fuzz-peer", {}).get("workers") == 1,
        30,
        "fake joined",
    )
    known_stream = malformed_backend_known(rng)
    for n in range(BACKEND_KNOWN_MESSAGES):
        category, frames = next(known_stream)
        categories[category] += 1
        known.send_multipart(frames)
        if n % 100 == 0:
            known.send_multipart([WORKER_PROTOCOL, HEARTBEAT])
    assert len(categories) >= 10, categories

    # Every malformed message was dropped and counted: a barrier for the broker's side.
    total = BACKEND_UNKNOWN_MESSAGES + BACKEND_KNOWN_MESSAGES
    wait_until(
        lambda: broker_stats(s.frontend, zctx, 5).get("dropped_backend_messages") == total, 60, "all dropped"
    )
    models = broker_stats(s.frontend, zctx, 5)["models"]
    assert models["fuzz-peer"]["workers"] == 1, "the misbehaving but live worker was dropped"
    assert models["echo"]["workers"] == 1, models
    known.send_multipart([WORKER_PROTOCOL, DISCONNECT])

    # A barrier for the DISCONNECTs: each unknown peer now announces itself; the broker's
    # first HEARTBEAT to it comes after every DISCONNECT it was sent before.
    for i, sock in enumerate(unknown):
        sock.send_multipart([WORKER_PROTOCOL, b"\x01", pack({"model": f"fuzz-barrier-{i}", "pid": 0})])
        deadline = time.monotonic() + 30
        while True:
            assert sock.poll(max(1, int((deadline - time.monotonic()) * 1000)), zmq.POLLIN), "no heartbeat"
            other = drain_unknown(i)
            if other:
                assert other[0][:2] == [WORKER_PROTOCOL, HEARTBEAT], other  # with the broker's settings
                break
        assert must_disconnect[i] <= disconnects[i] <= must_disconnect[i] + may_disconnect[i], (
            f"peer {i}: {disconnects[i]} DISCONNECTs for {must_disconnect[i]} messages that need one"
        )
        sock.send_multipart([WORKER_PROTOCOL, DISCONNECT])

    after = broker_stats(s.frontend, zctx, 5)
    assert after["workers_lost"] == 0, f"a worker was taken for dead during the fuzzing: {after}"
    assert_serves_correctly(s, zctx)
    growth = rss(s) - baseline
    assert growth < RSS_GROWTH_LIMIT, f"broker RSS grew {growth / 2**20:.1f} MiB"


def test_a_request_over_max_message_bytes_is_answered_too_large_on_a_live_connection(echo_broker, zctx):
    """Between --max-message-bytes and the hard limit (4x), a request is answered
    too_large, with its id when the body's head holds it, and its sender stays connected."""
    s = echo_broker
    sock = dealer(zctx, None)
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    sock.connect(s.frontend)
    try:
        assert monitor.poll(30_000) and recv_monitor_message(monitor)["event"] == zmq.EVENT_CONNECTED
        big = b"x" * (LIMIT + 1)
        sock.send_multipart([b"", pack({"id": "first", "input": big})])
        sock.send_multipart([b"", pack({"input": big, "id": "after-the-input"})])  # id past the head
        sock.send_multipart([b"", pack({"id": "ok", "input": "small"})])
        replies = [recv_reply(sock, 30) for _ in range(3)]
        why = f"request too large: more than {LIMIT} bytes (the broker's --max-message-bytes)"
        assert replies[:2] == [
            {"id": "first", "ok": False, "error": {"code": "too_large", "message": why}},
            {"id": None, "ok": False, "error": {"code": "too_large", "message": why}},
        ]
        assert replies[2]["id"] == "ok" and replies[2]["output"] == "small"
        assert not monitor.poll(0), "the sender was disconnected"
        assert broker_stats(s.frontend, zctx, 5)["refused_without_model"] == {"too_large": 2}
    finally:
        sock.disable_monitor()
        monitor.close(0)


def test_message_over_the_hard_limit_disconnects_its_sender_only(echo_broker, zctx):
    s = echo_broker
    bystander = Client(s.frontend, timeout_s=10, context=zctx)
    assert bystander.request("before") == "before"
    sock = dealer(zctx, None)
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    sock.connect(s.frontend)
    try:
        assert monitor.poll(30_000), "never connected"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_CONNECTED
        for _ in range(3):
            sock.send_multipart(
                [b"", b"\x81\xa5input\xc6" + (4 * LIMIT + 1).to_bytes(4, "big") + b"x" * (4 * LIMIT + 1)]
            )
            events = []
            while zmq.EVENT_DISCONNECTED not in events:
                assert monitor.poll(30_000), (
                    f"the sender of an oversized message was not disconnected: {events}"
                )
                events.append(recv_monitor_message(monitor)["event"])
            assert s.process.poll() is None, "the broker exited"
            assert bystander.request("during") == "during"
        assert not sock.poll(0, zmq.POLLIN), "an oversized message was answered"
        # ZeroMQ reconnects the sender; a normal request from it is served again.
        sock.send_multipart([b"", pack({"id": "after", "input": "after"})])
        reply = recv_reply(sock, 30)  # the reconnected sender is answered
        assert reply["id"] == "after" and reply["output"] == "after", reply
    finally:
        sock.disable_monitor()
        monitor.close(0)
        bystander.close()
    assert_serves_correctly(s, zctx)


def deepest_accepted_body() -> bytes:
    """The most deeply nested request body the broker's own parser accepts."""
    best = b""
    for depth in range(900, 1200):
        body = b"\x81\xa5input" + b"\x91" * depth + b"\xc0"
        try:
            protocol.parse_request(body)
        except protocol.ProtocolError:
            break
        best = body
    assert best, "no depth between 900 and 1200 is accepted"
    return best


def test_deepest_accepted_request_does_not_fail_the_requests_batched_with_it(serve, connect):
    sp = serve(
        "--workers", "1", "--model", "echo", "--policy", "window", "--max-batch-size", "4",
        "--max-wait-ms", "5000",
        workers=1,
    )  # fmt: skip
    innocent = [connect(zmq.DEALER, sp.frontend) for _ in range(3)]
    attacker = connect(zmq.DEALER, sp.frontend)
    for i, sock in enumerate(innocent):
        sock.send_multipart([b"", pack({"id": i, "input": f"innocent {i}"})])
    attacker.send_multipart([b"", deepest_accepted_body()])  # the 4th request: one full batch
    for i, sock in enumerate(innocent):
        reply = recv_reply(sock, 30)
        assert reply["ok"] and reply["output"] == f"innocent {i}", f"innocent request {i} got {reply}"
    # The broker parses a body one level deeper than sent, as the worker will see it in its
    # batch, so whatever it accepts the worker decodes too: this one is served.
    reply = recv_reply(attacker, 30)
    assert reply["ok"], reply


def test_valid_requests_among_malformed_ones_on_one_socket_get_their_own_outputs(echo_broker, zctx):
    s = echo_broker
    stream = malformed_frontend(random.Random(7))
    sock = dealer(zctx, s.frontend)
    expected = {}
    for n in range(500):
        sock.send_multipart(next(stream)[1])
        if n % 5 == 0:
            expected[f"v{n}"] = [n, "ok"]
            sock.send_multipart([b"", pack({"id": f"v{n}", "input": [n, "ok"]})])
    got: dict[str, Any] = {}
    bad = 0
    deadline = time.monotonic() + 60
    while bad < 500 or len(got) < len(expected):
        assert time.monotonic() < deadline, f"{bad} bad_request and {len(got)} results"
        if not sock.poll(100, zmq.POLLIN):
            continue
        reply = unpack(sock.recv_multipart()[-1])
        if reply.get("ok"):
            assert reply["id"] not in got, f"second reply {reply}"
            got[reply["id"]] = reply["output"]
        else:
            assert reply["error"]["code"] == "bad_request", reply
            bad += 1
    assert bad == 500 and got == expected
