"""CurveZMQ end to end: keygen, an encrypted broker with an allow-list, allowed and
refused clients, and serve's own workers admitted with the broker's key pair."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from batcher.client import Client, ClientTimeout
from batcher.launcher import ServeProcess

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
            log_level="INFO",
            stderr=log,
        )
        try:
            serve.start()
            server_key = str(tmp_path / "server" / "broker.key")
            with Client(
                serve.frontend, timeout_s=20, curve_server_key=server_key, curve_secret_key=str(alice_secret)
            ) as alice:
                # serve's own worker joins through the same CURVE socket (the broker's key pair)
                assert alice.request({"x": 1}, model="echo") == {"x": 1}
            for secret in (str(mallory_secret), None):
                with (
                    Client(
                        serve.frontend, timeout_s=1.0, curve_server_key=server_key, curve_secret_key=secret
                    ) as outsider,
                    pytest.raises(ClientTimeout),
                ):
                    outsider.request("let me in", model="echo")
            with Client(serve.frontend, timeout_s=1.0) as plain, pytest.raises(ClientTimeout):
                plain.request("no encryption", model="echo")
        finally:
            assert serve.stop() == 0
        log.seek(0)
        refusals = [line for line in log if "refused a connection" in line]
    assert refusals, "the broker should log refused keys"
