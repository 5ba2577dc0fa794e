"""The broker's CPU per small request, broken down by function.

`batcher serve --model echo --workers 1 --max-batch-size 32 --max-wait-ms 0` (the
overhead benchmark's batching row) is loaded by a closed loop of 64 in flight (16-byte
bodies). Inside a steady window of the load (the broker's `ok` count already rising),
psutil reads the CPU time of the broker process (`serve` itself), of its main thread
(the event loop; the rest is libzmq's I/O thread) and of the worker, and the broker's
`stats` how many requests were answered in the window: CPU per request, for --rounds
rounds. Then one more window is sampled with py-spy (`py-spy record --format raw
--nonblocking`, idle samples left out), and each function's share of the samples of
the main thread, its self time (the innermost Python frame: a call into libzmq counts
for the function that made it), is turned into microseconds of CPU per request with
the rounds' median main-thread CPU per request.

With --baseline DIR (a source tree, e.g. `git archive main | tar -x -C /tmp/base`),
the same is measured for a `serve` run from DIR, the two loaded alternately (A B A
B ...): a same-run before/after.

    python benchmarks/broker_cpu.py
    python benchmarks/broker_cpu.py --quick
    python benchmarks/broker_cpu.py --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from common import closed_loop, handle_sigterm, md_table, running_serve, serve_args, write_results

from batcher.client.sync import Client
from batcher.serve.launcher import ServeProcess

SERVE = serve_args(workers=1, model="echo", max_batch_size=32, max_wait_ms=0.0)
#: How long the load runs past the measured window's end (it must cover the window).
LOAD_MARGIN_S = 2.0


@dataclass
class Sample:
    """CPU seconds so far and requests answered so far, at one moment."""

    broker_s: float
    main_s: float
    worker_s: float
    answered: int
    batches: int
    at: float


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def sample(serve: ServeProcess, client: Client) -> Sample:
    assert serve.process is not None
    broker = psutil.Process(serve.process.pid)
    main = next(t for t in broker.threads() if t.id == broker.pid)
    worker = sum(cpu_s(c) for c in broker.children(recursive=True))
    stats = client.control("stats")
    answered = sum(sum(m["outcomes"].values()) for m in stats["models"].values())
    batches = sum(m["batches"] for m in stats["models"].values())
    return Sample(
        cpu_s(broker), main.user_time + main.system_time, worker, answered, batches, time.monotonic()
    )


def measured_window(
    serve: ServeProcess, window_s: float, concurrency: int, during: Any = None
) -> dict[str, float]:
    """Load `serve` and measure one steady window of `window_s`; `during(window_s)`, if
    given, runs (in this thread) over the window instead of a plain wait."""
    errors: list[BaseException] = []

    def load() -> None:
        try:
            closed_loop(serve.frontend, concurrency, window_s + LOAD_MARGIN_S, 0.2)
        except BaseException as exc:  # reported below
            errors.append(exc)

    loader = threading.Thread(target=load, daemon=True)
    with Client(serve.frontend, timeout_s=5.0) as client:
        base = sample(serve, client).answered
        loader.start()
        deadline = time.monotonic() + 30.0
        while sample(serve, client).answered < base + 1000:  # the load is up (a condition)
            if errors or time.monotonic() > deadline:
                raise RuntimeError(f"the load did not start: {errors}")
            time.sleep(0.05)
        start = sample(serve, client)
        if during is not None:
            during(window_s)
        else:
            time.sleep(window_s)
        end = sample(serve, client)
    loader.join()
    if errors:
        raise errors[0]
    n = end.answered - start.answered
    elapsed = end.at - start.at
    return {
        "requests": n,
        "rps": n / elapsed,
        "mean_batch": n / max(1, end.batches - start.batches),
        "broker_us": (end.broker_s - start.broker_s) / n * 1e6,
        "main_us": (end.main_s - start.main_s) / n * 1e6,
        "worker_us": (end.worker_s - start.worker_s) / n * 1e6,
    }


_LINE = re.compile(r"^(.*) (\d+)$")
_FRAME = re.compile(r"^(.*) \((.*?)(?::\d+)?\)$")


def self_time(raw: str, pid: int, root: Path) -> Counter[str]:
    """Samples per innermost frame (`function (file)`) of the main thread, from py-spy's
    raw output (`--threads`: each stack begins with its thread)."""
    out: Counter[str] = Counter()
    for line in raw.splitlines():
        m = _LINE.match(line)
        if m is None:
            continue
        frames = m.group(1).split(";")
        if not frames or (f"({pid:#x})" not in frames[0] and f"{pid}" not in frames[0]):
            continue
        leaf = frames[-1]
        f = _FRAME.match(leaf)
        if f is not None:
            path = f.group(2)
            with contextlib.suppress(ValueError):
                path = str(Path(path).relative_to(root))
            path = re.sub(r".*/site-packages/", "", path)
            leaf = f"{f.group(1)} ({path})"
        out[leaf] += int(m.group(2))
    return out


def profile(
    serve: ServeProcess, window_s: float, concurrency: int, rate: int
) -> tuple[Counter[str], dict[str, float]]:
    """One window sampled by py-spy: samples per function (self time), and the window's CPU."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    assert serve.process is not None
    pid = serve.process.pid
    source = getattr(serve, "source", None) or Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "raw.txt"
        holder: dict[str, Any] = {}

        def during(seconds: float) -> None:
            cmd = [py_spy, "record", "--format", "raw", "--nonblocking", "--threads",
                   "--rate", str(rate), "--duration", str(max(1, round(seconds))),
                   "--pid", str(pid), "--output", str(out)]  # fmt: skip
            holder["rc"] = subprocess.run(
                cmd, capture_output=True, text=True, timeout=seconds + 30, check=False
            )

        cpu = measured_window(serve, window_s, concurrency, during)
        done = holder["rc"]
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"py-spy failed ({done.returncode}): {done.stderr.strip()[-500:]}")
        return self_time(out.read_text(), pid, source.resolve()), cpu


def main(argv: list[str] | None = None) -> None:
    handle_sigterm()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 short rounds, a short profile")
    p.add_argument("--rounds", "--runs", type=int, default=None, help="CPU rounds per server (5; quick 2)")
    p.add_argument("--window", type=float, default=None, help="measured seconds per round (3; quick 1.5)")
    p.add_argument("--profile-s", type=float, default=None, help="py-spy's window (5; quick 2; 0: none)")
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--top", type=int, default=25, help="functions listed")
    p.add_argument("--baseline", type=Path, default=None, help="a source tree to compare with (A/B)")
    args = p.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 5)
    window = args.window or (1.5 if args.quick else 3.0)
    profile_s = args.profile_s if args.profile_s is not None else (2.0 if args.quick else 5.0)
    sources: dict[str, Path | None] = {"this tree": None}
    if args.baseline is not None:
        sources = {"baseline": args.baseline.resolve(), "this tree": None}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in sources}
    profiles: dict[str, tuple[Counter[str], dict[str, float]]] = {}
    with contextlib.ExitStack() as stack:
        serves = {
            name: stack.enter_context(running_serve(SERVE, 1, source=src)) for name, src in sources.items()
        }
        for i in range(rounds):
            for name, serve in serves.items():
                r = measured_window(serve, window, args.concurrency)
                results[name].append(r)
                print(
                    f"round {i + 1}/{rounds} {name}: {r['rps']:,.0f} req/s, batches of "
                    f"{r['mean_batch']:.1f}, broker {r['broker_us']:.2f} us/req "
                    f"(main thread {r['main_us']:.2f}), worker {r['worker_us']:.2f}",
                    flush=True,
                )
        if profile_s > 0:
            for name, serve in serves.items():
                profiles[name] = profile(serve, profile_s, args.concurrency, args.rate)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    def spread(name: str, key: str) -> str:
        values = [r[key] for r in results[name]]
        return f"{min(values):.2f}-{max(values):.2f}"

    cpu_rows = [
        [name, med(name, "rps"), med(name, "mean_batch"),
         f"{med(name, 'broker_us'):.2f} ({spread(name, 'broker_us')})",
         f"{med(name, 'main_us'):.2f} ({spread(name, 'main_us')})",
         f"{med(name, 'worker_us'):.2f} ({spread(name, 'worker_us')})"]
        for name in sources
    ]  # fmt: skip
    body = (
        f"`batcher serve {' '.join(SERVE)}`, a closed loop of {args.concurrency} in flight (16-byte "
        f"bodies); {rounds} round(s) of {window:g} s per server inside a steady load"
        + (", the servers alternating" if len(sources) > 1 else "")
        + ". CPU per request: psutil's CPU time of the broker process, of its main thread (the event "
        "loop) and of the worker, over the requests the broker answered in the window; median "
        "(min-max).\n\n"
        + md_table(
            ["server", "req/s", "mean batch", "broker us/req", "main thread us/req", "worker us/req"],
            cpu_rows,
        )
        + "\n"
    )
    for name, (counts, cpu) in profiles.items():
        total = sum(counts.values())
        per_req = med(name, "main_us")
        rows = [
            [fn, n, f"{100.0 * n / total:.1f}%", per_req * n / total]
            for fn, n in counts.most_common(args.top)
        ]
        rest = total - sum(n for _, n in counts.most_common(args.top))
        if rest:
            rows.append(["(the rest)", rest, f"{100.0 * rest / total:.1f}%", per_req * rest / total])
        body += (
            f"\n### {name}: the main thread's CPU per request by function (self time)\n\n"
            f"py-spy over {profile_s:g} s at {args.rate} samples/s ({total} busy samples; in that window "
            f"{cpu['rps']:,.0f} req/s, main thread {cpu['main_us']:.2f} us/req with py-spy running); "
            f"us/req = the function's share x the rounds' median main-thread CPU ({per_req:.2f} us).\n\n"
            + md_table(["function (self)", "samples", "share", "us/req"], rows)
            + "\n"
        )
    print(body)
    write_results(
        "broker_cpu",
        "The broker's CPU per small request, by function",
        body,
        {
            "settings": {**vars(args), "baseline": str(args.baseline), "rounds": rounds, "window": window},
            "rounds": results,
            "profiles": {k: {"samples": dict(c), "window": w} for k, (c, w) in profiles.items()},
        },
        args.quick,
    )


if __name__ == "__main__":
    main()
