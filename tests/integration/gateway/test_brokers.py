"""One gateway over many brokers, end to end (issue 31, item 1): real `batcher serve`
brokers with sim workers on 127.0.0.1 behind one `batcher gateway` with several --connect
or --discover file:; HTTP clients in threads. Rows spread, a broker killed or paused costs
no row its request allowed to be retried, discovery adds and retires brokers."""

from __future__ import annotations

import http.client
import itertools
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zmq

from batcher.serve.launcher import ServeProcess
from tests.conftest import Spawned
from tests.helpers import model_stats, sample, scrape, wait_until
from tests.integration.gateway.test_gateway import free_port, http_status, wait_gateway

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

#: A sim model of 5 ms a batch on each of two workers: a broker serves some 400 rows/s.
SIM = ("--model", "sim", "--sim-base-ms", "5", "--sim-per-item-ms", "0.1", "--workers", "2")
#: Every request's own deadline (a paused broker's rows answer 504 by then and a second).
TIMEOUT_MS = 2000


def rows_of(frontend: str) -> int:
    """The rows the broker at `frontend` was sent (its own `stats`), 0 if it does not answer."""
    return int(model_stats(frontend, zmq.Context.instance(), "sim").get("requests", 0))


def gateway_rows(port: int, broker: str) -> int:
    return int(sample(scrape(port), "batcher_gateway_broker_rows_total", broker=broker))


@dataclass
class Answer:
    """One request's answer as its client saw it."""

    number: int
    status: int
    echo: list[float] | None
    elapsed_s: float
    error: str | None = None


@dataclass
class Load:
    """`threads` HTTP clients, each sending one request after another until `stop`."""

    port: int
    threads: int = 6
    retry: bool = True
    answers: list[Answer] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _numbers: itertools.count[int] = field(default_factory=itertools.count)
    _workers: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Load:
        for _ in range(self.threads):
            t = threading.Thread(target=self._run, daemon=True)
            t.start()
            self._workers.append(t)
        return self

    def stop(self) -> list[Answer]:
        self._stop.set()
        for t in self._workers:
            t.join(30)
        assert not any(t.is_alive() for t in self._workers), "a client still waits: a request hangs"
        assert not self.errors, self.errors[:3]
        return self.answers

    def count(self) -> int:
        return len(self.answers)

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        while not self._stop.is_set():
            n = next(self._numbers)
            body: dict[str, Any] = {
                "inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [n, -n]}],
                "outputs": [{"name": "echo"}],
                "parameters": {"timeout": TIMEOUT_MS * 1000} | ({} if self.retry else {"retry": False}),
            }
            started = time.monotonic()
            try:
                conn.request(
                    "POST", "/v2/models/sim/infer", json.dumps(body), {"Content-Type": "application/json"}
                )
                response = conn.getresponse()
                doc = json.loads(response.read())
            except Exception as exc:  # a hang (socket timeout) or a broken answer
                self.errors.append(f"request {n}: {type(exc).__name__}: {exc}")
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
                continue
            ok = response.status == 200
            echo, error = (doc["outputs"][0]["data"], None) if ok else (None, doc.get("error"))
            self.answers.append(Answer(n, response.status, echo, time.monotonic() - started, error))
        conn.close()


def check_answers(answers: list[Answer], allowed: tuple[int, ...] = (200,)) -> None:
    """Each request answered once, with its own rows (or an allowed error), in time."""
    numbers = [a.number for a in answers]
    assert len(numbers) == len(set(numbers)), "a request answered twice"
    statuses = {a.status for a in answers}
    unexpected = [(a.number, a.status, a.error) for a in answers if a.status not in allowed]
    assert statuses <= set(allowed), f"statuses {statuses}, allowed {allowed}: {unexpected[:3]}"
    for a in answers:
        if a.status == 200:
            assert a.echo == [a.number, -a.number], f"request {a.number} answered {a.echo}"
        assert a.elapsed_s < TIMEOUT_MS / 1000.0 + 2.0, f"request {a.number} took {a.elapsed_s:.2f} s"


def start_gateway(spawn: Callable[..., Spawned], *sources: str, interval_s: float = 5.0) -> int:
    """`batcher gateway SOURCES` on a free HTTP port, once ready; its port."""
    port = free_port()
    spawn(
        "gateway",
        *sources,
        "--http-port",
        str(port),
        "--request-timeout-ms",
        str(TIMEOUT_MS),
        "--discover-interval-s",
        str(interval_s),
        "--log-level",
        "INFO",
    )
    wait_gateway(port)
    wait_until(lambda: http_status(port, "/v2/health/ready") == 200, 20, "the gateway ready")
    return port


def connects(*brokers: ServeProcess) -> list[str]:
    return [arg for b in brokers for arg in ("--connect", b.frontend)]


def wait_count(load: Load, n: int) -> None:
    wait_until(lambda: load.count() >= n, 30, f"{n} answers")


def test_two_brokers_share_the_rows_and_answer_alike(
    serve: Callable[..., ServeProcess], spawn: Callable[..., Spawned]
) -> None:
    """Two equal brokers behind one gateway: each is sent at least 30% of the rows (its
    own stats say), every answer is its request's, and the gateway's metrics agree."""
    a, b = serve(*SIM, workers=2), serve(*SIM, workers=2)
    port = start_gateway(spawn, *connects(a, b))
    load = Load(port).start()
    wait_count(load, 600)
    answers = load.stop()
    check_answers(answers)
    rows_a, rows_b = rows_of(a.frontend), rows_of(b.frontend)
    assert rows_a + rows_b == len(answers)
    assert min(rows_a, rows_b) >= 0.3 * len(answers), (rows_a, rows_b)
    assert gateway_rows(port, a.frontend) == rows_a and gateway_rows(port, b.frontend) == rows_b
    samples = scrape(port)
    assert sample(samples, "batcher_gateway_broker_up", broker=a.frontend) == 1
    assert sample(samples, "batcher_gateway_broker_up", broker=b.frontend) == 1


def test_a_broker_killed_under_load_loses_no_row(
    serve: Callable[..., ServeProcess], spawn: Callable[..., Spawned]
) -> None:
    """SIGKILL to one broker's process group under load: every request is answered 200
    with its own rows (those in flight on it are retried on the other), none twice, and
    within 2 s the gateway sends it nothing more and shows it down. Batches of 50 ms keep
    rows in flight on it when it dies."""
    slow = (*SIM, "--sim-base-ms", "50")
    a, b = serve(*slow, workers=2), serve(*slow, workers=2)
    port = start_gateway(spawn, *connects(a, b))
    load = Load(port).start()
    wait_count(load, 100)
    assert b.process is not None
    os.killpg(b.process.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(
        lambda: sample(scrape(port), "batcher_gateway_broker_up", broker=b.frontend) == 0,
        2,
        "the broker down",
    )
    time.sleep(max(0.0, killed_at + 2.0 - time.monotonic()))  # the 2 s the claim is about
    routed = gateway_rows(port, b.frontend)
    before = load.count()
    wait_count(load, before + 100)
    answers = load.stop()
    check_answers(answers)
    assert gateway_rows(port, b.frontend) == routed, "rows routed to the killed broker after 2 s"
    assert sample(scrape(port), "batcher_gateway_retried_rows_total") >= 1
    assert rows_of(a.frontend) == len(answers) - routed + sample(
        scrape(port), "batcher_gateway_retried_rows_total"
    )


def test_retry_false_gets_503_from_a_lost_broker(
    serve: Callable[..., ServeProcess], spawn: Callable[..., Spawned]
) -> None:
    """With `"retry": false` a row in flight on a broker that is lost is answered 503,
    not sent again; the others are all their own rows."""
    a, b = serve(*SIM, "--sim-base-ms", "200", workers=2), serve(*SIM, "--sim-base-ms", "200", workers=2)
    port = start_gateway(spawn, *connects(a, b))
    load = Load(port, threads=8, retry=False).start()
    wait_until(lambda: gateway_rows(port, b.frontend) >= 8, 10, "rows on the broker")
    wait_count(load, 8)
    assert b.process is not None
    os.killpg(b.process.pid, signal.SIGKILL)
    wait_count(load, load.count() + 40)
    answers = load.stop()
    check_answers(answers, allowed=(200, 503))
    assert any(a.status == 503 for a in answers), "no row of the lost broker was answered 503"
    assert sample(scrape(port), "batcher_gateway_retried_rows_total") == 0


def test_a_paused_broker_costs_no_hang_and_serves_again(
    serve: Callable[..., ServeProcess], spawn: Callable[..., Spawned]
) -> None:
    """SIGSTOP one broker's group for 4 s (a partition that keeps its TCP connection),
    then SIGCONT: every request is answered (200, or 503/504 for its rows caught there)
    within its deadline and a grace; from a heartbeat on it is sent nothing; after the
    resume it is sent rows again."""
    a, b = serve(*SIM, workers=2), serve(*SIM, workers=2)
    port = start_gateway(spawn, *connects(a, b))
    load = Load(port).start()
    wait_count(load, 200)
    assert b.process is not None
    os.killpg(b.process.pid, signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        time.sleep(1.5)  # a heartbeat (0.5 s) and more: the claim is about what follows
        silent = gateway_rows(port, b.frontend)
        asked_at = time.monotonic()  # the gateway stays ready on the other, and says so at once
        assert http_status(port, "/v2/health/ready") == 200 and time.monotonic() - asked_at < 1.0
        time.sleep(max(0.0, stopped_at + 4.0 - time.monotonic()))  # the pause itself
        assert gateway_rows(port, b.frontend) == silent, "rows routed to the paused broker"
    finally:
        os.killpg(b.process.pid, signal.SIGCONT)
    wait_until(lambda: gateway_rows(port, b.frontend) > silent + 20, 10, "rows on the resumed broker")
    answers = load.stop()
    check_answers(answers, allowed=(200, 503, 504))
    assert sum(a.status == 200 for a in answers) > 0.9 * len(answers)


def test_file_discovery_adds_and_retires_brokers(
    serve: Callable[..., ServeProcess], spawn: Callable[..., Spawned], tmp_path: Path
) -> None:
    """--discover file: a broker added to the file is sent rows within an interval (and
    the heartbeat that finds it ready); one removed is sent none after an interval."""
    a, b, c = (serve(*SIM, workers=2) for _ in range(3))
    listing = tmp_path / "brokers.txt"

    def publish(text: str) -> None:
        """As a sidecar or a ConfigMap volume does it: a whole new file, renamed in."""
        staged = tmp_path / "brokers.txt.new"
        staged.write_text(text)
        os.replace(staged, listing)

    publish(f"{a.frontend}\n{b.frontend}\n")
    port = start_gateway(spawn, "--discover", f"file:{listing}", interval_s=1.0)
    load = Load(port).start()
    wait_count(load, 100)
    assert rows_of(c.frontend) == 0
    publish(f"# three now\n{a.frontend}\n{b.frontend}\n{c.frontend}\n")
    added_at = time.monotonic()
    wait_until(lambda: rows_of(c.frontend) > 0, 3, "rows on the added broker")
    assert time.monotonic() - added_at < 1.0 + 0.5 + 0.5  # an interval, a heartbeat, a scrape
    publish(f"{b.frontend}\n{c.frontend}\n")
    # Retired: the gateway sends it no new row, and drops it once its rows are answered.
    wait_until(
        lambda: ("batcher_gateway_broker_up", (("broker", a.frontend),)) not in scrape(port),
        5,
        "the removed broker dropped by the gateway",
    )
    served = rows_of(a.frontend)
    wait_count(load, load.count() + 200)
    answers = load.stop()
    check_answers(answers)
    assert rows_of(a.frontend) == served, "rows sent to a broker no longer discovered"
    assert rows_of(a.frontend) + rows_of(b.frontend) + rows_of(c.frontend) == len(answers)


def test_dns_discovery_finds_a_broker_by_name(
    serve: Callable[..., ServeProcess], spawn: Callable[..., Spawned]
) -> None:
    """--discover dns+tcp://localhost:PORT: the name's records (127.0.0.1, and ::1 where
    the hosts file has it, where nothing listens) give the gateway its broker."""
    a = serve(*SIM, workers=2)
    port_of_a = a.frontend.rsplit(":", 1)[1]
    port = start_gateway(spawn, "--discover", f"dns+tcp://localhost:{port_of_a}", interval_s=1.0)
    load = Load(port, threads=2).start()
    wait_count(load, 50)
    answers = load.stop()
    check_answers(answers)
    assert rows_of(a.frontend) == len(answers)
    assert sample(scrape(port), "batcher_gateway_broker_up", broker=a.frontend) == 1
