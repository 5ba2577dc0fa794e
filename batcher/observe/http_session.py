"""The HTTP session the OTLP/HTTP exporter posts spans with: requests' own Session, but
one that reads what the environment says of a URL once, not on every post.

requests' Session (with `trust_env`, its default) reads the environment on each request:
the proxy variables (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY, NO_PROXY, in both cases), by
walking all of `os.environ` twice; the CA bundle variables (REQUESTS_CA_BUNDLE,
CURL_CA_BUNDLE); and ~/.netrc (or $NETRC) for the host's credentials. An exporter posts
to one URL, hundreds of times a minute under load, and these reads were about as costly
as the post itself (docs/tracing.md, "What tracing costs"). Here each is read the first
time a URL is posted to and kept: every setting works as it does with requests, but a
change to the process's environment or to the netrc file after the first post is not
seen until the process restarts (a process's environment does not change from outside;
a netrc edited at run time is the one case, and docs/tracing.md says so).

Everything else (the exporter's headers, TLS files, timeouts, compression, and the
precedence of each setting over the others) is requests' code, unchanged.

Imported only when tracing over HTTP is on: this module imports requests at its top."""

from __future__ import annotations

import os
from typing import Any

import requests
from requests.auth import AuthBase
from requests.sessions import merge_setting
from requests.utils import get_auth_from_url, get_environ_proxies, get_netrc_auth

#: URLs (and NO_PROXY overrides) whose environment is kept; an exporter has one.
_MAX_KEPT = 64


class _Unchanged(AuthBase):
    """No credentials: neither netrc nor the URL has any (requests' Session would look in
    the file again if the request's auth were left empty)."""

    def __call__(self, r: Any) -> Any:
        return r


_NO_NETRC = _Unchanged()


class EnvironmentOnceSession(requests.Session):
    """requests.Session whose proxies, CA bundle and netrc credentials are read from the
    environment once per URL (see the module's doc); otherwise requests' own."""

    def __init__(self) -> None:
        super().__init__()
        self._proxies: dict[tuple[str, Any], dict[str, str]] = {}
        self._netrc: dict[str, Any] = {}
        self._ca_bundle: str | None = None
        self._ca_read = False

    def _environ_proxies(self, url: str, no_proxy: Any) -> dict[str, str]:
        key = (url, no_proxy)
        found = self._proxies.get(key)
        if found is None:
            found = dict(get_environ_proxies(url, no_proxy=no_proxy))
            if len(self._proxies) >= _MAX_KEPT:
                self._proxies.clear()
            self._proxies[key] = found
        return found

    def _environ_ca_bundle(self) -> str | None:
        if not self._ca_read:
            self._ca_bundle = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
            self._ca_read = True
        return self._ca_bundle

    def merge_environment_settings(
        self, url: Any, proxies: Any, stream: Any, verify: Any, cert: Any
    ) -> dict[str, Any]:
        """requests' merge of a request's settings with the environment's and the
        session's, with the environment's read once (`trust_env`, as requests reads it)."""
        if self.trust_env:
            no_proxy = proxies.get("no_proxy") if proxies is not None else None
            env_proxies = self._environ_proxies(url, no_proxy)
            if proxies is not None:
                for k, v in env_proxies.items():
                    proxies.setdefault(k, v)
            if verify is True or verify is None:
                verify = self._environ_ca_bundle() or verify
        return {
            "proxies": merge_setting(proxies, self.proxies),
            "stream": merge_setting(stream, self.stream),
            "verify": merge_setting(verify, self.verify),
            "cert": merge_setting(cert, self.cert),
        }

    def prepare_request(self, request: Any) -> Any:
        """requests' request preparation, with the netrc file's credentials for the URL
        read once (used, as by requests, only when neither the request nor the session
        has credentials of its own; else, as by requests, those in the URL)."""
        if self.trust_env and not request.auth and not self.auth:
            url = request.url
            if url not in self._netrc:
                if len(self._netrc) >= _MAX_KEPT:
                    self._netrc.clear()
                in_url = get_auth_from_url(url)  # (what requests takes when netrc has none)
                self._netrc[url] = get_netrc_auth(url) or (in_url if any(in_url) else _NO_NETRC)
            request.auth = self._netrc[url]
        return super().prepare_request(request)
