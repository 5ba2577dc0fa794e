"""The errors a request's reply carries: ReplyError, and one class per protocol error code.

`error_from_reply` turns an error reply into its class, so a client raises BadRequest for
`bad_request`, Overloaded for `overloaded`, and so on (docs/protocol.md, section 5). The
client's own replies (no reply in time, no broker reachable, the client closed) use the
same form with codes of their own that never cross the wire: ClientTimeout, Unreachable,
ClientClosed. All are BatcherErrors (batcher.errors); the clients re-export every one.
"""

from __future__ import annotations

import types
from typing import Any

from batcher.errors import BatcherError
from batcher.wire.protocol import ErrorCode

#: The client's own error code, for a request that got no reply in time (never on the wire).
TIMEOUT = "timeout"
#: The client's own code for a request to an address where no broker can be reached
#: (nothing listens, or no ZeroMQ peer does): it fails after `connect_timeout_s`.
UNREACHABLE = "unreachable"
#: The client's own code for a request made after, or still waiting at, the client's close().
CLOSED = "closed"

#: The exception class of each error code a reply can carry (error_from_reply).
_ERRORS: dict[str, type[ReplyError]] = {}


class ReplyError(BatcherError):
    """A request answered with an error; `code` is the protocol's error code, `message`
    the reply's message and `reply` the whole reply map.

    `class X(ReplyError, code=...)` makes X the class of every reply with that code.
    """

    def __init_subclass__(cls, code: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if code is None:
            return
        if code in _ERRORS:
            raise TypeError(f"error code {code!r} already has its class {_ERRORS[code].__name__}")
        cls.code = str(code)  # an ErrorCode as the plain str a reply carries
        _ERRORS[cls.code] = cls

    def __init__(self, message: str, code: str | None = None, reply: dict[str, Any] | None = None):
        super().__init__(f"{code or self.code}: {message}")
        if code is not None:
            self.code = code
        self.message = message
        self.reply = reply or {}


# One class per protocol.ErrorCode, named after it (bad_request: BadRequest); a code
# without a class here gets one made from its name below, so none is ever forgotten.


class BadRequest(ReplyError, code=ErrorCode.BAD_REQUEST):
    """The broker refused the request as sent (a field of a wrong type, no input, an unknown op)."""


class UnknownModel(ReplyError, code=ErrorCode.UNKNOWN_MODEL):
    """No model of that name is configured on the broker or was ever served to it."""


class ModelError(ReplyError, code=ErrorCode.MODEL_ERROR):
    """The model raised, or returned the wrong number of outputs, for the request's batch."""


class DeadlineExceeded(ReplyError, code=ErrorCode.DEADLINE_EXCEEDED):
    """The request's deadline (`timeout_ms`) passed while it was still queued."""


class Overloaded(ReplyError, code=ErrorCode.OVERLOADED):
    """The model's queue was full when the request came (--max-queue); retry later."""


class Cancelled(ReplyError, code=ErrorCode.CANCELLED):
    """The request was cancelled (`cancel`) while it was still queued."""


class WorkerFailed(ReplyError, code=ErrorCode.WORKER_FAILED):
    """The workers holding the request failed more often than the broker's --max-retries."""


class ShuttingDown(ReplyError, code=ErrorCode.SHUTTING_DOWN):
    """The broker is draining: it queues nothing new (or ran out of drain time)."""


class Unavailable(ReplyError, code=ErrorCode.UNAVAILABLE):
    """The model has had no live worker for the broker's --no-worker-timeout-ms."""


class TooLarge(ReplyError, code=ErrorCode.TOO_LARGE):
    """The request is larger than the broker's --max-message-bytes; it was not queued."""


class Forbidden(ReplyError, code=ErrorCode.FORBIDDEN):
    """A control request that changes the service (`reload`) from a key that is not in
    the broker's --curve-admins; nothing was changed."""


class InternalError(ReplyError, code=ErrorCode.INTERNAL):
    """The broker hit a bug of its own handling this request (and logged it)."""


class ClientTimeout(ReplyError, code=TIMEOUT):
    """No reply arrived within the client's own timeout (the broker may be down)."""


class Unreachable(ClientTimeout, code=UNREACHABLE):
    """No broker could be reached at the address, and the client says so within its
    `connect_timeout_s` rather than waiting out its timeout: nothing listens there
    (the connection is refused), or what listens is no ZeroMQ peer (an HTTP server).
    A ClientTimeout too: no reply came, and none will."""


class ClientClosed(ReplyError, code=CLOSED):
    """The client was closed: a request made after `close()` raises it, and so does every
    request (or stream) still waiting for its reply when the client closes. The same on
    Client, MultiClient and AsyncClient."""


def error_class_name(code: str) -> str:
    """The exception class name for an error code: `bad_request` is BadRequest."""
    return "".join(part.capitalize() for part in code.split("_"))


def _make_missing_error_classes() -> None:
    for code in ErrorCode:
        if code.value not in _ERRORS:
            name = error_class_name(code.value)
            cls = types.new_class(name, (ReplyError,), {"code": code})
            cls.__module__ = __name__
            cls.__doc__ = f"A reply with error code `{code.value}`."
            globals()[name] = cls


_make_missing_error_classes()


def error_from_reply(reply: dict[str, Any]) -> ReplyError:
    """The typed exception for an error reply (ReplyError for a code it does not know)."""
    err = reply.get("error") or {}
    code = str(err.get("code", "error"))
    cls = _ERRORS.get(code, ReplyError)
    return cls(str(err.get("message", "")), code=code, reply=reply)
