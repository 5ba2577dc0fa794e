"""batcher: a dynamic-batching inference broker over ZeroMQ and msgpack.

The face is lazy (PEP 562): `import batcher` loads no zmq; the clients load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from batcher import moved_modules

moved_modules.install()  # the flat module paths of before the layered layout, kept importable

if TYPE_CHECKING:
    from batcher.client.aio import AsyncClient
    from batcher.client.multi import MultiClient
    from batcher.client.sync import Client, ClientTimeout
    from batcher.errors import BatcherError, ModelLoadError

__all__ = ["AsyncClient", "BatcherError", "Client", "ClientTimeout", "ModelLoadError", "MultiClient"]
__version__ = "0.1.0"

_LAZY = {
    "AsyncClient": "batcher.client.aio",
    "BatcherError": "batcher.errors",
    "Client": "batcher.client.sync",
    "ClientTimeout": "batcher.client.sync",
    "ModelLoadError": "batcher.errors",
    "MultiClient": "batcher.client.multi",
}


def __getattr__(name: str) -> Any:
    """Load a client or error class on first use, so `import batcher` stays light."""
    if name not in _LAZY:
        raise AttributeError(f"module 'batcher' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
