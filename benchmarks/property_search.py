"""Keep the property tests searching outside CI: many seeds, many more examples.

CI runs the Hypothesis tests derandomized (the "ci" profile in tests/conftest.py), so it
never goes red on a fresh draw, and never finds anything new either. This script is the
search: it runs the scheduler's and the protocol's property tests once per seed with the
"search" profile (1,500 examples a test) and lists the seeds that fail, each with the
command that replays it. Run it before resolving any issue that touches the scheduler:

    python benchmarks/property_search.py --seeds 100-129

Exits 1 if any seed fails.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = [
    "tests/unit/core/test_scheduler_policy.py",
    "tests/unit/core/test_scheduler.py",
    "tests/unit/core/test_queue.py",
    "tests/unit/core/test_policy.py",
    "tests/unit/wire/test_protocol.py",
]


def seed_range(text: str) -> range:
    first, _, last = text.partition("-")
    return range(int(first), int(last or first) + 1)


def run_seed(seed: int, tests: list[str], timeout_s: float) -> tuple[bool, str]:
    """One pytest run of the property tests (those using @given) with this seed."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not integration"]
    cmd += ["--hypothesis-profile=search", f"--hypothesis-seed={seed}", *tests]
    env = {k: v for k, v in os.environ.items() if k != "CI"}  # CI would force the derandomized profile
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout_s:.0f}s"
    tail = done.stdout.strip().splitlines()[-1:] or ["(no output)"]
    return done.returncode == 0, tail[0]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", default="100-129", help="a seed or a range FIRST-LAST")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="limit for one seed's run")
    parser.add_argument("tests", nargs="*", default=TESTS, help="test files (default: the core's)")
    args = parser.parse_args()
    failed: list[int] = []
    for seed in seed_range(args.seeds):
        t0 = time.monotonic()
        ok, summary = run_seed(seed, args.tests, args.timeout_s)
        print(
            f"seed {seed}: {'ok' if ok else 'FAILED'} in {time.monotonic() - t0:.0f}s  {summary}", flush=True
        )
        if not ok:
            failed.append(seed)
    print(f"{len(failed)} of {len(seed_range(args.seeds))} seeds failed")
    for seed in failed:
        print(f"  replay: pytest --hypothesis-profile=search --hypothesis-seed={seed} {' '.join(args.tests)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
