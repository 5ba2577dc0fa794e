"""The ZeroMQ address forms batcher's sockets take, checked before any socket sees them.

libzmq answers a malformed endpoint (`127.0.0.1:5555`, no scheme) with EINVAL from deep
inside a send or a bind; every address a user gives (the command line's --connect,
--frontend, --backend, a config file, their variables) is checked here first, so the
error is one line naming the form expected. No zmq import: this is text.
"""

from __future__ import annotations

from batcher.errors import SettingsError

#: What an address must look like, said in every refusal.
EXPECTED = "tcp://HOST:PORT or ipc://PATH"
#: The highest TCP port.
MAX_PORT = 65535


def check_address(text: str, *, bind: bool) -> str:
    """`text`, stripped, if it is an address a socket can `bind` (bind=True: a broker's
    frontend or backend; `tcp://*:PORT` is every interface) or connect to (bind=False:
    a client's, a worker's, a gateway's); ValueError naming the expected form if not."""
    address = text.strip()
    scheme, sep, rest = address.partition("://")
    if not sep:
        raise SettingsError(f"expected {EXPECTED}, got {text!r} (no scheme)")
    if scheme == "ipc":
        if not rest:
            raise SettingsError(f"expected {EXPECTED}, got {text!r} (no path)")
        return address
    if scheme != "tcp":
        raise SettingsError(f"expected {EXPECTED}, got {text!r} (scheme {scheme!r})")
    host, colon, port = rest.rpartition(":")
    if not colon or not host:
        raise SettingsError(f"expected {EXPECTED}, got {text!r} (no HOST:PORT)")
    if not port.isascii() or not port.isdigit() or not 1 <= int(port) <= MAX_PORT:
        raise SettingsError(f"expected {EXPECTED} with a PORT of 1..{MAX_PORT}, got {text!r}")
    if host == "*" and not bind:
        raise SettingsError(f"expected {EXPECTED} naming the host to connect to, got {text!r} (* only binds)")
    if host.startswith("[") != host.endswith("]") or any(c.isspace() for c in host):
        raise SettingsError(f"expected {EXPECTED}, got {text!r} (HOST {host!r})")
    return address
