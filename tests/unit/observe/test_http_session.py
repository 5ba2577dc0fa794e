"""The OTLP/HTTP exporter's session (batcher.observe.http_session): what it sends with,
for each configuration requests reads from the environment (proxies, NO_PROXY, the CA
bundle variables, ~/.netrc or $NETRC, credentials in the URL), is what requests' own
Session sends with; and it reads the environment once per URL, not on every post."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

requests = pytest.importorskip("requests")

from batcher.observe.export import http_session, make_exporter  # noqa: E402
from batcher.observe.http_session import EnvironmentOnceSession  # noqa: E402
from batcher.observe.settings import TraceSettings  # noqa: E402

URL = "http://collector.example:4318/v1/traces"
ENV_NAMES = (
    "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "all_proxy",
    "no_proxy", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NETRC",
)  # fmt: skip


def what_is_sent(session: Any, url: str = URL) -> dict[str, Any]:
    """The settings and the Authorization header a post of `session` would go with."""
    prepared = session.prepare_request(requests.Request("POST", url, data=b"x"))
    settings = session.merge_environment_settings(prepared.url, {}, None, None, None)
    return {**settings, "authorization": prepared.headers.get("Authorization")}


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # never the machine's own
    return monkeypatch


CONFIGS: list[dict[str, str]] = [
    {},
    {"HTTP_PROXY": "http://proxy.example:3128"},
    {"http_proxy": "http://proxy.example:3128", "NO_PROXY": "collector.example"},
    {"ALL_PROXY": "http://proxy.example:3128", "no_proxy": "other.example"},
    {"HTTPS_PROXY": "http://proxy.example:3128"},
    {"REQUESTS_CA_BUNDLE": "/etc/ca.pem"},
    {"CURL_CA_BUNDLE": "/etc/curl-ca.pem"},
]


@pytest.mark.parametrize("env", CONFIGS, ids=lambda e: ",".join(e) or "none")
def test_the_environment_is_read_as_requests_reads_it(
    clean_env: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    for name, value in env.items():
        clean_env.setenv(name, value)
    assert what_is_sent(EnvironmentOnceSession()) == what_is_sent(requests.Session())


@pytest.mark.parametrize("url", [URL, "http://user:secret@collector.example:4318/v1/traces"])
@pytest.mark.parametrize("has_netrc", [True, False])
def test_netrc_and_url_credentials_are_used_as_requests_uses_them(
    clean_env: pytest.MonkeyPatch, tmp_path: Path, url: str, has_netrc: bool
) -> None:
    netrc = tmp_path / "netrc"
    netrc.write_text("machine collector.example login alice password wonderland\n")
    netrc.chmod(0o600)
    if has_netrc:
        clean_env.setenv("NETRC", str(netrc))
    ours, theirs = what_is_sent(EnvironmentOnceSession(), url), what_is_sent(requests.Session(), url)
    assert ours == theirs
    assert (ours["authorization"] is not None) == (has_netrc or "@" in url)


def test_the_session_s_own_settings_still_come_after_the_environment_s(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("REQUESTS_CA_BUNDLE", "/etc/ca.pem")
    ours, theirs = EnvironmentOnceSession(), requests.Session()
    for s in (ours, theirs):
        s.verify = "/etc/otlp-certificate.pem"  # as OTEL_EXPORTER_OTLP_CERTIFICATE sets it
        s.auth = ("bob", "builder")
        s.trust_env = True
    assert what_is_sent(ours) == what_is_sent(theirs)
    for s in (ours, theirs):
        s.trust_env = False
    assert what_is_sent(ours) == what_is_sent(theirs)


def test_the_environment_is_read_once(clean_env: pytest.MonkeyPatch) -> None:
    session = EnvironmentOnceSession()
    first = what_is_sent(session)
    clean_env.setenv("HTTP_PROXY", "http://proxy.example:3128")  # after the first post: not seen
    assert what_is_sent(session) == first
    assert what_is_sent(EnvironmentOnceSession())["proxies"] == {"http": "http://proxy.example:3128"}


def test_a_credential_provider_keeps_the_sdk_s_own_session(clean_env: pytest.MonkeyPatch) -> None:
    assert isinstance(http_session(), EnvironmentOnceSession)
    clean_env.setenv("OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER", "someone's")
    assert http_session() is None


def test_the_exporter_posts_with_it(clean_env: pytest.MonkeyPatch) -> None:
    exporter = make_exporter(TraceSettings(endpoint="http://127.0.0.1:4318"))
    sessions = [v for v in _reachable(exporter) if isinstance(v, requests.Session)]
    assert sessions and all(isinstance(s, EnvironmentOnceSession) for s in sessions)


def _reachable(obj: Any, depth: int = 3) -> list[Any]:
    """The objects `obj`'s attributes lead to, `depth` levels down (the SDK keeps its
    session in different places across its versions)."""
    out = [obj]
    if depth and hasattr(obj, "__dict__") and not isinstance(obj, requests.Session):
        for value in vars(obj).values():
            out.extend(_reachable(value, depth - 1))
    return out
