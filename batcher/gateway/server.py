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

from batcher.gateway import access
from batcher.gateway.core import Gateway, GatewaySettings
from batcher.stopping import ignore_stop_signals

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
) -> None:
    """Run until `stop` is set, or else until `control_fd` (serve's pipe) closes, or
    else until SIGTERM/SIGINT."""
    # The key file and the TLS pair are checked before anything listens (ValueError).
    api_keys = None if settings.api_keys_file is None else access.load_api_keys(settings.api_keys_file)
    tls = access.check_tls_pair(settings.tls_cert_file, settings.tls_key_file)
    warning = access.clear_text_warning(settings.host, api_keys=api_keys is not None, tls=tls is not None)
    if warning is not None:
        log.warning("%s", warning)
    if stop is None:
        stop = _stop_on_signals() if control_fd is None else _stop_on_pipe_close(control_fd)
    gateway = Gateway(settings)
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
            )
        if settings.grpc_port:
            grpc_server = await _start_grpc(gateway, settings, api_keys, tls)
        log.info(
            "gateway up: http%s %s, grpc %s, broker %s, %s",
            "s" if tls else "",
            settings.http_port or "off",
            settings.grpc_port or "off",
            settings.connect,
            "API keys required" if api_keys else "no API keys",
        )
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


def _stop_on_pipe_close(fd: int) -> asyncio.Event:
    """Under serve: stop when serve closes our stdin (having drained its broker) or dies;
    SIGINT and SIGTERM are ignored, since a signal to the whole process group (Ctrl-C,
    systemd) is for serve, which drains first and then stops us."""
    ignore_stop_signals()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_readable() -> None:
        if not os.read(fd, 4096):  # end of file: the writer is gone
            loop.remove_reader(fd)
            stop.set()

    loop.add_reader(fd, on_readable)
    return stop


async def _start_grpc(
    gateway: Gateway,
    settings: GatewaySettings,
    api_keys: access.ApiKeys | None,
    tls: tuple[bytes, bytes] | None,
) -> grpc.aio.Server:
    import grpc

    from batcher.gateway.grpc_api import TokenInterceptor, add_service

    server = grpc.aio.server(
        interceptors=[] if api_keys is None else [TokenInterceptor(api_keys)],
        options=[
            ("grpc.max_receive_message_length", MAX_BODY_BYTES),
            ("grpc.max_send_message_length", MAX_BODY_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )
    add_service(server, gateway)
    where = f"{settings.host}:{settings.grpc_port}"
    try:
        if tls is None:
            port = server.add_insecure_port(where)
        else:
            cert, key = tls
            port = server.add_secure_port(where, grpc.ssl_server_credentials([(key, cert)]))
    except RuntimeError as exc:  # grpcio raises for a port in use (older ones return 0)
        raise OSError(f"cannot listen for gRPC on {where}: {exc}") from None
    if port == 0:
        raise OSError(f"cannot listen for gRPC on {where}")
    await server.start()
    return server


def run(settings: GatewaySettings, control_fd: int | None = None) -> None:
    """The `batcher gateway` command's body (`control_fd`: serve's pipe, under serve),
    on uvloop's event loop where it is installed (the gateway extra has it, but on
    Windows): a fifth less of the gateway's own CPU per request than asyncio's loop
    (docs/benchmarks.md, issue 30)."""
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(serve(settings, control_fd=control_fd))


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None  # asyncio's own
    return uvloop.new_event_loop
