"""Issue 28, item 18: the gateway's own access control. Under `serve --curve-clients` the
gateway talks to the broker with the broker's own key, so its ports were an
unauthenticated way past the allow-list. Now: API keys from a file on every endpoint but
the health probes (401 / UNAUTHENTICATED), TLS from a certificate pair on both
protocols, and a refusal to open an unauthenticated gateway on a non-loopback host while
allow-lists guard the broker."""

from __future__ import annotations

import http.client
import json
import shutil
import ssl
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

from batcher.gateway import access
from batcher.gateway import inference_pb2 as pb
from batcher.gateway import inference_pb2_grpc as pb_grpc
from batcher.serve.launcher import ServeProcess
from batcher.transport.security import generate_keys
from tests.helpers import wait_until
from tests.integration.gateway.test_gateway import PROBE, free_port

TOKEN = "s3cret-token-for-tests"
OTHER = "another.key_of+the/file="
#: An address of TEST-NET-1 (RFC 5737), assigned to no host here: the refusal tests name a
#: non-loopback host without ever being able to listen on a network, even if they fail.
NOWHERE = "192.0.2.1"
INFER = json.dumps({"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]}).encode()


# --- the token file ---------------------------------------------------------------------------


def test_the_key_file_holds_one_token_a_line_and_skips_blanks_and_comments() -> None:
    text = f"# the gateway's keys\n\n  {TOKEN}  \n\t\n# {OTHER} is a comment\n{OTHER}\n"
    assert access.parse_api_keys(text, "f") == (TOKEN, OTHER)


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n  # and another\n"])
def test_a_key_file_without_a_key_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"^keys\.txt holds no API key \(one a line"):
        access.parse_api_keys(text, "keys.txt")


@pytest.mark.parametrize("line", ["two words", "caf\u00e9", "bell\x07"])
def test_a_key_that_cannot_travel_in_a_header_is_refused_naming_its_line(line: str) -> None:
    with pytest.raises(ValueError, match=r"^keys\.txt, line 2: an API key must be printable ASCII"):
        access.parse_api_keys(f"{TOKEN}\n{line}\n", "keys.txt")


def test_a_missing_or_empty_key_file_is_one_precise_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^--api-keys-file .*nope\.txt: no such file$"):
        access.load_api_keys(str(tmp_path / "nope.txt"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"empty\.txt holds no API key"):
        access.load_api_keys(str(tmp_path / "empty.txt"))


def test_only_a_listed_token_passes_by_either_header() -> None:
    keys = access.ApiKeys([TOKEN, OTHER])
    for token in (TOKEN, OTHER):
        assert keys.refusal(f"Bearer {token}".encode(), None) is None
        assert keys.refusal(None, token.encode()) is None
    assert keys.refusal(f"bearer  {TOKEN} ".encode(), None) is None  # the scheme in any case
    assert keys.refusal(None, None) == access.MISSING
    assert keys.refusal(b"Basic dXNlcjpwYXNz", None) == access.MISSING
    assert keys.refusal(b"Bearer", None) == access.MISSING
    for wrong in (TOKEN[:-1], TOKEN + "x", TOKEN.upper(), OTHER[1:]):
        assert keys.refusal(f"Bearer {wrong}".encode(), None) == access.WRONG
        assert keys.refusal(None, wrong.encode()) == access.WRONG
    assert keys.refusal(b"Bearer nope", None) == access.WRONG


# --- where it may listen -----------------------------------------------------------------------


def test_loopback_hosts_are_told_from_the_network() -> None:
    for host in ("127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost", "LOCALHOST"):
        assert access.is_loopback(host), host
    for host in ("0.0.0.0", "::", "", NOWHERE, "10.0.0.1", "gpu-box.example.com"):
        assert not access.is_loopback(host), host


def exposure(
    host: str, *, keys: bool = False, lists: str | None = "--curve-clients", allow: bool = False
) -> Any:
    return access.exposure_error(
        host,
        api_keys=keys,
        allow_lists=lists,
        allow_unauthenticated=allow,
        keys_option="--gateway-api-keys-file",
    )


def test_an_unauthenticated_gateway_past_allow_lists_is_refused_unless_allowed() -> None:
    for host in ("0.0.0.0", "::", NOWHERE):
        error = exposure(host)
        assert error is not None
        assert "--curve-clients" in error and "--gateway-api-keys-file" in error
        assert "--allow-unauthenticated-gateway" in error and "\n" not in error
        assert exposure(host, allow=True) is None  # the explicit override
        assert exposure(host, keys=True) is None  # authenticated
        assert exposure(host, lists=None) is None  # no allow-list to get past
    assert exposure("127.0.0.1") is None and exposure("::1") is None  # loopback only


def test_tokens_in_clear_on_the_network_are_warned_of() -> None:
    warning = access.clear_text_warning("0.0.0.0", api_keys=True, tls=False)
    assert warning is not None and "tokens travel in clear" in warning
    assert access.clear_text_warning("0.0.0.0", api_keys=True, tls=True) is None
    assert access.clear_text_warning("127.0.0.1", api_keys=True, tls=False) is None
    assert access.clear_text_warning("0.0.0.0", api_keys=False, tls=False) is None


# --- TLS pairs ---------------------------------------------------------------------------------


def make_pair(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost, and its key (openssl CLI)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed: no certificate to test TLS with")
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
            *("-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost"),
            *("-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return cert, key


def test_a_tls_pair_that_does_not_load_or_match_is_one_line(tmp_path: Path) -> None:
    cert, key = make_pair(tmp_path, "a")
    _, other_key = make_pair(tmp_path, "b")
    assert access.check_tls_pair(str(cert), str(key)) == (cert.read_bytes(), key.read_bytes())
    assert access.check_tls_pair(None, None) is None
    with pytest.raises(ValueError, match="does not load") as info:
        access.check_tls_pair(str(cert), str(other_key))
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="does not load"):
        access.check_tls_pair(str(key), str(cert))  # swapped
    with pytest.raises(ValueError, match="go together"):
        access.check_tls_pair(str(cert), None)
    with pytest.raises(ValueError, match="cannot be read"):
        access.check_tls_pair(str(tmp_path / "nope.crt"), str(key))


# --- end to end ---------------------------------------------------------------------------------


def request(
    port: int,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    context: ssl.SSLContext | None = None,
) -> tuple[int, dict[str, str], Any]:
    conn: http.client.HTTPConnection
    if context is None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    else:
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=20, context=context)
    try:
        conn.request(method, path, body, headers or {})
        r = conn.getresponse()
        data = r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(data or b"null")
    finally:
        conn.close()


def start(
    serve: Callable[..., ServeProcess], tmp_path: Path, *extra: str, context: ssl.SSLContext | None = None
) -> tuple[int, int]:
    """serve with a gateway that takes TOKEN and OTHER; its (http, grpc) ports."""
    keys = tmp_path / "api-keys.txt"
    keys.write_text(f"# tokens\n{TOKEN}\n\n{OTHER}\n")
    http_port, grpc_port = free_port(), free_port()
    serve(
        "--model",
        PROBE,
        "--workers",
        "1",
        "--http-port",
        str(http_port),
        "--grpc-port",
        str(grpc_port),
        "--gateway-api-keys-file",
        str(keys),
        *extra,
        workers=1,
    )

    def live() -> bool:
        try:
            return request(http_port, "GET", "/v2/health/live", context=context)[0] == 200
        except OSError:
            return False

    wait_until(live, 20.0, "the gateway's HTTP port")
    return http_port, grpc_port


def stub(channel: grpc.Channel) -> Any:
    return pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]


def grpc_infer() -> Any:
    tensor = pb.ModelInferRequest.InferInputTensor(name="x", datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.append(b"hi")
    return pb.ModelInferRequest(model_name="probe", inputs=[tensor])


@pytest.mark.integration
def test_every_endpoint_but_health_needs_a_listed_key_over_http(
    serve: Callable[..., ServeProcess], tmp_path: Path
) -> None:
    port, _ = start(serve, tmp_path)
    for path in ("/v2/health/live", "/v2/health/ready"):  # the probes stay open
        status, _, body = request(port, "GET", path)
        assert status == 200 and body in ({"live": True}, {"ready": True}), (path, body)
    protected = [
        ("GET", "/v2", None),
        ("GET", "/v2/models/probe", None),
        ("GET", "/v2/models/probe/ready", None),
        ("GET", "/v2/models/probe/config", None),
        ("GET", "/v2/models/stats", None),
        ("POST", "/v2/models/probe/infer", INFER),
        ("GET", "/v2/no/such/endpoint", None),  # nothing about routes before the key
    ]
    for method, path, body in protected:
        status, headers, answer = request(port, method, path, body)
        assert status == 401, (path, status, answer)
        assert headers["www-authenticate"] == "Bearer"
        assert answer == {"error": access.MISSING}
        status, headers, answer = request(port, method, path, body, {"Authorization": "Bearer wrong"})
        assert status == 401 and headers["www-authenticate"].startswith("Bearer")
        assert answer == {"error": access.WRONG}
        status, _, answer = request(port, method, path, body, {"X-API-Key": TOKEN[:-1]})
        assert status == 401, (path, answer)
    for headers in (
        {"Authorization": f"Bearer {TOKEN}"},
        {"X-API-Key": OTHER},
        {"authorization": f"bearer {OTHER}"},
    ):
        status, _, answer = request(port, "POST", "/v2/models/probe/infer", INFER, headers)
        assert status == 200, answer
        assert answer["outputs"][0]["data"] == ["hi"]
        status, _, answer = request(port, "GET", "/v2/models/probe/ready", None, headers)
        assert (status, answer) == (200, {"name": "probe", "ready": True})
    # A refused request's body is not read: its 401 closes the connection.
    status, headers, _ = request(port, "POST", "/v2/models/probe/infer", INFER)
    assert status == 401 and headers.get("connection") == "close"


@pytest.mark.integration
def test_every_call_but_health_needs_a_listed_key_over_grpc(
    serve: Callable[..., ServeProcess], tmp_path: Path
) -> None:
    _, grpc_port = start(serve, tmp_path)
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        s = stub(channel)
        assert s.ServerLive(pb.ServerLiveRequest(), timeout=10).live
        assert s.ServerReady(pb.ServerReadyRequest(), timeout=10).ready
        calls: list[Callable[..., Any]] = [
            lambda **kw: s.ServerMetadata(pb.ServerMetadataRequest(), timeout=10, **kw),
            lambda **kw: s.ModelReady(pb.ModelReadyRequest(name="probe"), timeout=10, **kw),
            lambda **kw: s.ModelMetadata(pb.ModelMetadataRequest(name="probe"), timeout=10, **kw),
            lambda **kw: s.ModelInfer(grpc_infer(), timeout=10, **kw),
        ]
        for call in calls:
            for metadata, why in (
                ((), access.MISSING),
                ((("authorization", "Bearer wrong"),), access.WRONG),
                ((("x-api-key", TOKEN + "x"),), access.WRONG),
            ):
                with pytest.raises(grpc.RpcError) as info:
                    call(metadata=metadata)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert info.value.details() == why
        for metadata in ((("authorization", f"Bearer {TOKEN}"),), (("x-api-key", OTHER),)):
            assert s.ModelReady(pb.ModelReadyRequest(name="probe"), timeout=10, metadata=metadata).ready
            reply = s.ModelInfer(grpc_infer(), timeout=10, metadata=metadata)
            assert reply.model_name == "probe" and reply.raw_output_contents


@pytest.mark.integration
def test_tls_serves_https_and_grpc_with_a_key(serve: Callable[..., ServeProcess], tmp_path: Path) -> None:
    cert, key = make_pair(tmp_path, "gw")
    context = ssl.create_default_context(cafile=str(cert))
    http_port, grpc_port = start(
        serve,
        tmp_path,
        "--gateway-tls-cert-file",
        str(cert),
        "--gateway-tls-key-file",
        str(key),
        context=context,
    )
    status, _, answer = request(
        http_port, "POST", "/v2/models/probe/infer", INFER, {"Authorization": f"Bearer {TOKEN}"}, context
    )
    assert status == 200 and answer["outputs"][0]["data"] == ["hi"], answer
    assert request(http_port, "POST", "/v2/models/probe/infer", INFER, None, context)[0] == 401
    with pytest.raises(ssl.SSLError):  # a client that does not trust the certificate
        request(http_port, "GET", "/v2/health/live", context=ssl.create_default_context())
    with pytest.raises((http.client.HTTPException, OSError)):  # plain HTTP is not served
        request(http_port, "GET", "/v2/health/live")
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    with grpc.secure_channel(f"127.0.0.1:{grpc_port}", credentials) as channel:
        s = stub(channel)
        assert s.ServerLive(pb.ServerLiveRequest(), timeout=10).live
        reply = s.ModelInfer(grpc_infer(), timeout=10, metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert reply.model_name == "probe"
        with pytest.raises(grpc.RpcError) as info:
            s.ModelInfer(grpc_infer(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Triton's own clients, with their TLS options and the key as a header.
    auth = {"authorization": f"Bearer {TOKEN}"}  # gRPC metadata keys are lower case
    th = thttp.InferenceServerClient(
        f"127.0.0.1:{http_port}",
        ssl=True,
        ssl_context_factory=lambda: ssl.create_default_context(cafile=str(cert)),
    )
    tg = tgrpc.InferenceServerClient(f"127.0.0.1:{grpc_port}", ssl=True, root_certificates=str(cert))
    try:
        for client in (th, tg):
            assert client.is_server_live()
            assert client.is_model_ready("probe", headers=auth)
            with pytest.raises(InferenceServerException):
                client.get_model_metadata("probe")  # no key
            assert client.get_model_metadata("probe", headers=auth)
    finally:
        th.close()
        tg.close()
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:  # plaintext gets nothing
        with pytest.raises(grpc.RpcError) as info:
            stub(channel).ServerLive(pb.ServerLiveRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


# --- refusals at start-up -------------------------------------------------------------------------


@pytest.fixture
def curve(tmp_path: Path) -> dict[str, Any]:
    """A broker key pair, a client key pair and an allow-list holding the client's key."""
    broker = generate_keys(str(tmp_path / "keys" / "broker"), "broker")
    alice = generate_keys(str(tmp_path / "keys" / "alice"), "alice")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    shutil.copy(alice[0], allowed)
    return {"broker": broker, "alice": alice, "allowed": str(allowed)}


def one_line_usage_error(result: Any, *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("Error:")]
    for needle in needles:
        assert needle in line, line


@pytest.mark.integration
def test_serve_refuses_an_unauthenticated_gateway_past_its_allow_list(
    cli: Callable[..., Any], curve: dict[str, Any]
) -> None:
    """The refusal comes before anything binds (serve's broker would bind 127.0.0.1 only;
    the gateway's host is an address no interface here has)."""
    args = ("serve", "--model", "echo", "--curve-secret-key", curve["broker"][1], "--curve-clients")
    result = cli(*args, curve["allowed"], "--http-port", str(free_port()), "--gateway-host", NOWHERE)
    one_line_usage_error(
        result, f"listen on {NOWHERE} without authentication", "--curve-clients", "--gateway-api-keys-file"
    )
    assert "--allow-unauthenticated-gateway" in result.stderr
    assert (
        "broker listening" not in result.stderr and "started worker" not in result.stderr
    )  # nothing started


@pytest.mark.integration
def test_a_standalone_gateway_with_a_client_key_refuses_unless_allowed(
    cli: Callable[..., Any], curve: dict[str, Any]
) -> None:
    args = ["gateway", "--connect", f"tcp://127.0.0.1:{free_port()}", "--http-port", str(free_port())]
    args += ["--gateway-host", NOWHERE, "--curve-server-key", curve["broker"][0]]
    args += ["--curve-secret-key", curve["alice"][1]]
    one_line_usage_error(cli(*args), "--api-keys-file PATH", "--allow-unauthenticated-gateway")
    # Told explicitly, it gets past the rule: to the listen, which fails on an address no
    # interface here has (so nothing here ever listens on a network).
    result = cli(*args, "--allow-unauthenticated-gateway")
    assert result.returncode == 1, result.stderr
    assert f"cannot listen for HTTP on {NOWHERE}" in result.stderr
    assert "without authentication" not in result.stderr


@pytest.mark.integration
def test_bad_key_files_and_tls_pairs_stop_the_start_in_one_line(
    cli: Callable[..., Any], tmp_path: Path
) -> None:
    (tmp_path / "empty.txt").write_text("# nothing yet\n")
    cert, _ = make_pair(tmp_path, "a")
    _, other_key = make_pair(tmp_path, "b")
    base = ["--http-port", str(free_port())]
    cases = [
        (["--gateway-api-keys-file", str(tmp_path / "nope.txt")], "nope.txt: no such file"),
        (["--gateway-api-keys-file", str(tmp_path / "empty.txt")], "empty.txt holds no API key"),
        (["--gateway-tls-cert-file", str(cert), "--gateway-tls-key-file", str(other_key)], "does not load"),
        (["--gateway-tls-cert-file", str(cert)], "go together"),
    ]
    for extra, needle in cases:
        one_line_usage_error(cli("serve", "--model", "echo", *base, *extra), needle)
    one_line_usage_error(
        cli("gateway", *base, "--tls-cert-file", str(cert), "--tls-key-file", str(other_key)), "does not load"
    )
    one_line_usage_error(
        cli("gateway", *base, "--api-keys-file", str(tmp_path / "empty.txt")), "holds no API key"
    )
