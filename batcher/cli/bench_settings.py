"""`batcher bench`'s settings (LoadSettings) and what one load process measured
(ShardResult), with the histogram and noise rules both sides share."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from hdrh.histogram import HdrHistogram

#: Latencies are recorded in microseconds, from 1 us to 10 minutes, 3 significant digits.
HIST_MAX_US = 600_000_000
PERCENTILES = (50.0, 90.0, 99.0, 99.9)
#: Beyond this share of one core, the load generator itself may be what is measured.
CLIENT_BUSY_LIMIT = 0.9
#: How long the load processes may take to start and connect before the run is abandoned.
START_TIMEOUT_S = 60.0
#: How often a load process reports how many replies it has had (for a progress bar).
PROGRESS_INTERVAL_S = 0.1


def new_histogram() -> HdrHistogram:
    """An empty latency histogram in microseconds."""
    return HdrHistogram(1, HIST_MAX_US, 3)


def noise_allowance(expected: float) -> float:
    """How far a count of Poisson events may stray from `expected` before it means something:
    3 sigma, and never less than 2% (rates drift a little on a busy machine)."""
    return max(3.0 * math.sqrt(max(expected, 1.0)), 0.02 * expected)


def _finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")


@dataclass(frozen=True)
class LoadSettings:
    """What load to offer: closed loop (`concurrency`) or open loop (`rate`).

    `curve_server_key` (the broker's public key file) turns CurveZMQ on; with it,
    `curve_secret_key` is this client's own key pair (else a throwaway one, which only
    a broker without a client allow-list admits). `no_reply_timeout_s`: a run that
    gets no reply at all this long after its first request gives up."""

    connect: str
    concurrency: int | None = None
    rate: float | None = None
    duration_s: float | None = 10.0
    requests: int | None = None
    payload_bytes: int = 16
    model: str | None = None
    processes: int = 1
    warmup_s: float = 0.0
    drain_timeout_s: float = 10.0
    seed: int | None = None
    curve_server_key: str | None = None
    curve_secret_key: str | None = None
    no_reply_timeout_s: float = 10.0
    #: Each request's input (None: `payload_bytes` bytes), and whether it asks for streamed
    #: replies: then time to first chunk, chunks/s and the time between chunks are measured.
    input: Any = None
    stream: bool = False

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of concurrency (closed loop) or rate (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None:
            _finite("rate", self.rate)
            if not self.rate > 0:
                raise ValueError(f"rate must be > 0, got {self.rate}")
        if (self.duration_s is None) == (self.requests is None):
            raise ValueError("give exactly one of duration_s or requests")
        if self.duration_s is not None:
            _finite("duration_s", self.duration_s)
            if not self.duration_s > 0:
                raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.requests}")
        if self.payload_bytes < 0:
            raise ValueError(f"payload_bytes must be >= 0, got {self.payload_bytes}")
        if self.processes < 1:
            raise ValueError(f"processes must be >= 1, got {self.processes}")
        if self.concurrency is not None and self.concurrency < self.processes:
            raise ValueError(f"concurrency ({self.concurrency}) must be >= processes ({self.processes})")
        if self.requests is not None and self.requests < self.processes:
            raise ValueError(f"requests ({self.requests}) must be >= processes ({self.processes})")
        _finite("warmup_s", self.warmup_s)
        if self.warmup_s < 0:
            raise ValueError(f"warmup_s must be >= 0, got {self.warmup_s}")
        _finite("drain_timeout_s", self.drain_timeout_s)
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        _finite("no_reply_timeout_s", self.no_reply_timeout_s)
        if not self.no_reply_timeout_s > 0:
            raise ValueError(f"no_reply_timeout_s must be > 0, got {self.no_reply_timeout_s}")
        if self.curve_secret_key is not None and self.curve_server_key is None:
            raise ValueError(
                "curve_secret_key needs curve_server_key (the broker's public key file): "
                "without it the connection is not encrypted"
            )

    @property
    def mode(self) -> str:
        return "closed" if self.concurrency is not None else "open"

    def shard(self, index: int) -> LoadSettings:
        """This load split across `processes`: shard `index` gets its share."""
        p = self.processes

        def share(total: int) -> int:
            return total // p + (1 if index < total % p else 0)

        return replace(
            self,
            concurrency=share(self.concurrency) if self.concurrency is not None else None,
            rate=self.rate / p if self.rate is not None else None,
            requests=share(self.requests) if self.requests is not None else None,
            processes=1,
            seed=None if self.seed is None else self.seed + index,
        )


@dataclass
class ShardResult:
    """What one load process measured; merged by `merge`. Times are seconds from the
    shard's start (all shards start together), so windows can be compared."""

    sent: int = 0
    sent_in_window: int = 0  # requests due inside the window: those whose latency is measured
    ok: int = 0  # successful replies to requests sent in the window (whenever they arrived)
    errors: Counter[str] = field(default_factory=Counter)  # error replies to those, by code
    batch_sizes: Counter[int] = field(default_factory=Counter)  # requests seen in batches of size k
    histogram: bytes = b""
    replies: int = 0  # every reply to a request of this run
    replies_before_window: int = 0
    replies_in_window: int = 0  # arrived inside the window, whatever was sent when
    ok_in_window: int = 0
    in_flight_at_start: int = 0
    in_flight_at_end: int = 0  # unanswered when the window closed: late + lost
    in_flight_at_stop: int = 0  # unanswered when sending ended
    late: int = 0  # answered after the window closed
    lost: int = 0  # never answered (drain_timeout_s after sending ended)
    window_s: float = 0.0
    last_reply_s: float = 0.0
    first_send_s: float | None = None
    gave_up_s: float | None = None  # no reply at all within no_reply_timeout_s: stopped here
    cpu_s: float = 0.0
    wall_s: float = 0.0
    max_send_lag_ms: float = 0.0
    late_sends: int = 0
    chunks_in_window: int = 0  # streamed chunks (finals included) arriving inside the window
    chunks: int = 0  # every ok streamed chunk of this run, whenever it arrived
    first_chunk_histogram: bytes = b""  # time from a request's due time to its first chunk
    inter_chunk_histogram: bytes = b""  # time between two chunks of one request

    @property
    def backlog_growth(self) -> int:
        """How many more requests were unanswered when sending ended than when the window began."""
        return self.in_flight_at_stop - self.in_flight_at_start
