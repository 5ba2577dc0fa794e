"""What the HTTP and gRPC front ends share: one DEALER to the broker, and the v2 calls.

Every request of every front end goes over the one `BrokerLink` (an AsyncClient), so a
gateway keeps any number of rows in flight with no thread per request, and the broker
batches them with everyone else's. A request of k rows is k batcher requests, awaited
together; the first error answers the whole request and cancels its other rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from batcher import __version__, protocol, tensor
from batcher.aio import AsyncClient
from batcher.client import BatcherError
from batcher.gateway import oip
from batcher.protocol import ErrorCode

#: How long a model's output names (from its signature) are taken as known.
NAMES_TTL_S = 1.0
#: What `GET /v2` and ServerMetadata say the gateway supports.
EXTENSIONS = ["binary_tensor_data"]


@dataclass(frozen=True)
class GatewaySettings:
    """Where the broker is and where the gateway listens; a port of 0 is not served."""

    connect: str = "tcp://127.0.0.1:5555"
    host: str = "127.0.0.1"
    http_port: int = 0
    grpc_port: int = 0
    #: How long the gateway waits for the broker's reply to a request without a timeout.
    request_timeout_ms: float = 30_000.0
    #: How long a health or metadata question waits for the broker.
    probe_timeout_ms: float = 2_000.0
    #: The most bytes of outputs one response may hold (HTTP body, gRPC message).
    max_response_bytes: int = 256 * 1024 * 1024
    curve_server_key: str | None = None
    curve_secret_key: str | None = None

    def __post_init__(self) -> None:
        for name in ("http_port", "grpc_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in 0..65535, got {port}")
        if not self.http_port and not self.grpc_port:
            raise ValueError("give --http-port or --grpc-port (or both): the gateway serves neither")
        for name in ("request_timeout_ms", "probe_timeout_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def _keep_view(value: dict[Any, Any]) -> dict[Any, Any]:
    return dict(value)  # a new map: unpack_viewing keeps the tensor's data a view


class BrokerLink(AsyncClient):
    """An AsyncClient whose replies keep tensors as raw maps (no numpy): the gateway
    joins their bytes, never their values."""

    def decode_reply(self, frame: zmq.Frame) -> dict[str, Any]:
        if len(frame) >= tensor.VIEW_BYTES:
            with contextlib.suppress(Exception):
                return tensor.unpack_viewing(frame, "output", _keep_view)
        reply: dict[str, Any] = protocol.unpack(frame.bytes)
        return reply


class Gateway:
    """The v2 operations over one broker connection (create inside the event loop)."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self._output_names: dict[str, tuple[float, list[str] | None]] = {}
        self.link = BrokerLink(
            settings.connect,
            timeout_s=settings.request_timeout_ms / 1000.0,
            curve_server_key=settings.curve_server_key,
            curve_secret_key=settings.curve_secret_key,
            immediate=True,  # a request given up on (504) is never delivered to a broker back later
        )

    async def close(self) -> None:
        await self.link.close()

    # --- health and metadata ----------------------------------------------------------------

    async def _control(self, op: str, **fields: Any) -> Any:
        """A control request, waiting at most the probe timeout; OipError on failure."""
        try:
            async with asyncio.timeout(self.settings.probe_timeout_ms / 1000.0):
                return await self.link.control(op, **fields)
        except TimeoutError:
            raise oip.OipError("timeout", f"the broker at {self.settings.connect} did not answer") from None
        except BatcherError as exc:
            raise oip.OipError(exc.code, str(exc)) from None

    async def ready(self) -> bool:
        """Ready when the broker answers and every configured model has a worker (and
        some model does: a broker with no model serves nothing)."""
        try:
            stats = await self._control("stats")
        except oip.OipError:
            return False
        if stats.get("stopping"):  # draining: it refuses new requests
            return False
        models = (stats.get("models") or {}).values()
        configured = [m for m in models if m.get("configured")]
        return all(m.get("ready") for m in configured) and any(m.get("ready") for m in models)

    async def metadata(self, model: str, version: str = "") -> dict[str, Any]:
        """The model's v2 metadata; unknown_model (404) for a model or version not served."""
        check_version(model, version)
        meta = await self._control("metadata", model=model)
        self._output_names[model] = (time.monotonic(), _names(meta.get("outputs")))
        return {
            "name": model,
            "versions": [oip.MODEL_VERSION],
            "platform": "batcher",
            "inputs": meta.get("inputs") or [],
            "outputs": meta.get("outputs") or [],
            "ready": bool(meta.get("ready")),
        }

    async def model_ready(self, model: str, version: str = "") -> bool:
        try:
            return bool((await self.metadata(model, version))["ready"])
        except oip.OipError:
            return False

    def server_metadata(self) -> dict[str, Any]:
        return {"name": "batcher", "version": __version__, "extensions": EXTENSIONS}

    # --- inference --------------------------------------------------------------------------

    async def infer(self, request: oip.InferRequest) -> list[oip.OutputTensor]:
        """The request's rows through the broker, joined; OipError for any failure.

        Every row carries a deadline (the request's timeout, else the gateway's
        --request-timeout-ms), so the broker drops rows whose client was answered 504."""
        check_version(request.model, request.version)
        rows = oip.row_inputs(request.inputs)
        timeout_ms = request.timeout_ms or self.settings.request_timeout_ms
        try:
            if len(rows) == 1:  # the common case: no task of its own
                replies = [
                    await self.link.request_reply(rows[0], request.model, timeout_ms, request.priority)
                ]
                _raise_if_error(replies[0])
            else:
                calls = [
                    asyncio.ensure_future(
                        self.link.request_reply(row, request.model, timeout_ms, request.priority)
                    )
                    for row in rows
                ]
                replies = await _all_or_first_error(calls)
        except BatcherError as exc:  # the gateway's own wait ran out, or it is closing
            raise oip.OipError(exc.code, str(exc)) from None
        values = [r.get("output") for r in replies]
        names = None if oip.named_outputs(values[0]) else await self._names_of(request.model)
        outputs = oip.select_outputs(oip.join_outputs(values, names), request.outputs)
        size, limit = sum(oip.output_size(o) for o in outputs), self.settings.max_response_bytes
        if size > limit:
            raise oip.OipError(
                ErrorCode.TOO_LARGE, f"the outputs hold {size} bytes, over the gateway's {limit}"
            )
        return outputs

    async def _names_of(self, model: str) -> list[str] | None:
        """A model's output names from its signature, asked at most once a second."""
        cached = self._output_names.get(model)
        if cached is not None and time.monotonic() - cached[0] < NAMES_TTL_S:
            return cached[1]
        try:
            meta = await self._control("metadata", model=model)
        except oip.OipError:
            return None
        names = _names(meta.get("outputs"))
        self._output_names[model] = (time.monotonic(), names)
        return names


def _names(outputs: list[dict[str, Any]] | None) -> list[str] | None:
    return [str(o["name"]) for o in outputs] if outputs else None


def check_version(model: str, version: str) -> None:
    if version not in ("", oip.MODEL_VERSION):
        raise oip.OipError(
            ErrorCode.UNKNOWN_MODEL,
            f"model '{model}' has no version '{version}' (batcher serves one version: {oip.MODEL_VERSION})",
        )


def _raise_if_error(reply: dict[str, Any]) -> None:
    if not reply.get("ok"):
        err = reply.get("error") or {}
        raise oip.OipError(str(err.get("code", ErrorCode.INTERNAL)), str(err.get("message", "")))


async def _all_or_first_error(calls: Sequence[asyncio.Future[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every row's reply in order; on the first error (reply or exception), the rows
    still waiting are cancelled (the broker drops those still queued) and it is raised.
    If the caller is cancelled (its client went away), so is every row. O(rows): one
    callback per row, no wait over the pending set."""
    finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    remaining = len(calls)

    def on_done(fut: asyncio.Future[dict[str, Any]]) -> None:
        nonlocal remaining
        if finished.done() or fut.cancelled():
            return
        try:
            exc = fut.exception()
            if exc is None:
                _raise_if_error(fut.result())
            else:
                raise exc
        except Exception as error:
            finished.set_exception(error)
            return
        remaining -= 1
        if remaining == 0:
            finished.set_result(None)

    for fut in calls:
        fut.add_done_callback(on_done)
    try:
        await finished
        return [fut.result() for fut in calls]
    finally:
        for fut in calls:
            if not fut.done():
                fut.cancel()
