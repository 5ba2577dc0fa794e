"""`batcher bench`'s settings: what load to offer (LoadSettings). Apart from the load
generator (batcher.cli.bench_settings, which needs hdrh), so that every command's
options can read their bounds from it (batcher.settings)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from batcher.settings import (
    MAX_BENCH_S,
    MAX_CONCURRENCY,
    MAX_MESSAGE_BYTES,
    MAX_PROCESSES,
    MAX_RATE,
    MAX_REQUESTS,
    check,
    setting,
)

#: What a NaN or an infinity of a load setting is told.
_FINITE = "{label} must be a finite number, got {value!r}"


@dataclass(frozen=True)
class LoadSettings:
    """What load to offer: closed loop (`concurrency`) or open loop (`rate`).

    `curve_server_key` (the broker's public key file) turns CurveZMQ on; with it,
    `curve_secret_key` is this client's own key pair (else a throwaway one, which only
    a broker without a client allow-list admits). `no_reply_timeout_s`: a run that
    gets no reply at all this long after its first request gives up."""

    connect: str
    concurrency: int | None = setting(
        None, kind=int, min=1, max=MAX_CONCURRENCY, optional=True, help="Closed loop: requests in flight."
    )
    rate: float | None = setting(
        None,
        min=0,
        min_exclusive=True,
        max=MAX_RATE,
        optional=True,
        not_finite=_FINITE,
        help="Open loop: Poisson arrivals per second.",
    )
    duration_s: float | None = setting(
        10.0,
        min=0,
        min_exclusive=True,
        max=MAX_BENCH_S,
        optional=True,
        not_finite=_FINITE,
        help="Seconds of load after warm-up (default 10 unless --requests).",
    )
    requests: int | None = setting(
        None, kind=int, min=1, max=MAX_REQUESTS, optional=True, help="Requests to send in all."
    )
    payload_bytes: int = setting(
        16, kind=int, min=0, max=MAX_MESSAGE_BYTES, help="Size of each request's input."
    )
    model: str | None = None
    processes: int = setting(1, kind=int, min=1, max=MAX_PROCESSES, help="Load generator processes.")
    warmup_s: float = setting(
        0.0, min=0, max=MAX_BENCH_S, not_finite=_FINITE, help="Seconds of load not measured."
    )
    drain_timeout_s: float = setting(10.0, min=0, not_finite=_FINITE)
    seed: int | None = None
    curve_server_key: str | None = None
    curve_secret_key: str | None = None
    no_reply_timeout_s: float = setting(10.0, min=0, min_exclusive=True, not_finite=_FINITE)
    #: Each request's input (None: `payload_bytes` bytes), and whether it asks for streamed
    #: replies: then time to first chunk, chunks/s and the time between chunks are measured.
    input: Any = None
    stream: bool = False

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of concurrency (closed loop) or rate (open loop)")
        if (self.duration_s is None) == (self.requests is None):
            raise ValueError("give exactly one of duration_s or requests")
        check(self)
        if self.concurrency is not None and self.concurrency < self.processes:
            raise ValueError(f"concurrency ({self.concurrency}) must be >= processes ({self.processes})")
        if self.requests is not None and self.requests < self.processes:
            raise ValueError(f"requests ({self.requests}) must be >= processes ({self.processes})")
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
