"""Where the gateway finds its brokers besides --connect: a DNS name (a Kubernetes headless
Service: one A/AAAA record per cell) or a file of addresses (a sidecar's, the tests').

Each source is asked every --discover-interval-s; batcher/gateway/brokers.py turns the
answers into brokers added and removed (core.routing.membership_change). Nothing here
blocks the event loop: names are resolved with the loop's getaddrinfo (a thread of the
loop's pool), and a file is read only when its modification time or size changed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
from dataclasses import dataclass

from batcher.errors import SettingsError

DNS_SCHEME = "dns+tcp://"
FILE_SCHEME = "file:"


@dataclass(frozen=True)
class DnsSource:
    """`dns+tcp://NAME:PORT`: one broker at tcp://ADDRESS:PORT per A/AAAA record of NAME."""

    name: str
    port: int


@dataclass(frozen=True)
class FileSource:
    """`file:PATH`: one broker address a line (blank lines and # comments skipped)."""

    path: str


Source = DnsSource | FileSource


def parse_source(spec: str) -> Source:
    """The source `spec` names; SettingsError saying what is wrong with it."""
    if spec.startswith(FILE_SCHEME):
        path = spec[len(FILE_SCHEME) :]
        if not path:
            raise SettingsError(f"--discover {spec!r}: give a path after file:")
        return FileSource(path)
    if spec.startswith(DNS_SCHEME):
        rest = spec[len(DNS_SCHEME) :]
        name, sep, port = rest.rpartition(":")
        if not sep or not name or not port.isdigit() or not 0 < int(port) <= 65535:
            raise SettingsError(f"--discover {spec!r}: expected dns+tcp://NAME:PORT with a port in 1..65535")
        return DnsSource(name.strip("[]"), int(port))
    raise SettingsError(f"--discover {spec!r}: expected dns+tcp://NAME:PORT or file:PATH")


def tcp_address(host: str, port: int) -> str:
    """The ZeroMQ address of `host` (an IPv6 one in brackets) and `port`."""
    try:
        is_v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        is_v6 = False
    return f"tcp://[{host}]:{port}" if is_v6 else f"tcp://{host}:{port}"


def read_addresses(text: str) -> list[str]:
    """The addresses of a discovery file: one a line, blank lines and # comments skipped."""
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line]


class Discoverer:
    """One source, asked again and again (`resolve`): the brokers it names now, or None
    when it cannot say (a DNS failure, an unreadable or empty file: a writer that
    truncates before it writes leaves it empty for a moment), which leaves the last answer."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.source = parse_source(spec)
        self._seen: tuple[int, int] | None = None  # the file's (mtime_ns, size) last read
        self._last: list[str] | None = None

    async def resolve(self) -> list[str] | None:
        """The brokers the source names now (sorted), or None: it cannot say."""
        if isinstance(self.source, DnsSource):
            return await self._resolve_dns(self.source)
        return self._read_file(self.source)

    async def _resolve_dns(self, source: DnsSource) -> list[str] | None:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(source.name, source.port, type=socket.SOCK_STREAM)
        except OSError:
            return None
        hosts = {str(info[4][0]) for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)}
        return sorted(tcp_address(h, source.port) for h in hosts)

    def _read_file(self, source: FileSource) -> list[str] | None:
        try:
            st = os.stat(source.path)
            seen = (st.st_mtime_ns, st.st_size)
            if seen == self._seen and self._last is not None:
                return self._last  # unchanged: not read again
            with open(source.path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            return None
        if not text:  # truncated by a writer that has not written yet: not an empty list
            return None
        self._seen, self._last = seen, sorted(set(read_addresses(text)))
        return self._last
