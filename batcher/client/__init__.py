"""The Python clients: `Client` and `MultiClient` (blocking), `AsyncClient` (asyncio), and the errors.

`AsyncClient` loads lazily (PEP 562), so a blocking client never imports zmq.asyncio.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from batcher.client.multi import MultiClient, MultiPending
from batcher.client.sync import (
    BadRequest,
    BatcherError,
    Cancelled,
    Client,
    ClientClosed,
    ClientTimeout,
    DeadlineExceeded,
    Forbidden,
    InternalError,
    ModelError,
    Overloaded,
    PendingReply,
    ReplyError,
    ShuttingDown,
    Stream,
    TooLarge,
    Unavailable,
    UnknownModel,
    Unreachable,
    WorkerFailed,
    error_from_reply,
)

if TYPE_CHECKING:
    from batcher.client.aio import AsyncClient, AsyncPendingReply

_LAZY = {"AsyncClient": "batcher.client.aio", "AsyncPendingReply": "batcher.client.aio"}

__all__ = [
    "AsyncClient",
    "AsyncPendingReply",
    "BadRequest",
    "BatcherError",
    "Cancelled",
    "Client",
    "ClientClosed",
    "ClientTimeout",
    "DeadlineExceeded",
    "Forbidden",
    "InternalError",
    "ModelError",
    "MultiClient",
    "MultiPending",
    "Overloaded",
    "PendingReply",
    "ReplyError",
    "ShuttingDown",
    "Stream",
    "TooLarge",
    "Unavailable",
    "UnknownModel",
    "Unreachable",
    "WorkerFailed",
    "error_from_reply",
]


def __getattr__(name: str) -> Any:
    """Load the asyncio client on first use only."""
    if name not in _LAZY:
        raise AttributeError(f"module 'batcher.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
