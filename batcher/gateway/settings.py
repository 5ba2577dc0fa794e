"""The gateway's settings: where its brokers are, where it listens, and its limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from batcher.core.routing import ROUTINGS
from batcher.errors import SettingsError
from batcher.gateway.discovery import parse_source
from batcher.observe.settings import TraceSettings
from batcher.settings import MAX_TIMEOUT_MS, check, port, setting

#: The most gateway processes one gateway runs (`--processes`): each is a Python process
#: of some 50 MB with a link of its own to the broker; more than the host's cores only
#: adds memory and broker connections.
MAX_PROCESSES = 256


@dataclass(frozen=True)
class GatewaySettings:
    """Where the brokers are and where the gateway listens; a port of 0 is not served.

    The brokers: `connect` (none when empty), every `extra_connect`, and those each
    `discover` source names (docs/gateway.md, "Many brokers")."""

    connect: str = "tcp://127.0.0.1:5555"
    #: More brokers, each given its own --connect after the first.
    extra_connect: tuple[str, ...] = ()
    #: Discovery sources (`dns+tcp://NAME:PORT`, `file:PATH`), asked every
    #: `discover_interval_s`.
    discover: tuple[str, ...] = ()
    discover_interval_s: float = setting(
        5.0, min=0, min_exclusive=True, max=3600, help="How often each --discover source is asked again."
    )
    #: How a row's broker is chosen among those ready for its model (core.routing.ROUTINGS).
    routing: str = "p2c"
    host: str = "127.0.0.1"
    http_port: int = port("Serve the Open Inference Protocol (KServe v2) over HTTP on this port (0: not).")
    grpc_port: int = port("Serve the Open Inference Protocol (KServe v2) over gRPC on this port (0: not).")
    #: How long the gateway waits for the broker's reply to a request without a timeout.
    request_timeout_ms: float = setting(
        30_000.0,
        min=0,
        min_exclusive=True,
        max=MAX_TIMEOUT_MS,
        help="Longest wait for the broker's reply to a request that sets no timeout of its own.",
    )
    #: How long a health or metadata question waits for the broker.
    probe_timeout_ms: float = setting(2_000.0, min=0, min_exclusive=True)
    #: The most bytes of outputs one response may hold (HTTP body, gRPC message).
    max_response_bytes: int = 256 * 1024 * 1024
    curve_server_key: str | None = None
    curve_secret_key: str | None = None
    #: The accepted API keys, one a line (docs/gateway.md, "Access control"); None: none asked.
    api_keys_file: str | None = None
    #: The HTTPS / gRPC TLS pair (PEM): both or neither.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    #: How many processes serve the ports, sharing them (SO_REUSEPORT; docs/gateway.md,
    #: "Several processes"): 1 is one process, exclusive on its ports.
    processes: int = setting(
        1,
        kind=int,
        min=1,
        max=MAX_PROCESSES,
        message="processes (the gateway's --processes) must be an integer in {min}..{max}, got {value!r}",
        help="Gateway processes sharing the HTTP and gRPC ports (SO_REUSEPORT, Linux), each "
        "with its own link to the broker: up to one a core for HTTP/gRPC parsing (docs/gateway.md).",
    )
    #: OpenTelemetry traces (docs/tracing.md): off unless an endpoint is given.
    trace: TraceSettings = field(default_factory=TraceSettings)

    def __post_init__(self) -> None:
        check(self)
        if not self.http_port and not self.grpc_port:
            raise SettingsError("give --http-port or --grpc-port (or both): the gateway serves neither")
        if not self.addresses() and not self.discover:
            raise SettingsError("give a broker: --connect ADDR or --discover SOURCE")
        if self.routing not in ROUTINGS:
            raise SettingsError(f"routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        for source in self.discover:
            parse_source(source)  # SettingsError for a source it cannot read
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise SettingsError("--tls-cert-file and --tls-key-file go together: give both or neither")

    def addresses(self) -> tuple[str, ...]:
        """The brokers given by address (--connect), in order, each once."""
        given = ((self.connect,) if self.connect else ()) + self.extra_connect
        return tuple(dict.fromkeys(given))
