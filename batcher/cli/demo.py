"""`batcher demo`: the reference scenario of the seed design, in real processes.

A broker (max batch 4, 50 ms window) with `sim` workers; 8 clients, each its own
REQ socket, send one request each, 5 ms apart. The pass criteria are the seed's:
fewer batches than requests, a mean latency far below that of the 8 requests served
one after another (`serial_ms`: 8 x t(1), from the sim's costs), and every request
answered with its batch's amortized time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import click
import zmq

from batcher.client.sync import Client
from batcher.core.scheduler import Policy
from batcher.serve.launcher import ServeProcess
from batcher.wire import protocol
from workers.models import SimSettings

REQUESTS = 8
SPACING_S = 0.005
MAX_BATCH_SIZE = 4
MAX_WAIT_MS = 50
#: The reference design's dispatch policy (`serve` defaults to adaptive).
DEMO_POLICY: str = Policy.WINDOW.value
#: sim workers, one on each of simulated GPUs 0..DEMO_WORKERS-1.
DEMO_WORKERS = 2


@dataclass
class Outcome:
    """One demo request: its reply and its end-to-end latency."""

    index: int
    reply: dict[str, Any]
    latency_ms: float


def send_scenario(frontend: str) -> list[Outcome]:
    """8 REQ clients, one request each, 5 ms apart; replies are taken as they come."""
    ctx: zmq.Context[Any] = zmq.Context.instance()
    sockets = []
    try:
        for _ in range(REQUESTS):
            s = ctx.socket(zmq.REQ)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(frontend)
            sockets.append(s)
        poller = zmq.Poller()
        for s in sockets:
            poller.register(s, zmq.POLLIN)
        sent_at: dict[int, float] = {}
        outcomes: dict[int, Outcome] = {}
        start = time.perf_counter()
        deadline = start + 10.0
        while len(outcomes) < REQUESTS and time.perf_counter() < deadline:
            now = time.perf_counter()
            i = len(sent_at)
            if i < REQUESTS and now >= start + i * SPACING_S:
                sockets[i].send(protocol.pack({"id": i, "input": f"data-{i}"}))
                sent_at[i] = time.perf_counter()
                continue
            next_send = start + i * SPACING_S if i < REQUESTS else deadline
            timeout_ms = max(0, int((next_send - now) * 1000))
            for s, _ in poller.poll(timeout_ms):
                reply = protocol.unpack(s.recv())
                j = sockets.index(s)
                outcomes[j] = Outcome(j, reply, (time.perf_counter() - sent_at[j]) * 1000)
        return [outcomes[i] for i in sorted(outcomes)]
    finally:
        for s in sockets:
            s.close(0)


def serial_ms(sim: SimSettings) -> float:
    """The yardstick: the demo's requests one after another, each alone in its batch
    (8 x t(1), where t(1) = base_ms + per_item_ms: 8 x 22.5 ms with the defaults)."""
    return REQUESTS * sim.batch_ms(1)


def check(outcomes: list[Outcome], batches: int, sim: SimSettings) -> list[tuple[str, bool]]:
    """The seed's pass criteria, each with whether it held."""
    mean = sum(o.latency_ms for o in outcomes) / len(outcomes) if outcomes else float("inf")
    answered = len(outcomes) == REQUESTS and all(o.reply.get("ok") for o in outcomes)

    def amortized_ok(o: Outcome) -> bool:
        out = o.reply.get("output") or {}
        n = out.get("batch_size", 0)
        return (
            out.get("echo") == f"data-{o.index}"
            and n >= 1
            and abs(out.get("amortized_ms", -1) - sim.batch_ms(n) / n) < 1e-9
        )

    return [
        (f"fewer batches than requests ({batches} < {REQUESTS})", 0 < batches < REQUESTS),
        (f"mean latency {mean:.1f} ms far below {serial_ms(sim):.0f} ms serial (<= 80 ms)", mean <= 80.0),
        (
            "every request answered with its batch's amortized time",
            answered and all(amortized_ok(o) for o in outcomes),
        ),
    ]


def run_demo(workers: int = DEMO_WORKERS, policy: str = DEMO_POLICY) -> bool:
    """Run the scenario against a fresh `batcher serve`; print the report; True if it passed."""
    sim = SimSettings()
    args = [
        "--policy",
        policy,
        # One sim worker on each of simulated GPUs 0..workers-1, whatever this host has.
        "--gpus",
        ",".join(str(gpu) for gpu in range(workers)),
        "--model",
        "sim",
        "--max-batch-size",
        str(MAX_BATCH_SIZE),
        "--max-wait-ms",
        str(MAX_WAIT_MS),
    ]
    with ServeProcess(args) as serve:
        click.echo(
            f"broker at {serve.frontend}, {workers} sim worker(s), "
            f"max_batch_size={MAX_BATCH_SIZE}, max_wait_ms={MAX_WAIT_MS}, policy={policy}"
        )
        serve.wait_ready(workers)
        outcomes = send_scenario(serve.frontend)
        with Client(serve.frontend, timeout_s=5.0) as client:
            batches = client.control("stats")["models"]["sim"]["batches"]
    mean = sum(o.latency_ms for o in outcomes) / len(outcomes) if outcomes else float("nan")
    click.echo(f"batches: {batches}")
    click.echo(f"mean end-to-end latency: {mean:.1f} ms")
    for o in outcomes:
        out = o.reply.get("output") or {}
        click.echo(
            f"  request {o.index}: batch_size={out.get('batch_size')} "
            f"amortized_ms={out.get('amortized_ms')} latency={o.latency_ms:.1f} ms"
            + ("" if o.reply.get("ok") else f" error={o.reply.get('error')}")
        )
    passed = True
    for text, ok in check(outcomes, batches, sim):
        click.echo(f"{'PASS' if ok else 'FAIL'}: {text}")
        passed &= ok
    click.echo("demo passed" if passed else "demo FAILED")
    return passed
