"""The Python client: one DEALER socket, many requests in flight, typed errors.

The client sets each request's `id` to a counter of its own and matches replies by
it, so replies can arrive in any order and a late reply to a request that already
timed out is recognised and dropped.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from typing import Any

import zmq

from batcher import protocol


class BatcherError(Exception):
    """A request answered with an error; `code` is the protocol's error code."""

    code = "error"

    def __init__(self, message: str, code: str | None = None, reply: dict[str, Any] | None = None):
        super().__init__(f"{code or self.code}: {message}")
        if code is not None:
            self.code = code
        self.message = message
        self.reply = reply or {}


class BadRequest(BatcherError):
    code = "bad_request"


class UnknownModel(BatcherError):
    code = "unknown_model"


class ModelError(BatcherError):
    code = "model_error"


class DeadlineExceeded(BatcherError):
    code = "deadline_exceeded"


class Overloaded(BatcherError):
    code = "overloaded"


class Cancelled(BatcherError):
    code = "cancelled"


class WorkerFailed(BatcherError):
    code = "worker_failed"


class ShuttingDown(BatcherError):
    code = "shutting_down"


class ClientTimeout(BatcherError):
    """No reply arrived within the client's own timeout (the broker may be down)."""

    code = "timeout"


_ERRORS: dict[str, type[BatcherError]] = {
    cls.code: cls
    for cls in (
        BadRequest,
        UnknownModel,
        ModelError,
        DeadlineExceeded,
        Overloaded,
        Cancelled,
        WorkerFailed,
        ShuttingDown,
        ClientTimeout,
    )
}


def error_from_reply(reply: dict[str, Any]) -> BatcherError:
    """The typed exception for an error reply (BatcherError for a code it does not know)."""
    err = reply.get("error") or {}
    code = str(err.get("code", "error"))
    cls = _ERRORS.get(code, BatcherError)
    return cls(str(err.get("message", "")), code=code, reply=reply)


class PendingReply:
    """A request in flight; `result()` waits for it while serving the others too."""

    def __init__(self, client: Client, request_id: int, deadline: float | None) -> None:
        self._client = client
        self.request_id = request_id
        self.deadline = deadline
        self.reply: dict[str, Any] | None = None

    def done(self) -> bool:
        return self.reply is not None

    def result(self) -> Any:
        """The output; raises the typed error for an error reply, ClientTimeout for none."""
        reply = self.wait()
        if reply.get("ok"):
            return reply.get("output")
        raise error_from_reply(reply)

    def wait(self) -> dict[str, Any]:
        """The whole reply map (with metadata such as batch_size), error or not."""
        if self.reply is None:
            self._client._wait_for(self)
        assert self.reply is not None
        return self.reply


class Client:
    """Talks to a broker's frontend. Not thread-safe: one client per thread."""

    def __init__(
        self,
        address: str = "tcp://127.0.0.1:5555",
        timeout_s: float | None = 30.0,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._ctx: zmq.Context[Any] = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._ids = itertools.count(1)
        self._pending: dict[int, PendingReply] = {}

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the socket; replies still in flight are abandoned."""
        self._sock.close(0)
        self._pending.clear()

    def submit(
        self,
        input: Any,
        model: str | None = None,
        timeout_ms: float | None = None,
        priority: float | None = None,
    ) -> PendingReply:
        """Send a request without waiting; many can be in flight over the one socket."""
        request_id = next(self._ids)
        body: dict[str, Any] = {"id": request_id, "input": input}
        if model is not None:
            body["model"] = model
        if timeout_ms is not None:
            body["timeout_ms"] = timeout_ms
        if priority is not None:
            body["priority"] = priority
        self._sock.send_multipart([b"", protocol.pack(body)])
        wait_s = self.timeout_s
        if timeout_ms is not None:  # the broker answers by then; allow for the trip back
            wait_s = timeout_ms / 1000.0 + 1.0 if wait_s is None else min(wait_s, timeout_ms / 1000.0 + 1.0)
        deadline = None if wait_s is None else time.monotonic() + wait_s
        pending = PendingReply(self, request_id, deadline)
        self._pending[request_id] = pending
        return pending

    def request(
        self,
        input: Any,
        model: str | None = None,
        timeout_ms: float | None = None,
        priority: float | None = None,
    ) -> Any:
        """Send one request and return its output, or raise its typed error."""
        return self.submit(input, model, timeout_ms, priority).result()

    def request_many(
        self,
        inputs: Iterable[Any],
        model: str | None = None,
        timeout_ms: float | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Send all inputs at once (so the broker can batch them) and return the outputs
        in order. With return_exceptions, errors come back in place instead of raising."""
        pendings = [self.submit(x, model, timeout_ms) for x in inputs]
        out: list[Any] = []
        for p in pendings:
            try:
                out.append(p.result())
            except BatcherError as exc:
                if not return_exceptions:
                    raise
                out.append(exc)
        return out

    def control(self, op: str) -> Any:
        """Send a control request (`stats`) and return its output."""
        request_id = next(self._ids)
        self._sock.send_multipart([b"", protocol.pack({"id": request_id, "op": op})])
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        pending = PendingReply(self, request_id, deadline)
        self._pending[request_id] = pending
        return pending.result()

    def _wait_for(self, target: PendingReply) -> None:
        while target.reply is None:
            timeout_ms = -1
            if target.deadline is not None:
                remaining = target.deadline - time.monotonic()
                if remaining <= 0:
                    self._pending.pop(target.request_id, None)
                    target.reply = {
                        "id": target.request_id,
                        "ok": False,
                        "error": {"code": "timeout", "message": f"no reply from {self.address}"},
                    }
                    return
                timeout_ms = max(1, int(remaining * 1000))
            if self._sock.poll(timeout_ms, zmq.POLLIN):
                self._receive_ready()

    def _receive_ready(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = protocol.unpack(frames[-1])
                pending = self._pending.pop(reply["id"], None)
            except Exception:
                continue  # not a reply of ours; nothing to match it to
            if pending is not None:
                pending.reply = reply
