"""CurveZMQ encryption and client authentication, with pyzmq's own tools.

Keys are zmq.auth certificate files (`batcher keygen DIR` writes NAME.key and
NAME.key_secret). A broker given its secret key file encrypts both of its sockets;
given a directory of public keys, it admits only those peers (clients and workers),
through zmq.auth's ZAP authenticator, and logs each refusal.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("batcher.security")


class KeyFileError(ValueError):
    """A key file that cannot be used."""


def generate_keys(directory: str, name: str) -> tuple[str, str]:
    """Write NAME.key (public) and NAME.key_secret (secret) in `directory`."""
    os.makedirs(directory, exist_ok=True)
    public, secret = zmq.auth.create_certificates(directory, name)
    os.chmod(secret, 0o600)
    return str(public), str(secret)


def load_keypair(path: str) -> tuple[bytes, bytes]:
    """(public, secret) from a NAME.key_secret file."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"cannot load key file {path}: {exc}") from None
    if secret is None:
        raise KeyFileError(f"{path} holds no secret key (give the .key_secret file)")
    return public, secret


def load_public_key(path: str) -> bytes:
    """The public key from a NAME.key (or NAME.key_secret) file."""
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"cannot load key file {path}: {exc}") from None
    return public


@dataclass(frozen=True)
class CurveServerKeys:
    """The broker's side: its key pair and, optionally, the allow-list directory."""

    secret_key_file: str
    clients_dir: str | None = None


class _AllowList:
    """zmq.auth credentials provider: admits the listed keys, logs every refusal."""

    def __init__(self, allowed: set[bytes]) -> None:
        self.allowed = allowed
        self.refused: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        # A refused peer retries its handshake on every reconnect: one warning per key.
        level = logging.DEBUG if key in self.refused else logging.WARNING
        self.refused.add(key)
        log.log(level, "refused a connection: public key %s is not in the allow-list", key.decode())
        return False


def secure_server(
    ctx: zmq.Context[Any], sockets: list[zmq.Socket[Any]], keys: CurveServerKeys
) -> ThreadAuthenticator | None:
    """Make `sockets` CURVE servers (before they bind). With an allow-list, start the
    authenticator; the broker's own public key is allowed too, for `serve`'s workers."""
    public, secret = load_keypair(keys.secret_key_file)
    for sock in sockets:
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
    if keys.clients_dir is None:
        return None
    if not os.path.isdir(keys.clients_dir):
        raise KeyFileError(f"--curve-clients {keys.clients_dir} is not a directory")
    allowed = set(zmq.auth.load_certificates(keys.clients_dir)) | {public}
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("batcher.zap"))
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_AllowList(allowed))
    log.info("CURVE on; %d public keys allowed from %s", len(allowed) - 1, keys.clients_dir)
    return auth


def secure_client(sock: zmq.Socket[Any], server_key_file: str, secret_key_file: str | None) -> None:
    """Make `sock` a CURVE client of the server whose public key is in `server_key_file`
    (before it connects). Without a key pair of its own it uses a throwaway one, which
    only a broker without an allow-list admits."""
    sock.curve_serverkey = load_public_key(server_key_file)
    if secret_key_file:
        public, secret = load_keypair(secret_key_file)
    else:
        public, secret = zmq.curve_keypair()
    sock.curve_publickey = public
    sock.curve_secretkey = secret
