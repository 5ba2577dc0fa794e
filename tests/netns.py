"""A simulated cluster for the tests: Linux network namespaces as separate hosts.

One namespace per node, each with its own loopback and one address on a /24 of its own
(`eth0`, a veth whose other end is a port of a bridge in a "switch" namespace); the test's
own namespace gets one address on the same /24 (the "host" port), so the test reaches the
nodes and the nodes reach each other, and nothing else: no node has a default route, so
nothing leaves the test's namespaces. A node is lost by SIGKILLing every process in its
namespace, partitioned by taking its switch port down.

`Cluster` is a context manager that creates all of it and deletes it, processes first,
whatever happened (the test's fixture wraps it). `unavailable()` says why it cannot run
here (not root, no `ip`, namespaces refused), for a skip with that reason.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from workers.supervisor import child_environment

ROOT = Path(__file__).resolve().parent.parent


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    probe = f"btprobe{secrets.token_hex(3)}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add is not permitted here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.200.0.0/13 that no interface of this namespace is on."""
    used = _ip("-4", "-o", "addr").stdout
    for _ in range(100):
        net = ipaddress.ip_network(f"10.{200 + secrets.randbelow(8)}.{secrets.randbelow(256)}.0/24")
        prefix = str(net.network_address).rsplit(".", 1)[0] + "."
        if f"inet {prefix}" not in used:
            return net
    raise RuntimeError("no free /24 for the simulated cluster")


@dataclass
class Node:
    """One simulated host: its namespace, its address, its switch port and what it runs."""

    label: str
    namespace: str
    address: str
    port: str  # its port on the switch (in the switch's namespace)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def tcp(self, port: int) -> str:
        """A ZeroMQ address of this node."""
        return f"tcp://{self.address}:{port}"


class Cluster:
    """Nodes on one switch (module docstring). Use as a context manager."""

    def __init__(self, logs: Path) -> None:
        self.prefix = f"bt{secrets.token_hex(3)}"
        self.logs = logs
        self.switch = f"{self.prefix}-sw"
        self.host_link = f"{self.prefix}h"
        self.subnet = _free_subnet()
        self.nodes: dict[str, Node] = {}
        self._logs: list[IO[bytes]] = []
        self._made: list[str] = []  # namespaces, to delete

    @property
    def host_address(self) -> str:
        """The test's own address on the cluster's /24."""
        return str(self.subnet.network_address + 1)

    def __enter__(self) -> Cluster:
        try:
            self._netns(self.switch)
            _ip("-n", self.switch, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            _ip("link", "add", self.host_link, "type", "veth", "peer", "name", "host", "netns", self.switch)
            _ip("-n", self.switch, "link", "set", "host", "master", "br0", "up")
            _ip("addr", "add", f"{self.host_address}/24", "dev", self.host_link)
            _ip("link", "set", self.host_link, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def add_node(self, label: str) -> Node:
        """A new node `label` on the switch, with the next address."""
        index = len(self.nodes) + 1
        node = Node(
            label, f"{self.prefix}-{label}", str(self.subnet.network_address + 10 + index), f"p{index}"
        )
        self._netns(node.namespace)
        _ip("-n", node.namespace, "link", "set", "lo", "up")
        _ip(
            "-n",
            self.switch,
            "link",
            "add",
            node.port,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            node.namespace,
        )
        _ip("-n", self.switch, "link", "set", node.port, "master", "br0", "up")
        _ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", "eth0")
        _ip("-n", node.namespace, "link", "set", "eth0", "up")
        self.nodes[label] = node
        return node

    def run(self, node: Node, argv: Sequence[str], name: str) -> subprocess.Popen[bytes]:
        """`python -m batcher ARGV` on `node` (its own session; stderr to a log file of
        `name`): `ip netns exec` execs it, so the process's pid is the command's."""
        log = (self.logs / f"{node.label}-{name}.log").open("ab")
        self._logs.append(log)
        proc = subprocess.Popen(
            ["ip", "netns", "exec", node.namespace, sys.executable, "-m", "batcher", *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_environment(),
            cwd=ROOT,
            start_new_session=True,
        )
        node.processes.append(proc)
        return proc

    def run_to_end(
        self, node: Node, argv: Sequence[str], timeout_s: float
    ) -> subprocess.CompletedProcess[str]:
        """`python -m batcher ARGV` on `node`, waited for (a probe's command, say)."""
        return subprocess.run(
            ["ip", "netns", "exec", node.namespace, sys.executable, "-m", "batcher", *argv],
            capture_output=True,
            text=True,
            env=child_environment(),
            cwd=ROOT,
            timeout=timeout_s,
        )

    def exec_(self, node: Node, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        """Any command inside `node`'s namespace."""
        return subprocess.run(
            ["ip", "netns", "exec", node.namespace, *argv], capture_output=True, text=True, timeout=20
        )

    def pids(self, node: Node) -> list[int]:
        """Every process in `node`'s namespace."""
        out = _ip("netns", "pids", node.namespace, check=False).stdout
        return [int(p) for p in out.split()]

    def kill_node(self, node: Node) -> None:
        """The node is lost: every process of its namespace SIGKILLed at once."""
        for pid in self.pids(node):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in node.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)

    def link(self, node: Node, up: bool) -> None:
        """Take the node's switch port down (a partition) or up again (the heal)."""
        _ip("-n", self.switch, "link", "set", node.port, "up" if up else "down")

    def close(self) -> None:
        """Stop every process of every node (SIGTERM, then SIGKILL after 5 s), delete the
        namespaces (their veths go with them) and the host's link."""
        nodes = list(self.nodes.values())
        for node in nodes:
            for proc in node.processes:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for node in nodes:
            for proc in node.processes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.0, deadline - time.monotonic()))
        for node in nodes:
            self.kill_node(node)
            for proc in node.processes:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for log in self._logs:
            log.close()
        for name in reversed(self._made):
            _ip("netns", "del", name, check=False)
        self._made.clear()
        _ip("link", "del", self.host_link, check=False)

    def describe(self) -> str:
        """Each node's log, for a failed test's report."""
        parts = []
        for path in sorted(self.logs.glob("*.log")):
            parts.append(f"----- {path.name}\n{path.read_text(errors='replace')[-4000:]}")
        return "\n".join(parts)
