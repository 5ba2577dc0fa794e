"""The cost of the version lookup on the request path (issue 33, items 1-2): a request
naming a repository model's version, the same model with none (the broker picks its
newest), and a plain model (`--model`, no repository), all the same Python model file,
one worker each, in one `serve`. The version named is 1 and the newest 2, so each kind
has a worker of its own, each busy one request in three (were two kinds on one worker,
the second would find it warmer than the plain model's).

One client, one request at a time: rounds of N round trips of each kind, alternating
request by request (named, none, plain, named, ...), the p50 of each kind a round; the
medians over rounds of each repository kind's p50 less the plain model's of the round.

    python benchmarks/versions.py
    python benchmarks/versions.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from common import md_table, write_results

from batcher.client import Client
from batcher.serve.launcher import ServeProcess

MODEL = '''
def model(inputs):
    """Each input back: the model costs next to nothing, the path is what is timed."""
    return list(inputs)
'''

KINDS: dict[str, dict[str, Any]] = {
    "version named": {"model": "rep", "version": 1},
    "no version": {"model": "rep"},
    "plain model": {"model": "plain"},
}


def alternating(client: Client, n: int) -> dict[str, list[float]]:
    """n sequential round trips (ms) of each kind, alternating request by request (named,
    none, plain, named, ...): each kind sees the same machine at the same moments."""
    out: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(n):
        for kind, fields in KINDS.items():
            t0 = time.perf_counter()
            reply = client.request_reply(b"x", **fields)
            out[kind].append((time.perf_counter() - t0) * 1000.0)
            assert reply["ok"], reply
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rounds, n = (3, 300) if args.quick else (7, 2000)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "models"
        for v in (1, 2):
            (root / "rep" / str(v)).mkdir(parents=True)
            (root / "rep" / str(v) / "model.py").write_text(MODEL)
        (root / "rep" / "config.toml").write_text('kind = "python"\nversion_policy = "all"\nworkers = 1\n')
        plain = f"plain=pyfile:{root / 'rep' / '1' / 'model.py'}:model"
        serve_args = ["--model-repository", str(root), "--model", plain, "--workers", "1"]
        p50s: dict[str, list[float]] = {k: [] for k in KINDS}
        with ServeProcess(serve_args) as serve:
            serve.wait_ready(3)
            with Client(serve.frontend, timeout_s=30) as client:
                assert client.request_reply(b"x", **KINDS["version named"])["version"] == "1"
                assert client.request_reply(b"x", **KINDS["no version"])["version"] == "2"
                alternating(client, 200)  # warm each path
                for r in range(rounds):
                    for kind, times in alternating(client, n).items():
                        p50s[kind].append(statistics.median(times))
                    line = ", ".join(f"{k} {p50s[k][r]:.4f}" for k in KINDS)
                    print(f"round {r + 1}: p50 ms {line}")
    plain_p50 = p50s["plain model"]
    diffs = {
        k: [a - b for a, b in zip(p50s[k], plain_p50, strict=True)] for k in ("version named", "no version")
    }
    rows = [
        [
            f"{kind} p50 - plain model p50, one at a time, {rounds} rounds of {n} of each, alternating",
            f"median {statistics.median(d):+.4f} ms (rounds {', '.join(f'{x:+.3f}' for x in d)})",
            f"{statistics.median(p50s[kind]):.4f} / {statistics.median(plain_p50):.4f} ms",
        ]
        for kind, d in diffs.items()
    ]
    table = md_table(["measure", "difference", "p50 (median of rounds): this / plain"], rows)
    print(table)
    data = {"p50_ms": p50s, "minus_plain_ms": diffs}
    body = (
        "`serve --model-repository DIR --model plain=pyfile:DIR/rep/1/model.py:model --workers 1`: "
        '`rep` versions 1 and 2 (`version_policy = "all"`) and `plain`, the same Python '
        "model file, one worker each.\n\n" + table
    )
    write_results("versions", "Version lookup", body, data, args.quick)


if __name__ == "__main__":
    main()
