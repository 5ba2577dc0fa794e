"""The gateway's own access control: API keys (bearer tokens) from a file, TLS from a
certificate pair, and the rule that keeps an unauthenticated gateway off the network
while CurveZMQ allow-lists guard the broker. Under `serve --curve-clients` the gateway
talks to the broker with the broker's own key, so without this its HTTP and gRPC ports
would be a way past the allow-list. No I/O here but reading the files it is given."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import ssl
from collections.abc import Iterable
from pathlib import Path

from batcher.errors import SettingsError

#: The HTTP paths served without a token: the health probes (liveness and readiness,
#: which Kubernetes asks too); everything else needs one, as Triton's restricted APIs do.
OPEN_PATHS = frozenset({b"/v2/health/live", b"/v2/health/ready"})
#: The gRPC methods served without a token: the same two probes.
OPEN_METHODS = frozenset(
    {"/inference.GRPCInferenceService/ServerLive", "/inference.GRPCInferenceService/ServerReady"}
)
#: Said by a 401 (HTTP) and UNAUTHENTICATED (gRPC).
MISSING = "an API key is required: send 'Authorization: Bearer TOKEN' (or X-API-Key: TOKEN)"
WRONG = "the API key is not accepted"


def parse_api_keys(text: str, where: str) -> tuple[str, ...]:
    """The tokens of a key file's text: one a line, surrounding blanks stripped, blank
    lines and lines starting with `#` skipped. A token must be printable ASCII with no
    blank inside (it travels in a header); ValueError naming the line otherwise, or for
    a file that holds none."""
    tokens: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        token = line.strip()
        if not token or token.startswith("#"):
            continue
        if not (token.isascii() and token.isprintable()) or any(c.isspace() for c in token):
            raise SettingsError(
                f"{where}, line {number}: an API key must be printable ASCII without blanks (one key a line)"
            )
        tokens.append(token)
    if not tokens:
        raise SettingsError(f"{where} holds no API key (one a line; blank lines and # comments are skipped)")
    return tuple(tokens)


def load_api_keys(path: str) -> ApiKeys:
    """The keys of `path` (--api-keys-file); ValueError, one line, if it cannot be read
    or holds none."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SettingsError(f"--api-keys-file {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"--api-keys-file {path}: cannot be read: {exc}") from None
    return ApiKeys(parse_api_keys(text, f"--api-keys-file {path}"))


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


class ApiKeys:
    """The accepted tokens, kept as SHA-256 digests so that every comparison is of equal
    length: `accepts` compares the given token with every key (hmac.compare_digest, no
    early exit), so its time says neither which key nor how much of one matched."""

    def __init__(self, tokens: Iterable[str]) -> None:
        self._digests = tuple(_digest(t.encode()) for t in tokens)
        if not self._digests:
            raise SettingsError("ApiKeys needs at least one token")

    def accepts(self, token: bytes | None) -> bool:
        if token is None:
            return False
        given = _digest(token)
        ok = False
        for digest in self._digests:
            ok |= hmac.compare_digest(digest, given)
        return ok

    def refusal(self, authorization: bytes | None, api_key: bytes | None) -> str | None:
        """None when the request may pass; else why not (MISSING or WRONG). It passes
        with `Authorization: Bearer TOKEN` or `X-API-Key: TOKEN` (LitServe's header)."""
        token = bearer_token(authorization) if authorization is not None else api_key
        if token is None:
            return MISSING
        return None if self.accepts(token) else WRONG


def bearer_token(value: bytes) -> bytes | None:
    """The token of an `Authorization: Bearer TOKEN` value (the scheme in any case, as
    RFC 9110 has it), or None for another scheme."""
    scheme, _, token = value.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    token = token.strip()
    return token or None


def is_loopback(host: str) -> bool:
    """Whether listening on `host` keeps a port to this machine: a loopback address or
    `localhost`. Any other name, and every wildcard (0.0.0.0, ::, empty), is taken as
    reachable from the network."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_error(
    host: str, *, api_keys: bool, allow_lists: str | None, allow_unauthenticated: bool, keys_option: str
) -> str | None:
    """Why a gateway must not start (one line), or None. An unauthenticated gateway on a
    non-loopback host while CurveZMQ allow-lists guard the broker (`allow_lists`: the
    option that says so, or None) would be a way past them: refused unless told
    --allow-unauthenticated-gateway. `keys_option` is the command's --api-keys-file."""
    if api_keys or allow_lists is None or allow_unauthenticated or is_loopback(host):
        return None
    return (
        f"the gateway would listen on {host} without authentication while CurveZMQ allow-lists "
        f"guard the broker ({allow_lists}): give {keys_option} PATH, listen on 127.0.0.1, or pass "
        "--allow-unauthenticated-gateway to open it anyway"
    )


def clear_text_warning(host: str, *, api_keys: bool, tls: bool) -> str | None:
    """A warning for tokens that would cross the network unencrypted, or None."""
    if not api_keys or tls or is_loopback(host):
        return None
    return (
        f"the gateway listens on {host} with API keys but without TLS: tokens travel in clear "
        "(give --tls-cert-file and --tls-key-file, or put it behind a proxy that terminates TLS)"
    )


def check_tls_pair(cert_file: str | None, key_file: str | None) -> tuple[bytes, bytes] | None:
    """The (certificate chain, private key) PEM bytes of a TLS pair, checked to load and
    to match (ssl's own loader); None for no TLS. ValueError, one line, otherwise."""
    if cert_file is None and key_file is None:
        return None
    if cert_file is None or key_file is None:
        raise SettingsError("--tls-cert-file and --tls-key-file go together: give both or neither")
    try:
        cert, key = Path(cert_file).read_bytes(), Path(key_file).read_bytes()
    except OSError as exc:
        raise SettingsError(f"the TLS pair cannot be read: {exc}") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert_file, key_file, password=lambda: b"")  # no prompt for a locked key
    except ssl.SSLError as exc:
        reason = exc.reason or str(exc)
        raise SettingsError(
            f"the TLS pair {cert_file} / {key_file} does not load ({reason}): a PEM certificate "
            "and its own unencrypted private key are needed"
        ) from None
    return cert, key
