"""batcher's optional extras (pyproject.toml), and the one line that names the
`pip install` bringing one that is missing.

A command that needs an extra asks `require` before it starts anything, so a missing
module is one line naming its fix, never a ModuleNotFoundError traceback from a lazy
import deep inside (the gateway's uvicorn, an ONNX worker's onnxruntime). The modules
are looked for (importlib.util.find_spec), not imported: `serve` is the broker, and the
broker's process never imports the extras (its gateway and its workers do, in theirs).
"""

from __future__ import annotations

import importlib.util

from batcher.errors import BatcherError

#: The modules each extra brings, as they are imported.
EXTRAS: dict[str, tuple[str, ...]] = {
    "gateway": ("uvicorn", "httptools", "grpc", "google.protobuf"),
    "onnx": ("onnxruntime", "numpy"),
    "tensors": ("numpy",),
    "tracing": ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http"),
    "tracing-grpc": ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.grpc"),
}


class MissingExtra(BatcherError, ImportError):
    """An extra a command needs is not installed; the message is the one line to show."""


def install_command(extra: str) -> str:
    """What installs `extra`, quoted for a shell."""
    return f"pip install 'batcher[{extra}]'"


def extra_of(module: str | None) -> str | None:
    """The smallest extra that brings `module` (or its top package), None if none does."""
    if not module:
        return None
    for extra, modules in sorted(EXTRAS.items(), key=lambda item: len(item[1])):
        if any(module == m or module.startswith(m + ".") or m.startswith(module + ".") for m in modules):
            return extra
    return None


def missing_module(extra: str) -> str | None:
    """The first module of `extra` that cannot be imported here, None if all can."""
    for module in EXTRAS[extra]:
        try:
            found = importlib.util.find_spec(module)
        except ImportError:  # a parent package missing, or an import hook refusing it
            found = None
        if found is None:
            return module
    return None


def require(extra: str, needed_by: str) -> None:
    """Raise MissingExtra, saying what needs it and the pip install that fixes it, if a
    module of `extra` is missing."""
    module = missing_module(extra)
    if module is not None:
        raise MissingExtra(
            f"{needed_by} needs the {extra} extra, which is not installed (no module {module!r}): "
            f"{install_command(extra)}",
            name=module,
        )
