"""`serve --model-repository`: the repository's models served, versions side by side,
and what changes applied with nothing in flight lost (docs/models.md).

Each served version is a model of its own at the broker (`NAME/2`: its queue, workers,
stats), and the broker's VersionTable (batcher.core.versions) says which version a
request goes to. A change of a model's served versions (a poll found a new version, or
`load`/`unload`) moves through the phases of a rolling reload (batcher.core.reload): the
new versions' workers start and warm up while the old versions serve; once every new
worker has joined, the table switches (no new request reaches an old version); once the
old versions' queues are empty and their workers hold nothing, those workers are
retired; when they are gone the change is done and whoever asked is answered. New
workers that do not start fail the change alone: their version is reported and skipped,
the old ones serve on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from batcher.core.limits import BatchSettings
from batcher.core.reload import ReloadFacts, ReloadPhase, ReloadStep, advance, finished
from batcher.core.versions import split_key, version_key
from batcher.serve.multiplexed_pool import PoolChange, apply_pooled, loading
from batcher.serve.repository import scan
from batcher.wire.codes import ErrorCode
from workers.supervisor import Supervisor, WorkerProcess, add_model_workers

if TYPE_CHECKING:
    from batcher.broker.loop import Broker
    from workers.rollout import Rollouts

log = logging.getLogger("batcher.repository")

Reply = Callable[[bool, Any], None]
#: How often changes move on (serve's supervision interval).
TICK_S = 0.2
#: How long a new version's workers may take to load and warm up.
READY_TIMEOUT_S = 300.0


@dataclass
class Change:
    """One model's change of served versions under way."""

    name: str
    started_at: float
    new: dict[int, list[WorkerProcess]]
    old: list[int]
    replies: list[Reply] = field(default_factory=list)
    phase: ReloadPhase = ReloadPhase.STARTING
    retired: list[WorkerProcess] = field(default_factory=list)


class RepositoryControl:
    """The models of one repository directory and the versions of them this serve runs."""

    def __init__(self, root: str, default: BatchSettings, poll_s: float | None = None) -> None:
        self.root = root
        self.default = default
        self.poll_s = poll_s
        self.models, self.broken = scan(root, default)
        for name, why in self.broken.items():
            log.error("model repository %s: model %r skipped: %s", root, name, why)
        self.running: dict[str, set[int]] = {}  # name -> versions with workers
        self.failed: dict[tuple[str, int], tuple[float, str]] = {}  # (name, v) -> (file stamp, why)
        self.unloaded: set[str] = set()
        self.changes: dict[str, Change] = {}
        self.next_poll_at: float | None = None
        self.broker: Broker | None = None
        self.supervisor: Supervisor | None = None
        #: The multiplexed versions by key: the pool's catalog (its workers may serve no
        #: other; it grows by a replacement of them, batcher.serve.multiplexed_pool).
        self.pooled: dict[str, dict[str, Any]] = {}
        #: --multiplex-memory-mb (None: not given; no multiplexed model can be served).
        self.multiplex_budget_mb: int | None = None
        self.pool_change: PoolChange | None = None
        self.rollouts: Rollouts | None = None

    # --- before serve starts ----------------------------------------------------------------

    def wanted(self, name: str) -> tuple[int, ...]:
        """The versions of `name` its policy serves now (of those not failed, as they are)."""
        m = self.models.get(name)
        if m is None and name in self.broken and name not in self.unloaded:  # a bad edit, say
            return tuple(sorted(self.running.get(name, ())))  # what runs serves on, reported
        if m is None or name in self.unloaded:
            return ()
        usable = [v for v in m.versions if self.failed.get((name, v), (None,))[0] != m.stamps.get(v)]
        return m.policy.select(usable)

    def initial(self) -> tuple[list[str], dict[str, BatchSettings], dict[str, int]]:
        """What serve starts with: each served version's `--model` spec, its batching
        settings and its worker count (when its config says), by internal key."""
        specs, batch, workers = [], {}, {}
        for name, m in self.models.items():
            for v in self.wanted(name):
                key = version_key(name, v)
                batch[key] = m.batch_settings(self.default)
                if m.multiplexed:  # the pool's catalog holds it (multiplex_catalog)
                    self.pooled[key] = {"target": m.target(v), "memory_mb": m.memory_mb[v]}
                    continue
                specs.append(m.spec(v))
                if m.workers is not None:
                    workers[key] = m.workers
            self.running[name] = set(self.wanted(name))
        return specs, batch, workers

    def attach(self, broker: Broker, supervisor: Supervisor, rollouts: Rollouts, now: float) -> None:
        """Serve the initial versions through `broker`'s table; answer its repository ops;
        replace the multiplexed workers through `rollouts` when their catalog grows."""
        self.broker, self.supervisor, self.rollouts = broker, supervisor, rollouts
        table = broker.clients.versions
        for name, versions in self.running.items():
            table.set_served(name, versions)
            traffic = self.models[name].traffic
            if traffic is not None:
                self._apply_traffic(name, traffic)
        broker.controls.on_repository = self.handle
        default = split_key(broker.clients.default_model)
        if default is not None and default[0] in self.running:  # the model, not one version
            broker.clients.default_model = default[0]
        if self.poll_s is not None:
            self.next_poll_at = now + self.poll_s
        broker.call_every(TICK_S, self.tick)

    def owns(self, key: str) -> bool:
        """Whether `key` is a version of a repository model (its failures are not serve's)."""
        parts = split_key(key)
        return parts is not None and parts[0] in self.running

    # --- on the broker's loop ---------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Poll the directory when due, and move every change on."""
        if self.next_poll_at is not None and now >= self.next_poll_at and self.poll_s is not None:
            self.next_poll_at = now + self.poll_s
            self.rescan()
            for name in sorted(set(self.models) | set(self.running)):
                self.apply(name, None, now)
        for name, change in list(self.changes.items()):
            self._step(change, now)
            if finished(change.phase):
                del self.changes[name]

    def rescan(self) -> None:
        """Read the directory again (a model newly broken is reported once)."""
        models, broken = scan(self.root, self.default)
        for name, why in broken.items():
            if self.broken.get(name) != why:
                log.error("model repository %s: model %r skipped: %s", self.root, name, why)
        for name, m in models.items():
            old = self.models.get(name)
            if (
                old is not None
                and old.traffic != m.traffic
                and m.traffic is not None
                and name in self.running
            ):
                self._apply_traffic(name, m.traffic)
        self.models, self.broken = models, broken

    def apply(self, name: str, reply: Reply | None, now: float) -> None:
        """Start the change that makes `name`'s running versions its wanted ones (answer
        `reply` when it is done; at once when nothing changes)."""
        if name in self.changes:
            if reply is not None:
                self.changes[name].replies.append(reply)
            return
        wanted, have = set(self.wanted(name)), self.running.get(name, set())
        if wanted == have:
            if reply is not None:
                reply(True, self._summary(name))
            return
        assert self.supervisor is not None and self.broker is not None
        m = self.models.get(name)
        # By its config: one no longer multiplexed starts workers of its own for its new
        # versions, its pooled ones retire from the table alone (the pool serves on).
        if m.multiplexed if m is not None else any(version_key(name, v) in self.pooled for v in have):
            apply_pooled(self, name, wanted, have, reply, now)
            return
        new: dict[int, list[WorkerProcess]] = {}
        for v in sorted(wanted - have):
            assert m is not None
            key = version_key(name, v)
            self.broker.scheduler.set_settings(key, m.batch_settings(self.default))
            count = m.workers if m.workers is not None else self.supervisor.settings.default_count()
            new[v] = add_model_workers(m.spec(v), count, now, self.supervisor.settings.gpus)
            self.supervisor.workers.extend(new[v])
        self.supervisor.check(now)  # starts them (as many as may start at once)
        log.info("model %s: starting versions %s, then retiring %s", name, sorted(new), sorted(have - wanted))
        self.running[name] = have | set(new)
        self.changes[name] = Change(name, now, new, sorted(have - wanted), [reply] if reply else [])

    def _step(self, c: Change, now: float) -> None:
        while not finished(c.phase):
            phase, step = advance(c.phase, self._facts(c, now), READY_TIMEOUT_S)
            if phase is c.phase:
                return
            c.phase = phase
            self._carry_out(c, step)

    def _facts(self, c: Change, now: float) -> ReloadFacts:
        assert self.broker is not None and self.supervisor is not None
        controls, scheduler = self.broker.controls, self.broker.scheduler
        joined = {
            v: {pid for _, pid, _ in controls.workers_of(version_key(c.name, v))} for v in c.new
        }  # fmt: skip
        old_keys = [version_key(c.name, v) for v in c.old]
        old_workers = [w for k in old_keys for w in self.supervisor.current(k)] + c.retired
        return ReloadFacts(
            new_failed=any(w.given_up for ws in c.new.values() for w in ws),
            new_ready=all(
                w.process is not None and w.process.pid in joined[v] for v, ws in c.new.items() for w in ws
            ),
            waited_s=now - c.started_at,
            old_idle=all(  # a pooled version's workers are the pool's: its queue alone counts
                scheduler.queued(k) == 0
                and (k in self.pooled or all(h == 0 for _, _, h in controls.workers_of(k)))
                for k in old_keys
            ),
            old_running=any(self.supervisor.running(w) for w in old_workers),
        )

    def _carry_out(self, c: Change, step: ReloadStep) -> None:
        assert self.broker is not None and self.supervisor is not None
        table = self.broker.clients.versions
        controls = self.broker.controls
        if step is ReloadStep.DRAIN_OLD:  # every new worker joined: requests go to the new set
            served = sorted(self.running[c.name] - set(c.old))
            self._serve(c.name, served)
            # `ready` (and the gateway's readiness) wants the served versions' workers alone.
            keys = {version_key(c.name, v) for v in c.old}
            controls.configured = (controls.configured - keys) | {version_key(c.name, v) for v in c.new}
            log.info("model %s: now serving versions %s; draining %s", c.name, served, c.old)
        elif step is ReloadStep.RETIRE_OLD:
            for v in c.old:
                key = version_key(c.name, v)
                if key in self.pooled:  # the pool's workers serve the other models on
                    continue
                for wid, _, _ in self.broker.controls.workers_of(key):
                    self.broker.controls.drain_worker(wid)
                workers = self.supervisor.current(key)
                c.retired += workers
                self.supervisor.retire(workers)
        elif step is ReloadStep.ANSWER_DONE:
            self.running[c.name] -= set(c.old)
            if not self.running[c.name]:
                del self.running[c.name]
                table.remove(c.name)
            log.info("model %s: versions %s retired", c.name, c.old)
            self._answer(c, True, self._summary(c.name))
        else:  # a new version did not start: it is reported and skipped, the old ones serve on
            failures = []
            for v, ws in c.new.items():
                self.supervisor.retire(ws)
                failed = next((w for w in ws if w.given_up), None)
                if failed is not None or step is ReloadStep.FAIL_NEW_LATE:
                    why = failed.failure if failed is not None and failed.failure else "did not start in time"
                    self._mark_failed(c.name, v, why)
                    failures.append(f"version {v} {why}")
            self.running[c.name] -= set(c.new)
            message = f"model {c.name!r}: {'; '.join(failures)}; the versions served before serve on"
            log.error("%s", message)
            self._answer(c, False, (ErrorCode.WORKER_FAILED, message))

    def _serve(self, name: str, versions: list[int]) -> None:
        assert self.broker is not None
        table = self.broker.clients.versions
        if name in table.models:  # a version no longer served is not waited for by `ready`
            gone = {version_key(name, v) for v in table.models[name].served} - {
                version_key(name, v) for v in versions
            }
            self.broker.controls.configured -= gone
        table.set_served(name, versions)
        m = self.models.get(name)
        if m is not None and m.traffic is not None and table.models[name].traffic is None:
            self._apply_traffic(name, m.traffic)

    def _apply_traffic(self, name: str, traffic: dict[int, int]) -> None:
        """The config's split, over the versions it names that are served."""
        assert self.broker is not None
        table = self.broker.clients.versions
        served = {v: w for v, w in traffic.items() if v in table.models[name].served}
        table.set_traffic(name, served if any(served.values()) else None)

    def _mark_failed(self, name: str, v: int, why: str) -> None:
        m = self.models.get(name)
        self.failed[(name, v)] = (m.stamps.get(v, 0.0) if m is not None else 0.0, why)

    def _answer(self, c: Change, ok: bool, result: Any) -> None:
        for reply in c.replies:
            reply(ok, result)

    def load_failed(self, key: str) -> bool:
        """A version serve started with did not load: reported and no longer served (the
        next poll, or `load`, serves what the policy picks of the rest). False when `key`
        is no repository version."""
        parts = split_key(key)
        if parts is None or self.broker is None or not self.owns(key):
            return False
        name, v = parts
        log.error("model %s: version %d could not be loaded (its worker's error is above); skipped", name, v)
        self._mark_failed(name, v, "could not be loaded (see serve's log)")
        self.running.get(name, set()).discard(v)
        self._serve(name, sorted(self.running.get(name, set())))
        return True

    # --- the control ops --------------------------------------------------------------------

    def handle(self, op: str, model: str | None, reply: Reply) -> None:
        """`load MODEL`, `unload MODEL` and `repository_index`, from the broker's loop."""
        import time

        now = time.monotonic()
        if op == "repository_index":
            reply(True, {"models": repository_index(self)})
            return
        assert model is not None
        if op == "load":
            self.rescan()
            if model not in self.models:
                why = self.broken.get(model, "no such model directory")
                reply(False, (ErrorCode.UNKNOWN_MODEL, f"cannot load model {model!r}: {why}"))
                return
            self.unloaded.discard(model)
            self.failed = {k: f for k, f in self.failed.items() if k[0] != model}  # try again
        elif op == "unload":
            if model not in self.running and model not in self.models:
                reply(False, (ErrorCode.UNKNOWN_MODEL, f"no model {model!r} in the repository"))
                return
            self.unloaded.add(model)
        self.apply(model, reply, now)

    def _summary(self, name: str) -> dict[str, Any]:
        return {"model": name, "versions": sorted(self.running.get(name, set()))}


def repository_index(rc: RepositoryControl) -> list[dict[str, Any]]:
    """Every model and version of the repository with its state (READY, LOADING,
    UNLOADING, UNAVAILABLE) and, when it is not served, why: Triton's index."""
    table = rc.broker.clients.versions if rc.broker is not None else None
    out = []
    for name in sorted(set(rc.models) | set(rc.running) | set(rc.broken)):
        if name in rc.broken and name not in rc.models:
            why = rc.broken[name]
            out.append({"name": name, "version": "", "state": "UNAVAILABLE", "reason": why})
            for v in sorted(rc.running.get(name, ())):  # what ran before serves on
                out.append(
                    {"name": name, "version": str(v), "state": "READY", "reason": f"serving on: {why}"}
                )
            continue
        m = rc.models.get(name)
        served = table.models[name].served if table is not None and name in table.models else ()
        change = rc.changes.get(name)
        joining = loading(rc, name)
        versions = sorted(
            set(m.versions if m else ()) | set(m.problems if m else ()) | rc.running.get(name, set())
        )
        for v in versions:
            state, reason = "UNAVAILABLE", "not selected by the version policy"
            if (change is not None and v in change.new) or v in joining:
                state, reason = "LOADING", ""
            elif change is not None and v in change.old:
                state, reason = "UNLOADING", ""
            elif v in served:
                state, reason = "READY", ""
            elif name in rc.unloaded:
                reason = "unloaded"
            elif m is not None and v in m.problems:
                reason = m.problems[v]
            elif (name, v) in rc.failed:
                reason = rc.failed[(name, v)][1]
            elif m is None:
                reason = "removed from the repository"
            out.append({"name": name, "version": str(v), "state": state, "reason": reason})
    return out
