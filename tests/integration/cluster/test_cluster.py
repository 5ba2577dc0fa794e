"""The deployment on a simulated cluster (issue 31, item 5): network namespaces as nodes
(tests/netns.py), each cell started with the exact command line of its Deployment
(deploy/kubernetes/cell.yaml, the pod's mount paths under the test's directory), ready by
its own readiness probe's command, and the gateway with its Deployment's command line,
its DNS discovery of the headless Service replaced by a discovery file (the simulated
cluster has no DNS), or, before the gateway over many brokers, by --connect.

The tests of many cells need that gateway (issue 31 item 1) and are skipped until the
gateway's CLI has --discover."""

from __future__ import annotations

import http.client
import itertools
import json
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy_manifests import (
    API_KEY,
    GATEWAY_OVER_MANY,
    cell_argv,
    cell_ready_argv,
    discover_interval_s,
    frontend_port,
    gateway_argv,
    gateway_has_discover,
    http_port,
    pod_files,
)
from tests.helpers import broker_stats, wait_until
from tests.netns import Cluster, Node, unavailable

REASON = unavailable()
pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(180),
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
]
needs_many_brokers = pytest.mark.skipif(not gateway_has_discover(), reason=f"needs {GATEWAY_OVER_MANY}")

#: Every request's own deadline (rows caught on a partitioned cell answer 504 by then).
TIMEOUT_MS = 3000


@dataclass
class Deployment:
    """The pods the test runs on its cluster, and the files they mount."""

    cluster: Cluster
    etc: Path
    root: Path
    cells: dict[str, tuple[Node, subprocess.Popen[bytes]]] = field(default_factory=dict)
    gateway: Node | None = None
    listing: Path | None = None

    def start_cell(self, label: str) -> Node:
        """A node running the cell's Deployment's command, once its readiness probe passes."""
        node = self.cluster.add_node(label)
        proc = self.cluster.run(node, cell_argv(self.root), "serve")
        self.cells[label] = (node, proc)
        probe = cell_ready_argv(self.root)

        def ready() -> bool:
            assert proc.poll() is None, f"cell {label} exited {proc.returncode}:\n{self.cluster.describe()}"
            return self.cluster.run_to_end(node, probe, timeout_s=30).returncode == 0

        wait_until(ready, 90, f"cell {label} ready (its readiness probe)", interval_s=0.2)
        return node

    def address(self, label: str) -> str:
        return self.cells[label][0].tcp(frontend_port())

    def discover(self, *labels: str) -> None:
        """Write the discovery file (what a headless Service's records would say)."""
        assert self.listing is not None
        self.listing.write_text("".join(f"{self.address(label)}\n" for label in labels))

    def start_gateway(self, *labels: str) -> Node:
        """The gateway's node, its command line over the cells `labels`, once ready."""
        node = self.cluster.add_node("gw")
        if gateway_has_discover():
            self.listing = self.root / "brokers.txt"
            self.discover(*labels)
            argv = gateway_argv(self.root, discover_file=self.listing)
        else:
            (label,) = labels
            argv = gateway_argv(self.root, connect=self.address(label))
        argv += ["--request-timeout-ms", str(TIMEOUT_MS)]
        self.cluster.run(node, argv, "gateway")
        self.gateway = node
        wait_until(lambda: http_get(node, "/v2/health/ready") == 200, 60, "the gateway ready", interval_s=0.1)
        return node

    def cell_stats(self, label: str) -> dict[str, Any]:
        """The cell's `stats`, asked from the test's host with the cell's own key pair."""
        keys = self.etc / "keys"
        with zmq.Context() as ctx:
            return broker_stats(
                self.address(label),
                ctx,
                timeout_s=2.0,
                curve_server_key=str(keys / "broker.key"),
                curve_secret_key=str(keys / "broker.key_secret"),
            )

    def rows_of(self, label: str) -> int:
        stats = self.cell_stats(label)
        return int(stats["models"]["sim"]["requests"]) if stats else -1


def http_get(node: Node, path: str) -> int:
    """The status of GET `path` on the gateway (0 when it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://{node.address}:{http_port()}{path}", timeout=2) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def gateway_metrics(node: Node) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    request = urllib.request.Request(
        f"http://{node.address}:{http_port()}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    with urllib.request.urlopen(request, timeout=5) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def routed_to(node: Node, broker: str) -> float:
    """The rows the gateway sent to `broker` (its metrics)."""
    samples = gateway_metrics(node)
    return samples.get(("batcher_gateway_broker_rows_total", (("broker", broker),)), 0.0)


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    """A cluster with the pods' files; every node, process and link removed at the end."""
    logs = tmp_path / "logs"
    logs.mkdir()
    etc = pod_files(tmp_path)
    with Cluster(logs) as cluster:
        d = Deployment(cluster, etc, tmp_path)
        try:
            yield d
        finally:
            print(cluster.describe())  # shown when the test failed


@dataclass
class Answer:
    """One request as its client saw it."""

    number: int
    status: int
    echo: list[float] | None
    sent_at: float
    elapsed_s: float
    error: str | None


@dataclass
class Load:
    """`threads` HTTP clients on the test's host, each sending one request of one row after
    another to the gateway until stopped."""

    gateway: Node
    threads: int = 8
    answers: list[Answer] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _numbers: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _workers: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Load:
        for _ in range(self.threads):
            t = threading.Thread(target=self._run, daemon=True)
            t.start()
            self._workers.append(t)
        return self

    def count(self) -> int:
        return len(self.answers)

    def wait(self, n: int, timeout_s: float = 60) -> None:
        wait_until(lambda: self.count() >= n, timeout_s, f"{n} answers")

    def stop(self) -> list[Answer]:
        self._stop.set()
        for t in self._workers:
            t.join(30)
        assert not any(t.is_alive() for t in self._workers), "a client still waits: a request hangs"
        assert not self.errors, self.errors[:3]
        return self.answers

    def _connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.gateway.address, http_port(), timeout=TIMEOUT_MS / 1000 + 5)

    def _run(self) -> None:
        conn = self._connection()
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
        while not self._stop.is_set():
            n = next(self._numbers)
            body = {
                "inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [n]}],
                "parameters": {"timeout": TIMEOUT_MS * 1000},
            }
            sent = time.monotonic()
            try:
                conn.request("POST", "/v2/models/sim/infer", json.dumps(body), headers)
                response = conn.getresponse()
                doc = json.loads(response.read())
            except Exception as exc:  # a hang (socket timeout) or a broken answer
                self.errors.append(f"request {n}: {type(exc).__name__}: {exc}")
                conn.close()
                conn = self._connection()
                continue
            echo = None
            if response.status == 200:
                echo = next(o["data"] for o in doc["outputs"] if o["name"] == "echo")
            error = None if response.status == 200 else str(doc.get("error"))
            self.answers.append(Answer(n, response.status, echo, sent, time.monotonic() - sent, error))
        conn.close()


def check_answers(answers: list[Answer], allowed: tuple[int, ...] = (200,)) -> None:
    """Each request answered once, with its own row (or an allowed error), in time."""
    numbers = [a.number for a in answers]
    assert len(numbers) == len(set(numbers)), "a request answered twice"
    statuses = {a.status for a in answers}
    assert statuses <= set(allowed), f"statuses {statuses}, allowed {allowed}: " + str(
        [a.error for a in answers if a.status not in allowed][:3]
    )
    for a in answers:
        if a.status == 200:
            assert a.echo == [a.number], f"request {a.number} answered {a.echo}"
        assert a.elapsed_s < TIMEOUT_MS / 1000 + 2.0, f"request {a.number} took {a.elapsed_s:.2f} s"


# --- one cell: runs with today's gateway -----------------------------------------------------


def test_one_cell_and_a_gateway_serve_on_separate_nodes(deployment: Deployment) -> None:
    """A cell on one node and the gateway on another, each by its manifest's command:
    the gateway is ready by its probe, rows come back as sent, and the nodes have no route
    out of the test's namespaces."""
    cell = deployment.start_cell("cell1")
    gateway = deployment.start_gateway("cell1")
    assert http_get(gateway, "/v2/health/live") == 200
    load = Load(gateway).start()
    load.wait(200)
    answers = load.stop()
    check_answers(answers)
    assert deployment.rows_of("cell1") == len(answers)
    # no default route on a node, and an address off the cluster's /24 is unreachable
    for node in (cell, gateway):
        assert "default" not in deployment.cluster.exec_(node, ["ip", "route"]).stdout
        probe = "import socket; socket.create_connection(('192.0.2.1', 80), timeout=2)"
        out = deployment.cluster.exec_(node, ["python3", "-c", probe])
        assert out.returncode != 0 and "unreachable" in out.stderr.lower(), out.stderr


def test_a_cell_drained_with_sigterm_answers_what_it_holds(deployment: Deployment) -> None:
    """SIGTERM to the cell's serve (what Kubernetes sends at scale-in or a node drain)
    under load: every request is answered, the rows it held with their outputs (some
    after the signal), the rest refused 503 while it drains and after it left; none hangs,
    and serve exits 0 within the pod's termination grace."""
    deployment.start_cell("cell1")
    gateway = deployment.start_gateway("cell1")
    _, proc = deployment.cells["cell1"]
    load = Load(gateway).start()
    load.wait(100)
    wait_until(
        lambda: deployment.cell_stats("cell1")["models"]["sim"]["batches_in_flight"] > 0,
        10,
        "batches in flight on the cell",
    )
    proc.send_signal(signal.SIGTERM)
    signalled_at = time.monotonic()
    assert proc.wait(30) == 0
    left_at = time.monotonic()
    wait_until(lambda: any(a.sent_at > left_at for a in load.answers), 10, "answers after the cell left")
    answers = load.stop()
    check_answers(answers, allowed=(200, 503))
    held = [a for a in answers if a.status == 200 and a.sent_at < signalled_at < a.sent_at + a.elapsed_s]
    assert held, "no row in flight at the signal was answered with its output"
    assert all(a.status == 503 for a in answers if a.sent_at > left_at)
    assert left_at - signalled_at < 30  # the pod's terminationGracePeriodSeconds


# --- many cells: the gateway over many brokers -------------------------------------------------


@needs_many_brokers
def test_two_cells_share_the_load_and_answer_as_one(deployment: Deployment) -> None:
    for label in ("cell1", "cell2"):
        deployment.start_cell(label)
    gateway = deployment.start_gateway("cell1", "cell2")
    load = Load(gateway).start()
    load.wait(600)
    answers = load.stop()
    check_answers(answers)  # the rows a single cell gives: each request its own row back
    rows = [deployment.rows_of(label) for label in ("cell1", "cell2")]
    assert sum(rows) == len(answers)
    assert min(rows) >= 0.3 * len(answers), rows


@needs_many_brokers
def test_a_cell_node_lost_under_load_loses_no_row(deployment: Deployment) -> None:
    """Every process of one cell's node SIGKILLed under load: 0 rows lost (those in flight
    there are retried on the other cell), none answered twice, and within 2 s the gateway
    routes nothing more to it."""
    for label in ("cell1", "cell2"):
        deployment.start_cell(label)
    gateway = deployment.start_gateway("cell1", "cell2")
    lost = deployment.address("cell2")
    load = Load(gateway).start()
    load.wait(200)
    deployment.cluster.kill_node(deployment.cells["cell2"][0])
    killed_at = time.monotonic()
    time.sleep(max(0.0, killed_at + 2.0 - time.monotonic()))  # the 2 s the claim is about
    routed = routed_to(gateway, lost)
    load.wait(load.count() + 200)
    answers = load.stop()
    check_answers(answers)
    assert routed_to(gateway, lost) == routed, "rows routed to the lost cell after 2 s"


@needs_many_brokers
def test_a_partitioned_cell_costs_no_hang_and_serves_after_the_heal(deployment: Deployment) -> None:
    """One cell's link down for 5 s under load, then up: its rows are retried on the other
    cell or answered 503/504 within their deadline, none hangs; after the heal it is sent
    rows again."""
    for label in ("cell1", "cell2"):
        deployment.start_cell(label)
    gateway = deployment.start_gateway("cell1", "cell2")
    cut = deployment.address("cell2")
    node = deployment.cells["cell2"][0]
    load = Load(gateway).start()
    load.wait(200)
    deployment.cluster.link(node, up=False)
    try:
        cut_at = time.monotonic()
        load.wait(load.count() + 100, timeout_s=10)  # the gateway serves on meanwhile
        time.sleep(max(0.0, cut_at + 5.0 - time.monotonic()))  # the partition lasts 5 s
    finally:
        deployment.cluster.link(node, up=True)
    healed = routed_to(gateway, cut)
    wait_until(lambda: routed_to(gateway, cut) > healed + 20, 20, "rows on the healed cell")
    answers = load.stop()
    check_answers(answers, allowed=(200, 503, 504))
    assert sum(a.status == 200 for a in answers) > 0.9 * len(answers)


@needs_many_brokers
def test_scale_out_and_in_through_discovery(deployment: Deployment) -> None:
    """A third cell appears in the discovery records and is sent rows within one
    --discover-interval-s; then a cell is drained with SIGTERM and leaves the records:
    it answers what it holds, and 0 rows are lost."""
    for label in ("cell1", "cell2"):
        deployment.start_cell(label)
    gateway = deployment.start_gateway("cell1", "cell2")
    load = Load(gateway).start()
    load.wait(100)
    deployment.start_cell("cell3")  # ready: now the Service's records would list it
    deployment.discover("cell1", "cell2", "cell3")
    added_at = time.monotonic()
    wait_until(lambda: deployment.rows_of("cell3") > 0, discover_interval_s() + 2, "rows on the new cell")
    assert time.monotonic() - added_at <= discover_interval_s() + 1.0  # an interval and a heartbeat
    # scale in: Kubernetes takes the pod out of the records and sends SIGTERM
    _, proc = deployment.cells["cell1"]
    deployment.discover("cell2", "cell3")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    load.wait(load.count() + 200)
    answers = load.stop()
    check_answers(answers)
