"""The broker process: one event loop over its frontend and backend sockets, control, stats and metrics.

The names of the flat layout's `batcher.broker` module (`Broker`, `BrokerSettings`,
`run_broker`, ...) are found here still, with a DeprecationWarning naming their home,
`batcher.broker.loop`; nothing is loaded until one is asked for.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    """A name of the old flat module, from its new home (batcher.broker.loop)."""
    if name.startswith("__"):
        raise AttributeError(name)
    loop = importlib.import_module("batcher.broker.loop")
    try:
        value = getattr(loop, name)
    except AttributeError:
        raise AttributeError(f"module 'batcher.broker' has no attribute {name!r}") from None
    warnings.warn(f"batcher.broker.{name} moved to batcher.broker.loop", DeprecationWarning, stacklevel=2)
    return value
