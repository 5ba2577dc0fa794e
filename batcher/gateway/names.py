"""The gateway's cache of models' input and output names, per (model, version): the
gateway checks an inference request's input names against them (Triton's check) and
names a lone output after the model's one output. Two versions of a repository's model
may have different signatures (docs/models.md), so each version has its own entry; the
entry of a request that names no version is the model's newest served version's, and
holds no input names when the model serves several (a split may send the request to
any of them: the version that answers checks its own signature).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from batcher.gateway import oip
from batcher.wire.protocol import ErrorCode

#: How long a model's input and output names (from its signature) are taken as known;
#: past it they are asked again while the old ones still serve.
NAMES_TTL_S = 1.0

Names = tuple[list[str] | None, list[str] | None]
#: A control call: (op, fields) -> the reply's output; OipError on failure.
Control = Callable[..., Awaitable[Any]]


def names_of_meta(meta: dict[str, Any], version: str) -> Names:
    """(input names, output names) from a `metadata` reply asked with `version` (""
    none): no input names for an unnamed version of a model that serves several."""
    several = not version and len(meta.get("versions") or ()) > 1
    return (None if several else _names(meta.get("inputs"))), _names(meta.get("outputs"))


class ModelNames:
    """Each (model, version)'s names, asked at most once per NAMES_TTL_S, once at a time."""

    def __init__(self, control: Control) -> None:
        self._control = control
        #: (model, version) -> (when asked, its input names, its output names)
        self._names: dict[tuple[str, str], tuple[float, list[str] | None, list[str] | None]] = {}
        self._asking: dict[tuple[str, str], asyncio.Task[Names]] = {}

    def learned(self, model: str, version: str, meta: dict[str, Any]) -> None:
        """Keep the names a `metadata` reply for (model, version) gave."""
        self._names[(model, version)] = (time.monotonic(), *names_of_meta(meta, version))

    def fresh(self, model: str, version: str = "") -> Names | None:
        """The names if asked less than NAMES_TTL_S ago, else None."""
        cached = self._names.get((model, version))
        if cached is not None and time.monotonic() - cached[0] < NAMES_TTL_S:
            return cached[1], cached[2]
        return None

    async def get(self, model: str, version: str = "") -> Names:
        """The names (None: no signature, or the broker does not say); past the TTL the
        names known serve while they are asked again."""
        fresh = self.fresh(model, version)
        if fresh is not None:
            return fresh
        key = (model, version)
        cached = self._names.get(key)
        asking = self._asking.get(key)
        if asking is None:
            asking = self._asking[key] = asyncio.get_running_loop().create_task(self._ask(model, version))
            asking.add_done_callback(lambda _: self._asking.pop(key, None))
        if cached is not None:
            return cached[1], cached[2]
        return await asyncio.shield(asking)

    async def _ask(self, model: str, version: str) -> Names:
        try:
            meta = await self._control("metadata", model=model, **({"version": version} if version else {}))
        except oip.OipError as exc:
            if exc.code != ErrorCode.UNKNOWN_MODEL:
                return None, None  # not known now (the broker is away): no names, nothing kept
            meta = {}
        self.learned(model, version, meta)
        return names_of_meta(meta, version)


def _names(outputs: list[dict[str, Any]] | None) -> list[str] | None:
    return [str(o["name"]) for o in outputs] if outputs else None
