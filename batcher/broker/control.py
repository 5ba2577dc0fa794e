"""The broker's control plane: the `stats` and `reload` control requests, and the calls
`serve` makes (reload a model's workers, re-read batching settings). Apart from the
socket loop, which hands it each control request with a `reply` to answer through."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from batcher.broker.stats import BrokerStats
from batcher.core.pool import WorkerPool
from batcher.core.scheduler import BatchSettings, Scheduler
from batcher.core.versions import VersionTable, parse_traffic, split_key
from batcher.errors import SettingsError
from batcher.wire.protocol import ErrorCode

log = logging.getLogger("batcher.broker")

Reply = Callable[[bool, Any], None]

#: The control ops that change the service: with --curve-admins, only an admin's key
#: (or the broker's own) may send them; any other is answered `forbidden`. `stats` and
#: `metadata` only read, and `cancel` touches only its sender's own requests.
MUTATING_OPS = frozenset({"reload", "split", "load", "unload"})
#: The control ops of a model repository (`serve --model-repository`), answered by
#: `serve` through Controls.on_repository.
REPOSITORY_OPS = frozenset({"load", "unload", "repository_index"})


class Controls:
    """What a client (`stats`, `reload`) and `serve` may ask of a running broker."""

    def __init__(
        self,
        scheduler: Scheduler,
        pool: WorkerPool,
        stats: BrokerStats,
        configured: frozenset[str],
        loop_state: Callable[[], dict[str, Any]],
        limits: dict[str, int] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.pool = pool
        self.stats = stats
        self.configured = configured
        self.loop_state = loop_state
        #: What the `limits` op answers: the sizes past which a request is refused, so
        #: that a client that multiplexes others (the gateway) refuses it first.
        self.limits = dict(limits or {})
        #: Set by `serve`: starts a rolling reload of a model and answers through `reply`
        #: when it ends (a plain broker has no workers of its own to replace).
        self.on_reload: Callable[[str, Reply], None] | None = None
        #: The versioned models (the frontend's table: batcher.core.versions).
        self.versions = VersionTable()
        #: Set by `serve --model-repository`: answers `load`, `unload` and
        #: `repository_index` (op, model, reply).
        self.on_repository: Callable[[str, str | None, Reply], None] | None = None

    def handle(
        self,
        op: str,
        model: str | None,
        reply: Reply,
        admin: bool = True,
        fields: dict[str, Any] | None = None,
    ) -> None:
        """A control request other than `cancel` (which the loop answers itself); `admin`:
        whether its sender may change the service (always, without --curve-admins). A
        sender that may not is refused MUTATING_OPS and gets `stats` without worker pids."""
        if op in MUTATING_OPS and not admin:
            message = f"{op} changes the service: it needs a key in the broker's --curve-admins"
            reply(False, (ErrorCode.FORBIDDEN, message))
        elif op == "stats":
            reply(True, self.snapshot(redacted=not admin))
        elif op == "reload":
            self._reload(model, reply)
        elif op == "metadata":
            self._metadata(model, reply)
        elif op == "limits":
            reply(True, self.limits)
        elif op == "split":
            self._split(model, (fields or {}).get("traffic"), reply)
        elif op in REPOSITORY_OPS:
            if self.on_repository is None:
                reply(False, (ErrorCode.BAD_REQUEST, f"{op} needs `batcher serve --model-repository`"))
            elif op != "repository_index" and model is None:
                reply(False, (ErrorCode.BAD_REQUEST, f"{op} needs a 'model'"))
            else:
                self.on_repository(op, model, reply)
        else:
            reply(False, (ErrorCode.BAD_REQUEST, f"unknown op {op!r}"))

    def _reload(self, model: str | None, reply: Reply) -> None:
        if model is None:
            reply(False, (ErrorCode.BAD_REQUEST, "reload needs a 'model'"))
        elif not self.scheduler.knows_model(model):
            served = ", ".join(sorted(self.scheduler.views()))
            reply(False, (ErrorCode.UNKNOWN_MODEL, f"no model {model!r} to reload (models: {served})"))
        elif self.on_reload is None:
            message = "reload needs `batcher serve`: this broker starts no workers (restart them by hand)"
            reply(False, (ErrorCode.BAD_REQUEST, message))
        else:
            self.on_reload(model, reply)

    def _split(self, model: str | None, traffic: object, reply: Reply) -> None:
        """Split the requests naming no version of `model` by `traffic` (`{"2": 90, "3":
        10}`; null: all to the newest), from the next request on."""
        if model is None or model not in self.versions.models:
            names = ", ".join(sorted(self.versions.models)) or "none"
            reply(
                False,
                (ErrorCode.UNKNOWN_MODEL, f"no versioned model {model!r} to split (versioned: {names})"),
            )
            return
        try:
            self.versions.set_traffic(model, None if traffic is None else parse_traffic(traffic))
        except SettingsError as exc:
            reply(False, (ErrorCode.BAD_REQUEST, str(exc)))
            return
        log.info("model %s: traffic split now %s", model, traffic)
        reply(True, {"model": model, **self.versions.wire()[model]})

    def _metadata(self, model: str | None, reply: Reply) -> None:
        """A model's name, whether it is ready, and its inputs and outputs (null when no
        worker of it announced a signature): what an HTTP gateway serves as metadata."""
        if model is None:
            reply(False, (ErrorCode.BAD_REQUEST, "metadata needs a 'model'"))
        elif not self.scheduler.knows_model(model):
            served = ", ".join(sorted(self.scheduler.views()))
            reply(False, (ErrorCode.UNKNOWN_MODEL, f"no model {model!r} (models: {served})"))
        else:
            signature = self.pool.signature(model)
            wire = signature.wire() if signature is not None else {"inputs": None, "outputs": None}
            meta = {"name": model, "ready": self.scheduler.has_workers(model), **wire}
            parts = split_key(model)
            if parts is not None and parts[0] in self.versions.models:  # a repository's version
                meta.update(name=parts[0], version=str(parts[1]), key=model)
                meta["versions"] = [str(v) for v in self.versions.models[parts[0]].served]
            reply(True, meta)

    def snapshot(self, redacted: bool = False) -> dict[str, Any]:
        """The broker's state for the `stats` control request (`redacted`: without the
        workers' pids, BrokerStats.snapshot)."""
        views = self.scheduler.views()
        now = time.monotonic()
        snap = self.stats.snapshot(views, self.pool, self.configured, now, self.loop_state(), redacted)
        if self.versions:
            snap["versions"] = self.versions.wire()
        return snap

    def workers_of(self, model: str) -> list[tuple[bytes, object, int]]:
        """(worker id, pid from its READY, batches or sequences it holds) of each live worker
        of `model`."""
        held = self.scheduler.held
        in_streams = self.pool.streams.held
        return [(w, info.pid, held(w) + in_streams(w)) for w, info in self.pool.workers_of(model)]

    def drain_worker(self, worker_id: bytes) -> int:
        """Dispatch nothing more to a worker (it is being replaced); returns the batches it
        still holds."""
        return self.scheduler.drain_worker(worker_id) + self.pool.streams.drain_worker(worker_id)

    def apply_model_settings(self, per_model: dict[str, BatchSettings]) -> None:
        """Batching settings re-read from the config file (SIGHUP to serve)."""
        for model, settings in per_model.items():
            self.scheduler.set_settings(model, settings)
            log.info("model %s: batching settings now %s", model, settings)
