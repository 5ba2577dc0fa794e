"""The client core (batcher.client.core.BaseClient) on its own: request ids, matching replies
to requests, the nil-id rule, duplicates, timeouts with retries, and one exception class
per protocol error code. Without sockets, except the last tests, which drive Client's
public surface (start, receive_ready, forget, send_cancel, socket) over inproc.

The integration half: these tests start processes or measure time; the unit tests
are in tests/unit/client/test_core.py."""

from __future__ import annotations

import time
from typing import Any

import pytest

from batcher.client.multi import MultiClient
from batcher.client.sync import (
    Client,
    ClientTimeout,
    InternalError,
)
from tests.unit.client.test_core import received, router

__all__ = ["router"]  # the fixtures, shared with tests/unit/client/test_core.py


@pytest.mark.integration  # bounds the time the retries take
def test_client_resends_the_same_body_on_timeout_then_raises(router) -> None:
    ctx, broker, address = router
    with Client(address, timeout_s=0.15, retries=1, context=ctx) as c:
        started = time.monotonic()
        with pytest.raises(ClientTimeout) as err:
            c.request("x")
        assert 0.25 <= time.monotonic() - started < 3.0  # 2 attempts of 0.15 s, tenfold slack above
        assert err.value.message.startswith(f"no reply from {address} after 2 attempt(s): ")
        bodies = [received(broker)[1] for _ in range(2)]
        assert bodies == [{"id": 1, "input": "x"}] * 2  # the same id: either reply answers it


@pytest.mark.integration  # a fake broker's thread, and a bound on the time taken
def test_multiclient_takes_a_nil_id_error_as_the_answer_of_its_one_request_in_flight(
    fake_broker, zctx
) -> None:
    """MultiClient matches replies through Client, so the nil-id rule holds for it too."""

    def internal(body: dict[str, Any]) -> dict[str, Any]:
        return {"id": None, "ok": False, "error": {"code": "internal_error", "message": "a bug"}}

    with MultiClient([fake_broker(internal).address], timeout_s=5, context=zctx) as mc:
        started = time.monotonic()
        with pytest.raises(InternalError):
            mc.request("x")
        assert time.monotonic() - started < 2.0, "waited for the timeout"
        assert mc.duplicates_dropped == 0
