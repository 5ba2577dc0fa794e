"""`batcher demo`: the reference scenario (its body is `batcher.cli.demo`)."""

from __future__ import annotations

import sys

import click

from batcher.cli.demo import DEMO_POLICY, DEMO_WORKERS, run_demo
from batcher.cli.options import MAX_WORKERS, LogOptions, int_range, logging_options, option, setup
from batcher.core.scheduler import POLICIES


@click.command()
@option("--workers", type=int_range(1, MAX_WORKERS), default=DEMO_WORKERS, help="sim workers to start.")
@option(
    "--policy",
    type=click.Choice(POLICIES),
    default=DEMO_POLICY,
    help=f"Dispatch policy; the reference design's is {DEMO_POLICY}.",
)
@logging_options
def demo(workers: int, policy: str, logs: LogOptions) -> None:
    """The reference scenario: 8 clients, 5 ms apart, max batch 4, 50 ms window.

    Starts a real broker and workers on free loopback ports, prints each result and
    checks the reference pass criteria; exits 1 if one fails.
    """
    setup(logs)
    sys.exit(0 if run_demo(workers, policy) else 1)
