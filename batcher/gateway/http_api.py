"""The v2 REST API: an ASGI application served by uvicorn on httptools (chosen by
measurement: docs/benchmarks-history.md, "Gateway").

JSON tensors and the binary tensor data extension both ways. No framework between
uvicorn and the handlers: the routes are three shapes of path, and each layer a request
crosses costs its latency (docs/gateway.md). `http_server` serves it, and cancels the
handler of a request whose client disconnects (as aiohttp's handler_cancellation did,
with no task per request to watch for it), and so its rows at the broker.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import urllib.parse
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from batcher.errors import BatcherError
from batcher.gateway import access, oip, repository, tracing, triton
from batcher.gateway.core import Gateway
from batcher.wire.protocol import ErrorCode

log = logging.getLogger("batcher.gateway")
HEADER_LENGTH = "Inference-Header-Content-Length"
_HEADER_LENGTH_KEY = HEADER_LENGTH.lower().encode()
#: The most JSON one request may hold (the whole body, or the header before binary
#: data): decoding JSON takes many times its size in memory; large tensors go binary.
MAX_JSON_BYTES = 16 * 1024 * 1024
#: How long a client may take to send its body (a stalled upload is answered 408).
BODY_TIMEOUT_S = 30.0
_json_decode = msgspec.json.Decoder().decode
json_encode = msgspec.json.Encoder().encode

#: Scope keys the server reads: the task of a request waiting on the broker, which it
#: cancels (setting GONE first) when the client disconnects.
HANDLER = "batcher.handler"
GONE = "batcher.gone"
#: Set by the server in the scope of a request whose body has all arrived.
BODY_COMPLETE = "batcher.body_complete"
#: Set by the server: the connection's transport, which sends a response's head and body
#: as one write between its cork() and uncork() (http_server.CorkedTransport).
CORK = "batcher.cork"
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
JSON = "application/json"


@dataclass(frozen=True)
class Response:
    """What a handler answers; written by `HttpApi` as one status, headers and body."""

    status: int = 200
    body: bytes = b""
    content_type: str | None = None
    headers: dict[str, str] = field(default_factory=dict)


def error_response(code: str, message: str) -> Response:
    """An error as v2 gives one: `{"error": message}`, with the status of its code."""
    headers = {"Retry-After": "1"} if code == "overloaded" else {}
    if code in (ErrorCode.TOO_LARGE, "request_timeout"):
        headers["Connection"] = "close"  # the rest of the body is not read
    return _error(oip.http_status(code), message, headers)


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(status, json_encode({"error": message}), JSON, headers or {})


def _json(value: Any) -> Response:
    return Response(body=json_encode(value), content_type=JSON)


def _health(answer: dict[str, Any]) -> Response:
    """A readiness answer as v2 gives it: its JSON body, 200 when ready, else 503 (what a
    probe that reads only the status needs)."""
    return Response(200 if answer["ready"] else 503, json_encode(answer), JSON)


class ClientGone(BatcherError):
    """The client closed its connection before its request was answered."""


class HttpApi:
    """The ASGI application: routes, handlers, and every OipError as its status."""

    def __init__(self, gateway: Gateway, max_body_bytes: int, api_keys: access.ApiKeys | None = None) -> None:
        self.gateway = gateway
        self.max_body_bytes = max_body_bytes
        self.api_keys = api_keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # lifespan is off; websockets are not served
        try:
            response = await self._route(scope, receive)
        except ClientGone:
            return  # nobody to answer; its rows are cancelled at the broker
        except oip.OipError as exc:
            response = error_response(exc.code, str(exc))
        except Exception as exc:  # a bug of ours: the client still gets a v2 error
            log.exception("HTTP request failed")
            response = error_response(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        await write(send, response, scope.get(CORK))

    async def _route(self, scope: Scope, receive: Receive) -> Response:
        if self.api_keys is not None and scope["raw_path"] not in access.OPEN_PATHS:
            refused = self._refusal(scope)  # before routing, and before any body is read
            if refused is not None:
                return refused
        if scope["raw_path"] == b"/metrics":
            page = self.gateway.pool.metrics_text()
            text, content_type = self.gateway.metrics.exposition(page, _header(scope, b"accept"))
            return Response(body=text, content_type=content_type)
        route = match(scope["raw_path"])
        if route is None:
            return _error(404, "no such endpoint")
        name, model, version = route
        method = scope["method"]
        allowed = ("POST",) if name in ("infer", "repository_load", "repository_unload") else ("GET", "HEAD")
        allowed = ("GET", "POST") if name == "repository_index" else allowed
        if method not in allowed:
            return _error(405, f"method {method} is not allowed here", {"Allow": ",".join(allowed)})
        if name == "infer":
            return await self.infer(scope, receive, model, version)
        if name.startswith("repository_"):
            return await self._repository(scope, receive, name, model)
        if name == "live":
            return _json({"live": True})
        if name == "ready":
            return _health({"ready": await self.gateway.ready()})
        if name == "server":
            return _json(self.gateway.server_metadata())
        if name == "model_ready":
            return _health({"name": model, "ready": await self.gateway.model_ready(model, version)})
        if name in TRITON_ENDPOINTS:
            return _json(await TRITON_ENDPOINTS[name](self.gateway, model, version))
        meta = await self.gateway.metadata(model, version)
        meta.pop("ready")
        return _json(meta)

    async def _repository(self, scope: Scope, receive: Receive, name: str, model: str) -> Response:
        """Triton's model repository extension (batcher/gateway/repository.py)."""
        body = await read_body(scope, receive, self.max_body_bytes) if scope["method"] == "POST" else b""
        if name == "repository_index":
            return _json(await repository.index(self.gateway, repository.ready_only(body)))
        if name == "repository_load":
            return _json(await repository.load(self.gateway, model))
        return _json(await repository.unload(self.gateway, model))

    def _refusal(self, scope: Scope) -> Response | None:
        """401 for a request without an accepted API key (docs/gateway.md, "Access
        control"); the connection closes, so that no unread body is taken in after it."""
        assert self.api_keys is not None
        authorization = api_key = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value
            elif name == b"x-api-key":
                api_key = value
        why = self.api_keys.refusal(authorization, api_key)
        if why is None:
            return None
        challenge = "Bearer" if why == access.MISSING else 'Bearer error="invalid_token"'
        return _error(401, why, {"WWW-Authenticate": challenge, "Connection": "close"})

    async def infer(self, scope: Scope, receive: Receive, model: str, version: str) -> Response:
        """An infer request; traced (an HTTP server span, its caller's `traceparent` header
        as parent) when tracing is on; its duration observed (a traced one's exemplar)."""
        begun, trace = time.monotonic(), None
        try:
            trace = self._begin_trace(scope)
            return await self._traced_infer(scope, receive, model, version, trace)
        finally:
            self.gateway.metrics.request_done("http", time.monotonic() - begun, trace)

    def _begin_trace(self, scope: Scope) -> Any:
        """The request's trace (tracing.GatewayTrace), None when off or not sampled."""
        tracer = self.gateway.tracer
        if tracer is None:
            return None
        attributes = {"http.request.method": "POST", "http.route": "/v2/models/{model}/infer"}
        attributes["url.path"] = scope.get("path", "")
        traceparent, tracestate = _header(scope, b"traceparent"), _header(scope, b"tracestate")
        return tracing.begin(tracer, traceparent, tracestate, "POST /v2/models/{model}/infer", attributes)

    async def _traced_infer(
        self, scope: Scope, receive: Receive, model: str, version: str, trace: Any
    ) -> Response:
        if trace is None:
            return await self._infer(scope, receive, model, version, None)
        try:
            response = await self._infer(scope, receive, model, version, trace)
        except oip.OipError as exc:
            if trace is not None:
                trace.end({"http.response.status_code": oip.http_status(exc.code)}, exc.message)
            raise
        except BaseException as exc:
            if trace is not None:
                trace.end({"http.response.status_code": 500}, type(exc).__name__)
            raise
        if trace is not None:
            trace.end({"http.response.status_code": response.status})
        return response

    async def _infer(self, scope: Scope, receive: Receive, model: str, version: str, trace: Any) -> Response:
        begun = time.monotonic()
        body = await read_body(scope, receive, self.max_body_bytes)
        encoding = _header(scope, b"content-encoding")
        if encoding is not None:
            body = decompressed(body, encoding, self.max_body_bytes)
        infer, binary_default, binary_outputs = parse_infer(
            model, version, body, _header(scope, _HEADER_LENGTH_KEY)
        )
        if trace is not None:
            trace.parsed(begun, time.monotonic())
        scope[HANDLER] = asyncio.current_task()  # cancelled if the client goes: see http_server
        try:
            outputs, answered = await self.gateway.answer(infer, trace)
        except asyncio.CancelledError:
            if scope.get(GONE):
                raise ClientGone from None
            # uvicorn's shutdown, past its grace: the rows are cancelled at the broker
            # (Gateway.infer's cleanup) and the client told so, in v2's form.
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            raise oip.OipError("closed", "the gateway is closing") from None
        return infer_response(infer, outputs, binary_default, binary_outputs, answered)


async def write(send: Send, response: Response, cork: Any = None) -> None:
    """Send `response`; with the server's `cork` (CORK), its head and body in one write."""
    headers = [(b"content-length", b"%d" % len(response.body))]
    if response.content_type is not None:
        headers.append((b"content-type", response.content_type.encode()))
    for k, v in response.headers.items():
        headers.append((k.lower().encode(), v.encode()))
    if cork is not None:
        cork.cork()
    try:
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        await send({"type": "http.response.body", "body": response.body})
    finally:
        if cork is not None:
            cork.uncork()


_MODEL_ENDPOINTS = {
    (): "model",
    (b"ready",): "model_ready",
    (b"infer",): "infer",
    (b"config",): "config",
    (b"stats",): "stats",
}
#: Triton's extensions (batcher/gateway/triton.py): the handler of each endpoint.
TRITON_ENDPOINTS = {"config": triton.model_config, "stats": triton.model_statistics}


def match(raw_path: bytes) -> tuple[str, str, str] | None:
    """(the endpoint, the model, its version) of a path, or None: /v2, /v2/health/live,
    /v2/health/ready, /v2/models/stats,
    /v2/models/{model}[/versions/{version}][/ready | /infer | /config | /stats]. Each
    segment is percent-decoded on its own, so a model's name may hold an encoded '/'."""
    parts = raw_path.split(b"/")
    if parts[:2] != [b"", b"v2"]:
        return None
    if len(parts) == 2:
        return "server", "", ""
    if len(parts) == 4 and parts[2] == b"health" and parts[3] in (b"live", b"ready"):
        return parts[3].decode(), "", ""
    if parts[2:] == [b"repository", b"index"]:  # Triton's model repository extension
        return "repository_index", "", ""
    if len(parts) == 6 and parts[2:4] == [b"repository", b"models"] and parts[5] in (b"load", b"unload"):
        return "repository_" + parts[5].decode(), _segment(parts[4]), ""
    if len(parts) < 4 or parts[2] != b"models" or not parts[3]:
        return None
    if len(parts) == 4 and parts[3] == b"stats":  # every model's (Triton's form, as there)
        return "stats", "", ""
    rest, version = parts[4:], b""
    if rest[:1] == [b"versions"]:
        if len(rest) < 2 or not rest[1]:
            return None
        version, rest = rest[1], rest[2:]
    endpoint = _MODEL_ENDPOINTS.get(tuple(rest))
    if endpoint is None:
        return None
    try:
        return endpoint, _segment(parts[3]), _segment(version)
    except UnicodeDecodeError:
        raise oip.bad_request("the path is not UTF-8 once percent-decoded") from None


def _segment(raw: bytes) -> str:
    text = raw.decode("ascii", "strict") if raw.isascii() else raw.decode("utf-8")
    return urllib.parse.unquote(text, errors="strict") if "%" in text else text


def _header(scope: Scope, key: bytes) -> str | None:
    for name, value in scope["headers"]:
        if name == key:
            return str(value.decode("latin-1"))
    return None


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The request's body; too large (413) or stalled (408) as OipError, ClientGone when
    the client left. A body that came with its headers is read with no timer."""
    declared = _header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    if scope.get(BODY_COMPLETE):  # whole with its head: one read, nothing to time
        message = await receive()
        if message["type"] != "http.request":
            raise ClientGone
        return bytes(message.get("body", b""))
    chunks: list[bytes] = []
    size, message = 0, {"more_body": True}
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            while message.get("more_body"):
                message = await receive()
                if message["type"] != "http.request":
                    raise ClientGone
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise _too_large(size, limit)
                chunks.append(chunk)
    except TimeoutError:
        raise oip.OipError(
            "request_timeout", f"the body did not arrive within {BODY_TIMEOUT_S:g} s"
        ) from None
    return b"".join(chunks)


#: zlib's window bits for each Content-Encoding taken: gzip, and deflate (zlib's format,
#: as RFC 9110 has it and tritonclient sends it; a gzip header is taken there too).
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": 32 + zlib.MAX_WBITS}


def decompressed(body: bytes, encoding: str, limit: int) -> bytes:
    """A body sent with Content-Encoding gzip or deflate (tritonclient's
    request_compression_algorithm), decoded; at most `limit` bytes of it (413 past that,
    so a small bomb cannot fill memory), 400 if it does not decode, 415 for another
    encoding."""
    coding = encoding.strip().lower()
    if coding == "identity":
        return body
    wbits = _WBITS.get(coding)
    if wbits is None:
        raise oip.OipError(
            "unsupported_encoding", f"Content-Encoding {encoding!r} is not supported: gzip, deflate or none"
        )
    decoder = zlib.decompressobj(wbits)
    try:
        out = decoder.decompress(body, limit + 1)
    except zlib.error as exc:
        raise oip.bad_request(f"the body does not decode as {coding}: {exc}") from None
    if len(out) > limit or decoder.unconsumed_tail:
        raise oip.OipError(ErrorCode.TOO_LARGE, f"the body decodes to over the gateway's {limit} bytes")
    if not decoder.eof:
        raise oip.bad_request(f"the body ends inside its {coding} stream")
    return out


def _too_large(size: int, limit: int) -> oip.OipError:
    return oip.OipError(ErrorCode.TOO_LARGE, f"the body of {size} bytes is over the gateway's {limit}")


def parse_infer(
    model: str, version: str, body: bytes, header_length: str | None
) -> tuple[oip.InferRequest, bool, dict[str, bool]]:
    """The request, whether outputs are binary by default, and each requested output's
    own binary_data choice."""
    view = memoryview(body)
    if header_length is not None:
        if not (header_length.isascii() and header_length.isdigit()):
            raise oip.bad_request(f"{HEADER_LENGTH} must be an integer, got {header_length!r}")
        size = int(header_length)
        if not 0 <= size <= len(body):
            raise oip.bad_request(f"{HEADER_LENGTH} {size} is outside the body of {len(body)} bytes")
        head, binary = view[:size], view[size:]
    else:
        head, binary = view, view[len(view) :]
    if len(head) > MAX_JSON_BYTES:
        raise oip.OipError(
            ErrorCode.TOO_LARGE,
            f"{len(head)} bytes of JSON, over {MAX_JSON_BYTES}: send large tensors as binary data "
            f"({HEADER_LENGTH})",
        )
    try:
        doc = _json_decode(head)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise oip.bad_request(f"the request is not valid JSON: {exc}") from None
    except RecursionError:
        raise oip.bad_request("the request's JSON is nested too deeply") from None
    if not isinstance(doc, dict):
        raise oip.bad_request("the request must be a JSON object")
    params = _params(doc.get("parameters"), "request")
    inputs = _inputs(doc.get("inputs"), binary)
    wanted, binary_outputs = _outputs(doc.get("outputs"))
    request_id = doc.get("id") or ""
    if not isinstance(request_id, str):
        raise oip.bad_request(f"id must be a string, got {request_id!r}")
    infer = oip.InferRequest(
        model=model,
        version=version,
        inputs=inputs,
        id=request_id,
        outputs=wanted,
        timeout_ms=oip.timeout_ms_of(params),
        priority=oip.priority_of(params),
        retry=oip.retry_of(params),
    )
    return infer, params.get("binary_data_output") is True, binary_outputs


def _params(value: object, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise oip.bad_request(f"{where} parameters must be a JSON object")
    return value


def _inputs(value: object, binary: memoryview) -> list[oip.InputTensor]:
    if not isinstance(value, list) or not value:
        raise oip.bad_request("'inputs' must be a non-empty list")
    inputs, at = [], 0
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise oip.bad_request("each input must be an object with a string 'name'")
        name = item["name"]
        params = _params(item.get("parameters"), f"input '{name}'")
        size = params.get("binary_data_size")
        if size is not None:
            if type(size) is not int or size < 0 or at + size > len(binary):
                raise oip.bad_request(f"input '{name}': binary_data_size {size!r} runs past the binary data")
            inputs.append(
                oip.raw_input(name, item.get("datatype"), item.get("shape", []), binary[at : at + size])
            )
            at += size
        elif "data" in item:
            inputs.append(oip.json_input(name, item.get("datatype"), item.get("shape", []), item["data"]))
        else:
            raise oip.bad_request(f"input '{name}' has neither 'data' nor a binary_data_size parameter")
    if at != len(binary):
        raise oip.bad_request(f"{len(binary) - at} bytes of binary data belong to no input")
    return inputs


def _outputs(value: object) -> tuple[list[str] | None, dict[str, bool]]:
    if value is None:
        return None, {}
    if not isinstance(value, list):
        raise oip.bad_request("'outputs' must be a list")
    names, binary = [], {}
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise oip.bad_request("each requested output must be an object with a string 'name'")
        names.append(item["name"])
        choice = _params(item.get("parameters"), f"output '{item['name']}'").get("binary_data")
        if choice is not None:
            binary[item["name"]] = choice is True
    return names or None, binary


def infer_response(
    infer: oip.InferRequest,
    outputs: list[oip.OutputTensor],
    binary_default: bool,
    binary_outputs: dict[str, bool],
    answered: str = "",
) -> Response:
    """JSON, or a JSON header and the binary outputs after it when any output is binary;
    `model_version` the version that `answered` (else the one asked for, else 1)."""
    described: list[dict[str, Any]] = []
    parts: list[bytes | memoryview] = []
    for out in outputs:
        entry: dict[str, Any] = {"name": out.name, "datatype": out.datatype, "shape": list(out.shape)}
        values = None
        if not binary_outputs.get(out.name, binary_default):
            try:
                values = oip.output_values(out)
            except UnicodeDecodeError:
                values = None  # BYTES that are not text go as binary data
            if values and out.datatype.startswith("FP") and not all(map(math.isfinite, values)):
                values = None  # NaN and infinities, which JSON cannot hold, too
        if values is None:
            raw = oip.output_raw(out)
            entry["parameters"] = {"binary_data_size": len(raw)}
            parts.append(raw)
        else:
            entry["data"] = values
        described.append(entry)
    doc: dict[str, Any] = {
        "model_name": infer.model,
        "model_version": infer.response_version(answered),
        "outputs": described,
    }
    if infer.id:
        doc["id"] = infer.id
    head = json_encode(doc)
    if not parts:
        return Response(body=head, content_type=JSON)
    return Response(
        body=b"".join([head, *parts]),
        content_type="application/octet-stream",
        headers={HEADER_LENGTH: str(len(head))},
    )
