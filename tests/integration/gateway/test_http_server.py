"""The gateway's HTTP server (batcher.gateway.http_server, uvicorn with the v2 ASGI app)
over real sockets, with no broker behind it (an infer is then 503 `unavailable` once
its body is read): routes and methods, a request's head bounded, bodies whole, late and
stalled, pipelined requests, and the routing of percent-encoded paths."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from batcher.gateway import http_api, http_server
from batcher.gateway.core import Gateway, GatewaySettings
from batcher.gateway.http_server import HttpServer
from batcher.serve.launcher import free_tcp_address

pytestmark = pytest.mark.integration  # real sockets and a served port

BODY = b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1, 2]}]}'


def infer_head(body: bytes = BODY, path: str = "/v2/models/m/infer", extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP response: its status, headers (lower-case names) and body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if line)
    headers = {k.lower(): v for k, v in headers.items()}
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", 0))), 10)
    return int(lines[0].split()[1]), headers, body


def served(test: Callable[[int], Coroutine[Any, Any, None]]) -> None:
    """Run `test(port)` against an HttpServer whose broker is not there."""

    async def main() -> None:
        gateway = Gateway(GatewaySettings(connect=free_tcp_address(), http_port=1))
        server = HttpServer(gateway, "127.0.0.1", 0, 1 << 20, 1.0, asyncio.Event())
        try:
            await test(server.port)
        finally:
            await server.close()
            await gateway.close()

    asyncio.run(main())


def test_routes_methods_and_their_v2_errors() -> None:
    """Unknown paths 404 and wrong methods 405 with Allow, both as v2 error bodies; HEAD
    is served wherever GET is, without a body; an infer with no broker is 503."""

    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for request, status, allow in (
                (b"GET /v2/nothing HTTP/1.1\r\nHost: x\r\n\r\n", 404, None),
                (b"GET /v2/models/m/infer HTTP/1.1\r\nHost: x\r\n\r\n", 405, "POST"),
                (b"POST /v2/health/live HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 405, "GET,HEAD"),
                (b"GET /v2/models//ready HTTP/1.1\r\nHost: x\r\n\r\n", 404, None),
            ):
                writer.write(request)
                got, headers, body = await read_response(reader)
                assert (got, headers.get("allow")) == (status, allow), request
                assert "error" in json.loads(body)
            writer.write(b"HEAD /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).startswith(b"HTTP/1.1 200")
            writer.write(infer_head() + BODY)
            got, headers, body = await read_response(reader)
            assert got == 503 and "not connected" in json.loads(body)["error"]
            assert headers["content-type"] == "application/json"
        finally:
            writer.close()

    served(test)


def test_pipelined_requests_are_answered_in_order() -> None:
    """Three requests in one write on one connection: three answers, in order."""

    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(
                b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
                + infer_head()
                + BODY
                + b"GET /v2/nothing HTTP/1.1\r\nHost: x\r\n\r\n"
            )
            statuses = [(await read_response(reader))[0] for _ in range(3)]
            assert statuses == [200, 503, 404]
        finally:
            writer.close()

    served(test)


def test_a_head_over_its_bound_is_431_and_the_connection_closes() -> None:
    """An endless header is cut at MAX_HEAD_BYTES (431, connection closed), where
    httptools alone would keep it growing; a head just under the bound is served."""

    async def test(port: int) -> None:
        under = "X-Pad: " + "a" * (http_server.MAX_HEAD_BYTES - 1000) + "\r\n"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(infer_head(extra=under) + BODY)
            assert (await read_response(reader))[0] == 503  # read whole, then no broker
            writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Endless: ")
            for _ in range(http_server.MAX_HEAD_BYTES // 4096 + 1):  # past the bound, then wait
                writer.write(b"a" * 4096)
                await writer.drain()
            status, _, body = await read_response(reader)
            assert status == 431 and "head" in json.loads(body)["error"]
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed
        finally:
            writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:  # a head pipelined behind a request, growing in small writes: counted across them
            writer.write(
                b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\nGET /v2/health/live HTTP/1.1\r\nX: "
            )
            assert (await read_response(reader))[0] == 200
            for _ in range(http_server.MAX_HEAD_BYTES // 2048 + 1):
                writer.write(b"a" * 2048)
                await writer.drain()
                await asyncio.sleep(0.001)  # each its own read
            assert (await read_response(reader))[0] == 431
        finally:
            writer.close()
        over = "X-Pad: " + "a" * http_server.MAX_HEAD_BYTES + "\r\n"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:  # a whole head over the bound in one write: refused too
            writer.write(infer_head(extra=over) + BODY)
            assert (await read_response(reader))[0] == 431
        finally:
            writer.close()

    served(test)


def test_a_connection_that_never_finishes_a_head_is_closed(monkeypatch) -> None:
    """Idle from its start, inside its first head (slowloris), or inside a head
    pipelined behind a request (408 then): closed at the keep-alive timeout (shortened
    here), not held."""
    monkeypatch.setattr(http_server, "KEEP_ALIVE_S", 1)

    async def test(port: int) -> None:
        for first in (b"", b"GET /v2/hea", b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\nGET /v2"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                started = asyncio.get_running_loop().time()
                writer.write(first)
                if first.count(b"GET") == 2:
                    assert (await read_response(reader))[0] == 200
                    assert (await read_response(reader))[0] == 408
                assert await asyncio.wait_for(reader.read(), 10) == b"", first
                assert asyncio.get_running_loop().time() - started < 5
            finally:
                writer.close()

    served(test)


def test_a_body_over_the_limit_is_413_before_it_is_read() -> None:
    """A declared Content-Length over the gateway's limit is refused at once, and the
    connection closes (the rest of the body is not read)."""

    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(infer_head(b"x" * ((1 << 20) + 1)))  # the headers alone
            status, headers, body = await read_response(reader)
            assert status == 413 and "over the gateway's" in json.loads(body)["error"]
            assert headers.get("connection") == "close"
        finally:
            writer.close()

    served(test)


def test_a_body_is_read_whole_when_late_and_a_stalled_one_is_answered_408(monkeypatch) -> None:
    """A body that came with its headers is read at once (no timer); one that comes later
    is waited for; one that stalls is answered 408 after BODY_TIMEOUT_S (shortened here);
    a chunked one is read whole."""
    monkeypatch.setattr(http_api, "BODY_TIMEOUT_S", 0.3)
    head = infer_head()

    async def exchange(port: int, parts: list[bytes], pause_s: float) -> tuple[int, float]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = asyncio.get_running_loop().time()
        try:
            for i, part in enumerate(parts):
                if i:
                    await asyncio.sleep(pause_s)  # the client's own pace, not a wait for the server
                writer.write(part)
                await writer.drain()
            status = (await read_response(reader))[0]
            return status, asyncio.get_running_loop().time() - started
        finally:
            writer.close()

    async def test(port: int) -> None:
        assert (await exchange(port, [head + BODY], 0))[0] == 503  # read, then unavailable
        assert (await exchange(port, [head, BODY[:10], BODY[10:]], 0.1))[0] == 503  # late, read
        status, took_s = await exchange(port, [head + BODY[:10]], 0)  # stalled
        assert status == 408 and 0.25 < took_s < 0.9, (status, took_s)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:  # what follows a stalled body is not read as a request: the connection closes
            writer.write(head + BODY[:10])
            status, headers, _ = await read_response(reader)
            assert status == 408 and headers.get("connection") == "close"
            assert await asyncio.wait_for(reader.read(), 10) == b""
        finally:
            writer.close()
        chunked_head = b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        chunked = (
            chunked_head
            + b"%x\r\n%s\r\n" % (10, BODY[:10])
            + b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY) - 10, BODY[10:])
        )
        assert (await exchange(port, [chunked], 0))[0] == 503
        # no byte of the body at all: a length, 100-continue, a chunked body with no chunk
        for stalled in (head, infer_head(extra="Expect: 100-continue\r\n"), chunked_head):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(stalled)
                status, _, _ = await read_response(reader)
                if status == 100:  # what a client that asked for it waits for, then its answer
                    status = (await read_response(reader))[0]
                assert status == 408, stalled
            finally:
                writer.close()

    served(test)


def test_gzip_and_deflate_bodies_are_decoded_within_the_limit() -> None:
    """Content-Encoding gzip and deflate (tritonclient's request compression) are read
    as their JSON; a body that does not decode is 400, one that decodes past the limit
    413 (a small bomb), another encoding 415."""
    import gzip
    import zlib

    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for body, encoding, status, words in (
                (gzip.compress(BODY), "gzip", 503, "not connected"),  # decoded, parsed, no broker
                (zlib.compress(BODY), "deflate", 503, "not connected"),
                (BODY, "identity", 503, "not connected"),
                (b"\x1f\x8b not gzip at all", "gzip", 400, "does not decode"),
                (gzip.compress(BODY)[:-12], "gzip", 400, "ends inside"),
                (BODY, "br", 415, "not supported"),
                (gzip.compress(b" " * (2 << 20)), "gzip", 413, "decodes to over"),  # then closed
            ):
                writer.write(infer_head(body, extra=f"Content-Encoding: {encoding}\r\n") + body)
                got, _, reply = await read_response(reader)
                assert got == status and words in json.loads(reply)["error"], (encoding, got, reply)
        finally:
            writer.close()

    served(test)


def test_a_request_asking_to_upgrade_is_served_as_http_1_1() -> None:
    """curl --http2 and Java's client ask to upgrade to h2c; the gateway upgrades to
    nothing, so it serves them as HTTP/1.1, body and all, whether the body comes with
    the head or later, and never parses a body as a request of its own."""
    upgrade = "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAA\r\n"
    smuggled = b"GET /v2/models/SMUGGLED HTTP/1.1\r\nHost: x\r\n\r\n"

    async def test(port: int) -> None:
        for parts in ([infer_head(extra=upgrade) + BODY], [infer_head(smuggled, extra=upgrade), smuggled]):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                for part in parts:
                    writer.write(part)
                    await writer.drain()
                    await asyncio.sleep(0.05)  # the client's pace: the body in a packet of its own
                status, _, body = await read_response(reader)
                # the body read as this request's: JSON (no broker: 503), or not JSON (400)
                assert status in (503, 400) and b"SMUGGLED" not in body, (status, body)
                writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
                assert (await read_response(reader))[0] == 200  # the connection goes on
            finally:
                writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:  # a whole upgrade request: served
            writer.write(infer_head(extra=upgrade) + BODY)
            status, _, body = await read_response(reader)
            assert status == 503 and "not connected" in json.loads(body)["error"]
        finally:
            writer.close()

    served(test)


def test_requests_in_flight_past_the_grace_are_answered_closed() -> None:
    """A gateway told to stop gives what is in flight its grace, then answers it 503
    `closed` as v2 JSON (uvicorn cancels the handlers; it would answer a plain 500)."""
    import zmq

    async def main() -> None:
        address = free_tcp_address()
        ctx: zmq.Context[Any] = zmq.Context()
        silent = ctx.socket(zmq.ROUTER)  # a broker that takes requests and never answers
        silent.setsockopt(zmq.LINGER, 0)
        silent.bind(address)
        gateway = Gateway(GatewaySettings(connect=address, http_port=1))
        server = HttpServer(gateway, "127.0.0.1", 0, 1 << 20, 1.0, asyncio.Event())
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            deadline = asyncio.get_running_loop().time() + 10
            while True:  # until the link is up: the request is then in flight, unanswered
                writer.write(infer_head() + BODY)
                try:
                    status, _, body = await asyncio.wait_for(read_response(reader), 0.3)
                except TimeoutError:
                    break
                assert status == 503 and asyncio.get_running_loop().time() < deadline, body
            closing = asyncio.ensure_future(server.close())
            status, _, body = await read_response(reader)
            assert status == 503 and "closing" in json.loads(body)["error"], body
            await closing
            writer.close()
        finally:
            await server.close()
            await gateway.close()
            silent.close(0)
            ctx.term()

    asyncio.run(main())


def test_paths_route_with_each_segment_percent_decoded() -> None:
    """A model's name may hold an encoded '/' (one segment, decoded after the split);
    anything else of the v2 paths matches exactly."""
    match = http_api.match
    assert match(b"/v2") == ("server", "", "")
    assert match(b"/v2/health/ready") == ("ready", "", "")
    assert match(b"/v2/models/a%2Fb/infer") == ("infer", "a/b", "")
    assert match(b"/v2/models/m%C3%A9/versions/1/ready") == ("model_ready", "m\u00e9", "1")
    assert match(b"/v2/models/m/versions/7") == ("model", "m", "7")
    for path in (b"/v2/", b"/v3", b"/v2/models", b"/v2/models/m/versions", b"/v2/models/m/x", b"/v2/health"):
        assert match(path) is None, path
    with pytest.raises(http_api.oip.OipError, match="UTF-8"):
        match(b"/v2/models/%FF/infer")
