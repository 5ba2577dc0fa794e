"""The root of every error batcher raises at its users: `except BatcherError` catches them all.

This module imports nothing, so every layer can derive from it, down to batcher.extras
(below the wire). The errors a request's reply carries (BadRequest, Overloaded, ... one
per protocol error code, and the client's own ClientTimeout, Unreachable, ClientClosed)
are in batcher.wire.errors, under ReplyError; the rest sit next to the code that raises
them, each deriving from BatcherError and, where it always did, from a builtin too
(TensorError is a ValueError, BindError an OSError), so older `except` clauses still
catch them. docs/architecture.md ("Errors") draws the whole tree.
"""

from __future__ import annotations


class BatcherError(Exception):
    """Everything batcher raises at its users derives from this; `code` names the kind
    (a protocol error code for a reply's error, "error" when there is none)."""

    code: str = "error"

    @property
    def message(self) -> str:
        """The error's text, without its code: str(self), unless the raiser set it."""
        return str(self.__dict__.get("_message", self))

    @message.setter
    def message(self, value: str) -> None:
        self.__dict__["_message"] = value


class ModelLoadError(BatcherError, RuntimeError):
    """A model could not be loaded: its module or file could not be imported or built
    (a worker cannot start: `batcher worker` exits 78), or `serve`'s first worker of a
    model could not load it, or its gateway exited (serve stops).

    The one class for a model that will not load; `workers.worker.ModelLoadError`,
    `batcher.serve.serving.ModelLoadFailed` and `workers.onnx_model.OnnxLoadError` are
    this same class under its older names."""


class BindError(BatcherError, OSError):
    """An address batcher was told to listen on is taken or invalid: the broker's
    frontend, backend or metrics port, or the gateway's HTTP or gRPC port."""


class SettingsError(BatcherError, ValueError):
    """A value batcher was given and refuses, said precisely: a field of a settings
    dataclass, a client's constructor argument, an address, a model spec or signature, a
    CPU list, an API key or TLS file. A ValueError too, as these always were."""
