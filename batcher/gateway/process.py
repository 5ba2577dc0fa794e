"""`batcher serve --http-port/--grpc-port`: the gateway as a process of its own, so
HTTP parsing and JSON never slow the broker's loop."""

from __future__ import annotations

import re
import subprocess
import sys

from batcher.gateway.settings import GatewaySettings


def local_address(frontend: str) -> str:
    """The address a local process connects to for a broker bound on `frontend`
    (a wildcard host becomes the loopback)."""
    return re.sub(r"^tcp://(\*|0\.0\.0\.0):", "tcp://127.0.0.1:", frontend)


def gateway_command(
    settings: GatewaySettings, log_level: str, log_format: str, shared: bool = False
) -> list[str]:
    """The `batcher gateway` command line for `settings`, for a process that stops when
    its stdin closes: serve's gateway, or (`shared`) one of the processes of a gateway
    of several (batcher.gateway.processes), on ports it shares."""
    command = [
        sys.executable,
        "-m",
        "batcher",
        "gateway",
        *[arg for address in settings.addresses() for arg in ("--connect", address)],
        *[arg for source in settings.discover for arg in ("--discover", source)],
        "--discover-interval-s",
        repr(settings.discover_interval_s),
        "--routing",
        settings.routing,
        "--http-port",
        str(settings.http_port),
        "--grpc-port",
        str(settings.grpc_port),
        "--gateway-host",
        settings.host,
        "--request-timeout-ms",
        repr(settings.request_timeout_ms),
        "--log-level",
        log_level,
        "--log-format",
        log_format,
    ]
    # Always given: a child must not read BATCHER_GATEWAY_PROCESSES from the environment
    # it inherits and start processes of its own.
    command += ["--under-serve", "--processes", str(settings.processes)]
    if shared:
        command.append("--shared-ports")
    if settings.curve_server_key:
        command += ["--curve-server-key", settings.curve_server_key]
    if settings.curve_secret_key:
        command += ["--curve-secret-key", settings.curve_secret_key]
    for flag, value in (
        ("--api-keys-file", settings.api_keys_file),
        ("--tls-cert-file", settings.tls_cert_file),
        ("--tls-key-file", settings.tls_key_file),
    ):
        if value is not None:
            command += [flag, value]
    return command


class GatewayProcess:
    """The gateway child of `serve`: started after the broker binds, stopped after it has
    drained. Like serve's workers it ignores SIGINT and SIGTERM (a signal to the whole
    process group is for serve) and stops when serve closes its stdin, or dies."""

    def __init__(self, command: list[str]) -> None:
        self.command = command
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.command, stdin=subprocess.PIPE)

    def exit_code(self) -> int | None:
        """None while it runs (or before it started)."""
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout_s: float) -> None:
        """Close its pipe (it finishes what is in flight), then SIGKILL after `timeout_s`."""
        if self.proc is None:
            return
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
