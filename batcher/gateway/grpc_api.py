"""`inference.GRPCInferenceService` on grpcio's asyncio server.

Inputs come as raw_input_contents or typed contents; outputs always go as
raw_output_contents, as Triton sends them. The client's deadline, when it set one,
becomes the rows' `timeout_ms`; a cancelled call cancels its rows at the broker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import json_format

from batcher.gateway import access, oip, repository, tracing, triton
from batcher.gateway import inference_pb2 as pb
from batcher.gateway import inference_pb2_grpc as pb_grpc
from batcher.gateway.core import Gateway
from batcher.wire.protocol import ErrorCode

log = logging.getLogger("batcher.gateway")

#: The typed `contents` field that holds each datatype (FP16 has none: raw only).
CONTENTS_FIELD: dict[str, str] = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def add_service(server: grpc.aio.Server, gateway: Gateway) -> None:
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceService(gateway), server)  # type: ignore[no-untyped-call]


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: oip.OipError) -> None:
    await context.abort(grpc.StatusCode[oip.grpc_status(exc.code)], str(exc))


class TokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """The API key check of every call but the health probes (access.OPEN_METHODS):
    metadata `authorization: Bearer TOKEN` (or `x-api-key: TOKEN`), else UNAUTHENTICATED,
    decided before the request message is read (the refusing handler decodes nothing)."""

    def __init__(self, api_keys: access.ApiKeys) -> None:
        self.api_keys = api_keys
        self._refuse = {
            why: grpc.unary_unary_rpc_method_handler(_refuser(why)) for why in (access.MISSING, access.WRONG)
        }

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if handler_call_details.method not in access.OPEN_METHODS:
            authorization = api_key = None
            for key, value in handler_call_details.invocation_metadata or ():
                if key == "authorization":
                    authorization = value.encode() if isinstance(value, str) else value
                elif key == "x-api-key":
                    api_key = value.encode() if isinstance(value, str) else value
            why = self.api_keys.refusal(authorization, api_key)
            if why is not None:
                return self._refuse[why]
        return await continuation(handler_call_details)


def _refuser(why: str) -> Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[None]]:
    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    return refuse


class InferenceService(pb_grpc.GRPCInferenceServiceServicer):
    """The six calls of the v2 service, and Triton's ModelConfig and ModelStatistics,
    over one Gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=await self.gateway.ready())

    async def ModelReady(self, request: Any, context: Any) -> Any:
        return pb.ModelReadyResponse(ready=await self.gateway.model_ready(request.name, request.version))

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        return pb.ServerMetadataResponse(**self.gateway.server_metadata())

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        try:
            meta = await self.gateway.metadata(request.name, request.version)
        except oip.OipError as exc:
            await _abort(context, exc)
        tensor_meta = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=meta["name"],
            versions=meta["versions"],
            platform=meta["platform"],
            inputs=[tensor_meta(**t) for t in meta["inputs"]],
            outputs=[tensor_meta(**t) for t in meta["outputs"]],
        )

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        begun, trace = time.monotonic(), None
        try:
            trace = self._trace(context)
            return await self._infer(request, context, trace)
        finally:
            self.gateway.metrics.request_done("grpc", time.monotonic() - begun, trace)

    async def _infer(self, request: Any, context: Any, trace: Any) -> Any:
        try:
            begun = time.monotonic()
            infer = parse_infer(request, context.time_remaining())
            if trace is not None:
                trace.parsed(begun, time.monotonic())
            outputs, answered = await self.gateway.answer(infer, trace)  # a cancelled call cancels this
            raw = [bytes(oip.output_raw(o)) for o in outputs]
        except oip.OipError as exc:
            if trace is not None:
                trace.end({"rpc.grpc.status": oip.grpc_status(exc.code)}, exc.message)
            await _abort(context, exc)
        except Exception as exc:  # a bug of ours: the client still gets a status
            log.exception("ModelInfer failed", extra={"model": request.model_name, "request_id": request.id})
            if trace is not None:
                trace.end({"rpc.grpc.status": "INTERNAL"}, f"{type(exc).__name__}: {exc}")
            await _abort(context, oip.OipError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
        if trace is not None:
            trace.end({"rpc.grpc.status": "OK"})
        return pb.ModelInferResponse(
            model_name=infer.model,
            model_version=infer.response_version(answered),
            id=infer.id,
            outputs=[
                pb.ModelInferResponse.InferOutputTensor(name=o.name, datatype=o.datatype, shape=o.shape)
                for o in outputs
            ],
            raw_output_contents=raw,
        )

    def _trace(self, context: Any) -> tracing.GatewayTrace | None:
        """A ModelInfer call's trace (an RPC server span, its caller's `traceparent`
        metadata as parent), None when tracing is off or it is not sampled."""
        if self.gateway.tracer is None:
            return None
        metadata = dict(context.invocation_metadata() or ())
        attributes = {
            "rpc.system": "grpc",
            "rpc.service": "inference.GRPCInferenceService",
            "rpc.method": "ModelInfer",
        }
        name = "inference.GRPCInferenceService/ModelInfer"
        return tracing.begin(
            self.gateway.tracer, metadata.get("traceparent"), metadata.get("tracestate"), name, attributes
        )

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        """Triton's model configuration extension (batcher/gateway/triton.py)."""
        try:
            config = await triton.model_config(self.gateway, request.name, request.version)
        except oip.OipError as exc:
            await _abort(context, exc)
        return pb.ModelConfigResponse(config=json_format.ParseDict(config, pb.ModelConfig()))

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        """Triton's statistics extension: one model's, or every model's for no name."""
        try:
            stats = await triton.model_statistics(self.gateway, request.name, request.version)
        except oip.OipError as exc:
            await _abort(context, exc)
        return json_format.ParseDict(stats, pb.ModelStatisticsResponse())

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        """Triton's model repository extension (batcher/gateway/repository.py): the index."""
        try:
            models = await repository.index(self.gateway, request.ready)
        except oip.OipError as exc:
            await _abort(context, exc)
        entry = pb.RepositoryIndexResponse.ModelIndex
        return pb.RepositoryIndexResponse(models=[entry(**m) for m in models])

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        try:
            await repository.load(self.gateway, request.model_name)
        except oip.OipError as exc:
            await _abort(context, exc)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        try:
            await repository.unload(self.gateway, request.model_name)
        except oip.OipError as exc:
            await _abort(context, exc)
        return pb.RepositoryModelUnloadResponse()


def parse_infer(request: Any, time_remaining_s: float | None) -> oip.InferRequest:
    """The v2 request in batcher's terms; the call's deadline caps the timeout."""
    if not request.model_name:
        raise oip.bad_request("model_name is required")
    params = parameters(request.parameters)
    timeout_ms = oip.timeout_ms_of(params)
    if time_remaining_s is not None:
        deadline_ms = max(time_remaining_s * 1000.0, 0.001)
        timeout_ms = deadline_ms if timeout_ms is None else min(timeout_ms, deadline_ms)
    return oip.InferRequest(
        model=request.model_name,
        version=request.model_version,
        inputs=inputs_of(request),
        id=request.id,
        outputs=[o.name for o in request.outputs] or None,
        timeout_ms=timeout_ms,
        priority=oip.priority_of(params),
        retry=oip.retry_of(params),
    )


def parameters(params: Any) -> dict[str, Any]:
    """A protobuf parameter map as plain values."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        kind = value.WhichOneof("parameter_choice")
        out[key] = getattr(value, kind) if kind else None
    return out


def inputs_of(request: Any) -> list[oip.InputTensor]:
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise oip.bad_request(f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs")
    if raw and any(t.HasField("contents") for t in request.inputs):
        raise oip.bad_request("an input has contents while raw_input_contents is used: send one or the other")
    inputs = []
    for i, t in enumerate(request.inputs):
        if raw:
            inputs.append(oip.raw_input(t.name, t.datatype, list(t.shape), raw[i]))
            continue
        field = CONTENTS_FIELD.get(t.datatype)
        if field is None:
            if t.datatype == "FP16":
                raise oip.bad_request(f"input '{t.name}': FP16 must be sent as raw_input_contents")
            oip.check_datatype(t.name, t.datatype)
        inputs.append(oip.contents_input(t.name, t.datatype, list(t.shape), getattr(t.contents, str(field))))
    return inputs
