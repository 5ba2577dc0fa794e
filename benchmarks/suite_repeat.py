"""Run the whole test suite many times in a row and count the runs that fail.

A flaky test is a bug: this is how one is found before CI finds it. Each run is the
README's test command minus the install (`pytest` with CI set, so Hypothesis is
derandomized as in CI), in a fresh process; a failing run's failed tests are kept, and
the next run starts anyway. The report lists every run and, per failing test, how
often it failed:

    python benchmarks/suite_repeat.py --runs 20

Writes benchmarks/results/suite_repeat.json (and each failing run's whole output to
benchmarks/results/suite_repeat_failures/) and exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAILURES_DIR = ROOT / "benchmarks" / "results" / "suite_repeat_failures"
FAILED_LINE = re.compile(r"^(?:FAILED|ERROR) (\S+)(?: - (.*))?$", re.MULTILINE)


def run_once(extra: list[str], timeout_s: float) -> dict[str, object]:
    """One whole-suite run: its outcome, duration, summary line and failed test ids."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *extra]
    env = {**os.environ, "CI": "true"}
    started = time.monotonic()
    try:
        done = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, start_new_session=True
        )
    except subprocess.TimeoutExpired:
        return {
            "ok": False,
            "seconds": timeout_s,
            "summary": f"timed out after {timeout_s:.0f}s",
            "failed": [],
        }
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0:  # the whole output of a failing run, for its cause
        FAILURES_DIR.mkdir(parents=True, exist_ok=True)
        (FAILURES_DIR / time.strftime("run-%Y%m%d-%H%M%S.txt")).write_text(done.stdout + done.stderr)
    return {
        "ok": done.returncode == 0,
        "seconds": round(time.monotonic() - started, 1),
        "summary": lines[-1] if lines else done.stderr[-500:],
        "failed": [test for test, _ in FAILED_LINE.findall(done.stdout)],
        "why": {test: why[:300] for test, why in FAILED_LINE.findall(done.stdout)},
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=20, help="how many runs in a row (default 20)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="limit of one run (default 1800)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "suite_repeat.json")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --), e.g. a test file")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    runs = []
    for i in range(1, args.runs + 1):
        result = run_once(args.pytest_args, args.timeout_s)
        runs.append(result)
        mark = "ok  " if result["ok"] else "FAIL"
        print(f"run {i:>3}/{args.runs} {mark} {result['seconds']:>7.1f}s  {result['summary']}", flush=True)
        for test in result["failed"]:  # type: ignore[attr-defined]
            print(f"          failed: {test}: {result['why'][test]}", flush=True)  # type: ignore[index]
    failures = Counter(t for r in runs for t in r["failed"])  # type: ignore[attr-defined]
    report = {
        "runs": len(runs),
        "failed_runs": sum(not r["ok"] for r in runs),
        "failed_tests": dict(failures.most_common()),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "each": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{report['failed_runs']} of {len(runs)} runs failed; report in {args.out}")
    return 1 if report["failed_runs"] else 0


if __name__ == "__main__":
    sys.exit(main())
