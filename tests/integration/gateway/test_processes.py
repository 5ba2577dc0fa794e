"""Issue 30, item 3: `batcher gateway --processes N` and `serve --gateway-processes N`:
N gateway processes sharing the HTTP and gRPC ports (SO_REUSEPORT), each with its own link
to the broker, started, drained and stopped as one gateway. Real processes on loopback
ports; which process served a connection is read from the kernel's socket table
(psutil), matched to the client's own port."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest

from batcher.gateway import inference_pb2 as pb
from batcher.gateway import inference_pb2_grpc as pb_grpc
from batcher.gateway.processes import foreign_listeners
from batcher.gateway.settings import MAX_PROCESSES, GatewaySettings
from batcher.serve.launcher import ServeProcess, free_tcp_address
from tests.conftest import Spawned
from tests.helpers import wait_until
from tests.integration.gateway.test_auth import make_pair
from tests.integration.gateway.test_gateway import PROBE, free_port, http_status, stats

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="--processes > 1 is Linux only")

ROOT = Path(__file__).resolve().parents[3]
#: Connections opened to learn that both processes take some: all of them landing on one
#: of two processes has a chance of 2 * 2**-24 (the kernel hashes each connection's ports).
CONNECTIONS = 24
TOKEN = "a-token-for-the-processes-test"


def infer_body(value: str) -> bytes:
    return json.dumps(
        {"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": [value]}]}
    ).encode()


def children(parent_pid: int) -> list[psutil.Process]:
    return psutil.Process(parent_pid).children()


def served_by(processes: list[psutil.Process], port: int) -> dict[int, int]:
    """Each established connection to `port` held by one of `processes`: the client's
    port -> the pid that holds the server's end."""
    out = {}
    for p in processes:
        for c in p.net_connections(kind="tcp"):
            if c.laddr.port == port and c.raddr and c.status == psutil.CONN_ESTABLISHED:
                out[c.raddr.port] = p.pid
    return out


def gateway_up(spawned: Spawned, processes: int = 2) -> bool:
    return f"gateway up: {processes} processes" in spawned.stderr_path.read_text()


def start_chain(
    spawn: Callable[..., Spawned], *gateway_args: str, model: str = "echo"
) -> tuple[str, Spawned]:
    """A broker, a worker of `model` and `batcher gateway GATEWAY_ARGS` in front of them,
    up (its ready line logged)."""
    frontend, backend = free_tcp_address(), free_tcp_address()
    spec = PROBE if model == "probe" else model
    spawn(
        "broker", "--frontend", frontend, "--backend", backend, "--model", model,
        "--max-batch-size", "32", "--max-wait-ms", "300",
    )  # fmt: skip
    spawn("worker", "--connect", backend, "--model", spec)
    gw = spawn("gateway", "--connect", frontend, *gateway_args)
    wait_until(lambda: gateway_up(gw) or gw.process.poll() is not None, 30, "the gateway's ready line")
    assert gw.process.poll() is None, gw.stderr_path.read_text()
    return frontend, gw


# --- the setting -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, MAX_PROCESSES + 1, True, 2.0, "2"])
def test_the_settings_refuse_a_process_count_out_of_range_saying_which(bad: Any) -> None:
    with pytest.raises(ValueError) as info:
        GatewaySettings(http_port=8000, processes=bad)
    assert str(info.value) == (
        f"processes (the gateway's --processes) must be an integer in 1..{MAX_PROCESSES}, got {bad!r}"
    )
    assert GatewaySettings(http_port=8000).processes == 1  # the default: one process, as before


@pytest.mark.integration
def test_the_commands_refuse_a_bad_process_count_in_one_line(cli: Callable[..., Any]) -> None:
    port = str(free_port())
    for args, words in (
        (["gateway", "--http-port", port, "--processes", "0"], "'--processes'"),
        (
            ["serve", "--model", "echo", "--http-port", port, "--gateway-processes", "0"],
            "'--gateway-processes'",
        ),
        (["serve", "--model", "echo", "--gateway-processes", "2"], "needs --http-port or --grpc-port"),
    ):
        result = cli(*args)
        assert result.returncode == 2, result.stderr
        assert words in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.integration
def test_a_listener_of_another_process_on_the_same_address_and_port_is_found() -> None:
    """The check the parent makes once its children listen: a socket of another process
    that shares the port with SO_REUSEPORT on the same address is named (by its uid); one
    on another address of the port shares nothing, and is not."""
    port = free_port()
    listen = (
        "import socket, sys\n"
        "s = socket.socket()\n"
        "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)\n"
        "s.bind((sys.argv[1], int(sys.argv[2])))\n"
        "s.listen()\n"
        "print('listening', flush=True)\n"
        "sys.stdin.read()\n"
    )
    with socket.socket() as ours:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        ours.bind(("127.0.0.1", port))
        ours.listen()
        assert foreign_listeners(port, [os.getpid()]) == {}
        others = [
            subprocess.Popen(
                [sys.executable, "-c", listen, host, str(port)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for host in ("127.0.0.2", "127.0.0.1")
        ]
        try:
            for other in others:
                assert other.stdout is not None and other.stdout.readline() == "listening\n"
            found = foreign_listeners(port, [os.getpid()])
            assert list(found.values()) == [os.getuid()]
            (inode,) = found
            assert f"socket:[{inode}]" in [
                os.readlink(f"/proc/{others[1].pid}/fd/{fd}")
                for fd in os.listdir(f"/proc/{others[1].pid}/fd")
            ]
        finally:
            for other in others:
                other.kill()
                other.wait()


# --- serving ---------------------------------------------------------------------------------------


@pytest.mark.integration
def test_two_processes_serve_http_and_grpc_on_one_port_and_both_take_connections(
    spawn: Callable[..., Spawned],
) -> None:
    http_port, grpc_port = free_port(), free_port()
    frontend, gw = start_chain(
        spawn, "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--processes", "2"
    )
    kids = children(gw.pid)
    assert len(kids) == 2
    log_text = gw.stderr_path.read_text()
    assert (
        f"gateway up: 2 processes (pids {kids[0].pid} {kids[1].pid}), http {http_port}, grpc {grpc_port}"
        in (log_text)
    )
    # HTTP: every connection is answered, and both processes hold some of them.
    conns = [http.client.HTTPConnection("127.0.0.1", http_port, timeout=20) for _ in range(CONNECTIONS)]
    try:
        for i, conn in enumerate(conns):
            conn.request("POST", "/v2/models/echo/infer", infer_body(f"row {i}"))
            r = conn.getresponse()
            assert r.status == 200 and json.loads(r.read())["outputs"][0]["data"] == [f"row {i}"]
            conn.request("GET", "/v2/health/ready")  # each process was told all are up
            r = conn.getresponse()
            assert (r.status, json.loads(r.read())) == (200, {"ready": True})
        by_client = served_by(kids, http_port)
        mine = {conn.sock.getsockname()[1] for conn in conns}
        assert mine <= set(by_client), "a connection is held by neither gateway process"
        assert {by_client[p] for p in mine} == {k.pid for k in kids}
    finally:
        for conn in conns:
            conn.close()
    # gRPC: one connection per channel (a subchannel pool of its own), the same.
    channels = [
        grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(CONNECTIONS)
    ]
    try:
        for i, channel in enumerate(channels):
            tensor = pb.ModelInferRequest.InferInputTensor(name="x", datatype="BYTES", shape=[1])
            tensor.contents.bytes_contents.append(f"g{i}".encode())
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            reply = stub.ModelInfer(pb.ModelInferRequest(model_name="echo", inputs=[tensor]), timeout=20)
            assert reply.raw_output_contents[0][4:] == f"g{i}".encode()
            assert stub.ServerReady(pb.ServerReadyRequest(), timeout=20).ready
        held = served_by(kids, grpc_port)
        assert len(held) == CONNECTIONS
        assert set(held.values()) == {k.pid for k in kids}
    finally:
        for channel in channels:
            channel.close()
    # Triton's statistics are the broker's: the same whichever process answers.
    assert stats(frontend, "echo")["outcomes"]["ok"] == 2 * CONNECTIONS


@pytest.mark.integration
def test_api_keys_and_tls_hold_in_every_process(spawn: Callable[..., Spawned], tmp_path: Path) -> None:
    cert, key = make_pair(tmp_path, "gw")
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{TOKEN}\n")
    http_port, grpc_port = free_port(), free_port()
    _, gw = start_chain(
        spawn,
        "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--processes", "2",
        "--api-keys-file", str(keys), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
    )  # fmt: skip
    kids = children(gw.pid)
    context = ssl.create_default_context(cafile=str(cert))
    conns = [
        http.client.HTTPSConnection("127.0.0.1", http_port, timeout=20, context=context)
        for _ in range(CONNECTIONS)
    ]
    try:
        for conn in conns:
            conn.request(
                "POST", "/v2/models/echo/infer", infer_body("x"), {"Authorization": f"Bearer {TOKEN}"}
            )
            r = conn.getresponse()
            assert r.status == 200, r.read()
            r.read()
        by_client = served_by(kids, http_port)
        assert {by_client[conn.sock.getsockname()[1]] for conn in conns} == {k.pid for k in kids}
    finally:
        for conn in conns:
            conn.close()
    refused = []
    for _ in range(CONNECTIONS):  # a refusal closes its connection: each is a new one
        conn = http.client.HTTPSConnection("127.0.0.1", http_port, timeout=20, context=context)
        try:
            conn.request("POST", "/v2/models/echo/infer", infer_body("x"))
            refused.append(conn.getresponse().status)
        finally:
            conn.close()
    assert refused == [401] * CONNECTIONS
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    channels = [
        grpc.secure_channel(
            f"127.0.0.1:{grpc_port}", credentials, options=[("grpc.use_local_subchannel_pool", 1)]
        )
        for _ in range(CONNECTIONS)
    ]
    try:
        for channel in channels:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            with pytest.raises(grpc.RpcError) as info:
                stub.ServerMetadata(pb.ServerMetadataRequest(), timeout=20)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            meta = stub.ServerMetadata(
                pb.ServerMetadataRequest(), timeout=20, metadata=(("authorization", f"Bearer {TOKEN}"),)
            )
            assert meta.name == "batcher"
        assert set(served_by(kids, grpc_port).values()) == {k.pid for k in kids}
    finally:
        for channel in channels:
            channel.close()


# --- stopping --------------------------------------------------------------------------------------


class HeldRequests:
    """`n` slow rows (the probe holds its batch 1.5 s), one a connection, sent at once and
    answered later: `outcomes()` reads every answer (in a thread of its own each)."""

    def __init__(self, port: int, n: int) -> None:
        self.port = port
        self.conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=30) for _ in range(n)]
        for conn in self.conns:
            conn.request("POST", "/v2/models/probe/infer", infer_body("slow"))
        self.results: list[Any] = [None] * n
        self.threads = [threading.Thread(target=self._read, args=(i,)) for i in range(n)]
        for t in self.threads:
            t.start()

    def _read(self, i: int) -> None:
        try:
            r = self.conns[i].getresponse()
            self.results[i] = (r.status, json.loads(r.read()))
        except Exception as exc:  # shown by the assertion
            self.results[i] = repr(exc)

    def client_ports(self) -> list[int]:
        return [conn.sock.getsockname()[1] for conn in self.conns]

    def accepted(self, processes: list[psutil.Process]) -> bool:
        """Every connection is held by one of `processes`: none waits in the listener's
        backlog, where the broker's idle queue cannot tell it from one never sent."""
        return set(self.client_ports()) <= set(served_by(processes, self.port))

    def outcomes(self) -> list[Any]:
        for t in self.threads:
            t.join(30)
        for conn in self.conns:
            conn.close()
        return self.results


@pytest.mark.integration
@pytest.mark.parametrize("to_group", [False, True], ids=["sigterm-to-the-parent", "sigint-to-the-group"])
def test_a_signal_drains_every_process(spawn: Callable[..., Spawned], to_group: bool) -> None:
    """Rows in a batch on both processes when the gateway is told to stop (SIGTERM to it,
    or Ctrl-C to its whole process group): every one is answered 200, then all the
    processes exit, 0, and the ports are closed."""
    http_port = free_port()
    frontend, gw = start_chain(spawn, "--http-port", str(http_port), "--processes", "2", model="probe")
    kids = children(gw.pid)
    held = HeldRequests(http_port, CONNECTIONS)
    wait_until(lambda: held.accepted(kids), 10, "every connection accepted by a gateway process")
    wait_until(
        lambda: (s := stats(frontend, "probe")).get("busy_workers") == 1 and s.get("queued") == 0,
        10,
        "every row in a batch",
    )
    by_client = served_by(kids, http_port)
    assert {by_client[p] for p in held.client_ports()} == {k.pid for k in kids}
    if to_group:
        os.killpg(gw.pid, signal.SIGINT)
    else:
        os.kill(gw.pid, signal.SIGTERM)
    wait_until(lambda: http_status(http_port, "/v2/health/live") == 0, 5, "the listeners closed")
    outcomes = held.outcomes()
    assert all(o[0] == 200 and o[1]["outputs"][0]["data"] == ["slow"] for o in outcomes), outcomes
    assert gw.process.wait(10) == 0
    psutil.wait_procs(kids, timeout=5)
    assert not [k for k in kids if k.is_running() and k.status() != psutil.STATUS_ZOMBIE]
    log_text = gw.stderr_path.read_text()
    assert "gateway stopping: 2 processes" in log_text and log_text.count("gateway stopped in") == 3


@pytest.mark.integration
def test_a_process_that_dies_stops_the_gateway_with_an_error(spawn: Callable[..., Spawned]) -> None:
    """One child killed: the other drains and stops, and the gateway exits 1 naming the
    dead one, so its supervisor (Kubernetes, systemd) restarts it whole."""
    http_port = free_port()
    _, gw = start_chain(spawn, "--http-port", str(http_port), "--processes", "2")
    victim, other = children(gw.pid)
    victim.kill()
    assert gw.process.wait(15) == 1
    _, alive = psutil.wait_procs([other], timeout=5)
    assert not alive
    log_text = gw.stderr_path.read_text()
    assert f"batcher.gateway[{other.pid}]: gateway stopped in" in log_text  # drained, as on a signal
    assert f"Error: gateway process 1 of 2 (pid {victim.pid}) was killed by SIGKILL" in log_text, log_text
    assert http_status(http_port, "/v2/health/live") == 0


@pytest.mark.integration
def test_the_processes_die_with_their_parent(spawn: Callable[..., Spawned]) -> None:
    """The parent killed outright (SIGKILL: it can stop nothing): its processes do not
    live on holding the port."""
    http_port = free_port()
    _, gw = start_chain(spawn, "--http-port", str(http_port), "--processes", "2")
    kids = children(gw.pid)
    os.kill(gw.pid, signal.SIGKILL)
    _, alive = psutil.wait_procs(kids, timeout=5)
    assert not alive
    assert http_status(http_port, "/v2/health/live") == 0


# --- ports -----------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("reuse_port", [False, True], ids=["plain", "so_reuseport"])
@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port"])
def test_a_port_in_use_is_refused_even_by_a_socket_that_would_share_it(
    cli: Callable[..., Any], flag: str, reuse_port: bool
) -> None:
    """A port another program listens on is the same one-line error as with one process,
    also when that program set SO_REUSEPORT (grpcio's default), which the children's
    sockets would otherwise share with it unseen."""
    with socket.socket() as taken:
        if reuse_port:
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = cli("gateway", flag, str(port), "--processes", "2", timeout_s=30)
    what = "HTTP" if flag == "--http-port" else "gRPC"
    assert result.returncode == 1, result.stderr
    assert f"cannot listen for {what} on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "Traceback" not in result.stderr


# --- under serve -----------------------------------------------------------------------------------


@pytest.mark.integration
def test_serve_with_gateway_processes_serves_drains_and_stops_on_a_dead_one(
    serve: Callable[..., ServeProcess],
) -> None:
    http_port = free_port()
    sp = serve(
        "--model",
        "echo",
        "--workers",
        "1",
        "--http-port",
        str(http_port),
        "--gateway-processes",
        "2",
        workers=1,
    )
    assert sp.process is not None
    wait_until(lambda: http_status(http_port, "/v2/health/ready") == 200, 20, "ready")
    (parent,) = [p for p in psutil.Process(sp.process.pid).children() if "gateway" in " ".join(p.cmdline())]
    kids = parent.children()
    assert len(kids) == 2
    conns = [http.client.HTTPConnection("127.0.0.1", http_port, timeout=20) for _ in range(CONNECTIONS)]
    try:
        for conn in conns:
            conn.request("POST", "/v2/models/echo/infer", infer_body("s"))
            assert conn.getresponse().read()
        by_client = served_by(kids, http_port)
        assert {by_client[c.sock.getsockname()[1]] for c in conns} == {k.pid for k in kids}
    finally:
        for conn in conns:
            conn.close()
    kids[1].kill()  # serve stops, as when its one gateway process exits with an error
    assert sp.process.wait(20) == 1
    _, alive = psutil.wait_procs([parent, kids[0]], timeout=5)
    assert not alive


@pytest.mark.integration
def test_a_signal_to_serves_group_drains_every_gateway_process(serve: Callable[..., ServeProcess]) -> None:
    """Ctrl-C or systemd's SIGTERM to serve's whole process group with rows in a batch on
    both gateway processes: the broker drains, every row is answered 200 through the
    process that took it, and serve exits 0 with nothing of it left."""
    http_port = free_port()
    sp = serve(
        "--model", PROBE, "--workers", "1", "--max-batch-size", "32", "--max-wait-ms", "300",
        "--http-port", str(http_port), "--gateway-processes", "2", workers=1,
    )  # fmt: skip
    assert sp.process is not None
    wait_until(lambda: http_status(http_port, "/v2/health/ready") == 200, 20, "ready")
    (parent,) = [p for p in psutil.Process(sp.process.pid).children() if "gateway" in " ".join(p.cmdline())]
    kids = parent.children()
    held = HeldRequests(http_port, CONNECTIONS)
    wait_until(lambda: held.accepted(kids), 10, "every connection accepted by a gateway process")
    wait_until(
        lambda: (s := stats(sp.frontend, "probe")).get("busy_workers") == 1 and s.get("queued") == 0,
        10,
        "every row in a batch",
    )
    by_client = served_by(kids, http_port)
    assert {by_client[p] for p in held.client_ports()} == {k.pid for k in kids}
    os.killpg(sp.process.pid, signal.SIGTERM)
    outcomes = held.outcomes()
    assert all(o[0] == 200 and o[1]["outputs"][0]["data"] == ["slow"] for o in outcomes), outcomes
    assert sp.process.wait(20) == 0
    _, alive = psutil.wait_procs([parent, *kids], timeout=5)
    assert not alive
