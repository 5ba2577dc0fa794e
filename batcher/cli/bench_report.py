"""A run's result: the shards merged into one LoadResult and judged (did the broker keep
up, did the load generator, did anything answer), and the summary `batcher bench` prints."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from hdrh.histogram import HdrHistogram

from batcher.cli.bench_settings import (
    CLIENT_BUSY_LIMIT,
    PERCENTILES,
    LoadSettings,
    ShardResult,
    new_histogram,
    noise_allowance,
)
from batcher.errors import BatcherError


class BenchFailed(BatcherError, RuntimeError):
    """A run that measured nothing worth reporting (see LoadResult.failure)."""


@dataclass
class LoadResult:
    """The merged result of a run, as printed and as written by --json.

    `throughput_rps` (= `achieved_rate`) is `ok_in_window / window_s`; `latency_ms`
    covers the `ok` replies to the `sent_in_window` requests, late ones included.
    `offered_rate` is the open loop's asked rate (None in a closed loop), `sent_rate`
    what was actually sent in the window. `fell_behind` (open loop only, else None):
    the broker's backlog grew beyond noise, or it refused requests; `broker_notes` say
    how. `failure` is set when the run got no reply, or no successful one."""

    settings: dict[str, Any]
    mode: str
    sent: int
    sent_in_window: int
    ok: int
    errors: dict[str, int]
    window_s: float
    window: str  # what the window is, in words
    replies_in_window: int
    ok_in_window: int
    throughput_rps: float
    offered_rate: float | None
    sent_rate: float
    achieved_rate: float
    in_flight_at_start: int
    in_flight_at_end: int
    late: int
    lost: int
    fell_behind: bool | None
    broker_notes: list[str]
    latency_ms: dict[str, float]
    batch_sizes: dict[int, int]  # batch size -> number of batches
    mean_batch_size: float
    wall_s: float
    client: dict[str, Any]
    failure: str | None
    #: Streamed requests only (else None): chunks arriving in the window per second, the
    #: time from a request's due time to its first chunk, and between two of its chunks.
    chunks_per_s: float | None = None
    first_chunk_ms: dict[str, float] | None = None
    inter_chunk_ms: dict[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["batch_sizes"] = {str(k): v for k, v in sorted(self.batch_sizes.items())}
        return data

    def check(self) -> LoadResult:
        """This result, or BenchFailed when it measured nothing (for scripts that must not
        go on with zeros)."""
        if self.failure is not None:
            raise BenchFailed(self.failure)
        return self


def _failure(settings: LoadSettings, shards: list[ShardResult], ok: int, errors: Counter[str]) -> str | None:
    replies = sum(sh.replies for sh in shards)
    if settings.stream:  # a chunk is an answer too: a stream may outlast the run
        chunks = sum(sh.chunks for sh in shards)
        replies, ok = replies + chunks, ok + chunks
    if replies == 0:
        waited = max(
            ((sh.gave_up_s or sh.wall_s) - (sh.first_send_s or 0.0) for sh in shards),
            default=0.0,
        )
        hint = (
            " (and, with CURVE, is the server key the broker's, and this client's key allowed?)"
            if settings.curve_server_key
            else ""
        )
        return f"no reply from {settings.connect} within {waited:.1f} s: is a broker running there?{hint}"
    if sum(sh.sent_in_window for sh in shards) == 0:
        if settings.stream and settings.concurrency is not None:
            return (
                "no request was sent after the warm-up: a closed loop sends one only when one "
                "ends, and no stream ended; give shorter streams or no warm-up"
            )
        return "no request was sent after the warm-up: give more requests or a shorter warm-up"
    if ok == 0:
        if errors:
            codes = ", ".join(f"{k}: {v}" for k, v in sorted(errors.items()))
            return f"no successful reply from {settings.connect}: every reply was an error ({codes})"
        return f"no reply from {settings.connect} to the requests sent after the warm-up"
    return None


def _merged_histogram(shards: list[ShardResult], attr: str) -> HdrHistogram:
    """One histogram of the shards' encoded histograms `attr` (an empty one adds nothing)."""
    hist = new_histogram()
    for sh in shards:
        encoded = getattr(sh, attr)
        if encoded:
            hist.decode_and_add(encoded)
    return hist


def _window(settings: LoadSettings, shards: list[ShardResult]) -> tuple[float, str]:
    """The measured window: its length in seconds, and what it is in words."""
    if settings.duration_s is not None:
        return settings.duration_s, f"{settings.duration_s:g} s after {settings.warmup_s:g} s of warm-up"
    window_s = max((sh.window_s for sh in shards), default=0.0)
    start = f"the end of {settings.warmup_s:g} s of warm-up" if settings.warmup_s else "the first send"
    return window_s, f"{window_s:.2f} s from {start} to the last reply"


def _client_notes(
    settings: LoadSettings, shards: list[ShardResult], window_s: float, busy: float
) -> list[str]:
    """Why the load generator may not have offered the load asked (none: it kept up)."""
    notes = []
    if settings.rate is not None and window_s > 0:
        expected = settings.rate * window_s
        sent_in_window = sum(sh.sent_in_window for sh in shards)
        if settings.duration_s is not None and sent_in_window < expected - noise_allowance(expected):
            notes.append(
                f"sent {sent_in_window} requests in the window of the {expected:.0f} asked "
                f"({settings.rate:g}/s)"
            )
        late_sends = sum(sh.late_sends for sh in shards)
        if late_sends > 0.01 * max(sum(sh.sent for sh in shards), 1):
            notes.append(f"{late_sends} sends were more than 1 ms late")
    if busy > CLIENT_BUSY_LIMIT:
        notes.append(f"a load process used {busy:.0%} of a core: add --processes")
    return notes


def _broker_notes(
    settings: LoadSettings, shards: list[ShardResult], errors: Counter[str], failure: str | None
) -> tuple[bool | None, list[str]]:
    """Whether the broker fell behind an open loop's offered load, and how (None: a closed
    loop, or a run that failed): its backlog grew, or it refused requests, beyond noise."""
    if settings.rate is None or failure is not None:
        return None, []
    notes: list[str] = []
    in_flight_at_start = sum(sh.in_flight_at_start for sh in shards)
    growth = sum(sh.backlog_growth for sh in shards)
    allowance = noise_allowance(sum(sh.sent_in_window for sh in shards))
    if growth > allowance:
        notes.append(
            f"requests in flight grew from {in_flight_at_start} to {in_flight_at_start + growth} "
            f"while it sent (more than the {allowance:.0f} that noise explains)"
        )
    refused = sum(errors.values())
    if refused > allowance:
        codes = ", ".join(f"{k}: {v}" for k, v in sorted(errors.items()))
        notes.append(f"{refused} of the requests sent in the window got errors ({codes})")
    return bool(notes), notes


def _streamed(settings: LoadSettings, shards: list[ShardResult], window_s: float) -> dict[str, Any]:
    """A streamed run's chunks per second and chunk timings (none for other runs)."""
    if not settings.stream:
        return {}
    return {
        "chunks_per_s": sum(sh.chunks_in_window for sh in shards) / window_s if window_s > 0 else 0.0,
        "first_chunk_ms": _percentiles_ms(_merged_histogram(shards, "first_chunk_histogram")),
        "inter_chunk_ms": _percentiles_ms(_merged_histogram(shards, "inter_chunk_histogram")),
    }


def merge(settings: LoadSettings, shards: list[ShardResult]) -> LoadResult:
    """Add the shards' counts and histograms into one result, and judge it."""
    errors: Counter[str] = Counter()
    per_size: Counter[int] = Counter()
    for sh in shards:
        errors.update(sh.errors)
        per_size.update(sh.batch_sizes)
    window_s, window = _window(settings, shards)
    ok = sum(sh.ok for sh in shards)
    ok_in_window = sum(sh.ok_in_window for sh in shards)
    sent_in_window = sum(sh.sent_in_window for sh in shards)
    throughput = ok_in_window / window_s if window_s > 0 else 0.0
    batches = {k: max(1, round(v / k)) for k, v in per_size.items() if k > 0}
    n_batches = sum(batches.values())
    busy = max((sh.cpu_s / sh.wall_s for sh in shards if sh.wall_s > 0), default=0.0)
    failure = _failure(settings, shards, ok, errors)
    client_notes = _client_notes(settings, shards, window_s, busy)
    fell_behind, broker_notes = _broker_notes(settings, shards, errors, failure)
    return LoadResult(
        settings=asdict(settings),
        mode=settings.mode,
        sent=sum(sh.sent for sh in shards),
        sent_in_window=sent_in_window,
        ok=ok,
        errors=dict(errors),
        window_s=window_s,
        window=window,
        replies_in_window=sum(sh.replies_in_window for sh in shards),
        ok_in_window=ok_in_window,
        throughput_rps=throughput,
        offered_rate=settings.rate,
        sent_rate=sent_in_window / window_s if window_s > 0 else 0.0,
        achieved_rate=throughput,
        in_flight_at_start=sum(sh.in_flight_at_start for sh in shards),
        in_flight_at_end=sum(sh.in_flight_at_end for sh in shards),
        late=sum(sh.late for sh in shards),
        lost=sum(sh.lost for sh in shards),
        fell_behind=fell_behind,
        broker_notes=broker_notes,
        latency_ms=_percentiles_ms(_merged_histogram(shards, "histogram")),
        batch_sizes=dict(sorted(batches.items())),
        mean_batch_size=sum(per_size.values()) / n_batches if n_batches else 0.0,
        wall_s=max((sh.wall_s for sh in shards), default=0.0),
        client={
            "processes": settings.processes,
            "max_cpu_share": round(busy, 3),
            "max_send_lag_ms": max((sh.max_send_lag_ms for sh in shards), default=0.0),
            "kept_up": not client_notes,
            "notes": client_notes,
        },
        failure=failure,
        **_streamed(settings, shards, window_s),
    )


def _percentiles_ms(hist: HdrHistogram) -> dict[str, float]:
    """A microsecond histogram's percentiles, max and mean, in milliseconds."""
    out = {f"p{p:g}": hist.get_value_at_percentile(p) / 1000.0 for p in PERCENTILES}
    out["max"] = hist.get_max_value() / 1000.0
    out["mean"] = hist.get_mean_value() / 1000.0
    return out


def format_report(result: LoadResult) -> str:
    """The human-readable summary `batcher bench` prints."""
    s = result.settings
    mode = (
        f"closed loop, {s['concurrency']} in flight"
        if s["concurrency"] is not None
        else f"open loop, {s['rate']:g} requests/s offered (Poisson)"
    )
    lines = [
        f"load: {mode}, {s['processes']} process(es), payload {s['payload_bytes']} B, "
        f"model {s['model'] or '(default)'}",
    ]
    if result.failure is not None:
        lines.append(f"requests: {result.sent} sent, {result.ok} ok, {sum(result.errors.values())} errors")
        lines.append(f"FAILED: {result.failure}")
        return "\n".join(lines)
    lines += [
        f"window: {result.window}; {result.wall_s:.2f} s in all with the drain",
        f"requests: {result.sent} sent ({result.sent_in_window} in the window), "
        f"{result.ok} ok, {sum(result.errors.values())} errors",
        f"throughput: {result.throughput_rps:,.1f} requests/s = {result.ok_in_window} ok replies "
        f"arriving in the window / {result.window_s:.2f} s",
    ]
    if result.offered_rate is not None:
        lines.append(
            f"rate: offered {result.offered_rate:,.1f} requests/s (sent {result.sent_rate:,.1f}/s), "
            f"achieved {result.achieved_rate:,.1f} requests/s"
        )
    if s["duration_s"] is not None:
        lines.append(
            f"in flight: {result.in_flight_at_start} at the window's start, {result.in_flight_at_end} at "
            f"its end: {result.late} answered late (after the window), {result.lost} lost"
        )
    elif result.lost:
        lines.append(f"in flight: {result.lost} never answered (lost)")
    lat = result.latency_ms
    lines.append(
        f"latency ms of the {result.ok} ok replies to requests sent in the window (late ones included): "
        + "  ".join(f"{k}={v:.3f}" for k, v in lat.items() if k != "mean")
        + f"  mean={lat['mean']:.3f}"
    )
    if result.chunks_per_s is not None:
        lines.append(f"chunks: {result.chunks_per_s:,.1f} chunks/s arriving in the window")
        for label, values in (
            ("time to first chunk", result.first_chunk_ms),
            ("between chunks", result.inter_chunk_ms),
        ):
            if values:
                lines.append(
                    f"{label} ms: "
                    + "  ".join(f"{k}={v:.3f}" for k, v in values.items() if k != "mean")
                    + f"  mean={values['mean']:.3f}"
                )
    if result.batch_sizes:
        dist = ", ".join(f"{k}: {v}" for k, v in sorted(result.batch_sizes.items()))
        lines.append(f"batches by size: {dist} (mean {result.mean_batch_size:.2f})")
    if result.errors:
        lines.append("errors: " + ", ".join(f"{k}: {v}" for k, v in sorted(result.errors.items())))
    if result.fell_behind:
        lines.append(
            "WARNING, the broker fell behind the offered load: "
            + "; ".join(result.broker_notes)
            + ". Latency grows with the run's length: this is overload, not a steady state"
        )
    elif result.fell_behind is False:
        lines.append("the broker kept up with the offered load")
    client = result.client
    busiest = f"busiest process used {client['max_cpu_share']:.0%} of a core"
    if not client["kept_up"]:
        lines.append("WARNING, load generator could not keep up: " + "; ".join(client["notes"]))
    elif result.fell_behind:  # never "kept up" next to a broker that did not
        lines.append(f"load generator sent on schedule ({busiest})")
    else:
        lines.append(f"load generator kept up ({busiest})")
    return "\n".join(lines)
