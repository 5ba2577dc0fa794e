"""A multiplexed worker's models (`multiplexed = true`, docs/models.md): it may serve every
model of its catalog, loads one on the first batch that needs it and unloads the least
recently used to stay within its memory budget, by the rule the broker runs too
(batcher.core.multiplex.Resident), so the broker knows which worker holds what.

The catalog comes on the command line (`batcher worker --multiplex JSON`, which `serve`
writes for a model repository's multiplexed models):

    {"budget_mb": 200, "models": {"NAME/V": {"target": "onnx:PATH", "memory_mb": 100}, ...}}
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batcher.core.multiplex import Catalog, Resident
from batcher.core.versions import split_key
from batcher.errors import ModelLoadError, SettingsError
from batcher.wire import protocol
from batcher.wire.signature import signature_of
from workers.models import ModelFn, ModelSpec
from workers.steps import is_step_model

log = logging.getLogger("batcher.worker")


@dataclass(frozen=True)
class MultiplexSpec:
    """A parsed `--multiplex` value: the catalog, and what to load for each of its models."""

    catalog: Catalog
    targets: dict[str, ModelSpec]

    @classmethod
    def parse(cls, text: str) -> MultiplexSpec:
        """The JSON of the module docstring; SettingsError saying what is wrong with it."""
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise SettingsError(f"--multiplex must be JSON: {exc}") from None
        if not isinstance(value, dict) or set(value) != {"budget_mb", "models"}:
            raise SettingsError("--multiplex must be a JSON object of budget_mb and models")
        models = value["models"]
        if not isinstance(models, dict) or not models:
            raise SettingsError(
                "--multiplex models must be a non-empty object of name to {target, memory_mb}"
            )
        sizes: dict[str, int] = {}
        targets: dict[str, ModelSpec] = {}
        for key, entry in models.items():
            if not isinstance(entry, dict) or set(entry) != {"target", "memory_mb"}:
                raise SettingsError(f"--multiplex model {key!r} must be an object of target and memory_mb")
            if not isinstance(entry["target"], str):
                raise SettingsError(f"--multiplex model {key!r}: target must be a string")
            targets[key] = ModelSpec.parse(f"{key}={entry['target']}")
            sizes[key] = entry["memory_mb"]
        return cls(Catalog(value["budget_mb"], sizes), targets)


class Shelf:
    """The models one multiplexed worker holds; `model_for` gives the one a batch names,
    loaded first when needed (and what that cost)."""

    def __init__(
        self,
        spec: MultiplexSpec,
        load: Callable[[ModelSpec], ModelFn],
        release: Callable[[ModelSpec], None] = lambda target: None,
    ) -> None:
        self.spec = spec
        self.resident = Resident(spec.catalog)
        self._load = load
        #: Forgets what a load keeps beyond the model (workers.models.release_model), so
        #: an unloaded model's memory goes back.
        self._release = release
        self._held: dict[str, ModelFn] = {}
        #: Models whose load ended the process that loaded them (workers.catalog_signatures),
        #: with why: never loaded here, or their first batch would end this worker.
        self.fatal: dict[str, str] = {}
        self.loads = 0
        self.unloads = 0

    def model_for(self, key: str) -> tuple[ModelFn, tuple[float, list[str], list[str]] | None]:
        """The model `key` and, when it was loaded now, (ms it took, models unloaded for
        it, models held now); a model that will not load is a callable raising why, so each request of its
        batch is answered model_error (and the next batch of it tries again)."""
        use = self.resident.use(key)
        for old in use.unloaded:
            self._held.pop(old, None)
            self._release(self.spec.targets[old])
            self.unloads += 1
            log.info("model %s unloaded to make room for %s", old, key)
        if not use.cold:
            return self._held[key], None
        if use.unloaded:
            gc.collect()  # what the unloaded models held goes back before the new one loads
        t0 = time.perf_counter()
        try:
            if key in self.fatal:
                raise ModelLoadError(self.fatal[key])
            model = self._load(self.spec.targets[key])
            if is_step_model(model):
                raise ModelLoadError("a step-level model cannot be multiplexed")
        except (Exception, SystemExit) as exc:  # its import or build error (a sys.exit() too)
            self.resident.drop(key)
            self._release(self.spec.targets[key])  # what its import left half done
            why = f"model {key!r} could not be loaded: {type(exc).__name__}: {exc}"[:500]
            log.warning("%s", why)
            return _failing(why), (
                (time.perf_counter() - t0) * 1000.0,
                list(use.unloaded),
                list(self.resident),
            )
        load_ms = (time.perf_counter() - t0) * 1000.0
        self._held[key] = model
        self.loads += 1
        log.info("model %s loaded in %.1f ms (%d held)", key, load_ms, len(self.resident))
        return model, (load_ms, list(use.unloaded), list(self.resident))

    def signatures(self) -> dict[str, dict[str, Any]]:
        """Each model's declared signature in wire form, for READY (the broker checks its
        requests, the gateway answers its metadata): read by loading each model once, one
        at a time, and letting it go. A model that will not load, or declares none, is
        left out (its batches say why it does not load): one model's sys.exit() at import
        must not stop the worker, and with it every model of the pool."""
        out: dict[str, dict[str, Any]] = {}
        for key, target in self.spec.targets.items():
            try:
                model = self._load(target)
                declared = None if is_step_model(model) else signature_of(model)
            except (Exception, SystemExit) as exc:  # its batches answer model_error, saying why
                log.warning("model %s: no signature read (%s: %s)", key, type(exc).__name__, exc)
                self._release(target)
                continue
            if declared is not None:
                out[key] = declared.wire()
            del model
            self._release(target)
            gc.collect()  # one model's memory at a time, never the catalog's
        return out


def _failing(why: str) -> ModelFn:
    def failed(inputs: list[Any]) -> list[Any]:
        raise ModelLoadError(why)

    return failed


def batch_model(header_frame: bytes) -> str | None:
    """The model a multiplexed worker's BATCH names (its header's 5th element), or None."""
    try:
        header = protocol.unpack(header_frame)
    except Exception:  # msgpack raises several unrelated types: the batch path says why
        return None
    if isinstance(header, list) and len(header) >= 5 and isinstance(header[4], str):
        return header[4]
    return None


def not_served(key: str | None) -> str:
    """Why a BATCH naming `key` (batch_model's) is not run: bounded, since the name is the
    peer's and goes into the worker's log (a name of megabytes must not fill it)."""
    return f"a multiplexed worker's BATCH must name one of its models, got {key!r}"[:300]


def version_of(key: str) -> str | None:
    """The version a reply names for model `key` (NAME/V), None outside a repository."""
    parts = split_key(key)
    return None if parts is None else str(parts[1])
