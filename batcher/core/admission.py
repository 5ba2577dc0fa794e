"""Whether the broker takes a request, and on what terms: the refusal order and the
deadline arithmetic as one pure rule, so the loop only reads sockets and writes replies.

The order is part of the contract (docs/protocol.md): a draining broker refuses first
(`shutting_down`); then a model that has failed to load or has had no worker for too long
(`worker_failed`, `unavailable`); then a body that does not fit the model's signature, or
that `--bucket-by length` cannot measure (`bad_request`). A request that passes is queued;
a full queue or an unknown model is the scheduler's answer (`overloaded`, `unknown_model`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from batcher.core.pool import WorkerPool
from batcher.core.scheduler import BatchSettings
from batcher.wire import protocol
from batcher.wire.protocol import ErrorCode, ProtocolError, RequestHeader


class Admitted(msgspec.Struct, frozen=True, gc=False):
    """A request the broker queues: when it expires (None: never) and its length bucket
    (None: its model does not bucket). A Struct, as every request gets one (0.05 us
    against a NamedTuple's 0.31)."""

    deadline: float | None
    bucket: int | None


class Refusal(msgspec.Struct, frozen=True, gc=False):
    """A request answered at once with this error. `req_id` is the id to answer with: the
    header's, or the one a parse error recovered."""

    code: ErrorCode
    message: str
    req_id: int | str | None


#: The refusal of a draining broker, the same for every request.
SHUTTING_DOWN_MESSAGE = "the broker is shutting down"


def admit(
    header: RequestHeader,
    model: str,
    body: Any,
    now: float,
    *,
    draining: bool,
    pool: WorkerPool,
    settings: BatchSettings | None,
    default_timeout_s: float | None,
) -> Admitted | Refusal:
    """The broker's verdict on one request for `model` arriving at `now` (module docstring:
    the order). `settings` are the model's batch settings (None: not served)."""
    if draining:
        return Refusal(ErrorCode.SHUTTING_DOWN, SHUTTING_DOWN_MESSAGE, header.id)
    refusal, signature = pool.admission(model, now)
    if refusal is not None:
        return Refusal(refusal[0], refusal[1], header.id)
    if signature is not None and (why := signature.misfit(body)) is not None:
        return Refusal(ErrorCode.BAD_REQUEST, why, header.id)
    bucket = None
    if settings is not None and settings.bucket_by is not None:
        try:
            bucket = settings.bucket(protocol.input_length(body, header.id))
        except ProtocolError as exc:
            return Refusal(exc.code, exc.message, exc.req_id)
    # When it expires: its own timeout_ms, else the broker's default; 0 or none: never.
    timeout_s = header.timeout_ms / 1000.0 if header.timeout_ms else default_timeout_s
    return Admitted(now + timeout_s if timeout_s else None, bucket)
