"""The v2 REST API on aiohttp (chosen by measurement: docs/benchmarks.md, "Gateway").

JSON tensors and the binary tensor data extension both ways; a client that disconnects
cancels its handler (aiohttp's handler_cancellation), and with it its rows still queued
at the broker.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import msgspec
from aiohttp import web

from batcher.gateway import oip
from batcher.gateway.core import Gateway
from batcher.protocol import ErrorCode

log = logging.getLogger("batcher.gateway")
HEADER_LENGTH = "Inference-Header-Content-Length"
#: The most JSON one request may hold (the whole body, or the header before binary
#: data): decoding JSON takes many times its size in memory; large tensors go binary.
MAX_JSON_BYTES = 16 * 1024 * 1024
#: How long a client may take to send its body (a stalled upload is answered 408).
BODY_TIMEOUT_S = 30.0
_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode


def make_app(gateway: Gateway, max_body_bytes: int) -> web.Application:
    """The aiohttp application of the v2 endpoints over `gateway`."""
    app = web.Application(client_max_size=max_body_bytes, middlewares=[json_errors])
    api = HttpApi(gateway)
    app.router.add_get("/v2/health/live", api.live)
    app.router.add_get("/v2/health/ready", api.ready)
    app.router.add_get("/v2", api.server_metadata)
    for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        app.router.add_get(base, api.model_metadata)
        app.router.add_get(base + "/ready", api.model_ready)
        app.router.add_post(base + "/infer", api.infer)
    return app


@web.middleware
async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own errors (no such route, a method not allowed, a body too large) as
    v2 error bodies, so every client reads `{"error": ...}`."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After")}
        return web.Response(
            status=exc.status,
            body=_json_encode({"error": exc.text or exc.reason}),
            content_type="application/json",
            headers=headers,
        )


def error_response(code: str, message: str) -> web.Response:
    """An error as v2 gives one: `{"error": message}`, with the status of its code."""
    headers = {"Retry-After": "1"} if code == "overloaded" else None
    return web.Response(
        status=oip.http_status(code),
        body=_json_encode({"error": message}),
        content_type="application/json",
        headers=headers,
    )


def _json(value: Any) -> web.Response:
    return web.Response(body=_json_encode(value), content_type="application/json")


class HttpApi:
    """The handlers; each turns an OipError into its status."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def live(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if await self.gateway.ready() else 503)

    async def server_metadata(self, request: web.Request) -> web.Response:
        return _json(self.gateway.server_metadata())

    async def model_metadata(self, request: web.Request) -> web.Response:
        try:
            meta = await self.gateway.metadata(
                request.match_info["model"], request.match_info.get("version", "")
            )
        except oip.OipError as exc:
            return error_response(exc.code, str(exc))
        meta.pop("ready")
        return _json(meta)

    async def model_ready(self, request: web.Request) -> web.Response:
        ready = await self.gateway.model_ready(
            request.match_info["model"], request.match_info.get("version", "")
        )
        return web.Response(status=200 if ready else 503)

    async def infer(self, request: web.Request) -> web.Response:
        try:
            body = await read_body(request)
            infer, binary_default, binary_outputs = parse_infer(
                request.match_info["model"],
                request.match_info.get("version", ""),
                body,
                request.headers.get(HEADER_LENGTH),
            )
            outputs = await self.gateway.infer(infer)
            return infer_response(infer, outputs, binary_default, binary_outputs)
        except oip.OipError as exc:
            return error_response(exc.code, str(exc))
        except Exception as exc:  # a bug of ours: the client still gets a v2 error
            log.exception("infer request failed")
            return error_response(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")


async def read_body(request: web.Request) -> bytes:
    """The request's body; too large (413), stalled (408) or undecodable (400) as OipError."""
    try:
        if request.content.is_eof():  # all of it came with the headers: nothing to time
            return await request.read()
        async with asyncio.timeout(BODY_TIMEOUT_S):
            return await request.read()
    except TimeoutError:
        raise oip.OipError(
            "request_timeout", f"the body did not arrive within {BODY_TIMEOUT_S:g} s"
        ) from None
    except web.HTTPRequestEntityTooLarge as exc:
        raise oip.OipError(ErrorCode.TOO_LARGE, exc.text or "the body is too large") from None
    except web.RequestPayloadError as exc:
        raise oip.bad_request(f"the body cannot be read: {exc}") from None


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
) -> web.Response:
    """JSON, or a JSON header and the binary outputs after it when any output is binary."""
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
        "model_version": oip.MODEL_VERSION,
        "outputs": described,
    }
    if infer.id:
        doc["id"] = infer.id
    head = _json_encode(doc)
    if not parts:
        return web.Response(body=head, content_type="application/json")
    return web.Response(
        body=b"".join([head, *parts]),
        content_type="application/octet-stream",
        headers={HEADER_LENGTH: str(len(head))},
    )
