"""The response cache's rule (issue 33, item 6): a size-bounded LRU of ok reply bodies,
keyed by the broker's internal model key (its queue's name, so each version has its own
entries), and a hash of the request's input bytes. Pure: it takes sizes, does no I/O and
reads no clock; the broker does the hashing of what it forwards and the sending."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from batcher.errors import SettingsError

#: The bytes an entry costs beyond its body (its key and the table's bookkeeping).
ENTRY_OVERHEAD_BYTES = 64


def input_key(model: str, body: bytes) -> tuple[str, bytes]:
    """A cache key: the model's internal key and a 16-byte blake2b digest of the input
    bytes (hashlib's, in C: no extra dependency for the broker core)."""
    return model, hashlib.blake2b(body, digest_size=16).digest()


@dataclass
class ModelCounts:
    """One model's hits and misses."""

    hits: int = 0
    misses: int = 0


@dataclass
class ResponseCache:
    """An LRU bounded by `max_bytes` (0: off); an entry bigger than the bound is never kept."""

    max_bytes: int
    used_bytes: int = 0
    _entries: OrderedDict[tuple[str, bytes], bytes] = field(default_factory=OrderedDict)
    counts: dict[str, ModelCounts] = field(default_factory=dict)
    evictions: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes < 0:
            raise SettingsError(f"cache_bytes must be an int >= 0, got {self.max_bytes!r}")

    def get(self, key: tuple[str, bytes]) -> bytes | None:
        """The cached reply body of `key` (made the most recently used), or None; counted."""
        counts = self.counts.get(key[0])
        if counts is None:
            counts = self.counts[key[0]] = ModelCounts()
        body = self._entries.get(key)
        if body is None:
            counts.misses += 1
            return None
        self._entries.move_to_end(key)
        counts.hits += 1
        return body

    def put(self, key: tuple[str, bytes], body: bytes) -> None:
        """Keep `body` under `key`, evicting the least recently used to stay within bounds."""
        size = len(body) + ENTRY_OVERHEAD_BYTES
        if size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.used_bytes -= len(old) + ENTRY_OVERHEAD_BYTES
        while self.used_bytes + size > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.used_bytes -= len(evicted) + ENTRY_OVERHEAD_BYTES
            self.evictions += 1
        self._entries[key] = body
        self.used_bytes += size

    def drop_model(self, model: str) -> int:
        """Forget every entry of `model` (its workers changed: a new one may run other
        weights, as after a reload); returns how many there were."""
        keys = [key for key in self._entries if key[0] == model]
        for key in keys:
            self.used_bytes -= len(self._entries.pop(key)) + ENTRY_OVERHEAD_BYTES
        return len(keys)

    def __len__(self) -> int:
        return len(self._entries)

    def lru_order(self) -> list[tuple[str, bytes]]:
        """The keys, least recently used first (for tests and stats)."""
        return list(self._entries)

    def stats(self) -> dict[str, object]:
        """What `stats` reports: bytes, entries, and each model's hits, misses and ratio."""
        models = {
            name: {
                "hits": c.hits,
                "misses": c.misses,
                # (a model's counts are made by its first `get`: never both 0)
                "hit_ratio": round(c.hits / (c.hits + c.misses), 4),
            }
            for name, c in self.counts.items()
        }
        return {
            "bytes": self.used_bytes,
            "max_bytes": self.max_bytes,
            "entries": len(self._entries),
            "evictions": self.evictions,
            "models": models,
        }
