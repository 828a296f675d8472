"""Triton's GRPCInferenceService on the public port, built on tritonclient's generated stubs.

Each RPC converts and hands off to ``Router``.  Model control, repository, logging and
trace RPCs are refused with PERMISSION_DENIED: the public port never controls what is
loaded (that is remote code execution).  System shared memory is served for clients on this
host only: every call that registers, lists, unregisters or names a region is refused for a
peer that is not on loopback (``router.frontends.shared_memory``); CUDA shared memory is
refused as Triton refuses a handle it cannot open, with what to use instead.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2, service_pb2_grpc

from domain.router_errors import PermissionDenied, RateLimited, RouterError
from router.frontends.grpc_inference import parameter_value
from router.frontends.peers import grpc_client
from router.frontends.shared_memory import cuda_refusal, refuse_remote
from router.serving.inference_pipeline import user_id_of
from router.serving.miss_budget import CLIENT
from router.serving.triton_channels import GRPC_MESSAGE_LIMIT_BYTES

if TYPE_CHECKING:  # the assembly builds the router these ports serve
    from router.frontends.public_router import PublicRouter

log = logging.getLogger(__name__)

SERVER_NAME = "triton"  # what Triton clients expect to see
SERVER_VERSION = "2.51.0"
# Triton's extensions that the public port offers, in Triton's order: not model_repository,
# trace, logging (control, refused here) or cuda_shared_memory (refused, see
# router.shared_memory).
EXTENSIONS = ["classification", "sequence", "schedule_policy", "model_configuration",
              "system_shared_memory", "binary_tensor_data", "parameters", "statistics"]


def _metadata_user_id(context) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "x-user-id":
            return value
    return None


def _user_id(request, context) -> str | None:
    param = request.parameters.get("user_id") if request.parameters else None
    return user_id_of(parameter_value(param), None) or _metadata_user_id(context)


async def _abort(context, exc: RouterError):
    if isinstance(exc, RateLimited):
        context.set_trailing_metadata((("retry-after", f"{exc.retry_after_s:.3f}"),))
    await context.abort(exc.grpc_code, exc.message)


def _refuse(name: str):
    async def refused(self, request, context):
        self.router.metrics.refused.labels(name).inc()
        exc = PermissionDenied(
            f"{name} is not available on the public port: model control, repository, log and "
            "trace APIs go through the control plane's admin API (mmctl)")
        await context.abort(exc.grpc_code, exc.message)

    return refused


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """``max_request_bytes``: the largest request, its shared-memory tensors included."""

    def __init__(self, router: PublicRouter, max_request_bytes: int):
        self.router = router
        self.max_request_bytes = max_request_bytes

    async def _loopback_only(self, name: str, context) -> None:
        """Abort a system shared-memory call from a peer not on the router's host."""
        try:
            refuse_remote(context.peer())
        except PermissionDenied as exc:
            self.router.metrics.refused.labels(name).inc()
            await _abort(context, exc)

    async def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=self.router.answers.any_server_up())

    async def ServerMetadata(self, request, context):
        return service_pb2.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION,
                                                  extensions=EXTENSIONS)

    async def ModelReady(self, request, context):
        try:
            return service_pb2.ModelReadyResponse(ready=self.router.answers.model_ready(request.name, request.version))
        except RouterError as exc:  # a version that is not a number
            await _abort(context, exc)

    async def _model_call(self, context, name, method, version):
        try:
            return await self.router.answers.model_call(name, method, version)
        except RouterError as exc:
            await _abort(context, exc)
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details())

    async def ModelMetadata(self, request, context):
        return await self._model_call(context, request.name, "metadata", request.version)

    async def ModelConfig(self, request, context):
        return await self._model_call(context, request.name, "config", request.version)

    async def ModelStatistics(self, request, context):
        if not request.name:  # every model (Triton ignores the version then)
            return await self.router.answers.all_statistics()
        return await self._model_call(context, request.name, "statistics", request.version)

    async def ModelInfer(self, request, context):
        CLIENT.set(partial(grpc_client, self.router.config, context))
        try:
            self.router.shared_memory.admit(request, context.peer(), self.max_request_bytes)
            return await self.router.forwarder.infer(request, _user_id(request, context),
                                                   context.time_remaining(),
                                                   lambda: dict(context.invocation_metadata()))
        except RouterError as exc:  # Triton's own answers (shape, dtype, ...) included
            await _abort(context, exc)

    async def ModelStreamInfer(self, request_iterator, context):
        CLIENT.set(partial(grpc_client, self.router.config, context))
        async for request in request_iterator:
            try:
                self.router.shared_memory.admit(request, context.peer(), self.max_request_bytes)
                response = await self.router.forwarder.infer(request, _user_id(request, context))
                yield service_pb2.ModelStreamInferResponse(infer_response=response)
            except RouterError as exc:
                yield service_pb2.ModelStreamInferResponse(error_message=exc.message)

    async def SystemSharedMemoryStatus(self, request, context):
        await self._loopback_only("SystemSharedMemoryStatus", context)
        try:
            regions = self.router.shared_memory.status(request.name)
        except RouterError as exc:
            await _abort(context, exc)
        response = service_pb2.SystemSharedMemoryStatusResponse()
        for region in regions:
            response.regions[region.name].CopyFrom(service_pb2.SystemSharedMemoryStatusResponse.RegionStatus(
                name=region.name, key=region.key, offset=region.offset, byte_size=region.byte_size))
        return response

    async def SystemSharedMemoryRegister(self, request, context):
        await self._loopback_only("SystemSharedMemoryRegister", context)
        try:
            self.router.shared_memory.register(request.name, request.key, request.offset, request.byte_size)
        except RouterError as exc:
            await _abort(context, exc)
        return service_pb2.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request, context):
        await self._loopback_only("SystemSharedMemoryUnregister", context)
        self.router.shared_memory.unregister(request.name)
        return service_pb2.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, request, context):
        if request.name:  # nothing is ever registered
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"Unable to find cuda shared memory region: '{request.name}'")
        return service_pb2.CudaSharedMemoryStatusResponse()

    async def CudaSharedMemoryRegister(self, request, context):
        self.router.metrics.refused.labels("CudaSharedMemoryRegister").inc()
        await _abort(context, cuda_refusal())

    async def CudaSharedMemoryUnregister(self, request, context):
        return service_pb2.CudaSharedMemoryUnregisterResponse()

    RepositoryIndex = _refuse("RepositoryIndex")
    RepositoryModelLoad = _refuse("RepositoryModelLoad")
    RepositoryModelUnload = _refuse("RepositoryModelUnload")
    TraceSetting = _refuse("TraceSetting")
    LogSettings = _refuse("LogSettings")


SERVICE = "inference.GRPCInferenceService"
REGISTERED_METHODS = ("ModelInfer",)


class _HandlerCapture:
    """Collects the generated method handlers so one of them can be replaced."""

    def __init__(self):
        self.handlers: dict = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        assert service == SERVICE, service
        self.handlers = dict(handlers)


def _servicer_handlers(servicer) -> dict:
    capture = _HandlerCapture()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, capture)
    return capture.handlers


def _decoding_in_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """The handler with its request decoded inside the RPC: gRPC answers a message that its
    deserializer cannot parse with UNKNOWN; a malformed request is INVALID_ARGUMENT."""
    decode = handler.request_deserializer

    async def request(raw: bytes, context):
        try:
            return decode(raw)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message: {exc}")

    if handler.unary_unary is not None:
        behavior = handler.unary_unary

        async def unary_unary(raw: bytes, context):
            return await behavior(await request(raw, context), context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, None, handler.response_serializer)
    stream = handler.stream_stream

    async def stream_stream(raw_requests, context):
        async def requests():
            async for raw in raw_requests:
                yield await request(raw, context)

        async for response in stream(requests(), context):
            yield response

    return grpc.stream_stream_rpc_method_handler(stream_stream, None, handler.response_serializer)


def model_infer_raw(router: PublicRouter, max_request_bytes: int):
    """ModelInfer on bytes (no deserializer): the hot path never re-serializes.  A request
    that names shared memory is admitted first (``SystemSharedMemory.admit_raw``)."""
    async def infer(raw: bytes, context):
        CLIENT.set(partial(grpc_client, router.config, context))
        try:
            router.shared_memory.admit_raw(raw, context.peer(), max_request_bytes)
            return await router.forwarder.infer_raw(raw, lambda: _metadata_user_id(context),
                                                    context.time_remaining(),
                                                    lambda: dict(context.invocation_metadata()))
        except RouterError as exc:  # Triton's own answers (shape, dtype, ...) included
            await _abort(context, exc)

    return infer


async def start_grpc(router: PublicRouter, host: str, port: int, max_request_bytes: int,
                     reuse_port: bool = False) -> tuple[grpc.aio.Server, int]:
    """Serve on host:port (0 = any free port); returns the server and the bound port.

    ``reuse_port``: router workers share the port (SO_REUSEPORT, the kernel spreads
    connections); otherwise a port already in use is an error, not a silent share.

    ``grpc.max_receive_message_length`` makes gRPC refuse an oversize message from its
    length prefix, before the body is read into memory (RESOURCE_EXHAUSTED).
    """
    servicer = InferenceServicer(router, max_request_bytes)
    handlers = {name: _decoding_in_handler(h) for name, h in _servicer_handlers(servicer).items()}
    handlers["ModelInfer"] = grpc.unary_unary_rpc_method_handler(model_infer_raw(router, max_request_bytes))
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", max_request_bytes),
        ("grpc.max_send_message_length", GRPC_MESSAGE_LIMIT_BYTES),
        ("grpc.so_reuseport", 1 if reuse_port else 0),
    ])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    # Only inference is a registered method.  gRPC's aio server keeps one pending "next call"
    # per registered method and waits on all of them again for every call it accepts
    # (asyncio.wait over ~20 futures: measured 0.2 ms of CPU per request here with every
    # method registered); the others are found through the generic handler above.
    server.add_registered_method_handlers(SERVICE, {name: handlers[name] for name in REGISTERED_METHODS})
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the router's gRPC port {host}:{port} (in use?)")
    await server.start()
    return server, bound
