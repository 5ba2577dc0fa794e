"""What one `batcher bench` load process measured (ShardResult; its settings,
LoadSettings, are in batcher.cli.load_settings), with the histogram and noise rules
both sides share."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from hdrh.histogram import HdrHistogram

from batcher.cli.load_settings import LoadSettings as LoadSettings  # its older home

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
