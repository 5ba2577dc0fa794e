"""The batching settings of a model and the bounds they are checked against.

`BatchSettings` is what `--max-batch-size`, `--max-wait-ms`, `--policy` and the other
batching options of a model become; it rejects a bad value with a precise message when
built, so the scheduler (batcher.core.scheduler) never meets one.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from enum import StrEnum

from batcher.errors import SettingsError
from batcher.settings import MAX_BATCH_COST, MAX_BATCH_SIZE, MAX_QUEUE, MAX_TIMEOUT_MS, check, setting


class Policy(StrEnum):
    """How a model's queue turns into batches (module docstring)."""

    ADAPTIVE = "adaptive"
    WINDOW = "window"


POLICIES = tuple(p.value for p in Policy)
#: What requests may be grouped by (`--bucket-by`): the first axis of the input tensor.
BUCKET_BY = ("length",)
#: The shortest time limit a batch gets by default (fast models).
MIN_BATCH_LIMIT_S = 1.0
#: The default time limit of a model's batches before any of them was answered.
FIRST_BATCH_LIMIT_S = 60.0


@dataclass(frozen=True, slots=True)
class BatchSettings:
    """How one model's requests are queued and grouped into batches."""

    max_batch_size: int = setting(
        8, kind=int, min=1, max=MAX_BATCH_SIZE, int_message=True, help="Largest batch sent to a worker."
    )
    max_wait_ms: float = setting(
        5.0,
        min=0,
        max=MAX_TIMEOUT_MS,  # not MAX_MS: a window of an hour is a scheduler's to take (tests do)
        noun="a finite number",
        help="Longest a request waits for its batch to fill.",
    )
    batch_sizes: tuple[int, ...] | None = None
    max_queue: int = setting(
        10_000, kind=int, min=1, max=MAX_QUEUE, int_message=True, help="Queued requests per model."
    )
    policy: Policy = Policy.ADAPTIVE
    max_batch_cost: float | None = setting(
        None,
        min=0,
        min_exclusive=True,
        max=MAX_BATCH_COST,
        optional=True,
        noun="a finite number",
        help="Largest sum of the requests' `cost` (tokens, pixels, bytes; 1 when a request "
        "gives none) in one batch; a lone request over it runs alone. Default: no cap.",
    )
    priority_aging_ms: float = setting(  # 0: priority is strict
        0.0,
        min=0,
        max=MAX_TIMEOUT_MS,
        noun="a finite number",
        help="A waiting request gains one priority level each this many ms, so a flood of "
        "higher priorities cannot starve the rest (0: strict priority).",
    )
    bucket_by: str | None = None  # "length": requests of different length buckets never share a batch
    length_buckets: tuple[int, ...] | None = None  # the buckets' upper bounds, e.g. (16, 32, 64, 128)

    def __post_init__(self) -> None:
        check(self)
        if self.policy not in POLICIES:
            raise SettingsError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        object.__setattr__(self, "policy", Policy(self.policy))  # a plain str is accepted
        if self.batch_sizes is not None:
            sizes = self.batch_sizes
            if not all(type(n) is int for n in sizes):
                raise SettingsError(f"batch_sizes must be ints, got {list(sizes)}")
            if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] != 1:
                raise SettingsError(
                    "batch_sizes must be increasing, without repeats, and start at 1 "
                    f"(so a lone request can be served), got {list(sizes)}"
                )
            if sizes[-1] > self.max_batch_size:
                raise SettingsError(
                    f"batch_sizes must not exceed max_batch_size {self.max_batch_size}, got {list(sizes)}"
                )

        self._check_buckets()

    def _check_buckets(self) -> None:
        if self.bucket_by not in (None, *BUCKET_BY):
            raise SettingsError(f"bucket_by must be one of {', '.join(BUCKET_BY)}, got {self.bucket_by!r}")
        bounds = self.length_buckets
        if bounds is not None:
            if not all(type(n) is int for n in bounds):
                raise SettingsError(f"length_buckets must be ints, got {list(bounds)}")
            if not bounds or list(bounds) != sorted(set(bounds)) or bounds[0] < 1:
                raise SettingsError(
                    f"length_buckets must be increasing ints >= 1, without repeats, got {list(bounds)}"
                )
        if (self.bucket_by is None) != (bounds is None):
            raise SettingsError(
                "bucket_by and length_buckets go together (--bucket-by length --length-buckets 16,32,64), "
                f"got bucket_by={self.bucket_by!r} and length_buckets={bounds!r}"
            )

    def bucket(self, length: int) -> int:
        """The length bucket of a request: the index of the first bound >= `length`, or
        len(length_buckets) for a request longer than the last (a bucket of its own)."""
        assert self.length_buckets is not None
        return bisect.bisect_left(self.length_buckets, length)

    @property
    def max_wait_s(self) -> float:
        """The wait window in seconds, the unit the scheduler's clock uses."""
        return self.max_wait_ms / 1000.0

    def cut_size(self, queued: int) -> int:
        """How many of `queued` requests the next batch takes."""
        n = min(queued, self.max_batch_size)
        if self.batch_sizes is None:
            return n
        return max(s for s in self.batch_sizes if s <= n) if n >= 1 else 0
