"""CurveZMQ end to end: keygen, an encrypted broker with an allow-list, allowed and
refused clients, and serve's own workers admitted with the broker's key pair.

A refused client gets no answer at all, so refusal is never inferred from that silence:
the broker's `stats` must count each refused handshake, its log must name the refused
key, and the client's own socket monitor must report the failed handshake (in its
ClientTimeout's message)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from batcher.client.sync import Client, ClientTimeout
from batcher.serve.launcher import ServeProcess
from batcher.transport.security import load_public_key
from tests.helpers import wait_until

pytestmark = pytest.mark.integration


def keygen(directory: Path, name: str) -> Path:
    """Run `batcher keygen` as a user would; returns the secret key file."""
    subprocess.run(
        [sys.executable, "-m", "batcher", "keygen", str(directory), "--name", name],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return directory / f"{name}.key_secret"


def test_curve_admits_listed_keys_only(tmp_path: Path) -> None:
    broker_secret = keygen(tmp_path / "server", "broker")
    alice_secret = keygen(tmp_path / "clients", "alice")
    mallory_secret = keygen(tmp_path / "outsiders", "mallory")
    assert (tmp_path / "server" / "broker.key").is_file()
    mallory_public = load_public_key(str(tmp_path / "outsiders" / "mallory.key")).decode()
    server_key = str(tmp_path / "server" / "broker.key")
    # (who, curve_server_key, curve_secret_key, what the client's monitor says of it)
    outsiders = [
        ("mallory", server_key, str(mallory_secret), f"the broker refused our CURVE key {mallory_public}"),
        ("a throwaway key", server_key, None, "the broker refused our throwaway CURVE key"),
        ("plaintext", None, None, "plaintext vs CURVE mismatch"),
    ]
    log_path = tmp_path / "serve.log"
    with log_path.open("w+") as log:
        serve = ServeProcess(
            [
                "--workers",
                "1",
                "--model",
                "echo",
                "--curve-secret-key",
                str(broker_secret),
                "--curve-clients",
                str(tmp_path / "clients"),
            ],
            log_level="DEBUG",
            stderr=log,
        )
        try:
            serve.start()
            # Bound before the first request: a client gives up on a port that refuses it
            # for connect_timeout_s (1 s), which a loaded machine's start-up can outlast.
            wait_until(lambda: "broker listening" in log_path.read_text(), 30, "the broker listening")
            with Client(
                serve.frontend, timeout_s=20, curve_server_key=server_key, curve_secret_key=str(alice_secret)
            ) as alice:
                # serve's own worker joins through the same CURVE socket (the broker's key pair)
                assert alice.request({"x": 1}, model="echo") == {"x": 1}

                def refused() -> int:
                    return int(alice.control("stats")["handshakes_refused"]["frontend"])

                for who, server, secret, says in outsiders:
                    before = refused()
                    with (
                        Client(
                            serve.frontend, timeout_s=1.0, curve_server_key=server, curve_secret_key=secret
                        ) as outsider,
                        pytest.raises(ClientTimeout) as err,
                    ):
                        outsider.request("let me in", model="echo")
                    assert says in err.value.message, f"{who}: {err.value.message}"
                    wait_until(lambda n=before: refused() > n, 10, f"the broker counted {who}'s handshake")
                assert alice.request({"x": 2}, model="echo") == {"x": 2}  # still admitted
        finally:
            code = serve.stop()
        log.seek(0)
        lines = log.read().splitlines()
    assert code == 0, f"serve exited with {code}"
    refusals = [line for line in lines if "refused a connection on the frontend" in line]
    assert any(mallory_public in line for line in refusals), refusals  # the key, by name
    assert len(refusals) == 2, refusals  # mallory's and the throwaway key
    # The plaintext peer: a WARNING when the broker read its greeting, DEBUG when the peer
    # hung up first (a race, docs/deployment.md); one of them, always.
    plaintext = (
        "refused a handshake on the frontend (protocol error",
        "a handshake on the frontend ended early",
    )
    assert any(p in line for line in lines for p in plaintext), "plaintext peer not logged"


def test_the_admin_role_is_read_from_the_key_each_message_came_with(tmp_path: Path) -> None:
    """--curve-admins: the authenticator gives each connection its key as User-Id, which
    every message from it carries; CurveGate.is_admin holds it against the admin list as
    it stands at that message (the broker's own key always being one), so a SIGHUP that
    changes the list changes the role of connections already up."""
    import shutil

    import zmq

    from batcher.broker.loop import router
    from batcher.transport.security import CurveServerKeys, secure_client, secure_server
    from batcher.transport.zmqio import recv_bounded_from

    broker_secret = keygen(tmp_path / "server", "broker")
    ops_secret = keygen(tmp_path / "ops", "ops")
    alice_secret = keygen(tmp_path / "alice", "alice")
    admins = tmp_path / "admins"
    admins.mkdir()
    shutil.copy(tmp_path / "ops" / "ops.key", admins)
    ctx: zmq.Context[Any] = zmq.Context()
    front, back = router(ctx, 1 << 20), router(ctx, -1)
    gate = secure_server(ctx, CurveServerKeys(str(broker_secret), admins_dir=str(admins)), front, back)
    assert gate is not None
    peers: dict[str, zmq.Socket[Any]] = {}
    try:
        port = front.bind_to_random_port("tcp://127.0.0.1")
        for who, secret in [
            ("ops", ops_secret),
            ("alice", alice_secret),
            ("own", broker_secret),
            ("any", None),
        ]:
            sock = peers[who] = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            secure_client(sock, str(tmp_path / "server" / "broker.key"), str(secret) if secret else None)
            sock.connect(f"tcp://127.0.0.1:{port}")

        def roles() -> dict[str, bool]:
            seen = {}
            for who, sock in peers.items():
                sock.send_multipart([b"", who.encode()])
                assert front.poll(10_000), f"nothing from {who}"
                frames, fits, first = recv_bounded_from(front, 32, 1 << 20)
                assert fits and frames[-1] == who.encode()
                seen[who] = gate.is_admin(first)
            return seen

        # Every key is admitted (no --curve-clients); only ops and the broker's are admins.
        assert roles() == {"ops": True, "alice": False, "own": True, "any": False}
        (admins / "ops.key").unlink()
        shutil.copy(tmp_path / "alice" / "alice.key", admins)
        gate.reload()
        assert roles() == {"ops": False, "alice": True, "own": True, "any": False}
    finally:
        for sock in peers.values():
            sock.close(0)
        gate.stop()
        front.close(0)
        back.close(0)
        ctx.term()
