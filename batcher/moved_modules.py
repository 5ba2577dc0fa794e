"""The flat module paths of batcher before its layered layout (issue 29), kept importable:
`import batcher.tensor` or `from batcher.aio import AsyncClient` in code written for them
gets the module's new home, with a DeprecationWarning naming it. Nothing is loaded until
such an import runs."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

#: Old module (under batcher.) -> its home now.
MOVED = {
    "protocol": "batcher.wire.protocol",
    "tensor": "batcher.wire.tensor",
    "signature": "batcher.wire.signature",
    "aligned": "batcher.wire.aligned",
    "scheduler": "batcher.core.scheduler",
    "pool": "batcher.core.pool",
    "streams": "batcher.core.streams",
    "zmqio": "batcher.transport.zmqio",
    "security": "batcher.transport.security",
    "allocator": "batcher.transport.allocator",
    "stopping": "batcher.transport.stopping",
    "addresses": "batcher.transport.addresses",
    "backend": "batcher.broker.backend",
    "control": "batcher.broker.control",
    "stats": "batcher.broker.stats",
    "metrics": "batcher.broker.metrics",
    "aio": "batcher.client.aio",
    "serving": "batcher.serve.serving",
    "launcher": "batcher.serve.launcher",
    "config": "batcher.cli.config_file",
    "stats_table": "batcher.cli.stats_table",
    "bench": "batcher.cli.bench",
    "demo": "batcher.cli.demo",
}


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module at its new home (the same module object)."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.new}: import it from there", DeprecationWarning, stacklevel=2
        )
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module at its new home is loaded already."""


class MovedModules(importlib.abc.MetaPathFinder):
    """Finds `batcher.<old>` for each old flat module name, and nothing else."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        head, _, old = fullname.partition(".")
        if head != "batcher" or old not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(MOVED[old]))


def install() -> None:
    """Put the finder last on sys.meta_path, once: real modules are always found first."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
