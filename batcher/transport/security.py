"""CurveZMQ encryption and peer authentication, with pyzmq's own tools.

Keys are zmq.auth certificate files (`batcher keygen DIR` writes NAME.key and
NAME.key_secret). A broker given its secret key file encrypts both of its sockets.
Authentication has two roles, because a worker sees every request it is sent and
answers for the model: `--curve-clients DIR` lists who may use the frontend,
`--curve-workers DIR` who may serve on the backend. Each socket has a ZAP domain of
its own, checked by zmq.auth's ThreadAuthenticator, and each refusal is logged.

A third list, `--curve-admins DIR`, names the keys that may send the control requests
that change the service (`reload`, control.MUTATING_OPS). The authenticator gives each
admitted connection its key as ZeroMQ's User-Id (pyzmq's `curve_user_id`: the key's
Z85 text), which every message received from it carries; the broker reads it from a
control request's frame, so a key's role is decided at each request, as the lists
stand then.
"""

from __future__ import annotations

import glob
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.backend import Frame

from batcher.errors import BatcherError

log = logging.getLogger("batcher.security")

#: ZAP domains of the broker's two sockets: the authenticator tells them apart by these.
FRONTEND_DOMAIN = "frontend"
BACKEND_DOMAIN = "backend"
#: Refused keys remembered (to log each once); past this, refusals of new keys go to DEBUG,
#: so a peer making up keys can grow neither the log nor the broker's memory.
MAX_REMEMBERED_REFUSALS = 1024


class KeyFileError(BatcherError, ValueError):
    """A key file that cannot be used."""


class KeyExistsError(KeyFileError):
    """A key pair of that name is already there: replacing it would lock out every peer
    that holds its public key, so it takes `force`."""


def generate_keys(directory: str, name: str, force: bool = False) -> tuple[str, str]:
    """Write NAME.key (public) and NAME.key_secret (secret) in `directory`; refuse to
    replace either file unless `force` (KeyExistsError), and a NAME that is not a plain
    file name (ValueError)."""
    if not name or name in (".", "..") or os.sep in name or (os.altsep and os.altsep in name):
        raise ValueError(f"the name must be a plain file name, got {name!r}")
    paths = [os.path.join(directory, name + ext) for ext in (".key", ".key_secret")]
    existing = [p for p in paths if os.path.lexists(p)]
    if existing and not force:
        raise KeyExistsError(
            f"{' and '.join(existing)} already exist{'s' if len(existing) == 1 else ''}: "
            "give --force to replace the key pair (every peer holding its public key must then "
            "be given the new one)"
        )
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
    """The broker's side: its key pair and the allow-list directories of the two roles.

    Without either directory CURVE only encrypts. With `clients_dir` alone the backend
    admits only the broker's own key (`serve`'s workers): authenticated clients behind
    a backend anyone may serve from would gain nothing. With `workers_dir` alone the
    frontend stays open to any key (encrypted, not authenticated). With `admins_dir`,
    only its keys and the broker's own may send the control requests that change the
    service; its keys are admitted on the frontend too."""

    secret_key_file: str
    clients_dir: str | None = None
    workers_dir: str | None = None
    #: Keys that may change the service (`reload`); also admitted on the frontend. None:
    #: no admin role, every admitted client may.
    admins_dir: str | None = None


def load_allow_list(directory: str, option: str) -> set[bytes]:
    """The public keys (*.key) of an allow-list directory. Secret keys found there are
    reported: an allow-list is copied to the broker's host, a secret key must not be."""
    if not os.path.isdir(directory):
        raise KeyFileError(f"{option} {directory} is not a directory")
    try:
        keys = set(zmq.auth.load_certificates(directory))
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"cannot load the keys of {option} {directory}: {exc}") from None
    pattern = os.path.join(glob.escape(directory), "*.key_secret")
    secrets = sorted(os.path.basename(p) for p in glob.glob(pattern))
    if secrets:
        log.warning(
            "%s %s holds secret key files (%s): an allow-list needs public keys (.key) only; "
            "keep each secret key on its own host",
            option,
            directory,
            ", ".join(secrets),
        )
    return keys


class _RoleCheck:
    """zmq.auth credentials provider for one socket: admits its own role's keys and the
    broker's, and logs each refused key once at WARNING (then at DEBUG), naming the other
    role when the key belongs to it, since that is a mistake worth spelling out."""

    def __init__(
        self,
        side: str,
        allowed: set[bytes] | None,
        own_option: str,
        other: set[bytes],
        other_role: str,
    ) -> None:
        self.side = side
        self.allowed = allowed  # None: any key (encryption only)
        self.own_option = own_option
        self.other = other
        self.other_role = other_role
        self.refused: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        if self.allowed is None or key in self.allowed:
            return True
        # A refused peer retries its handshake on every reconnect: one warning per key.
        level = logging.DEBUG if key in self.refused else logging.WARNING
        if len(self.refused) < MAX_REMEMBERED_REFUSALS:
            self.refused.add(key)
        elif key not in self.refused:
            level = logging.DEBUG
        if key in self.other:
            why = f"key {key.decode()} is a {self.other_role} key, not in {self.own_option}"
        else:
            why = f"public key {key.decode()} is not in {self.own_option}"
        log.log(level, "refused a connection on the %s: %s", self.side, why)
        return False


def secure_server(
    ctx: zmq.Context[Any], keys: CurveServerKeys, frontend: zmq.Socket[Any], backend: zmq.Socket[Any]
) -> CurveGate | None:
    """Make both sockets CURVE servers with ZAP domains of their own (before they bind).
    With an allow-list, start the authenticator, which checks each socket against its
    role's list; the broker's own public key is admitted on both (`serve`'s workers,
    `bench --spawn`)."""
    public, secret = load_keypair(keys.secret_key_file)
    for sock, domain in ((frontend, FRONTEND_DOMAIN), (backend, BACKEND_DOMAIN)):
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
        sock.zap_domain = domain.encode()
    if keys.clients_dir is None and keys.workers_dir is None and keys.admins_dir is None:
        return None
    front = _RoleCheck("frontend", None, "--curve-clients", set(), "worker")
    back = _RoleCheck("backend", None, "--curve-workers", set(), "client")
    gate = CurveGate(keys, public, front, back)
    says = gate.load()
    gate.auth = ThreadAuthenticator(ctx, log=logging.getLogger("batcher.zap"))
    gate.auth.start()
    gate.auth.configure_curve_callback(domain=FRONTEND_DOMAIN, credentials_provider=front)
    gate.auth.configure_curve_callback(domain=BACKEND_DOMAIN, credentials_provider=back)
    log.info("CURVE on; %s", says)
    return gate


@dataclass
class CurveGate:
    """The broker's two allow-lists, checked by a ZAP authenticator, and its admins, all
    read again on SIGHUP: an added key is admitted, a removed one refused at its next
    handshake (a connection already admitted stays up); a key's admin role is looked up
    at each control request, so it is gained or lost at the next one."""

    keys: CurveServerKeys
    public: bytes
    front: _RoleCheck
    back: _RoleCheck
    auth: ThreadAuthenticator | None = None
    #: The Z85 keys that may change the service (the admins' and the broker's own, which
    #: `serve`'s gateway and `bench --spawn` use); None without --curve-admins.
    admins: frozenset[bytes] | None = None
    _forbidden: set[str] = field(default_factory=set)  # keys refused a mutating op, logged

    def load(self) -> str:
        """Read the directories and swap the checks' key sets (each swap is one
        assignment, so the authenticator's thread sees the old set or the new one);
        KeyFileError, changing nothing, when a directory cannot be read."""
        keys, public = self.keys, self.public
        clients = load_allow_list(keys.clients_dir, "--curve-clients") if keys.clients_dir else set()
        workers = load_allow_list(keys.workers_dir, "--curve-workers") if keys.workers_dir else set()
        admins = load_allow_list(keys.admins_dir, "--curve-admins") if keys.admins_dir else None
        # An admin is a client that may do more: admitted on the frontend, not the backend.
        front_keys = clients | (admins or set())
        both = sorted(k.decode() for k in front_keys & workers)
        if both:
            log.warning(
                "%d keys are in both --curve-clients (or --curve-admins) and --curve-workers, "
                "so admitted as either: %s",
                len(both),
                ", ".join(both[:5]) + (", ..." if len(both) > 5 else ""),
            )
        if keys.clients_dir:
            self.front.allowed = front_keys | {public}
            front_says = f"{len(clients)} client keys from {keys.clients_dir}"
        else:
            front_says = "any key (no --curve-clients)"
        if admins is not None:
            front_says += f"; {len(admins)} admin keys from {keys.admins_dir} may reload"
        self.front.other = workers - front_keys
        # Without --curve-workers but with --curve-clients, only the broker's own key may
        # serve; --curve-admins alone leaves the backend open, as no list at all does.
        if keys.clients_dir or keys.workers_dir:
            self.back.allowed = workers | {public}
            back_says = (
                f"{len(workers)} worker keys from {keys.workers_dir}"
                if keys.workers_dir
                else "only the broker's own key (no --curve-workers)"
            )
        else:
            back_says = "any key (no --curve-workers or --curve-clients)"
        self.back.other = front_keys - workers
        self.admins = None if admins is None else frozenset(admins | {public})
        return f"frontend admits {front_says}; backend admits {back_says}"

    def reload(self) -> None:
        """SIGHUP: read the allow-lists again; on an error keep the current ones."""
        try:
            says = self.load()
        except KeyFileError as exc:
            log.error("SIGHUP: %s; the allow-lists are unchanged", exc)
            return
        log.info("SIGHUP: allow-lists read again; %s", says)

    def is_admin(self, frame: Frame) -> bool:
        """Whether the message `frame` came in may change the service: always without
        --curve-admins; with it, when the key its connection was admitted with (its
        User-Id) is an admin's or the broker's own. Read only for control requests."""
        admins = self.admins
        if admins is None:
            return True
        try:
            user_id = frame.get("User-Id")
        except zmq.ZMQError:  # no User-Id: a connection the authenticator never saw
            return False
        return isinstance(user_id, str) and user_id.encode() in admins

    def note_forbidden(self, frame: Frame, op: str) -> None:
        """Log a control request refused `forbidden`, naming its key: at WARNING once per
        key (then at DEBUG, and past MAX_REMEMBERED_REFUSALS keys at DEBUG only), so a
        client repeating it grows neither the log nor the broker's memory."""
        try:
            key = str(frame.get("User-Id"))
        except zmq.ZMQError:
            key = "(none)"
        level = logging.DEBUG if key in self._forbidden else logging.WARNING
        if len(self._forbidden) < MAX_REMEMBERED_REFUSALS:
            self._forbidden.add(key)
        elif key not in self._forbidden:
            level = logging.DEBUG
        log.log(level, "refused %s from key %s: not in --curve-admins (answered forbidden)", op, key)

    def stop(self) -> None:
        if self.auth is not None:
            self.auth.stop()


def secure_client(sock: zmq.Socket[Any], server_key_file: str, secret_key_file: str | None) -> None:
    """Make `sock` a CURVE client of the server whose public key is in `server_key_file`
    (before it connects). Without a key pair of its own it uses a throwaway one, which
    only a broker without an allow-list for that socket admits."""
    sock.curve_serverkey = load_public_key(server_key_file)
    if secret_key_file:
        public, secret = load_keypair(secret_key_file)
    else:
        public, secret = zmq.curve_keypair()
    sock.curve_publickey = public
    sock.curve_secretkey = secret


#: Handshake failures a broker socket reports through its monitor.
HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
#: At most one warning per socket and kind of failure in this many seconds (then a count).
HANDSHAKE_LOG_INTERVAL_S = 60.0


class HandshakeWatch:
    """Counts and logs, at a bounded rate, the CURVE handshakes a broker socket refused:
    a peer speaking plaintext or with the wrong server key fails before any allow-list is
    asked (and would otherwise go unnoticed); a key an allow-list refused is logged by
    the allow-list, and only counted here."""

    def __init__(self, sockets: dict[str, zmq.Socket[Any]]) -> None:
        self._sockets = list(sockets.values())
        self.monitors: dict[zmq.Socket[Any], str] = {
            sock.get_monitor_socket(HANDSHAKE_FAILURES): name for name, sock in sockets.items()
        }
        self.refused: dict[str, int] = dict.fromkeys(sockets, 0)
        self._last_log: dict[tuple[str, int], tuple[float, int]] = {}  # -> (when, count then)

    def handle(self, monitor: zmq.Socket[Any], now: float) -> None:
        """Read every event waiting on `monitor` (registered in the broker's poller)."""
        from zmq.utils.monitor import recv_monitor_message

        name = self.monitors[monitor]
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            self.refused[name] += 1
            kind = int(event["event"])
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                continue  # the allow-list logged it, with the key
            if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                # Mostly a peer that went away mid-handshake (a worker checking the address
                # before it loads its model does): counted, not worth a warning.
                log.debug("a handshake on the %s ended early (error %s)", name, event.get("value"))
                continue
            last_at, count_then = self._last_log.get((name, kind), (-math.inf, 0))
            if now - last_at < HANDSHAKE_LOG_INTERVAL_S:
                continue
            since = self.refused[name] - count_then - 1
            log.warning(
                "refused a handshake on the %s (protocol error %s): a plaintext peer on a CURVE socket, "
                "or a peer with the wrong server key?%s",
                name,
                event.get("value"),
                f" ({since} more refused since the last such line)" if since > 0 else "",
            )
            self._last_log[(name, kind)] = (now, self.refused[name])

    def close(self) -> None:
        for sock in self._sockets:
            sock.disable_monitor()
        for monitor in self.monitors:
            monitor.close(0)
