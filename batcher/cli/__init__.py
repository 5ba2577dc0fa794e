"""The `batcher` command line: its commands, the TOML configuration file, and the bench and demo bodies.

`batcher.cli:main` stays the console entry point (installs made before the commands moved
to `batcher.cli.commands` keep working); it loads the commands on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["main"]


def __getattr__(name: str) -> Any:
    """Load the commands only when the entry point asks for them."""
    if name != "main":
        raise AttributeError(f"module 'batcher.cli' has no attribute {name!r}")
    return importlib.import_module("batcher.cli.commands").main
