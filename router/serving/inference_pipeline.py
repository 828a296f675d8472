"""One inference through the router, whatever the transport: address the model, its variant
and adapter; route it (A/B, canary) and spend its rate limits; have its model loaded on a
miss; send it, and send it again within its deadline when Triton unloaded the model or could
not be reached; answer under the name the client asked for; mirror it to a route's shadow.

Typed gRPC, raw gRPC and HTTP are codecs around this pipeline
(``router.serving.grpc_inference``, ``router.frontends.http_inference``): each decodes its
request into an ``Inference`` and gives the pipeline an ``Exchange`` that speaks its
protocol to Triton and encodes the answer in its words.  Every rule above lives here once,
so the transports cannot drift apart.

The cost per request is a few small objects; what is derived from names (the Triton
address of a variant or adapter, the names an answer carries) is cached per route-table
and registry version, so the hot path looks it up instead of building it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from domain import tracing
from domain.router_errors import InvalidRequest, PermissionDenied, RouterError, parse_version
from domain.routes import ADAPTER_SEPARATOR, Decision
from model_runtime.family.protocol import CONTROL_PARAMETER, VARIANT_PARAMETER
from router.rollouts.routing_decisions import Decider
from router.rollouts.shadow import ShadowItem, ShadowMirror
from router.serving.ensure_and_resend import Resend, Sender
from router.serving.server_lookup import Call
from router.serving.serving_state import ServerAddress, ServingState

# Entries of the per-name caches: their keys include client-chosen adapter names.
CACHE_MAX = 4096


def refuse_family_control(parameters: Mapping) -> None:
    """A family's slot control is model control: never from the public port.  Nor is the
    variant a family model answers for: the router names it from the model asked for, so a
    client cannot reach a variant's weights past its routes and limits through another name."""
    if CONTROL_PARAMETER in parameters:
        raise PermissionDenied(f"parameter {CONTROL_PARAMETER} is model control, not available on "
                               "the public port; use mmctl load/unload/pin")
    if VARIANT_PARAMETER in parameters:
        raise InvalidRequest(f"parameter {VARIANT_PARAMETER} is set by the router, not by clients: "
                             "ask for the variant by its model name")


def user_id_of(parameter: object, transport: str | None) -> str | None:
    """The user a request names for sticky assignment, the same on both ports: its
    ``user_id`` parameter (a string, or a whole number as gRPC's int64 parameter carries it),
    else the transport's ``x-user-id`` (gRPC metadata, HTTP header); empty is none."""
    if isinstance(parameter, int) and not isinstance(parameter, bool):
        return str(parameter)
    if isinstance(parameter, str) and parameter:
        return parameter
    return transport or None


def routing_shown(asked: str, decision: Decision) -> bool:
    """Whether the answer says how it was routed (``parameters``: model, variant, experiment,
    adapter).  A request for a model served as itself gets Triton's answer unchanged, so a
    client cannot tell the router from Triton; one that a route, an experiment, a canary,
    an adapter or a registry version answered says which."""
    return (decision.model != asked or decision.variant != "default" or bool(decision.experiment)
            or decision.adapter is not None)


@dataclass(slots=True)
class Inference:
    """One inference request as the pipeline sees it, decoded by its transport's codec.

    ``asked``: the model name the client wrote; ``version``: its model version, parsed
    ("" none); ``logical``: the public name it is routed and limited as (``base:adapter``
    when an adapter was chosen by parameter); ``timeout_s``: the client's deadline for the
    request and all its resends (None: the router's ``request_timeout_s``)."""

    asked: str
    version: str
    logical: str
    user_id: str | None
    timeout_s: float | None
    trace_parent: Mapping[str, str] | None = None  # the client's headers, when tracing is on


@dataclass(slots=True)
class Target:
    """Where Triton finds a model: ``model`` (a family's variant: its family model) at
    ``version``, with the parameters the router sets (``adapter``, ``mms_variant``).
    ``encoded``: a codec's encoding of it, kept with it (the raw gRPC override bytes)."""

    model: str
    version: str
    parameters: dict[str, str]
    encoded: bytes | None = None


@dataclass(slots=True)
class Naming:
    """The names an answer carries: ``model`` the client asked for, ``version`` the public
    version (None: Triton's own stands), ``routing`` how it was routed (None: not shown).
    ``encoded``: a codec's encoding of it, kept with it (the raw gRPC response suffix)."""

    model: str
    version: str | None
    routing: dict[str, str] | None = None
    encoded: bytes | None = field(default=None)


class Exchange(Protocol):
    """One request's transport: how its message is addressed, sent to Triton and answered."""

    def outgoing(self, call: Call, target: Target):
        """The request for Triton, addressed to ``target`` (checks that need the decision:
        an adapter named twice, tensors in shared memory)."""

    def attempt(self, server: ServerAddress, message, left_s: float) -> Awaitable:
        """Send ``message`` to ``server`` with ``left_s`` of the deadline left."""

    def resend_for(self, outcome) -> Resend | None:
        """Why Triton's answer (or the exception) means the request is sent once more."""

    def failure(self, call: Call, exc: BaseException, asked: str) -> RouterError | None:
        """The transport's exception as the client's error (None: not the transport's)."""

    def answer(self, call: Call, answer, naming: Naming, mirrored: bool) -> tuple[object, object]:
        """(what the client gets, the primary's outputs for the shadow or None when the
        answer is not one to compare: ``mirrored`` says whether a shadow waits for them)."""

    def shadow_request(self, call: Call, target: Target):
        """The request addressed to the shadow's ``target``: bytes, or a function that
        builds them when the mirror is sent."""


class InferencePipeline:
    """``state`` says which Triton model carries a family's variant; ``decider`` routes and
    names; ``sender`` serves (limits, ensure, record) and sends with resends; ``shadow``
    gets the mirrors."""

    def __init__(self, state: ServingState, decider: Decider, sender: Sender,
                 shadow: ShadowMirror | None):
        self.state = state
        self.decider = decider
        self.sender = sender
        self.shadow = shadow
        self._targets: dict[tuple, Target] = {}
        self._namings: dict[tuple, Naming] = {}
        self._namings_of = (-1, -1)  # (table.version, names.generation) the namings reflect

    # ------------------------------------------------------------------ decode
    def inference(self, asked: str, version: str, parameters: Mapping, input_names: Iterable[str],
                  adapter: str | None, user_id: str | None, timeout_s: float | None,
                  headers: Callable[[], Mapping[str, str]] | None = None) -> Inference:
        """The neutral request: version parsed, model control refused, the adapter checks
        done (``Decider.public_name``).  ``headers``: the request's headers (a client's
        ``traceparent``), read only while tracing is on."""
        version = parse_version(version) if version else ""
        if parameters:  # most requests carry none
            refuse_family_control(parameters)
        logical = self.decider.public_name(asked, input_names, adapter)
        parent = headers() if headers is not None and tracing.enabled() else None
        return Inference(asked, version, logical, user_id, timeout_s, parent)

    # ------------------------------------------------------------------ the pipeline
    def infer(self, inference: Inference, exchange: Exchange) -> Awaitable:
        """Serve ``inference`` through ``exchange``: await it for what the exchange answers.
        Raises RouterError (Triton's own answers included, about the name asked for).
        Without tracing, the pipeline's own coroutine, not wrapped in a span's."""
        if tracing.enabled():
            return self._traced(inference, exchange)
        return self._infer(inference, exchange)

    async def _traced(self, inference: Inference, exchange: Exchange):
        with tracing.span("infer", tracing.SpanKind.SERVER, parent=inference.trace_parent,
                          model=inference.asked):
            return await self._infer(inference, exchange)

    async def _infer(self, inference: Inference, exchange: Exchange):
        async with self.sender.serving(inference.logical, inference.user_id,
                                       inference.version, inference.timeout_s) as call:
            decision = call.decision
            message = exchange.outgoing(call, self.target(decision.model, decision.version,
                                                          decision.adapter))
            answer = await self.sender.send(call, exchange, message, inference.timeout_s,
                                            inference.asked)
            shadow = decision.shadow
            result, primary = exchange.answer(call, answer, self.naming(inference.asked, decision),
                                              shadow is not None)
            if shadow is not None and primary is not None:
                request = exchange.shadow_request(call, self.target(shadow, "", decision.adapter))
                if request is not None:
                    self.shadow.offer(ShadowItem(
                        decision.logical.split(":", 1)[0], shadow, request, primary,
                        (time.perf_counter() - call.start) * 1000,
                        placed=None if decision.adapter is None
                        else f"{shadow}{ADAPTER_SEPARATOR}{decision.adapter}"))
            return result

    # ------------------------------------------------------------------ addressing
    def target(self, model: str, version: str, adapter: str | None) -> Target:
        """Where Triton finds ``model``: itself, or for a family's variant its family model
        with the variant named in ``mms_variant`` (whatever the client sent); an adapter
        travels as the ``adapter`` parameter."""
        carrier = self.state.carrier_of(model)
        key = (model, version, adapter, carrier)
        target = self._targets.get(key)
        if target is None:
            parameters = {}
            if adapter is not None:
                parameters["adapter"] = adapter
            if carrier is not None:
                parameters[VARIANT_PARAMETER] = model
            if len(self._targets) >= CACHE_MAX:
                self._targets.clear()
            target = self._targets[key] = Target(carrier or model, version, parameters)
        return target

    # ------------------------------------------------------------------ renaming
    def naming(self, asked: str, decision: Decision) -> Naming:
        """The names the answer carries (``Decider.public_identity``, ``routing_shown``)."""
        names, table = self.decider.names, self.decider.table
        generation = names.generation if names is not None else 0
        if table.version != self._namings_of[0] or generation != self._namings_of[1]:
            self._namings.clear()  # a route or the registry changed: public names may have too
            self._namings_of = (table.version, generation)
        key = (asked, decision.model, decision.variant, decision.experiment, decision.adapter,
               decision.version)
        naming = self._namings.get(key)
        if naming is None:
            public_model, public_version = self.decider.public_identity(decision)
            routing = None
            if routing_shown(asked, decision):
                routing = {"model": public_model, "variant": decision.variant}
                if decision.experiment:
                    routing["experiment"] = decision.experiment
                if decision.adapter is not None:
                    routing["adapter"] = decision.adapter
            if len(self._namings) >= CACHE_MAX:
                self._namings.clear()
            naming = self._namings[key] = Naming(asked, public_version, routing)
        return naming

    def public_text(self, text: str, call: Call, asked: str) -> str:
        """Triton's message about the concrete model, about the one the client asked for."""
        model = call.decision.model
        return self.decider.public_text(text, model, asked, self.state.carrier_of(model))
