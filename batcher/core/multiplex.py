"""Many models per worker (`multiplexed = true`, docs/models.md): which models a worker
holds, and which it unloads to make room, apart from any socket or clock.

A multiplexed worker may serve every model of its `Catalog`, but holds at most
`budget_mb` of them at once (each counted at its declared `memory_mb`). A batch of a
model it does not hold loads it first, unloading the least recently used models until
the new one fits: `Resident.use`. The worker and the broker run the same `Resident` over
the same batches in the same order (a worker runs its batches in the order sent), so the
broker knows, without being told, which worker holds which model: the scheduler prefers
one that holds the batch's model (batcher.core.policy.pick_worker), and a model used all
the time is never unloaded while the budget holds two models or more.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from batcher.errors import SettingsError
from batcher.wire.codes import clip

#: The name a multiplexed worker announces for itself (its logs and stats): the pool's.
POOL_NAME = "multiplexed"
#: The most models one catalog may hold.
MAX_MODELS = 1024
#: The largest budget or model size, in MB (a petabyte: far above any memory).
MAX_MB = 2**30
#: What a batch that loads its model may take beyond its time limit (a load may be slow).
LOAD_LIMIT_S = 60.0
#: The longest model key a catalog may hold (characters).
MAX_KEY_CHARS = 256


@dataclass(frozen=True)
class Catalog:
    """The models a multiplexed worker may serve (key -> its memory in MB) and the memory
    it may hold them in: checked so that every model fits alone."""

    budget_mb: int
    sizes_mb: Mapping[str, int]

    def __post_init__(self) -> None:
        if type(self.budget_mb) is not int or not 1 <= self.budget_mb <= MAX_MB:
            raise SettingsError(
                f"multiplex budget_mb must be an int in [1, {MAX_MB}], got {clip(self.budget_mb)}"
            )
        if not isinstance(self.sizes_mb, Mapping) or not 1 <= len(self.sizes_mb) <= MAX_MODELS:
            raise SettingsError(
                f"a multiplexed worker serves 1 to {MAX_MODELS} models, got {clip(self.sizes_mb, 240)}"
            )
        for key, mb in self.sizes_mb.items():
            if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS:
                raise SettingsError(
                    f"a multiplexed model's name must be 1 to {MAX_KEY_CHARS} characters, "
                    f"got {clip(key, 200)}"
                )
            if type(mb) is not int or not 1 <= mb <= MAX_MB:
                raise SettingsError(
                    f"memory_mb of model {key!r} must be an int in [1, {MAX_MB}], got {clip(mb)}"
                )
            if mb > self.budget_mb:
                raise SettingsError(
                    f"model {key!r} needs {mb} MB, more than the multiplexed workers' budget of "
                    f"{self.budget_mb} MB (--multiplex-memory-mb)"
                )

    def wire(self) -> dict[str, Any]:
        """As READY carries it (docs/protocol.md 6.2)."""
        return {"budget_mb": self.budget_mb, "models": dict(self.sizes_mb)}

    @classmethod
    def from_wire(cls, value: Any) -> Catalog:
        """A READY's `multiplexed` map; SettingsError (a ValueError) for anything else."""
        if not isinstance(value, dict) or set(value) != {"budget_mb", "models"}:
            raise SettingsError(f"multiplexed must be a map of budget_mb and models, got {clip(value, 240)}")
        models = value["models"]
        if not isinstance(models, dict):
            raise SettingsError(f"multiplexed models must be a map of name to MB, got {clip(models, 240)}")
        return cls(value["budget_mb"], dict(models))


class Use(NamedTuple):
    """What a batch of one model costs its worker: whether it must load the model first
    (`cold`), and the models it unloads to make room, least recently used first."""

    cold: bool
    unloaded: tuple[str, ...]


class Resident:
    """The models one multiplexed worker holds, least recently used first."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._held: OrderedDict[str, int] = OrderedDict()  # key -> MB, least recent first
        self.used_mb = 0

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def __iter__(self) -> Iterator[str]:
        return iter(self._held)

    def __len__(self) -> int:
        return len(self._held)

    def serves(self, key: str) -> bool:
        return key in self.catalog.sizes_mb

    def room_for(self, key: str) -> bool:
        """Whether `key` is held, or would load without unloading anything."""
        return key in self._held or self.used_mb + self.catalog.sizes_mb[key] <= self.catalog.budget_mb

    def use(self, key: str) -> Use:
        """A batch of `key` runs now: it becomes the most recently used, loaded first (when
        not held) after the least recently used models are unloaded until it fits."""
        if key in self._held:
            self._held.move_to_end(key)
            return Use(False, ())
        mb = self.catalog.sizes_mb[key]
        unloaded: list[str] = []
        while self._held and self.used_mb + mb > self.catalog.budget_mb:
            old, old_mb = self._held.popitem(last=False)
            self.used_mb -= old_mb
            unloaded.append(old)
        self._held[key] = mb
        self.used_mb += mb
        return Use(True, tuple(unloaded))

    def reset(self, held: list[str] | tuple[str, ...]) -> None:
        """Hold `held` (least recently used first), as the worker says it does: the
        models of the catalog among them, up to the budget."""
        self._held.clear()
        self.used_mb = 0
        for key in held:
            mb = self.catalog.sizes_mb.get(key)
            if mb is not None and key not in self._held and self.used_mb + mb <= self.catalog.budget_mb:
                self._held[key] = mb
                self.used_mb += mb

    def drop(self, key: str) -> None:
        """`key` is not held after all (its load failed)."""
        mb = self._held.pop(key, None)
        if mb is not None:
            self.used_mb -= mb


class Placed(Protocol):
    """A batch as this module sees it (batcher.core.queue.Batch)."""

    model: str
    multiplexed: bool
    cold: bool
    unloaded: tuple[str, ...]
    held_after: tuple[str, ...]


def place(resident: Resident, batch: Placed) -> None:
    """`batch` goes to the multiplexed worker of `resident`, after the batches it holds:
    whether it loads its model first (`cold`), the models it unloads for it, and what the
    worker holds after it."""
    use = resident.use(batch.model)
    batch.multiplexed, batch.cold, batch.unloaded = True, use.cold, use.unloaded
    batch.held_after = tuple(resident)


def replay(
    resident: Resident, held: list[str] | tuple[str, ...], answered: Placed, still_to_run: Iterable[Placed]
) -> None:
    """A worker said, answering batch `answered` (that loaded its model), which models it
    holds now: taken only as far as the broker's own replay allows, what it expected the
    worker to hold after that batch (`held_after`), less the batch's model when the
    worker does not hold it (its load failed: it holds nothing). A worker's word cannot
    make the broker believe it holds what it never loaded, nor lose what it did not
    unload. The batches it still runs are then placed again, in the order sent (one that
    was to find its model loaded may now load it: `cold`, and its time limit with it)."""
    resident.reset([key for key in answered.held_after if key != answered.model or key in held])
    for batch in still_to_run:
        place(resident, batch)
