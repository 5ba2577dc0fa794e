"""`batcher gateway`: the Open Inference Protocol (KServe v2) over HTTP and gRPC in front of
a broker; and the gateway options `serve` shares (ports, host, processes, access control)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import click
import zmq

from batcher.broker.loop import BrokerSettings
from batcher.cli.option_groups import (
    ClientKeys,
    curve_client_options,
    pass_trace_to_children,
    trace_options,
)
from batcher.cli.options import (
    CONNECT_ADDRESS,
    Decorator,
    LogOptions,
    field_default,
    local_option,
    logging_options,
    option,
    option_group,
    require_extra,
    setting_option,
    setup,
)
from batcher.core.routing import ROUTINGS
from batcher.gateway import access
from batcher.gateway.process import gateway_command
from batcher.gateway.processes import check_supported as check_processes_supported
from batcher.gateway.settings import GatewaySettings
from batcher.observe.settings import TraceSettings

HTTP_PORT_OPTION = setting_option("--http-port", cls=GatewaySettings, field="http_port")
GRPC_PORT_OPTION = setting_option("--grpc-port", cls=GatewaySettings, field="grpc_port")


@dataclass(frozen=True)
class GatewayAccess:
    """The gateway's access control options (docs/gateway.md, "Access control")."""

    api_keys_file: str | None
    tls_cert_file: str | None
    tls_key_file: str | None
    allow_unauthenticated_gateway: bool

    def check(self, host: str, *, allow_lists: str | None, keys_option: str) -> None:
        """Before anything listens: the key file and TLS pair load, and an
        unauthenticated gateway is not opened past CURVE allow-lists (a usage error)."""
        try:
            if self.api_keys_file is not None:
                access.load_api_keys(self.api_keys_file)
            access.check_tls_pair(self.tls_cert_file, self.tls_key_file)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        error = access.exposure_error(
            host,
            api_keys=self.api_keys_file is not None,
            allow_lists=allow_lists,
            allow_unauthenticated=self.allow_unauthenticated_gateway,
            keys_option=keys_option,
        )
        if error is not None:
            raise click.UsageError(error)


_ALLOW_UNAUTHENTICATED = local_option(
    "--allow-unauthenticated-gateway",
    is_flag=True,
    default=False,
    help="Open the gateway on a non-loopback host without API keys even though CurveZMQ "
    "allow-lists guard the broker (refused otherwise: the gateway would be a way past them).",
)


def gateway_access_options(prefix: str) -> Decorator:
    """--api-keys-file, --tls-cert-file, --tls-key-file (serve's: --gateway-...) and
    --allow-unauthenticated-gateway."""
    path = click.Path(dir_okay=False)
    return option_group(
        "gateway_access",
        GatewayAccess,
        option(
            f"--{prefix}api-keys-file",
            "api_keys_file",
            envvar="BATCHER_GATEWAY_API_KEYS_FILE",
            type=path,
            default=None,
            help="File of the API keys the gateway accepts, one a line (# comments): every "
            "endpoint but the health probes then needs 'Authorization: Bearer KEY'.",
        ),
        option(
            f"--{prefix}tls-cert-file",
            "tls_cert_file",
            envvar="BATCHER_GATEWAY_TLS_CERT_FILE",
            type=path,
            default=None,
            help=f"PEM certificate (chain) for HTTPS and gRPC over TLS; with --{prefix}tls-key-file.",
        ),
        option(
            f"--{prefix}tls-key-file",
            "tls_key_file",
            envvar="BATCHER_GATEWAY_TLS_KEY_FILE",
            type=path,
            default=None,
            help=f"PEM private key of --{prefix}tls-cert-file (unencrypted).",
        ),
        _ALLOW_UNAUTHENTICATED,
    )


def gateway_processes_option(name: str) -> Decorator:
    return setting_option(
        name, "processes", cls=GatewaySettings, field="processes", envvar="BATCHER_GATEWAY_PROCESSES"
    )


@dataclass(frozen=True)
class BrokerSources:
    """Where the gateway's brokers are and how rows are routed over them (docs/gateway.md,
    "Many brokers")."""

    connect: tuple[str, ...]
    discover: tuple[str, ...]
    discover_interval_s: float
    routing: str

    def into(self, settings: GatewaySettings) -> GatewaySettings:
        """`settings` with these brokers (the default one when none is given at all)."""
        connect = self.connect or (() if self.discover else (BrokerSettings().frontend,))
        return replace(
            settings,
            connect=connect[0] if connect else "",
            extra_connect=tuple(connect[1:]),
            discover=self.discover,
            discover_interval_s=self.discover_interval_s,
            routing=self.routing,
        )


_BROKER_SOURCES = option_group(
    "brokers",
    BrokerSources,
    option(
        "--connect",
        envvar="BATCHER_GATEWAY_CONNECT",
        old_envvar="BATCHER_CONNECT",
        type=CONNECT_ADDRESS,
        multiple=True,
        help="A broker's frontend address; give it once per broker (default: "
        f"{BrokerSettings().frontend} when no --discover is given either).",
    ),
    option(
        "--discover",
        multiple=True,
        help="Find brokers by dns+tcp://NAME:PORT (each A/AAAA record of NAME, as a headless "
        "Service has one per cell) or file:PATH (an address a line), asked again every "
        "--discover-interval-s; repeatable (docs/gateway.md, 'Many brokers').",
    ),
    setting_option("--discover-interval-s", cls=GatewaySettings, field="discover_interval_s"),
    option(
        "--routing",
        type=click.Choice(ROUTINGS),
        default=field_default(GatewaySettings, "routing"),
        help="How each row's broker is chosen among those ready for its model: p2c (the "
        "power of two choices on outstanding rows) or round-robin.",
    ),
)


GATEWAY_HOST_OPTION = option(
    "--gateway-host",
    "host",
    default=field_default(GatewaySettings, "host"),
    help="Address the gateway's HTTP and gRPC ports listen on (0.0.0.0: every interface).",
)


@click.command()
@_BROKER_SOURCES
@HTTP_PORT_OPTION
@GRPC_PORT_OPTION
@GATEWAY_HOST_OPTION
@setting_option("--request-timeout-ms", cls=GatewaySettings, field="request_timeout_ms")
@gateway_processes_option("--processes")
@gateway_access_options("")
@local_option(
    "--under-serve", is_flag=True, hidden=True, help="Started by serve or a gateway: stop when stdin closes."
)
@local_option(
    "--shared-ports",
    is_flag=True,
    hidden=True,
    help="One of the processes of a gateway of several: bind with SO_REUSEPORT, say so on stdout.",
)
@curve_client_options
@trace_options
@logging_options
def gateway(
    brokers: BrokerSources,
    http_port: int,
    grpc_port: int,
    host: str,
    request_timeout_ms: float,
    processes: int,
    gateway_access: GatewayAccess,
    under_serve: bool,
    shared_ports: bool,
    curve: ClientKeys,
    trace: TraceSettings,
    logs: LogOptions,
) -> None:
    """Serve the Open Inference Protocol (KServe v2) over HTTP and gRPC in front of a
    broker: Triton's and KServe's clients, curl and load balancers reach batcher's
    batching unchanged (docs/gateway.md). Several gateways may front one broker, and
    one gateway may be several processes on the same ports (--processes)."""
    setup(logs)
    try:
        settings = GatewaySettings(
            host=host,
            http_port=http_port,
            grpc_port=grpc_port,
            request_timeout_ms=request_timeout_ms,
            curve_server_key=curve.curve_server_key,
            curve_secret_key=curve.curve_secret_key,
            api_keys_file=gateway_access.api_keys_file,
            tls_cert_file=gateway_access.tls_cert_file,
            tls_key_file=gateway_access.tls_key_file,
            processes=processes,
            trace=trace,
        )
        settings = brokers.into(settings)
        check_processes_supported(processes)
        pass_trace_to_children(trace)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if shared_ports and processes > 1:
        raise click.UsageError("--shared-ports is for one process of a gateway of several (--processes 1)")
    # A client key pair means a broker with an allow-list (under serve, serve decided).
    gateway_access.check(
        host,
        allow_lists="--curve-secret-key" if curve.curve_secret_key and not under_serve else None,
        keys_option="--api-keys-file",
    )
    require_extra("gateway", "batcher gateway")
    from batcher.gateway import processes as gateway_processes
    from batcher.gateway.server import run

    control_fd = 0 if under_serve else None
    try:
        if processes > 1:
            gateway_processes.run(
                settings,
                lambda one: gateway_command(one, logs.log_level, logs.log_format, shared=True),
                control_fd=control_fd,
            )
        else:
            if shared_ports:
                gateway_processes.die_with_parent()
            run(
                settings,
                control_fd=control_fd,
                shared=shared_ports,
                on_listening=gateway_processes.report_listening if shared_ports else None,
            )
    except gateway_processes.GatewayExited as exc:
        raise click.ClickException(str(exc)) from None
    except ValueError as exc:  # a key file or TLS pair that changed since the check
        raise click.ClickException(str(exc)) from None
    except zmq.ZMQError as exc:
        where = ", ".join(settings.addresses() + settings.discover)
        raise click.ClickException(f"the gateway cannot connect to {where}: {exc}") from None
    except OSError as exc:
        raise click.ClickException(f"the gateway cannot listen: {exc}") from None
