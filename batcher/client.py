"""The Python client: one DEALER socket, many requests in flight, typed errors.

The client sets each request's `id` to a counter of its own and matches replies by
it, so replies can arrive in any order and a late reply to a request that already
timed out is recognised and dropped.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterable
from typing import Any

import zmq

from batcher import protocol
from batcher.security import secure_client


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

    def __init__(self, client: Client, request_id: int, body: bytes, wait_s: float | None) -> None:
        self._client = client
        self.request_id = request_id
        self.body = body
        self.wait_s = wait_s
        self.attempts = 1
        self.deadline = None if wait_s is None else time.monotonic() + wait_s
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

    def cancel(self) -> None:
        """Ask the broker to drop this request if it is still queued; it is then answered
        with `cancelled` (a request already running is answered normally)."""
        if self.reply is None:
            self._client._send({"op": "cancel", "id": self.request_id})


class Client:
    """Talks to a broker's frontend over one DEALER socket. Not thread-safe.

    `timeout_s` bounds the wait for each reply (None: wait forever). With `retries`,
    a request that got no reply in time is sent again, up to that many times: only for
    idempotent models, since the first attempt may still run; whichever reply comes
    first is the answer and a duplicate is dropped. ZeroMQ reconnects to a restarted
    broker by itself; requests lost with the old one time out (and are retried).
    """

    def __init__(
        self,
        address: str = "tcp://127.0.0.1:5555",
        timeout_s: float | None = 30.0,
        retries: int = 0,
        context: zmq.Context[Any] | None = None,
        curve_server_key: str | None = None,
        curve_secret_key: str | None = None,
    ) -> None:
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.address = address
        self.timeout_s = timeout_s
        self.retries = retries
        self._ctx: zmq.Context[Any] = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if curve_server_key:  # the broker's public key file; ours from curve_secret_key
            secure_client(self._sock, curve_server_key, curve_secret_key)
        self._sock.connect(address)
        self._ids = itertools.count(1)
        self._pending: dict[int, PendingReply] = {}
        self.duplicates_dropped = 0

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
        body: dict[str, Any] = {"input": input}
        if model is not None:
            body["model"] = model
        if timeout_ms is not None:
            body["timeout_ms"] = timeout_ms
        if priority is not None:
            body["priority"] = priority
        wait_s = self.timeout_s
        if timeout_ms:  # the broker answers by then; allow for the trip back
            limit = timeout_ms / 1000.0 + 1.0
            wait_s = limit if wait_s is None else min(wait_s, limit)
        return self._start(body, wait_s)

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
        return self._start({"op": op}, self.timeout_s).result()

    def _start(self, fields: dict[str, Any], wait_s: float | None) -> PendingReply:
        request_id = next(self._ids)
        body = self._send({"id": request_id, **fields})
        pending = PendingReply(self, request_id, body, wait_s)
        self._pending[request_id] = pending
        return pending

    def _send(self, fields: dict[str, Any]) -> bytes:
        body = protocol.pack(fields)
        self._sock.send_multipart([b"", body])
        return body

    def _wait_for(self, target: PendingReply) -> None:
        while target.reply is None:
            timeout_ms = -1
            if target.deadline is not None:
                remaining = target.deadline - time.monotonic()
                if remaining <= 0:
                    self._expire(target)
                    continue
                timeout_ms = max(1, math.ceil(remaining * 1000))
            if self._sock.poll(timeout_ms, zmq.POLLIN):
                self._receive_ready()

    def _expire(self, pending: PendingReply) -> None:
        """No reply in time: send it again while retries last, else give up on it."""
        if pending.attempts <= self.retries and pending.wait_s is not None:
            pending.attempts += 1
            pending.deadline = time.monotonic() + pending.wait_s
            self._sock.send_multipart([b"", pending.body])
            return
        self._pending.pop(pending.request_id, None)
        pending.reply = {
            "id": pending.request_id,
            "ok": False,
            "error": {
                "code": "timeout",
                "message": f"no reply from {self.address} after {pending.attempts} attempt(s)",
            },
        }

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
            if pending is None:
                self.duplicates_dropped += 1  # a retried request's second reply, or a late one
            else:
                pending.reply = reply
