"""ModelInfer through the router: re-address the request to the concrete model the decision
chose, send it (``router.serving.send``), answer under the name the client asked for, and offer a
copy to the shadow.  The raw path works on serialized bytes: it parses a request once to
route it and appends pre-serialized overrides instead of re-serializing.

``Forwarder`` is given the decision (``router.serving.decide.Decider``), the sends
(``router.serving.send.Sender``), the shadow mirror and the clients' shared memory."""

from __future__ import annotations

import time
from collections.abc import Callable

from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2

from domain.router_errors import InvalidRequest, PermissionDenied, parse_version
from domain.routes import Decision
from model_runtime.family.protocol import CONTROL_PARAMETER, VARIANT_PARAMETER
from router.frontends.shared_memory import SystemSharedMemory
from router.frontends.shared_memory_requests import uses_shared_memory
from router.rollouts.shadow import ShadowItem, ShadowMirror, outputs_of
from router.serving.answers import BYTES_CACHE_MAX
from router.serving.decide import Decider
from router.serving.send import Sender
from router.serving.serving_state import ServingState


def refuse_family_control(parameters) -> None:
    """A family's slot control is model control: never from the public port.  Nor is the
    variant a family model answers for: the router names it from the model asked for, so a
    client cannot reach a variant's weights past its routes and limits through another name."""
    if CONTROL_PARAMETER in parameters:
        raise PermissionDenied(f"parameter {CONTROL_PARAMETER} is model control, not available on "
                               "the public port; use mmctl load/unload/pin")
    if VARIANT_PARAMETER in parameters:
        raise InvalidRequest(f"parameter {VARIANT_PARAMETER} is set by the router, not by clients: "
                             "ask for the variant by its model name")


def routing_shown(asked: str, decision: Decision) -> bool:
    """Whether the answer says how it was routed (``parameters``: model, variant, experiment,
    adapter).  A request for a model served as itself gets Triton's answer unchanged, so a
    client cannot tell the router from Triton; one that a route, an experiment, a canary,
    an adapter or a registry version answered says which."""
    return (decision.model != asked or decision.variant != "default" or bool(decision.experiment)
            or decision.adapter is not None)


class Forwarder:
    """``state`` says which Triton model carries a family's variant; ``decider`` routes;
    ``sender`` serves and sends; ``shadow`` gets copies; ``shared_memory`` holds the
    tensors clients keep in system shared memory."""

    def __init__(self, state: ServingState, decider: Decider, sender: Sender, shadow: ShadowMirror,
                 shared_memory: SystemSharedMemory):
        self.state = state
        self.decider = decider
        self.sender = sender
        self.shadow = shadow
        self.shared_memory = shared_memory
        self._suffixes: dict[tuple, bytes] = {}
        self._suffixes_of = (-1, -1)  # (table.version, names.generation) the suffixes reflect
        self._name_overrides: dict[tuple, bytes] = {}

    def _asked(self, request: service_pb2.ModelInferRequest) -> tuple[str, str, str]:
        """The name and version the client asked for, and the public name they serve."""
        version = parse_version(request.model_version) if request.model_version else ""
        refuse_family_control(request.parameters)
        logical = self.decider.public_name(request.model_name, (i.name for i in request.inputs),
                                           self.decider.adapter_param(request))
        return request.model_name, version, logical

    async def infer(self, request: service_pb2.ModelInferRequest, user_id: str | None,
                    timeout_s: float | None = None) -> service_pb2.ModelInferResponse:
        """Route one ModelInferRequest.  Raises RouterError (Triton's own answers included).

        Tensors in the client's shared memory are read here and sent inline; outputs asked
        for in shared memory are written there once Triton answers (``router.frontends.shared_memory``)."""
        asked, version, logical = self._asked(request)
        async with self.sender.serving(logical, user_id, version) as call:
            decision = call.decision
            output_places = self.shared_memory.inline(request)
            if decision.adapter is not None:
                self.decider.check_adapter_parameter(request, decision)
                request.parameters["adapter"].string_param = decision.adapter
            shadow_request = None
            if decision.shadow:
                shadow_request = service_pb2.ModelInferRequest()
                shadow_request.CopyFrom(request)
                self._address(shadow_request, decision.shadow, "")
            self._address(request, decision.model, decision.version)
            response = await self.sender.send_typed(call, request, timeout_s, asked)
            public_model, public_version = self.decider.public_identity(decision)
            response.model_name = asked
            if public_version is not None:
                response.model_version = public_version
            if routing_shown(asked, decision):
                params = response.parameters
                params["model"].string_param = public_model
                params["variant"].string_param = decision.variant
                if decision.experiment:
                    params["experiment"].string_param = decision.experiment
                if decision.adapter is not None:
                    params["adapter"].string_param = decision.adapter
            if shadow_request is not None:
                self.shadow.offer(ShadowItem(decision.logical.split(":", 1)[0], decision.shadow,
                                             shadow_request.SerializeToString(),
                                             outputs_of(response),
                                             (time.perf_counter() - call.start) * 1000))
            if output_places:
                self.shared_memory.deliver(response, output_places)
            return response

    async def infer_raw(self, raw: bytes, metadata_user_id: Callable[[], str | None],
                        timeout_s: float | None = None) -> bytes:
        """ModelInfer on serialized bytes: parse once to route, forward the bytes as they are."""
        try:
            request = service_pb2.ModelInferRequest.FromString(raw)
        except DecodeError as exc:
            raise InvalidRequest(f"malformed ModelInferRequest: {exc}") from None
        param = request.parameters.get("user_id")
        user_id = param.string_param if param is not None and param.string_param else metadata_user_id()
        if uses_shared_memory(request):  # tensors are read and written here: the typed path
            return (await self.infer(request, user_id, timeout_s)).SerializeToString()
        asked, version, logical = self._asked(request)
        async with self.sender.serving(logical, user_id, version) as call:
            decision = call.decision
            if decision.adapter is not None:
                self.decider.check_adapter_parameter(request, decision)
            if request.model_version != decision.version:
                # A registry version chose the concrete model; Triton gets no version.  An
                # empty field cannot be appended (proto3 does not write it): re-serialize.
                self._address(request, decision.model, decision.version)
                if decision.adapter is not None:
                    request.parameters["adapter"].string_param = decision.adapter
                body = request.SerializeToString()
            elif (decision.adapter is not None or decision.model != asked
                    or self.state.carrier_of(decision.model) is not None):
                body = raw + self._model_override(decision.model, decision.adapter)
            else:
                body = raw
            response = await self.sender.send_raw(call, body, timeout_s, asked)
            if decision.shadow:
                # Bytes as they are (re-addressed by an appended override): the shadow's
                # analysis thread parses the responses, the loop only sends.
                if version:  # the version asked of the primary means nothing to the shadow
                    self._address(request, decision.shadow, "")
                    if decision.adapter is not None:
                        request.parameters["adapter"].string_param = decision.adapter
                    shadow_body = request.SerializeToString()
                else:
                    shadow_body = raw + self._model_override(decision.shadow, decision.adapter)
                self.shadow.offer(ShadowItem(decision.logical.split(":", 1)[0], decision.shadow,
                                             shadow_body, response,
                                             (time.perf_counter() - call.start) * 1000))
            return response + self._response_suffix(asked, decision)

    def _response_suffix(self, asked: str, decision: Decision) -> bytes:
        """Serialized name, version and routing parameters (``routing_shown``), appended to Triton's response
        bytes.

        Protobuf merges concatenated messages (the last value of a singular field wins, map
        entries add up), so appending these bytes equals setting the fields on a parsed
        response."""
        names, table = self.decider.names, self.decider.table
        generation = names.generation if names is not None else 0
        if table.version != self._suffixes_of[0] or generation != self._suffixes_of[1]:
            self._suffixes.clear()  # a route or the registry changed: public names may have too
            self._suffixes_of = (table.version, generation)
        key = (asked, decision.model, decision.variant, decision.experiment, decision.adapter,
               decision.version)
        suffix = self._suffixes.get(key)
        if suffix is None:
            public_model, public_version = self.decider.public_identity(decision)
            r = service_pb2.ModelInferResponse(model_name=asked)
            if public_version is not None:
                r.model_version = public_version
            if routing_shown(asked, decision):
                r.parameters["model"].string_param = public_model
                r.parameters["variant"].string_param = decision.variant
                if decision.experiment:
                    r.parameters["experiment"].string_param = decision.experiment
                if decision.adapter is not None:
                    r.parameters["adapter"].string_param = decision.adapter
            if len(self._suffixes) >= BYTES_CACHE_MAX:  # keys include client-chosen adapters
                self._suffixes.clear()
            suffix = self._suffixes[key] = r.SerializeToString()
        return suffix

    def _address(self, request: service_pb2.ModelInferRequest, model: str, version: str) -> None:
        """Address ``request`` to the Triton model that serves ``model``: itself, or for a
        family's variant its family model with the variant named in ``mms_variant`` (set
        here whatever the client sent)."""
        carrier = self.state.carrier_of(model)
        request.model_name = carrier or model
        request.model_version = version
        if carrier is not None:
            request.parameters[VARIANT_PARAMETER].string_param = model

    def _model_override(self, model: str, adapter: str | None = None) -> bytes:
        """Appended to request bytes: for a singular field the last occurrence wins, and a
        map entry (``parameters["adapter"]``, ``parameters["mms_variant"]``) is added to or
        replaces the request's own."""
        carrier = self.state.carrier_of(model)
        key = (model, adapter, carrier)
        suffix = self._name_overrides.get(key)
        if suffix is None:
            r = service_pb2.ModelInferRequest(model_name=carrier or model)
            if carrier is not None:
                r.parameters[VARIANT_PARAMETER].string_param = model
            if adapter is not None:
                r.parameters["adapter"].string_param = adapter
            if len(self._name_overrides) >= BYTES_CACHE_MAX:
                self._name_overrides.clear()
            suffix = self._name_overrides[key] = r.SerializeToString()
        return suffix
