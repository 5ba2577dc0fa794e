"""`batcher gateway --processes N` (and `serve --gateway-processes N`): N gateway
processes on the same HTTP and gRPC ports, so that HTTP parsing, JSON and protobuf use N
cores instead of one.

Each child is a whole gateway (batcher.gateway.server) with its own link to the broker,
so the rows of all of them still share batches at the broker. They share the ports
through SO_REUSEPORT: the kernel gives each new connection to one of their listening
sockets (a hash of its addresses and ports), so a client's connection, with every
request it carries, stays with one process. This process is their parent and serves
nothing itself (docs/gateway.md, "Several processes"):

- **Ports.** Each port is first bound alone, without SO_REUSEPORT, exactly as one
  gateway process binds it: a port that anyone listens on is the same one-line error.
  Then a socket bound with SO_REUSEPORT, which never listens (so it is given no
  connection), holds the port for as long as the parent runs, and the children bind
  beside it. The kernel lets only sockets of the same user that also set SO_REUSEPORT
  bind beside it; once the children listen, the parent checks (/proc/net/tcp) that no
  listener but theirs is on the port, so a gRPC server of the same user (grpcio sets
  SO_REUSEPORT by default) is not silently shared with either.
- **Up.** Each child writes a line to its stdout (a pipe to the parent) once both its
  ports listen; when all have, the parent tells each of them on its pipe, and logs the
  ready line, `gateway up: N processes`. Until told, a child answers its readiness
  probes (`/v2/health/ready`, ServerReady) "not ready", so a probe answered 200 means
  every process listens; after that each answers from its own link to the broker.
- **Stop.** SIGTERM or SIGINT (under serve: serve closing the parent's stdin) closes
  every child's pipe at once; each drains as one gateway does (its listeners close,
  what is in flight gets GRACE_S); a second signal kills them. Children ignore SIGINT
  and SIGTERM themselves (a signal to the process group is the parent's to act on) and
  are killed if the parent dies (PR_SET_PDEATHSIG), so none outlives it.
- **A child that exits by itself** (a crash, the OOM killer): the others are drained and
  the parent exits 1, naming the process and how it ended. Restarting it here would keep
  the pod "ready" at a fraction of its capacity and hide the crash from the
  orchestrator, whose restart policy, back-off and restart count are where a crash
  belongs (Kubernetes, systemd's Restart=); serve treats the exit of its gateway alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from batcher.errors import BatcherError, BindError, SettingsError
from batcher.gateway import access
from batcher.gateway.server import GRACE_S, SIBLINGS_UP
from batcher.gateway.settings import GatewaySettings
from batcher.transport.stopping import ignore_stop_signals, stop_signals_blocked

log = logging.getLogger("batcher.gateway")

#: What a child writes to its stdout once both its ports listen.
LISTENING_LINE = b"listening\n"
#: How long the children have to listen (imports, key files, binding) before the
#: gateway gives up on starting.
START_TIMEOUT_S = 60.0
#: How long past GRACE_S a stopping child may take before it is killed.
STOP_MARGIN_S = 1.5
#: prctl(2): the signal a process receives when its parent dies.
_PR_SET_PDEATHSIG = 1


class GatewayExited(BatcherError, RuntimeError):
    """A gateway process exited by itself (or never listened): the gateway has stopped."""


def check_supported(processes: int) -> None:
    """ValueError where several processes would not share connections: SO_REUSEPORT
    spreads connections over the sockets only on Linux (elsewhere the last socket bound
    takes them all, or the option is missing)."""
    if processes > 1 and not sys.platform.startswith("linux"):
        raise SettingsError(
            f"--processes {processes} needs Linux, where SO_REUSEPORT spreads connections over "
            f"the processes' sockets (this is {sys.platform}); run one process per port instead"
        )


def die_with_parent() -> None:
    """For a child: SIGKILL when the parent dies (a parent killed with SIGKILL cannot
    stop its children; its pipe closing would give them GRACE_S more)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning("gateway process: prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))


def report_listening() -> None:
    """For a child: tell the parent both ports listen."""
    os.write(1, LISTENING_LINE)


def hold_port(host: str, port: int, what: str) -> socket.socket:
    """A socket that holds (host, port) for processes that bind it with SO_REUSEPORT,
    after checking, as one gateway process binding it alone would, that no one else has
    it; BindError (an OSError), saying where, if someone has."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
        except OSError as exc:
            raise BindError(exc.errno, f"cannot listen for {what} on {host}:{port}: {exc.strerror}") from None
    holder = socket.socket(family, socket.SOCK_STREAM)
    try:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind((host, port))
    except OSError as exc:  # taken between the two binds
        holder.close()
        raise BindError(exc.errno, f"cannot listen for {what} on {host}:{port}: {exc.strerror}") from None
    return holder


#: How /proc/net/tcp6 writes an IPv4-mapped address (::ffff:a.b.c.d): this, then the IPv4's.
_V4_MAPPED = "0000000000000000FFFF0000"


def listeners(
    port: int, tables: tuple[str, ...] = ("/proc/net/tcp", "/proc/net/tcp6")
) -> dict[int, tuple[str, int]]:
    """The listening TCP sockets on `port` in this network namespace: inode -> (its
    local address as the table writes it, an IPv4-mapped one as the IPv4's; its uid)."""
    found: dict[int, tuple[str, int]] = {}
    for table in tables:
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
                if len(fields) < 10 or fields[3] != "0A":
                    continue
                address, _, hex_port = fields[1].rpartition(":")
                if int(hex_port, 16) == port:
                    found[int(fields[9])] = (address.removeprefix(_V4_MAPPED), int(fields[7]))
    return found


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process `pid` holds open."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    return inodes


def foreign_listeners(port: int, pids: list[int]) -> dict[int, int]:
    """The sockets of processes other than `pids` listening on the address and `port`
    that the sockets of `pids` listen on, so sharing their connections (inode -> uid)."""
    ours: set[int] = set()
    for pid in pids:
        ours |= socket_inodes(pid)
    table = listeners(port)
    addresses = {address for inode, (address, _) in table.items() if inode in ours}
    return {
        inode: uid for inode, (address, uid) in table.items() if inode not in ours and address in addresses
    }


@dataclass
class _Child:
    """One gateway process: its pipe in (closed to stop it) and out (its `listening`)."""

    index: int
    proc: subprocess.Popen[bytes]
    listening: bool = False
    code: int | None = None
    _seen: bytes = field(default=b"", repr=False)

    def name(self, of: int) -> str:
        return f"gateway process {self.index} of {of} (pid {self.proc.pid})"

    def read(self) -> bool:
        """Read what it wrote; False at end of file (it exited, or is exiting)."""
        assert self.proc.stdout is not None
        data = os.read(self.proc.stdout.fileno(), 4096)
        if not data:
            return False
        self._seen = (self._seen + data)[-4 * len(LISTENING_LINE) :]  # it writes nothing else
        self.listening = self.listening or LISTENING_LINE in self._seen
        return True

    def tell(self, data: bytes) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.write(data)
                self.proc.stdin.flush()

    def close_pipe(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()


def how_it_ended(code: int) -> str:
    """`exited with code 1 (its error is above)`, `was killed by SIGKILL`."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code} (its error is above)"


class _Gateway:
    """The parent's state: its children, and whatever ends the wait (a change)."""

    def __init__(self, settings: GatewaySettings, command: Callable[[GatewaySettings], list[str]]) -> None:
        self.settings = settings
        self.command = command
        self.children: list[_Child] = []
        self.changed = asyncio.Event()
        self.signals = 0
        self.stop_asked = False
        self.loop = asyncio.get_running_loop()

    def start(self) -> None:
        child_settings = replace(self.settings, processes=1)
        # A signal to the process group while they start waits until each has chosen
        # to ignore it (batcher.transport.stopping.stop_signals_blocked): the parent acts on it.
        with stop_signals_blocked():
            for index in range(1, self.settings.processes + 1):
                proc = subprocess.Popen(
                    self.command(child_settings), stdin=subprocess.PIPE, stdout=subprocess.PIPE
                )
                child = _Child(index, proc)
                self.children.append(child)
                assert proc.stdout is not None
                self.loop.add_reader(proc.stdout.fileno(), self._on_output, child)

    def _on_output(self, child: _Child) -> None:
        try:
            more = child.read()
        except OSError:
            more = False
        if not more:
            assert child.proc.stdout is not None
            self.loop.remove_reader(child.proc.stdout.fileno())
            child.proc.stdout.close()
            try:  # its stdout closes as it exits: reaped at once
                child.code = child.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.code = child.proc.wait()
        self.changed.set()

    def on_stop(self) -> None:
        """SIGTERM/SIGINT, or the end of serve's pipe: drain; a second signal: kill."""
        self.signals += 1
        self.stop_asked = True
        if self.signals > 1:
            self.kill()
        self.changed.set()

    def kill(self) -> None:
        for child in self.children:
            if child.code is None:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.kill()

    def exited(self) -> list[_Child]:
        return [c for c in self.children if c.code is not None]

    async def wait_for(self, done: Callable[[], bool], timeout_s: float | None = None) -> bool:
        """Until `done()` (True), or `timeout_s` passes (False)."""
        deadline = None if timeout_s is None else self.loop.time() + timeout_s
        while not done():
            self.changed.clear()
            left = None if deadline is None else deadline - self.loop.time()
            if left is not None and left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self.changed.wait()
        return True

    async def stop(self) -> None:
        """Close every child's pipe at once; kill those still up after their grace."""
        for child in self.children:
            child.close_pipe()
        if not await self.wait_for(lambda: len(self.exited()) == len(self.children), GRACE_S + STOP_MARGIN_S):
            n = len(self.children)
            for child in self.children:
                if child.code is None:
                    log.warning(
                        "%s did not stop within %.1f s: killed", child.name(n), GRACE_S + STOP_MARGIN_S
                    )
            self.kill()
            await self.wait_for(lambda: len(self.exited()) == len(self.children))


async def supervise(
    settings: GatewaySettings,
    command: Callable[[GatewaySettings], list[str]],
    control_fd: int | None = None,
) -> None:
    """Run `settings.processes` gateway processes (each `command(settings)` for one
    process) on shared ports until SIGTERM/SIGINT, or else `control_fd` (serve's pipe)
    closes; GatewayExited if one exits by itself, OSError if a port is not free, after
    the others have stopped."""
    check_supported(settings.processes)
    api_keys = None if settings.api_keys_file is None else access.load_api_keys(settings.api_keys_file)
    tls = access.check_tls_pair(settings.tls_cert_file, settings.tls_key_file)
    warning = access.clear_text_warning(settings.host, api_keys=api_keys is not None, tls=tls is not None)
    if warning is not None:
        log.warning("%s", warning)
    ports = [(p, what) for p, what in ((settings.http_port, "HTTP"), (settings.grpc_port, "gRPC")) if p]
    holders: list[socket.socket] = []
    gateway = _Gateway(settings, command)
    try:
        for port, what in ports:
            holders.append(hold_port(settings.host, port, what))
        _on_stop(gateway, control_fd)
        gateway.start()
        await _serve(gateway, ports, api_keys is not None, tls is not None)
    finally:
        for holder in holders:
            holder.close()


async def _serve(gateway: _Gateway, ports: list[tuple[int, str]], api_keys: bool, tls: bool) -> None:
    settings, n = gateway.settings, gateway.settings.processes
    children = gateway.children
    up = await gateway.wait_for(
        lambda: gateway.stop_asked or bool(gateway.exited()) or all(c.listening for c in children),
        START_TIMEOUT_S,
    )
    failure: Exception | None = None
    if gateway.exited():
        child = gateway.exited()[0]
        assert child.code is not None
        state = "" if child.listening else ", before it listened,"
        failure = GatewayExited(f"{child.name(n)}{state} {how_it_ended(child.code)}")
    elif not up:
        failure = GatewayExited(f"the gateway processes did not all listen within {START_TIMEOUT_S:g} s")
    elif not gateway.stop_asked:
        pids = [c.proc.pid for c in children]
        for port, what in ports:
            foreign = foreign_listeners(port, pids)
            if foreign:
                uids = ", ".join(sorted({str(u) for u in foreign.values()}))
                failure = BindError(
                    f"cannot listen for {what} on {settings.host}:{port}: another process (uid {uids}) "
                    "listens on it too, with SO_REUSEPORT, and would be given some of its connections"
                )
                break
    if failure is None and not gateway.stop_asked:
        for child in children:  # from now on each answers its readiness probes itself
            child.tell(SIBLINGS_UP)
        log.info(
            "gateway up: %d processes (pids %s), http%s %s, grpc %s, broker %s, %s",
            n,
            " ".join(str(c.proc.pid) for c in children),
            "s" if tls else "",
            settings.http_port or "off",
            settings.grpc_port or "off",
            " ".join(settings.addresses() + settings.discover),
            "API keys required" if api_keys else "no API keys",
        )
        await gateway.wait_for(lambda: gateway.stop_asked or bool(gateway.exited()))
        if gateway.exited() and not gateway.stop_asked:
            child = gateway.exited()[0]
            assert child.code is not None
            failure = GatewayExited(f"{child.name(n)} {how_it_ended(child.code)}")
            log.error("%s; stopping the other gateway processes", failure)
    stopping_at = time.monotonic()
    if failure is None:
        log.info("gateway stopping: %d processes, requests in flight get up to %.1f s", n, GRACE_S)
    await gateway.stop()
    if failure is not None:
        raise failure
    log.info("gateway stopped in %.2f s", time.monotonic() - stopping_at)


def _on_stop(gateway: _Gateway, control_fd: int | None) -> None:
    loop = asyncio.get_running_loop()
    if control_fd is None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, gateway.on_stop)
        return
    ignore_stop_signals()  # under serve: a signal to the group is serve's, which closes our pipe

    def on_readable() -> None:
        if not os.read(control_fd, 4096):
            loop.remove_reader(control_fd)
            gateway.on_stop()

    loop.add_reader(control_fd, on_readable)


def run(
    settings: GatewaySettings,
    command: Callable[[GatewaySettings], list[str]],
    control_fd: int | None = None,
) -> None:
    """The body of `batcher gateway --processes N` for N > 1."""
    asyncio.run(supervise(settings, command, control_fd))
