"""A model repository's multiplexed models (docs/models.md, "Many models per worker"):
the catalog of serve's pool of multiplexed workers, and how it grows at run time.

A pool worker may serve only the models of the catalog on its command line
(`batcher worker --multiplex JSON`). A multiplexed version that is not in it (a new
version polled or `load`ed, a new model marked `multiplexed = true`) joins through a
rolling replacement of the pool (workers/rollout.py, as `batcher reload` does): serve's
`--multiplex` becomes the larger catalog, a new pool worker starts for each old one (or
the pool's first workers, when serve started with no multiplexed model), and once they
have all joined the old ones are drained and stopped. The versions served before serve
on meanwhile, and on if the new workers do not start; nothing queued is lost, since the
new catalog holds every version the old one did.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from batcher.core.limits import BatchSettings
from batcher.core.multiplex import POOL_NAME, Catalog
from batcher.core.versions import split_key, version_key
from batcher.errors import SettingsError
from batcher.wire.codes import ErrorCode
from workers.supervisor import POOL_SPEC, add_model_workers

if TYPE_CHECKING:
    from batcher.serve.repository_control import RepositoryControl

log = logging.getLogger("batcher.repository")

Reply = Callable[[bool, Any], None]


@dataclass
class PoolChange:
    """The pool's workers being replaced by ones of a larger catalog: its models, the
    `--multiplex` JSON before (put back if the new workers do not start), and who waits
    for it (a model's name, and whom to answer once it has been applied again)."""

    entries: dict[str, dict[str, Any]]
    previous: str | None
    waiting: list[tuple[str, Reply | None]] = field(default_factory=list)
    #: The batching settings of the models it adds, given to the broker once they join.
    settings: dict[str, BatchSettings] = field(default_factory=dict)

    def wait(self, name: str, reply: Reply | None) -> None:
        """`name` is applied again when the change ends (once for a poll's, unanswered)."""
        if reply is not None or (name, None) not in self.waiting:
            self.waiting.append((name, reply))


def catalog_json(budget_mb: int, entries: dict[str, dict[str, Any]]) -> str:
    """The `--multiplex` value of a pool holding `entries` within `budget_mb`."""
    return json.dumps({"budget_mb": budget_mb, "models": entries})


def multiplex_catalog(rc: RepositoryControl, budget_mb: int | None) -> str | None:
    """The `--multiplex` JSON of the pool of multiplexed workers (workers/multiplexed.py),
    None when no model is multiplexed; SettingsError without a budget, or for a model
    that does not fit in it. The budget is kept for the pool's later growth."""
    rc.multiplex_budget_mb = budget_mb
    if not rc.pooled:
        return None
    if budget_mb is None:
        raise SettingsError(
            f"models {sorted({k.partition('/')[0] for k in rc.pooled})} are multiplexed: give "
            "--multiplex-memory-mb, the memory each multiplexed worker may hold them in"
        )
    Catalog(budget_mb, {k: e["memory_mb"] for k, e in rc.pooled.items()})  # each must fit
    return catalog_json(budget_mb, rc.pooled)


def apply_pooled(
    rc: RepositoryControl, name: str, wanted: set[int], have: set[int], reply: Reply | None, now: float
) -> None:
    """A multiplexed model's change: its versions in the pool's catalog are served or
    not at once (the pool's workers hold the model or unload it as batches come; an
    unserved version's queued requests are still answered); one outside the catalog
    joins through a replacement of the pool (the module docstring), the versions served
    before serving on until it is done."""
    assert rc.broker is not None
    served = {v for v in wanted if version_key(name, v) in rc.pooled}
    outside = sorted(wanted - served)
    if outside:  # until they have joined, those served before serve on (pooled or not)
        served |= have
    # Versions with workers of their own (the model was not multiplexed before): they
    # drain and stop as any retired version does, not left running unserved.
    own = sorted(v for v in have - served if version_key(name, v) not in rc.pooled)
    if served or own:
        rc.running[name] = served | set(own)
        if served:
            rc._serve(name, sorted(served))
    else:
        rc.running.pop(name, None)
        rc.broker.clients.versions.remove(name)
    log.info("model %s (multiplexed): serving versions %s", name, sorted(served))
    if outside:
        grow_pool(rc, name, outside, reply, now)
    elif own:
        from batcher.serve.repository_control import Change  # it imports this module

        log.info("model %s: retiring versions %s (workers of their own)", name, own)
        rc.changes[name] = Change(name, now, {}, own, [reply] if reply is not None else [])
    elif reply is not None:
        reply(True, rc._summary(name))


def grow_pool(rc: RepositoryControl, name: str, versions: list[int], reply: Reply | None, now: float) -> None:
    """Start replacing the pool's workers with ones whose catalog also holds `versions`
    of `name` (joining a replacement under way: `name` is applied again when it ends).
    A version that cannot join (no budget, too big for it) is reported and skipped."""
    if rc.pool_change is not None:
        rc.pool_change.wait(name, reply)
        return
    assert rc.broker is not None and rc.supervisor is not None and rc.rollouts is not None
    m = rc.models[name]
    new = {version_key(name, v): {"target": m.target(v), "memory_mb": m.memory_mb[v]} for v in versions}
    budget = rc.multiplex_budget_mb
    entries = {k: e for k, e in rc.pooled.items() if _kept(rc, k)} | new
    try:
        if budget is None:
            raise SettingsError(
                "a multiplexed model needs serve's --multiplex-memory-mb, the memory each "
                "multiplexed worker may hold its models in (give it when serve starts)"
            )
        Catalog(budget, {k: e["memory_mb"] for k, e in entries.items()})  # each must fit
        # Checked as serve's own settings are (a pool that would leave no core to the broker).
        grown = dataclasses.replace(rc.supervisor.settings, multiplex=catalog_json(budget, entries))
    except (SettingsError, ValueError) as exc:
        _refuse(rc, name, versions, str(exc), reply)
        return
    supervisor = rc.supervisor
    change = rc.pool_change = PoolChange(entries, supervisor.settings.multiplex, [(name, reply)])
    change.settings = {key: m.batch_settings(rc.default) for key in new}
    supervisor.settings = grown
    log.info("multiplexed workers: replacing them to add %s to their catalog", sorted(new))
    done: Reply = lambda ok, result: _pool_changed(rc, change, ok, result)  # noqa: E731
    old = supervisor.current(POOL_NAME)
    if old:
        rc.rollouts.start(POOL_NAME, done, now)
        return
    count = supervisor.settings.multiplex_workers or supervisor.settings.default_count()
    first = add_model_workers(POOL_SPEC, count, now, supervisor.settings.gpus)
    supervisor.workers.extend(first)
    supervisor.check(now)  # starts them (as many as may start at once)
    rc.rollouts.adopt(POOL_NAME, [], first, done, now)


def _pool_changed(rc: RepositoryControl, change: PoolChange, ok: bool, result: Any) -> None:
    """The replacement ended: its models are the pool's catalog and each waiting model is
    applied again; or its new workers did not start, and its new versions are reported
    (the old catalog and workers serve on)."""
    assert rc.broker is not None and rc.supervisor is not None
    rc.pool_change = None
    now = time.monotonic()
    added = {k for k in change.entries if k not in rc.pooled}
    why = ""
    if ok:
        for key, settings in change.settings.items():  # before any request can reach them
            rc.broker.scheduler.set_settings(key, settings)
        dropped = set(rc.pooled) - set(change.entries)  # gone from the repository
        rc.pooled = change.entries
        controls = rc.broker.controls  # `ready` waits for the catalog's models, and no others
        controls.configured = (controls.configured - dropped) | added
    else:
        supervisor = rc.supervisor
        supervisor.settings = dataclasses.replace(supervisor.settings, multiplex=change.previous)
        why = result[1] if isinstance(result, tuple) and len(result) == 2 else str(result)
        why = str(why).removesuffix("; the old workers serve on")  # said once, below
        log.error("multiplexed workers: %s could not join: %s", sorted(added), why)
    failed = _names_of(added)
    for name, reply in change.waiting:
        if ok or name not in failed:
            rc.apply(name, reply, now)
            continue
        versions = failed[name]
        for v in versions:
            rc._mark_failed(name, v, f"the multiplexed workers of its catalog did not start: {why}")
        if reply is not None:
            message = (
                f"model {name!r}: versions {versions} could not join the multiplexed workers: {why}; "
                "the versions served before serve on"
            )
            reply(False, (ErrorCode.WORKER_FAILED, message))


def _refuse(rc: RepositoryControl, name: str, versions: list[int], why: str, reply: Reply | None) -> None:
    message = f"model {name!r}: versions {versions} cannot be multiplexed: {why}"
    for v in versions:
        rc._mark_failed(name, v, why)
    log.error("%s", message)
    if reply is not None:
        reply(False, (ErrorCode.UNAVAILABLE, message))


def _names_of(keys: set[str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for key in sorted(keys):
        parts = split_key(key)
        if parts is not None:
            out.setdefault(parts[0], []).append(parts[1])
    return out


def _kept(rc: RepositoryControl, key: str) -> bool:
    """Whether version `key` stays in the pool's catalog: it is still in the repository,
    or still served (its removal not applied yet). One removed and no longer served
    leaves the catalog at the pool's next replacement."""
    parts = split_key(key)
    if parts is None:
        return False
    name, v = parts
    m = rc.models.get(name)
    return (m is not None and v in m.versions) or v in rc.running.get(name, ())


def loading(rc: RepositoryControl, name: str) -> set[int]:
    """The versions of `name` joining the pool now (the repository index's LOADING)."""
    change = rc.pool_change
    if change is None:
        return set()
    return set(_names_of({k for k in change.entries if k not in rc.pooled}).get(name, ()))
