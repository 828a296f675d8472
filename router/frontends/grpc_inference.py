"""ModelInfer over gRPC, typed and on raw bytes: codecs around the inference pipeline
(``router.serving.inference_pipeline``).  Each decodes the request into the pipeline's
``Inference``, addresses the message to the Triton model the pipeline chose, sends it on the
channel to that Triton, and encodes the answer under the name the client asked for.

The raw path works on serialized bytes: it parses a request once to route it and appends
pre-serialized overrides (the target's name and parameters, the answer's names) instead of
re-serializing; protobuf merges concatenated messages (the last value of a singular field
wins, map entries add up), so appended bytes equal fields set on a parsed message.

``Forwarder`` is given the pipeline's collaborators (the state, the decision, the sends, the
shadow mirror) and the clients' shared memory."""

from __future__ import annotations

import logging
from collections.abc import Awaitable

import grpc
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2

from domain import tracing
from domain.router_errors import BackendUnavailable, InvalidRequest, RouterError, UpstreamError
from router.frontends.shared_memory import SystemSharedMemory
from router.frontends.shared_memory_requests import names_region, uses_shared_memory
from router.rollouts.routing_decisions import Decider
from router.rollouts.shadow import ShadowMirror, outputs_of
from router.serving.ensure_and_resend import Resend, Sender
from router.serving.inference_pipeline import (
    Inference,
    InferencePipeline,
    Naming,
    Target,
    user_id_of,
)
from router.serving.server_lookup import Call
from router.serving.serving_state import ServerAddress, ServingState
from router.serving.triton_channels import Channels, unloaded_under

log = logging.getLogger(__name__)


def parameter_value(param: service_pb2.InferParameter | None) -> object:
    """What an InferParameter holds (a bool, int, float or string), or None."""
    if param is None:
        return None
    which = param.WhichOneof("parameter_choice")
    return getattr(param, which) if which else None


def _adapter_parameter(request: service_pb2.ModelInferRequest) -> str | None:
    return _adapter_of(request.parameters)


def _adapter_of(parameters) -> str | None:
    """The adapter a request's parameters name (``adapter``), or None."""
    param = parameters.get("adapter")
    return param.string_param if param is not None and param.string_param else None


_parse_request = service_pb2.ModelInferRequest.FromString


def _address(request: service_pb2.ModelInferRequest, target: Target) -> None:
    """Address ``request`` to ``target``: its Triton model, version and parameters."""
    request.model_name = target.model
    request.model_version = target.version
    for key, value in target.parameters.items():
        request.parameters[key].string_param = value


def _override(target: Target) -> bytes:
    """``target`` as bytes appended to a request: its model name and parameters (a map
    entry is added to or replaces the request's own)."""
    encoded = target.encoded
    if encoded is None:
        r = service_pb2.ModelInferRequest(model_name=target.model)
        for key, value in target.parameters.items():
            r.parameters[key].string_param = value
        encoded = target.encoded = r.SerializeToString()
    return encoded


def _set_names(response: service_pb2.ModelInferResponse, naming: Naming) -> None:
    response.model_name = naming.model
    if naming.version is not None:
        response.model_version = naming.version
    if naming.routing is not None:
        for key, value in naming.routing.items():
            response.parameters[key].string_param = value


def _suffix(naming: Naming) -> bytes:
    """``naming`` as bytes appended to Triton's response."""
    encoded = naming.encoded
    if encoded is None:
        r = service_pb2.ModelInferResponse()
        _set_names(r, naming)
        encoded = naming.encoded = r.SerializeToString()
    return encoded


class _GrpcExchange:
    """What both gRPC codecs share: Triton's gRPC answers, resends and failures."""

    __slots__ = ("channels", "pipeline", "request")

    def __init__(self, channels: Channels, pipeline: InferencePipeline,
                 request: service_pb2.ModelInferRequest):
        self.channels = channels
        self.pipeline = pipeline
        self.request = request

    @staticmethod
    def resend_for(outcome) -> Resend | None:
        if not isinstance(outcome, grpc.aio.AioRpcError):
            return None
        # Unloaded between placement and send (under thrash, again after a resend).
        if unloaded_under(outcome):
            return Resend.UNLOADED
        # A Triton that cannot be reached did not run the request; one whose connection
        # broke mid-request may have, and inference is sent again as a client retry would.
        return Resend.UNREACHABLE if outcome.code() == grpc.StatusCode.UNAVAILABLE else None

    def failure(self, call: Call, exc: BaseException, asked: str) -> RouterError | None:
        """Triton's own answer (shape, dtype, ...) passes on with its code, about the model
        the client asked for; a Triton that is down says so."""
        if not isinstance(exc, grpc.aio.AioRpcError):
            return None
        call.code = exc.code().name
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            # What happened, not where: the server's name, address and Triton's own words are
            # the operators' (the log), not a client's.
            log.warning("Triton %s at %s is unavailable for %s: %s", call.server.name,
                        call.server.grpc_url, asked, exc.details())
            return BackendUnavailable(f"the server of '{asked}' is unavailable; the control "
                                      "plane restarts it, retry shortly")
        return UpstreamError(exc.code(), self.pipeline.public_text(exc.details() or "", call, asked))

    def _check_adapter(self, call: Call) -> None:
        decision = call.decision
        if decision.adapter is not None:
            Decider.check_adapter_parameter(self.request, decision)


class _TypedExchange(_GrpcExchange):
    """A ModelInferRequest message; tensors in the client's shared memory are read before
    the send and outputs asked for there are written once Triton answers."""

    __slots__ = ("output_places", "shadow_copy", "shared_memory")

    def __init__(self, channels, pipeline, request, shared_memory: SystemSharedMemory):
        super().__init__(channels, pipeline, request)
        self.shared_memory = shared_memory
        self.output_places = None
        self.shadow_copy = None

    def outgoing(self, call: Call, target: Target):
        request = self.request
        self.output_places = self.shared_memory.inline(request)
        self._check_adapter(call)
        if call.decision.shadow:  # the client's request, before it is addressed to the primary
            self.shadow_copy = service_pb2.ModelInferRequest()
            self.shadow_copy.CopyFrom(request)
        _address(request, target)
        return request

    def attempt(self, server: ServerAddress, message, left_s: float):
        if tracing.enabled():
            return self.channels.typed_infer(server)(message, timeout=left_s, metadata=_trace_metadata())
        return self.channels.typed_infer(server)(message, timeout=left_s)

    def answer(self, call: Call, answer, naming: Naming, mirrored: bool):
        _set_names(answer, naming)
        primary = outputs_of(answer) if mirrored else None
        if self.output_places:
            self.shared_memory.deliver(answer, self.output_places)
        return answer, primary

    def shadow_request(self, call: Call, target: Target):
        copy = self.shadow_copy
        _address(copy, target)
        return copy.SerializeToString()


class _RawExchange(_GrpcExchange):
    """Serialized bytes forwarded as they are, re-addressed by appended overrides."""

    __slots__ = ("raw", "versioned")

    def __init__(self, channels, pipeline, request, raw: bytes):
        super().__init__(channels, pipeline, request)
        self.raw = raw
        self.versioned = bool(request.model_version)  # the client asked for a version

    def outgoing(self, call: Call, target: Target):
        self._check_adapter(call)
        request = self.request
        if request.model_version != target.version:
            # A registry version chose the concrete model; Triton gets no version.  An empty
            # field cannot be appended (proto3 does not write it): re-serialize.
            _address(request, target)
            return request.SerializeToString()
        if target.parameters or target.model != request.model_name:
            return self.raw + _override(target)
        return self.raw

    def attempt(self, server: ServerAddress, message, left_s: float):
        if tracing.enabled():
            return self.channels.raw_infer(server)(message, timeout=left_s, metadata=_trace_metadata())
        return self.channels.raw_infer(server)(message, timeout=left_s)

    def answer(self, call: Call, answer, naming: Naming, mirrored: bool):
        # Bytes as they are: the shadow's analysis thread parses the responses.
        return answer + _suffix(naming), answer

    def shadow_request(self, call: Call, target: Target):
        request = self.request
        if self.versioned:  # the version asked of the primary means nothing to the shadow
            _address(request, target)
            return request.SerializeToString()
        return self.raw + _override(target)


class Forwarder:
    """ModelInfer, typed (``infer``) and raw (``infer_raw``), through the pipeline.
    ``pipeline``: the one the router serves with (None: one over these collaborators)."""

    def __init__(self, state: ServingState, decider: Decider, sender: Sender,
                 shadow: ShadowMirror | None, shared_memory: SystemSharedMemory | None,
                 pipeline: InferencePipeline | None = None):
        self.pipeline = pipeline or InferencePipeline(state, decider, sender, shadow)
        self.shared_memory = shared_memory

    def _inference(self, request: service_pb2.ModelInferRequest, user_id: str | None,
                   timeout_s: float | None, headers=None) -> Inference:
        return self.pipeline.inference(request.model_name, request.model_version,
                                       request.parameters, (i.name for i in request.inputs),
                                       _adapter_parameter(request), user_id, timeout_s, headers)

    async def infer(self, request: service_pb2.ModelInferRequest, user_id: str | None,
                    timeout_s: float | None = None, headers=None) -> service_pb2.ModelInferResponse:
        """Route one ModelInferRequest.  Raises RouterError (Triton's own answers included).
        ``headers()``: the call's metadata (a client's ``traceparent``)."""
        pipeline = self.pipeline
        return await pipeline.infer(
            self._inference(request, user_id, timeout_s, headers),
            _TypedExchange(pipeline.sender.channels, pipeline, request, self.shared_memory))

    def infer_raw(self, raw: bytes, metadata_user_id, timeout_s: float | None = None,
                  headers=None) -> Awaitable[bytes]:
        """ModelInfer on serialized bytes: parse once to route, forward the bytes as they are;
        await what it returns (the pipeline's own coroutine: no level of awaiting more).
        ``metadata_user_id()``: the user id of the call's metadata, asked for only when the
        request has no ``user_id`` parameter.  Raises RouterError (here, or when awaited)."""
        try:
            request = _parse_request(raw)
        except DecodeError as exc:
            raise InvalidRequest(f"malformed ModelInferRequest: {exc}") from None
        parameters = request.parameters
        user_id = ((parameters and user_id_of(parameter_value(parameters.get("user_id")), None))
                   or metadata_user_id())
        # names_region: the region's name is not in the bytes, so no tensor names one (a
        # search in C, before the walk over every input's and output's parameters).
        if names_region(raw) and uses_shared_memory(request):  # tensors are read and written here: the typed path
            return self._typed_serialized(request, user_id, timeout_s, headers)
        pipeline = self.pipeline
        return pipeline.infer(
            pipeline.inference(request.model_name, request.model_version, parameters,
                               [i.name for i in request.inputs],
                               _adapter_of(parameters) if parameters else None,
                               user_id, timeout_s, headers),
            _RawExchange(pipeline.sender.channels, pipeline, request, raw))

    async def _typed_serialized(self, request, user_id, timeout_s, headers) -> bytes:
        return (await self.infer(request, user_id, timeout_s, headers)).SerializeToString()

    def _model_override(self, model: str, adapter: str | None = None) -> bytes:
        """The bytes that re-address a raw request to ``model`` with ``adapter``."""
        return _override(self.pipeline.target(model, "", adapter))

    def _response_suffix(self, asked: str, decision) -> bytes:
        """The bytes that name Triton's raw answer as the client asked for it."""
        return _suffix(self.pipeline.naming(asked, decision))


def _trace_metadata() -> tuple | None:
    """The request's trace context for Triton (``traceparent``) as gRPC metadata."""
    return tuple(tracing.inject().items()) or None
