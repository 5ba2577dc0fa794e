"""The gateway process: HTTP and gRPC on one asyncio loop, one connection to the broker.

SIGTERM or SIGINT stops it gracefully: the listeners close, the requests in flight get
up to `grace_s` to finish, then the broker connection closes (any row still waiting is
answered `closed`, 503 / UNAVAILABLE).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from batcher.errors import BindError, SettingsError
from batcher.gateway import access
from batcher.gateway.core import Gateway
from batcher.gateway.settings import GatewaySettings
from batcher.observe.tracer import start_tracing
from batcher.transport.stopping import ignore_stop_signals

if TYPE_CHECKING:
    import grpc

    from batcher.gateway.http_server import HttpServer

log = logging.getLogger("batcher.gateway")

#: How long requests in flight may finish once the gateway is told to stop.
GRACE_S = 5.0
#: The largest request or message the gateway takes (HTTP body, gRPC message).
MAX_BODY_BYTES = 256 * 1024 * 1024


async def serve(
    settings: GatewaySettings,
    stop: asyncio.Event | None = None,
    grace_s: float = GRACE_S,
    control_fd: int | None = None,
    shared: bool = False,
    on_listening: Callable[[], None] | None = None,
) -> None:
    """Run until `stop` is set, or else until `control_fd` (serve's pipe) closes, or
    else until SIGTERM/SIGINT. `shared`: one of several processes of one gateway
    (batcher.gateway.processes), whose ports it shares (SO_REUSEPORT), leaving the
    start-up warning to the parent; `on_listening` is called once both ports listen."""
    if settings.processes != 1:
        raise SettingsError("server.serve is one gateway process: batcher.gateway.processes runs several")
    # The key file and the TLS pair are checked before anything listens (ValueError).
    api_keys = None if settings.api_keys_file is None else access.load_api_keys(settings.api_keys_file)
    tls = access.check_tls_pair(settings.tls_cert_file, settings.tls_key_file)
    warning = access.clear_text_warning(settings.host, api_keys=api_keys is not None, tls=tls is not None)
    if warning is not None and not shared:
        log.warning("%s", warning)
    siblings_up = asyncio.Event()  # shared: set when the parent says every process listens

    def on_parent_data(data: bytes) -> None:
        if SIBLINGS_UP in data:
            siblings_up.set()

    if stop is None:
        stop = _stop_on_signals() if control_fd is None else _stop_on_pipe_close(control_fd, on_parent_data)
    gateway = SharedGateway(settings, siblings_up) if shared else Gateway(settings)
    gateway.tracer = start_tracing(settings.trace, "batcher-gateway")
    http: HttpServer | None = None
    grpc_server = None
    try:
        if settings.http_port:
            from batcher.gateway.http_server import HttpServer

            http = HttpServer(
                gateway,
                settings.host,
                settings.http_port,
                MAX_BODY_BYTES,
                grace_s,
                stop,
                api_keys=api_keys,
                tls_files=None if tls is None else (settings.tls_cert_file, settings.tls_key_file),
                reuse_port=shared,
            )
        if settings.grpc_port:
            grpc_server = await _start_grpc(gateway, settings, api_keys, tls, shared)
        log.info(
            "gateway %s: http%s %s, grpc %s, broker %s, %s",
            "process listening" if shared else "up",
            "s" if tls else "",
            settings.http_port or "off",
            settings.grpc_port or "off",
            " ".join(settings.addresses() + settings.discover),
            "API keys required" if api_keys else "no API keys",
        )
        if on_listening is not None:
            on_listening()
        await stop.wait()
    finally:  # both listeners close at once; what is in flight gets grace_s
        stopping_at = time.monotonic()
        log.info("gateway stopping: listeners closed, requests in flight get up to %.1f s", grace_s)
        closing = [] if grpc_server is None else [grpc_server.stop(grace_s)]
        if http is not None:
            closing.append(http.close())
        await asyncio.gather(*closing)
        await gateway.close()
        log.info("gateway stopped in %.2f s", time.monotonic() - stopping_at)


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


class SharedGateway(Gateway):
    """One process of a gateway of several: not ready (`/v2/health/ready`, ServerReady)
    until its parent says every process listens (SIBLINGS_UP on its pipe), so that a probe
    answered 200 means the whole gateway is up; then ready as one gateway is."""

    def __init__(self, settings: GatewaySettings, siblings_up: asyncio.Event) -> None:
        super().__init__(settings)
        self.siblings_up = siblings_up

    async def ready(self) -> bool:
        return self.siblings_up.is_set() and await super().ready()


#: What the parent of several gateway processes writes to each one's pipe once all listen.
SIBLINGS_UP = b"up"


def _stop_on_pipe_close(fd: int, on_data: Callable[[bytes], None] | None = None) -> asyncio.Event:
    """Under serve: stop when serve closes our stdin (having drained its broker) or dies;
    SIGINT and SIGTERM are ignored, since a signal to the whole process group (Ctrl-C,
    systemd) is for serve, which drains first and then stops us."""
    ignore_stop_signals()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_readable() -> None:
        data = os.read(fd, 4096)
        if not data:  # end of file: the writer is gone
            loop.remove_reader(fd)
            stop.set()
        elif on_data is not None:
            on_data(data)

    loop.add_reader(fd, on_readable)
    return stop


async def _start_grpc(
    gateway: Gateway,
    settings: GatewaySettings,
    api_keys: access.ApiKeys | None,
    tls: tuple[bytes, bytes] | None,
    shared: bool = False,
) -> grpc.aio.Server:
    import grpc

    from batcher.gateway.grpc_api import TokenInterceptor, add_service

    server = grpc.aio.server(
        interceptors=[] if api_keys is None else [TokenInterceptor(api_keys)],
        options=[
            ("grpc.max_receive_message_length", MAX_BODY_BYTES),
            ("grpc.max_send_message_length", MAX_BODY_BYTES),
            # grpcio's default is 1, which would let a second gateway (or any gRPC
            # server of the same user) share the port unseen; several processes of one
            # gateway share it on purpose, after their parent has checked it was free.
            ("grpc.so_reuseport", 1 if shared else 0),
        ],
    )
    add_service(server, gateway)
    where = grpc_address(settings.host, settings.grpc_port)
    try:
        if tls is None:
            port = server.add_insecure_port(where)
        else:
            cert, key = tls
            port = server.add_secure_port(where, grpc.ssl_server_credentials([(key, cert)]))
    except RuntimeError as exc:  # grpcio raises for a port in use (older ones return 0)
        raise BindError(f"cannot listen for gRPC on {where}: {exc}") from None
    if port == 0:
        raise BindError(f"cannot listen for gRPC on {where}")
    await server.start()
    return server


def grpc_address(host: str, port: int) -> str:
    """`host:port` as grpcio reads it: an IPv6 address in brackets (`[::1]:8001`), which
    it would otherwise take for a host name ending in a port."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def run(
    settings: GatewaySettings,
    control_fd: int | None = None,
    shared: bool = False,
    on_listening: Callable[[], None] | None = None,
) -> None:
    """One gateway process: the `batcher gateway` command's body (`control_fd`: its
    parent's pipe, under serve or the gateway's own parent; `shared`, `on_listening`: as
    for `serve`), on uvloop's event loop where it is installed (the gateway extra has it,
    but on Windows): a fifth less of the gateway's own CPU per request than asyncio's loop
    (docs/benchmarks-history.md, issue 30)."""
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(serve(settings, control_fd=control_fd, shared=shared, on_listening=on_listening))


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None  # asyncio's own
    return uvloop.new_event_loop
