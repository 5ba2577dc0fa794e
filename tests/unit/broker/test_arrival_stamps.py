"""When the broker says a message arrived (its queue span's start, its queue_ms; a REPLY's
end of its batch span): never before it did. The first message of a loop's turn is
stamped with the turn's time; one that came during the turn (a gateway's row sent in
answer to a reply the same turn sent) with the clock read before it is taken, not the
turn's start, or its queue span would begin before its sender's span did (docs/tracing.md,
"Limits")."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import zmq

from batcher.broker.backend import Backend
from batcher.broker.frontend import Frontend
from batcher.transport.zmqio import recv_bounded


@pytest.fixture
def pair(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    # The drain's time budget is not what is tested: on a loaded machine the second
    # message's trip through the socket may take longer than the broker's 5 ms.
    monkeypatch.setattr("batcher.broker.backend.DRAIN_BUDGET_S", 60.0)
    monkeypatch.setattr("batcher.broker.frontend.DRAIN_BUDGET_S", 60.0)
    ctx: zmq.Context[Any] = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    address = f"ipc://{tmp_path / 'sock'}"
    router.bind(address)
    dealer.connect(address)
    yield router, dealer
    router.close(0)
    dealer.close(0)
    ctx.term()


def answer_with_a_second(router: zmq.Socket[Any], dealer: zmq.Socket[Any], stamps: list[tuple[float, float]]):  # type: ignore[no-untyped-def]
    """A handler of the first message that makes a second one come (as a client answered
    by it would), waits until it is there, and records each message's stamp against the
    time it was sent."""
    sent_at = [0.0]

    def handle(frames: Any, now: float) -> None:
        stamps.append((now, sent_at[-1]))
        if len(stamps) == 1:
            sent_at.append(time.monotonic())
            dealer.send_multipart([b"", b"second"])
            assert router.poll(5000), "the second message never came"

    return handle


def test_a_request_that_came_during_the_turn_is_not_stamped_before_it_was_sent(
    pair: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    router, dealer = pair
    dealer.send_multipart([b"", b"first"])
    assert router.poll(5000)
    stamps: list[tuple[float, float]] = []
    frontend = Frontend.__new__(Frontend)
    frontend.sock, frontend.max_message_bytes = router, 1 << 20
    frontend._receive = recv_bounded  # type: ignore[method-assign]
    frontend._accept = answer_with_a_second(router, dealer, stamps)  # type: ignore[method-assign]
    turn = time.monotonic()
    frontend.drain(turn)
    assert len(stamps) == 2, "both read in the one turn"
    assert stamps[0][0] == turn
    assert stamps[1][0] >= stamps[1][1] > turn


def test_a_reply_that_came_during_the_turn_is_not_stamped_before_it_was_sent(
    pair: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    router, dealer = pair
    dealer.send_multipart([b"", b"first"])
    assert router.poll(5000)
    stamps: list[tuple[float, float]] = []
    backend = Backend.__new__(Backend)
    backend.sock = router
    backend.pool = SimpleNamespace(backend_read=lambda now: None)  # type: ignore[assignment]
    backend._on_worker_message = answer_with_a_second(router, dealer, stamps)  # type: ignore[method-assign]
    turn = time.monotonic()
    backend.drain(turn)
    assert len(stamps) == 2, "both read in the one turn"
    assert stamps[0][0] == turn
    assert stamps[1][0] >= stamps[1][1] > turn
